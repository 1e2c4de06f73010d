"""The Llama decoder family (Llama-3.x, Qwen2/2.5, Qwen3, Mistral, and the Qwen3-MoE / Qwen2-MoE sparse
variants, whose MLPs are `moe.SparseMoE` in the layers the config names) on blockspec's KV cache.

One forward serves prefill, decode and verify: every request feeds a run of tokens at known
positions into its cache slot. The same pass can return the outputs of chosen decoder layers
(the "taps" DFlash and DSpark condition on), so no extra target pass is needed for features.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from blockspec.config import ModelConfig
from blockspec.models.kv_cache import AttnMeta, KVCache, KVScales, PageTable
from blockspec.models.layers import (GatedMLP, RMSNorm, Rotary, add_rms_norm, additive_mask, attention, dense, few_rows,
                                     qkv_heads, stream)
from blockspec.kernels.attention import block_attention
from blockspec.kernels.ops import PreNormed, qkv_rope_store
from blockspec.models.moe import SparseMoE


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_type: str = "full_attention") -> None:
        super().__init__()
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.heads * self.head_dim
        self.kv_size = self.kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = self.head_dim**-0.5
        self.eps = cfg.rms_norm_eps
        self.layer_type = layer_type

    def project(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x: [R, Q, H] -> q [R, Hq, Q, hd], k/v [R, Hkv, Q, hd] with q/k-norm and RoPE applied."""
        qw = self.q_norm.weight if self.q_norm is not None else None
        kw = self.k_norm.weight if self.k_norm is not None else None
        return qkv_heads(self.qkv_proj(x), self.heads, self.kv_heads, self.head_dim, qw, kw, self.eps, cos, sin)

    def forward(
        self, x: Tensor | PreNormed, cos: Tensor, sin: Tensor, layer: int, cache: KVCache | None, meta: AttnMeta,
        mask: Tensor | None, norm: RMSNorm | None = None, residual: Tensor | None = None,
        next_norm: RMSNorm | None = None,
    ) -> Tensor | PreNormed:
        """mask: additive [R, 1, Q, kv_len] for the SDPA reference, or None for the Triton kernels (then
        a cache is given): one kernel norms, rotates and stores this step's K/V, and the rows read
        their keys in place from the cache. There, `norm` (the layer's pre-norm of x), `residual`
        (added to the output) and `next_norm` (see `dense`) fold into the products."""
        r, n, _ = stream(x).shape
        if mask is None:
            qw = self.q_norm.weight if self.q_norm is not None else None
            kw = self.k_norm.weight if self.k_norm is not None else None
            q = qkv_rope_store(dense(x, self.qkv_proj, norm=norm), self.heads, self.kv_heads, self.head_dim, qw, kw,
                               self.eps, cos, sin, cache.k[layer], cache.v[layer], cache.table, meta.slots,
                               meta.write_pos, cache.k_scales[layer], cache.v_scales[layer])
            lo, hi = meta.bounds[self.layer_type]
            out = block_attention(q, cache.k[layer], cache.v[layer], cache.table, meta.slots, lo, hi, self.scale,
                                  meta.kv_len, k_scale=cache.k_scales[layer], v_scale=cache.v_scales[layer])
            return dense(out.view(r, n, self.q_size), self.o_proj, residual=residual, next_norm=next_norm)
        q, k, v = self.project(x, cos, sin)
        if cache is not None:
            cache.write(layer, meta, k, v)
        keys, values = (k, v) if cache is None else cache.read(layer, meta)
        out = attention(q, keys, values, mask, self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(r, n, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_type: str, index: int = 0) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_type)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg) if index in cfg.moe_layers else GatedMLP(cfg.hidden_size, cfg.intermediate_size,
                                                                           cfg.mlp_bias)

    def forward(
        self, x: Tensor | PreNormed, residual: Tensor | None, cos: Tensor, sin: Tensor, layer: int,
        cache: KVCache | None, meta: AttnMeta, masks: dict[str, Tensor] | None, next_norm: RMSNorm | None = None,
    ) -> tuple[Tensor | PreNormed, Tensor | None]:
        """Pre-norm block on the residual stream; returns (block output, residual) un-summed so the
        next layer fuses the add into its norm. With few rows on the GPU the norms and adds fold into
        the products instead, and the summed stream comes back with residual None (as PreNormed rows
        for `next_norm`, the next layer's pre-norm, above one row: see `dense`)."""
        if masks is None and few_rows(stream(x)):
            h = x if residual is None else x + residual
            post = self.post_attention_layernorm
            h = self.self_attn(h, cos, sin, layer, cache, meta, None, norm=self.input_layernorm, residual=stream(h),
                               next_norm=post)
            return self.mlp(h, norm=post, residual=stream(h), next_norm=next_norm), None
        norm = self.input_layernorm
        if residual is None:
            residual, h = x, norm(x)
        else:
            residual, h = add_rms_norm(x, residual, norm.weight, norm.eps)
        h = self.self_attn(h, cos, sin, layer, cache, meta, None if masks is None else masks[self.layer_type])
        post = self.post_attention_layernorm
        residual, h = add_rms_norm(h, residual, post.weight, post.eps)
        return self.mlp(h), residual


class CausalLM(nn.Module):
    """Target model. `forward` returns final-normed hidden states (logits are taken only where needed)."""

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, t, i) for i, t in enumerate(cfg.layer_types))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(cfg.rope, cfg.head_dim, max_positions or cfg.max_position_embeddings)
        self.attention_backend = "sdpa"  # the engine sets "triton" on GPUs (see triton_attention)
        self.kv_cache_dtype: torch.dtype | None = None  # the engine sets float8_e4m3fn for an FP8 cache
        self.kv_scales: KVScales | None = None  # an FP8 cache's per-layer scales, from the checkpoint (else 1.0)
        # the LM head's product where it is not the head module's own (the engine sets a packed one on the CPU:
        # `models.cpu_linear.verify_head_product`)
        self.head_product: Callable[[Tensor], Tensor] | None = None

    def new_cache(self, table: PageTable | int, max_len: int, device: torch.device | str | None = None) -> KVCache:
        """This model's K/V pools over `table`'s pages, `max_len` positions a slot (see `KVCache`)."""
        w = self.embed_tokens.weight
        k, v = (self.kv_scales.k, self.kv_scales.v) if self.kv_scales is not None else (1.0, 1.0)
        return KVCache(*self._cache_dims(), max_len, w.dtype, device or w.device, table, self.kv_cache_dtype, k, v)

    def page_bytes(self, page_size: int, kv_dtype: torch.dtype | None = None) -> int:
        """Bytes one page of this model's cache takes (every layer's K and V), stored in `kv_dtype`
        (default: this model's cache dtype)."""
        dtype = kv_dtype or self.kv_cache_dtype or self.embed_tokens.weight.dtype
        return KVCache.page_bytes(*self._cache_dims(), page_size, dtype)

    def _cache_dims(self) -> tuple[int, int, int]:
        kv_heads = self.layers[0].self_attn.kv_heads  # local count under tensor parallelism
        return self.config.num_hidden_layers, kv_heads, self.config.head_dim

    def embed(self, input_ids: Tensor) -> Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self, input_ids: Tensor, meta: AttnMeta, cache: KVCache | None, taps: Sequence[int] = ()
    ) -> tuple[Tensor, Tensor | None]:
        """input_ids [R, Q] -> (final hidden [R, Q, H], concatenated tap outputs [R, Q, len(taps)*H] or None).

        Tap i is the output of decoder layer i (HF `hidden_states[i + 1]`; -1 is the embedding
        output); for the last layer that is the final-normed state, as in HF. With `cache=None` the rows attend only to each other
        (training and scoring; build `meta` with `dense_causal_meta`).
        """
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(meta.positions, x.dtype)
        masks = None
        if self.attention_backend == "sdpa" or cache is None:
            masks = {name: additive_mask(meta.mask(name), x.dtype) for name in meta.bounds}
        tapped: dict[int, Tensor] = {-1: x} if -1 in taps else {}
        last = len(self.layers) - 1
        residual = None
        for i, layer in enumerate(self.layers):
            next_norm = self.layers[i + 1].input_layernorm if i < last else None
            x, residual = layer(x, residual, cos, sin, i, cache, meta, masks, next_norm)
            if i in taps and i != last:
                tapped[i] = stream(x) if residual is None else x + residual
        x = self.norm(stream(x) if residual is None else x + residual)
        if last in taps:
            tapped[last] = x
        features = torch.cat([tapped[i] for i in taps], dim=-1) if taps else None
        return x, features

    def head_logits(self, hidden: Tensor) -> Tensor:
        """Logits in the head's own dtype: what an argmax needs, since the fp32 copy that `compute_logits`
        makes keeps every value, so every maximum and its lowest id (a [rows, vocab] pass saved)."""
        return (self.head_product or self.lm_head)(hidden)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """Logits in fp32 for the given final hidden rows."""
        return self.head_logits(hidden).float()
