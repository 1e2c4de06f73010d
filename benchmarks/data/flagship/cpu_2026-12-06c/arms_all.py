import types, importlib.util
from pathlib import Path
HERE = Path(__file__).parent
def load(p):
    spec = importlib.util.spec_from_file_location(p.split("/")[-1][:-3], p); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m
mk, ap, qk = (load(str(HERE / f)) for f in ("arms_markov.py", "arms_append.py", "arms_qk.py"))
def arms(llm):
    import blockspec.drafters.backbone as bb
    dr = llm.engine.proposer.drafter
    attns = [l.self_attn for l in dr.layers]
    a1, a2 = mk.arms(llm), ap.arms(llm)
    new_qkv = type(attns[0])._block_qkv
    def old_qkv(self, x, cos, sin):
        from blockspec.models.layers import apply_rotary
        r, n, _ = x.shape
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(self.q_norm(q.view(r, n, self.heads, self.head_dim)).transpose(1, 2), cos, sin)
        k = apply_rotary(self.k_norm(k.view(r, n, self.kv_heads, self.head_dim)).transpose(1, 2), cos, sin)
        return q, k, v.view(r, n, self.kv_heads, self.head_dim).transpose(1, 2)
    def set_old():
        a1["torch"](); a2["all_rows"]()
        for a in attns: a._block_qkv = types.MethodType(old_qkv, a)
    def set_new():
        a1["numpy"](); a2["held_rows"]()
        for a in attns: a._block_qkv = types.MethodType(new_qkv, a)
    return {"old3": set_old, "new3": set_new}
