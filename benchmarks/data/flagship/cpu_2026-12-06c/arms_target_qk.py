import types, torch
from blockspec.models.layers import apply_rotary, rms_norm
def joint(self, x, cos, sin):
    r, n, _ = x.shape
    qkv = self.qkv_proj(x)
    qk = qkv[..., : self.q_size + self.kv_size].view(r, n, self.heads + self.kv_heads, self.head_dim)
    if self.q_norm is not None:
        w = torch.cat([self.q_norm.weight.expand(self.heads, -1), self.k_norm.weight.expand(self.kv_heads, -1)])
        qk = rms_norm(qk, None, self.eps) * w
    qk = apply_rotary(qk.transpose(1, 2), cos, sin)
    v = qkv[..., self.q_size + self.kv_size:].view(r, n, self.kv_heads, self.head_dim).transpose(1, 2)
    return qk[:, : self.heads], qk[:, self.heads:], v
def arms(llm):
    attns = [l.self_attn for l in llm.engine.model.layers]
    orig = type(attns[0]).project
    def set_old():
        for a in attns: a.project = types.MethodType(orig, a)
    def set_new():
        for a in attns: a.project = types.MethodType(joint, a)
    return {"separate": set_old, "joint": set_new}
