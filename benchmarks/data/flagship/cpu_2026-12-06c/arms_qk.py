import types, torch
import torch.nn.functional as F
from blockspec.models.layers import apply_rotary
def fused(self, x, cos, sin):
    r, n, _ = x.shape
    qkv = self.qkv_proj(x)
    heads = self.heads + self.kv_heads
    qk = qkv[..., : self.q_size + self.kv_size].view(r, n, heads, self.head_dim)
    w = torch.cat([self.q_norm.weight.expand(self.heads, -1), self.k_norm.weight.expand(self.kv_heads, -1)])
    qk = apply_rotary((F.rms_norm(qk, (self.head_dim,), None, self.q_norm.eps) * w).transpose(1, 2), cos, sin)
    v = qkv[..., self.q_size + self.kv_size:].view(r, n, self.kv_heads, self.head_dim).transpose(1, 2)
    return qk[:, : self.heads], qk[:, self.heads:], v
def arms(llm):
    dr = llm.engine.proposer.drafter
    attns = [l.self_attn for l in dr.layers]
    orig = type(attns[0])._block_qkv
    x = torch.randn(1, 8, 256); pos = torch.arange(8)[None] + 100
    cos, sin = dr._rope(pos, 200)
    for a in attns:
        ref = orig(a, x, cos, sin); new = fused(a, x, cos, sin)
        print("max diff", [float((p - q).abs().max()) for p, q in zip(ref, new)])
    def set_old():
        for a in attns: a._block_qkv = types.MethodType(orig, a)
    def set_new():
        for a in attns: a._block_qkv = types.MethodType(fused, a)
    return {"separate": set_old, "fused": set_new}
