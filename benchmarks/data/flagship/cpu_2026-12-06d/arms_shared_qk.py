"""The target's q and k normed and rotated in two passes (before) against as one tensor (`layers.qkv_heads`)."""
import contextlib

from cpu_ab import swapped

import blockspec.models.llama as llama
from blockspec.models.layers import apply_rotary, rms_norm


def two_passes(qkv, heads, kv_heads, head_dim, q_weight, k_weight, eps, cos, sin):
    r, n, _ = qkv.shape
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(r, n, heads, head_dim), k.view(r, n, kv_heads, head_dim)
    if k_weight is not None:
        q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    return (apply_rotary(q.transpose(1, 2), cos, sin), apply_rotary(k.transpose(1, 2), cos, sin),
            v.view(r, n, kv_heads, head_dim).transpose(1, 2))


def arms(llm):
    return {"two_passes": lambda: swapped([(llama, "qkv_heads", two_passes)]),
            "one_tensor": contextlib.nullcontext}
