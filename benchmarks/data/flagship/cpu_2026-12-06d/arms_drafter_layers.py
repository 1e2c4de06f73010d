"""The drafter's context on the CPU: projected, appended, gathered and concatenated with the block's K/V layer by
layer (before) against every layer's context K/V in one product, norm, rotation and write, and gathered once with
room for the block's K/V (now)."""
import contextlib

import torch
from cpu_ab import swapped

from blockspec.drafters.backbone import DraftAttention, DraftModel
from blockspec.models.layers import apply_rotary, attention, qkv_heads
from blockspec.models.quant import linear_rows


def attention_cat(self, x, cos, sin, ctx_k, ctx_v, mask):
    r, n, _ = x.shape
    q, k, v = qkv_heads(self.qkv_proj(x), self.heads, self.kv_heads, self.head_dim, self.q_norm.weight,
                        self.k_norm.weight, self.q_norm.eps, cos, sin)
    out = attention(q, torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2), mask, self.scale)
    return self.o_proj(out.transpose(1, 2).reshape(r, n, self.q_size))


def block_layer_by_layer(self, cache, slots, ctx_lens, anchor_ids, kv_len, embed=None, rows=None, every_key=False):
    r, b, dev = anchor_ids.shape[0], self.block_size, anchor_ids.device
    ids = torch.full((r, b), self.mask_token_id, dtype=torch.int64, device=dev)
    ids[:, 0] = anchor_ids
    x = self.embed_block(ids, embed)
    positions = ctx_lens[:, None] + torch.arange(b, device=dev)[None, :]
    cos, sin = self._rope(positions, kv_len + b)
    masks = self._block_masks(ctx_lens, positions, kv_len, every_key)
    for i, layer in enumerate(self.layers):
        x = layer(x, cos, sin, *cache.gather(i, slots, kv_len), masks[i])
    return self.norm(x[:, :rows])


def context_kv(attn, ctx, cos, sin):
    r, c, _ = ctx.shape
    k, v = linear_rows(attn.qkv_proj, ctx, attn.q_size).split([attn.kv_size, attn.kv_size], dim=-1)
    k = attn.k_norm(k.view(r, c, attn.kv_heads, attn.head_dim)).transpose(1, 2)
    v = v.view(r, c, attn.kv_heads, attn.head_dim).transpose(1, 2)
    return apply_rotary(k, cos, sin), v


def append_layer_by_layer(self, cache, slots, starts, counts, features, max_pos):
    from blockspec.models.kv_cache import AttnMeta
    c = features.shape[1]
    ar = torch.arange(c, device=features.device)
    positions = starts[:, None] + ar[None, :]
    valid = ar[None, :] < counts[:, None]
    write_pos = torch.where(valid, positions, torch.full_like(positions, cache.trash))
    rope_pos = torch.where(valid, positions, torch.zeros_like(positions))
    cos, sin = self._rope(rope_pos, max_pos)
    ctx = self.hidden_norm(self.fc(features.to(self.dtype)))
    meta = AttnMeta(slots, positions, write_pos, 0, {})
    for i, layer in enumerate(self.layers):
        cache.write(i, meta, *context_kv(layer.self_attn, ctx, cos, sin))


def arms(llm):
    return {"layer_by_layer": lambda: swapped([(DraftAttention, "forward", attention_cat),
                                               (DraftModel, "block_hidden_tensors", block_layer_by_layer),
                                               (DraftModel, "append_context_tensors", append_layer_by_layer)]),
            "all_layers": contextlib.nullcontext}
