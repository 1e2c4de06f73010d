"""The target's q and k normed and rotated apart (shipped) against together, as the drafter's are (not landed)."""
import contextlib
import types

import torch
from cpu_ab import swapped

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
    attns = [layer.self_attn for layer in llm.engine.model.layers]
    return {"separate": contextlib.nullcontext,
            "joint": lambda: swapped([(a, "project", types.MethodType(joint, a)) for a in attns])}
