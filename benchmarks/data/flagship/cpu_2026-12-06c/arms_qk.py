"""The drafter block's q and k normed and rotated apart (before a667394) against together (shipped)."""
import contextlib
import types

from cpu_ab import swapped

from blockspec.models.layers import apply_rotary


def separate(self, x, cos, sin):
    r, n, _ = x.shape
    q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
    q = apply_rotary(self.q_norm(q.view(r, n, self.heads, self.head_dim)).transpose(1, 2), cos, sin)
    k = apply_rotary(self.k_norm(k.view(r, n, self.kv_heads, self.head_dim)).transpose(1, 2), cos, sin)
    return q, k, v.view(r, n, self.kv_heads, self.head_dim).transpose(1, 2)


def swaps(llm):
    return [(layer.self_attn, "_block_qkv", types.MethodType(separate, layer.self_attn))
            for layer in llm.engine.proposer.drafter.layers]


def arms(llm):
    return {"separate": lambda: swapped(swaps(llm)), "fused": contextlib.nullcontext}
