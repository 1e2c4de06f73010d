"""Block drafters: the DFlash backbone (Qwen3-style layers with target-feature KV injection) and DFlash itself.

One backbone serves DFlash (z-lab, speculators) and DSpark (DeepSpec, speculators):

* Context. The target's tapped hidden states of committed tokens are fused once,
  ``H_ctx = hidden_norm(fc([h_l1; ...; h_ln]))``, and every draft layer turns them into its own
  context keys/values, ``k = k_norm(k_proj(H_ctx))`` with RoPE at the token's absolute position and
  ``v = v_proj(H_ctx)``. Only these context K/V are ever stored (``append_context``).
* Block. ``[anchor, MASK x (B-1)]`` at positions ``ctx_len .. ctx_len+B-1`` is embedded and run
  through the layers; its queries see the cached context plus the block's own K/V, which are
  computed for the call and thrown away (``block_hidden``). Attention inside the block is
  non-causal unless the checkpoint says otherwise.
* Slots. DFlash reads drafts from block rows 1..B-1 (row k proposes position start+k);
  anchor-first checkpoints (DSpark, speculators ``sample_from_anchor``) read rows 0..B-1 (row i
  proposes start+i+1).

The reference implementations (z-lab ``dflash/model.py``, DeepSpec ``qwen3/modeling.py``) run the
context and the block through one forward with a growing ``DynamicCache`` that is cropped back to
the anchor after each draft; this module computes the same numbers over blockspec's slot cache,
for R requests of different lengths at once, without a host sync.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from blockspec.config import ConfigError, ModelConfig, RopeConfig, rope_from_hf
from blockspec.models.kv_cache import AttnMeta, KVCache, PageTable, range_mask
from blockspec.models.layers import GatedMLP, RMSNorm, Rotary, apply_rotary, attention, dense
from blockspec.kernels.attention import block_attention
from blockspec.kernels.ops import qkv_rope_store
from blockspec.models.loader import (
    ModelLoadError,
    assign_weights,
    fuse_hf_layer_names,
    read_json,
    read_state_dict,
    resolve_device,
    resolve_dtype,
    resolve_model_dir,
)
from blockspec.transfer import to_device

__all__ = [
    "DrafterConfig",
    "DraftModel",
    "DFlashDraft",
    "build_target_layer_ids",
    "load_dflash",
    "save_dflash",
    "load_drafter",
    "parse_zlab_config",
    "parse_speculators_config",
]


# ----------------------------------------------------------------------------------------- config
def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default taps: uniform between layer 1 and layer L-3 (or the middle layer for n=1)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + (i * span) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass(frozen=True)
class DrafterConfig:
    """Shape and semantics of a block drafter, whatever checkpoint format it came from.

    ``target_layer_ids`` use blockspec's tap convention: tap l is the output of target decoder
    layer l (HF ``hidden_states[l + 1]``), -1 is the embedding output.
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target vocabulary the drafter was built for (W1 rows, embedding rows)
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    target_hidden_size: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    causal: tuple[bool, ...] = ()  # per layer: causal attention inside the block
    window_mode: str = "query"  # "query": z-lab newest (|q - k| < w); "anchor": speculators (k >= anchor - w)
    anchor_first: bool = False  # block row 0 proposes a draft (DSpark / sample_from_anchor)
    draft_vocab_size: int | None = None  # columns of the drafter's own LM head (None: the target's)
    num_target_layers: int | None = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    logit_scale: float = 1.0
    torch_dtype: str = "bfloat16"
    is_causal: bool | None = None  # explicit causality override as written in the checkpoint
    sliding_window_non_causal: bool = False  # speculators flag (kept for saving)

    def __post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_layers)
        if not self.causal:
            object.__setattr__(self, "causal", (False,) * self.num_layers)
        if len(self.layer_types) != self.num_layers or len(self.causal) != self.num_layers:
            raise ConfigError(f"drafter config: layer_types has {len(self.layer_types)} entries for "
                              f"{self.num_layers} layers")
        if self.window_mode not in ("query", "anchor"):
            raise ConfigError(f"drafter config: window_mode {self.window_mode!r} (allowed: query, anchor)")

    @property
    def num_draft_slots(self) -> int:
        return self.block_size if self.anchor_first else self.block_size - 1


def _need(cfg: dict[str, Any], name: str, source: str, kind: type | tuple[type, ...] = int) -> Any:
    value = cfg.get(name)
    if value is None:
        raise ModelLoadError(f"{source}: missing required field {name!r}")
    if kind is int and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise ModelLoadError(f"{source}: field {name!r} must be a positive integer, got {value!r}")
    return value


def _int_field(value: Any, name: str, source: str, minimum: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ModelLoadError(f"{source}: field {name!r} must be an integer >= {minimum}, got {value!r}")
    return value


def _layer_ids(value: Any, name: str, source: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not value or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise ModelLoadError(f"{source}: field {name!r} must be a non-empty list of integers, got {value!r}")
    return tuple(int(v) for v in value)


def _arch_fields(tl: dict[str, Any], source: str) -> dict[str, Any]:
    """Backbone shape from a Qwen3-style config dict (z-lab, DeepSpec, speculators transformer_layer_config)."""
    for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        _need(tl, name, source)
    heads = tl["num_attention_heads"]
    kv_heads = tl.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise ModelLoadError(f"{source}: num_attention_heads ({heads}) must be a multiple of "
                             f"num_key_value_heads ({kv_heads})")
    head_dim = tl.get("head_dim") or tl["hidden_size"] // heads
    layers = tl["num_hidden_layers"]
    layer_types = tuple(tl.get("layer_types") or ("full_attention",) * layers)
    if len(layer_types) != layers:
        raise ModelLoadError(f"{source}: layer_types has {len(layer_types)} entries for num_hidden_layers={layers}")
    bad = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if bad:
        raise ModelLoadError(f"{source}: layer_types {bad} not supported (full_attention, sliding_attention)")
    window = tl.get("sliding_window") if "sliding_attention" in layer_types else None
    if "sliding_attention" in layer_types and (not isinstance(window, int) or window <= 0):
        raise ModelLoadError(f"{source}: sliding_attention layers need a positive 'sliding_window', got {window!r}")
    try:
        rope = rope_from_hf(tl, source)
    except ConfigError as exc:
        raise ModelLoadError(str(exc)) from None
    dtype = tl.get("torch_dtype") or tl.get("dtype") or "bfloat16"
    return dict(
        hidden_size=tl["hidden_size"], intermediate_size=tl["intermediate_size"], num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, vocab_size=tl["vocab_size"],
        rms_norm_eps=float(tl.get("rms_norm_eps", 1e-6)), rope=rope,
        max_position_embeddings=int(tl.get("max_position_embeddings", 4096)),
        attention_bias=bool(tl.get("attention_bias", False)), layer_types=layer_types, sliding_window=window,
        torch_dtype=str(dtype).replace("torch.", ""),
    )


def parse_zlab_config(raw: dict[str, Any], source: str) -> DrafterConfig:
    """A z-lab DFlash config.json (``DFlashDraftModel``)."""
    arch = raw.get("architectures") or []
    if any("DFlash2" in a for a in arch):
        raise ModelLoadError(f"{source}: DFlash2 drafters ({arch}) are not supported (DFlash v1 only)")
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{source}: hidden_act {raw.get('hidden_act')!r} not supported (silu)")
    fields = _arch_fields(raw, source)
    dcfg = raw.get("dflash_config") or {}
    if not isinstance(dcfg, dict):
        raise ModelLoadError(f"{source}: 'dflash_config' must be an object")

    def value(name: str) -> Any:  # newest z-lab: dflash_config first, then top level
        return dcfg[name] if dcfg.get(name) is not None else raw.get(name)

    top, inner = raw.get("block_size"), dcfg.get("block_size")
    if top is not None and inner is not None and top != inner:
        raise ModelLoadError(f"{source}: block_size {top} (top level) != dflash_config.block_size {inner}")
    block = inner if inner is not None else top
    if block is None:
        raise ModelLoadError(f"{source}: missing required field 'block_size' (top level or dflash_config.block_size)")
    block = _int_field(block, "block_size", source, 2)
    mask = value("mask_token_id")
    if mask is None:
        raise ModelLoadError(f"{source}: missing required field 'dflash_config.mask_token_id'")
    mask = _int_field(mask, "dflash_config.mask_token_id", source)
    num_target_layers = raw.get("num_target_layers")
    ids = value("target_layer_ids")
    if ids is None:
        if num_target_layers is None:
            raise ModelLoadError(f"{source}: missing 'dflash_config.target_layer_ids' (and no 'num_target_layers' "
                                 "to build the default from)")
        ids = build_target_layer_ids(_int_field(num_target_layers, "num_target_layers", source, 1),
                                     fields["num_layers"])
    ids = _layer_ids(ids, "dflash_config.target_layer_ids", source)
    explicit = raw.get("is_causal")
    if explicit is None:
        explicit = dcfg.get("is_causal", dcfg.get("causal"))
    layer_types = fields["layer_types"]
    causal = tuple(lt == "sliding_attention" if explicit is None else bool(explicit) for lt in layer_types)
    softcap = value("final_logit_softcapping")
    return DrafterConfig(
        **fields, block_size=block, mask_token_id=mask, target_layer_ids=ids,
        target_hidden_size=int(raw.get("target_hidden_size") or fields["hidden_size"]),
        causal=causal, window_mode="query", anchor_first=False, draft_vocab_size=None,
        num_target_layers=num_target_layers, input_embedding_scale=float(value("input_embedding_scale") or 1.0),
        output_multiplier=float(value("output_multiplier") or 1.0),
        final_logit_softcapping=float(softcap) if softcap else None,
        is_causal=None if explicit is None else bool(explicit),
    )


def parse_speculators_config(raw: dict[str, Any], source: str, kind: str) -> tuple[DrafterConfig, dict[str, Any]]:
    """A speculators-format config (``speculators_model_type`` dflash or dspark): backbone + extras dict."""
    tl = raw.get("transformer_layer_config")
    if not isinstance(tl, dict):
        raise ModelLoadError(f"{source}: missing required field 'transformer_layer_config'")
    fields = _arch_fields(tl, f"{source} transformer_layer_config")
    block = _int_field(_need(raw, "block_size", source), "block_size", source, 2)
    mask = raw.get("mask_token_id")
    if mask is None:
        raise ModelLoadError(f"{source}: missing required field 'mask_token_id'")
    mask = _int_field(mask, "mask_token_id", source)
    aux = raw.get("aux_hidden_state_layer_ids")
    if aux is None:
        raise ModelLoadError(f"{source}: missing required field 'aux_hidden_state_layer_ids'")
    aux = _layer_ids(aux, "aux_hidden_state_layer_ids", source)
    if min(aux) < 0:
        raise ModelLoadError(f"{source}: aux_hidden_state_layer_ids must be >= 0 (HF hidden_states indices), got {aux}")
    draft_vocab = raw.get("draft_vocab_size")
    if draft_vocab is None:
        raise ModelLoadError(f"{source}: missing required field 'draft_vocab_size'")
    draft_vocab = _int_field(draft_vocab, "draft_vocab_size", source, 1)
    sample_from_anchor = bool(raw.get("sample_from_anchor", kind == "dspark"))
    non_causal = bool(raw.get("sliding_window_non_causal", False))
    causal = tuple(lt == "sliding_attention" and not non_causal for lt in fields["layer_types"])
    cfg = DrafterConfig(
        **fields, block_size=block, mask_token_id=mask,
        # speculators ids index HF hidden_states (0 = embeddings): tap = id - 1
        target_layer_ids=tuple(i - 1 for i in aux),
        target_hidden_size=int(raw.get("target_hidden_size") or fields["hidden_size"]),
        causal=causal, window_mode="anchor", anchor_first=sample_from_anchor, draft_vocab_size=draft_vocab,
        logit_scale=float(raw.get("logit_scale") or tl.get("logit_scale") or 1.0),
        sliding_window_non_causal=non_causal,
    )
    return cfg, raw


# ------------------------------------------------------------------------------------------ model
class DraftAttention(nn.Module):
    """Qwen3 attention (q/k norms) whose keys/values are [cached context ; this block]."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.heads * self.head_dim
        self.kv_size = self.kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.scale = self.head_dim**-0.5

    def context_kv(self, ctx: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """ctx [R, C, H] (fused target features) -> k, v [R, kv_heads, C, hd] (k normed and rotated)."""
        r, c, _ = ctx.shape
        k, v = self._context_kv_proj(ctx).split([self.kv_size, self.kv_size], dim=-1)
        k = self.k_norm(k.view(r, c, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = v.view(r, c, self.kv_heads, self.head_dim).transpose(1, 2)
        return apply_rotary(k, cos, sin), v

    def store_context_kv(self, ctx: Tensor, cos: Tensor, sin: Tensor, cache: KVCache, layer: int,
                         meta: AttnMeta) -> None:
        """Kernel path of `context_kv` + `cache.write`: project, norm, rotate and store in one kernel."""
        qkv_rope_store(self._context_kv_proj(ctx), 0, self.kv_heads, self.head_dim, None, self.k_norm.weight,
                       self.k_norm.eps, cos, sin, cache.k[layer], cache.v[layer], cache.table, meta.slots,
                       meta.write_pos)

    def _context_kv_proj(self, ctx: Tensor) -> Tensor:
        """[k | v] of the context rows: the k and v slices of the fused projection."""
        w = self.qkv_proj.weight[self.q_size:]
        b = self.qkv_proj.bias[self.q_size:] if self.qkv_proj.bias is not None else None
        return F.linear(ctx, w, b)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx_k: Tensor, ctx_v: Tensor, mask: Tensor) -> Tensor:
        """Reference: keys are the gathered context K/V [R, kv_heads, C, hd] followed by the block's own."""
        r, n, _ = x.shape
        q, k, v = self._block_qkv(x, cos, sin)
        keys = torch.cat([ctx_k, k], dim=2)
        values = torch.cat([ctx_v, v], dim=2)
        out = attention(q, keys, values, mask, self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(r, n, self.q_size))

    def forward_cached(self, x: Tensor, cos: Tensor, sin: Tensor, block: "CachedBlock", layer: int,
                       norm: RMSNorm, residual: Tensor) -> Tensor:
        """Kernel path of residual + attention(norm(x)): the block's K/V are written into the cache
        right after the context (columns the next context append overwrites) and the rows read keys
        in place, within `block.bounds`; the norm and the residual add fold into the products."""
        r, n, _ = x.shape
        cache, meta = block.cache, block.meta
        q = qkv_rope_store(dense(x, self.qkv_proj, norm=norm), self.heads, self.kv_heads, self.head_dim,
                           self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cos, sin, cache.k[layer],
                           cache.v[layer], cache.table, meta.slots, meta.write_pos)
        lo, hi = block.bounds[layer]
        out = block_attention(q, cache.k[layer], cache.v[layer], cache.table, meta.slots, lo, hi, self.scale,
                              meta.kv_len)
        return dense(out.view(r, n, self.q_size), self.o_proj, residual=residual)

    def _block_qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        r, n, _ = x.shape
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(self.q_norm(q.view(r, n, self.heads, self.head_dim)).transpose(1, 2), cos, sin)
        k = apply_rotary(self.k_norm(k.view(r, n, self.kv_heads, self.head_dim)).transpose(1, 2), cos, sin)
        return q, k, v.view(r, n, self.kv_heads, self.head_dim).transpose(1, 2)


@dataclass
class CachedBlock:
    """What the kernel path of a block forward needs: the drafter cache, where the block's K/V go
    (slots, write positions, key extent) and each layer's visible key range per block row."""

    cache: KVCache
    meta: AttnMeta
    bounds: list[tuple[Tensor, Tensor]]


class DraftLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx_k: Tensor, ctx_v: Tensor, mask: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_cached(self, x: Tensor, cos: Tensor, sin: Tensor, block: CachedBlock, layer: int) -> Tensor:
        x = self.self_attn.forward_cached(x, cos, sin, block, layer, self.input_layernorm, x)
        return self.mlp(x, norm=self.post_attention_layernorm, residual=x)


class DraftModel(nn.Module):
    """Shared drafter backbone; see the module docstring for the data flow.

    Optional vocabulary pieces (speculators / DeepSpec checkpoints): ``embed_tokens`` (a copy of the
    target embedding, possibly with extra rows), ``lm_head`` (draft vocabulary, maybe reduced) and
    ``d2t`` (draft id -> target id offsets, ``target = draft + d2t[draft]``).
    """

    source_format: str = "zlab"

    def __init__(self, cfg: DrafterConfig, embed_rows: int | None = None, head_rows: int | None = None,
                 has_d2t: bool = False) -> None:
        super().__init__()
        self.config = cfg
        self.block_size = cfg.block_size
        self.num_draft_slots = cfg.num_draft_slots
        self.anchor_first = cfg.anchor_first
        self.target_layer_ids = tuple(cfg.target_layer_ids)
        self.mask_token_id = cfg.mask_token_id
        n_feat = len(cfg.target_layer_ids)
        self.fc = nn.Linear(n_feat * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.embed_tokens = nn.Embedding(embed_rows, cfg.hidden_size) if embed_rows else None
        self.lm_head = nn.Linear(cfg.hidden_size, head_rows, bias=False) if head_rows else None
        if has_d2t:
            self.register_buffer("d2t", torch.zeros(head_rows or 0, dtype=torch.int64))
        else:
            self.d2t = None
        self.use_own_embedding = self.embed_tokens is not None
        self.use_own_head = self.lm_head is not None
        self._target = None
        self.rotary = self._make_rotary()
        self.attention_backend = "sdpa"  # the engine sets "triton" on GPUs (see triton_attention)

    # ------------------------------------------------------------------ plumbing
    def _make_rotary(self, device: torch.device | str | None = None) -> Rotary:
        c = self.config
        rotary = Rotary(c.rope, c.head_dim, c.max_position_embeddings + c.block_size + 1)
        return rotary if device is None else rotary.to(device)

    def cast(self, device: torch.device | str, dtype: torch.dtype) -> "DraftModel":
        """Move to device/dtype; RoPE tables stay fp32 and d2t int64."""
        self.to(device=device, dtype=dtype)
        self.rotary = self._make_rotary(device)
        if self.d2t is not None:
            self.d2t = self.d2t.to(device=device, dtype=torch.int64)
        return self

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def bind_target(self, target: nn.Module | None) -> None:
        """Remember the target whose embedding / LM head are shared (not registered as a submodule)."""
        object.__setattr__(self, "_target", target)

    def _rope(self, positions: Tensor, max_pos: int) -> tuple[Tensor, Tensor]:
        if max_pos >= self.rotary.cos.shape[0]:  # host-side check; positions are known on the host
            self.rotary = Rotary(self.config.rope, self.config.head_dim, max(2 * max_pos, 64)).to(self.device)
        return self.rotary.cos[positions].to(self.dtype), self.rotary.sin[positions].to(self.dtype)

    def new_cache(self, table: PageTable | int, max_len: int, device: torch.device | str | None = None,
                  dtype: torch.dtype | None = None) -> KVCache:
        """The drafter's K/V pools over `table`'s pages (the target's: one page id names the same
        positions in both), `max_len` positions a slot (see `KVCache`)."""
        return KVCache(*self._cache_dims(), max_len, dtype or self.dtype, device or self.device, table)

    def page_bytes(self, page_size: int, dtype: torch.dtype | None = None) -> int:
        """Bytes one page of the drafter's cache takes (every layer's K and V)."""
        return KVCache.page_bytes(*self._cache_dims(), page_size, dtype or self.dtype)

    def _cache_dims(self) -> tuple[int, int, int]:
        c = self.config
        return c.num_layers, c.num_kv_heads, c.head_dim

    # ------------------------------------------------------------------ checks
    def check_target(self, target_cfg: ModelConfig) -> None:
        """Raise ConfigError naming the field when this drafter cannot serve `target_cfg`."""
        c = self.config
        name = type(self).__name__
        if c.target_hidden_size != target_cfg.hidden_size:
            raise ConfigError(
                f"{name}: fc expects target features of hidden_size {c.target_hidden_size} x "
                f"{len(c.target_layer_ids)} layers (fc input {self.fc.in_features}) but the target's hidden_size is "
                f"{target_cfg.hidden_size}")
        layers = target_cfg.num_hidden_layers
        for lid in c.target_layer_ids:
            if not -1 <= lid < layers:
                raise ConfigError(f"{name}: target_layer_ids {list(c.target_layer_ids)}: layer {lid} is outside the "
                                  f"target's range [-1, {layers - 1}] (num_hidden_layers={layers})")
        self._check_vocab(target_cfg)
        embed_rows = self.embed_tokens.num_embeddings if self.use_own_embedding else target_cfg.vocab_size
        if not 0 <= c.mask_token_id < embed_rows:
            raise ConfigError(f"{name}: mask_token_id {c.mask_token_id} is outside the embedding "
                              f"({embed_rows} rows{'' if self.use_own_embedding else ', the target vocab_size'})")
        if not math.isclose(c.rope.theta, target_cfg.rope.theta, rel_tol=1e-6):
            raise ConfigError(f"{name}: rope_theta {c.rope.theta} != the target's rope_theta {target_cfg.rope.theta}; "
                              "context positions are absolute target positions, so they must match")
        if c.rope.type != target_cfg.rope.type or c.rope.factor != target_cfg.rope.factor:
            warnings.warn(f"{name}: RoPE scaling ({c.rope.type}, factor {c.rope.factor}) differs from the target's "
                          f"({target_cfg.rope.type}, factor {target_cfg.rope.factor})", stacklevel=2)

    def _check_vocab(self, target_cfg: ModelConfig) -> None:
        c = self.config
        name = type(self).__name__
        tv = target_cfg.vocab_size
        if self.use_own_head:
            rows = self.lm_head.out_features
            if rows > tv:
                raise ConfigError(f"{name}: draft_vocab_size {rows} (lm_head rows) exceeds the target vocab_size {tv}")
            if rows < tv and self.d2t is None:
                raise ConfigError(f"{name}: reduced draft vocabulary ({rows} < target vocab_size {tv}) needs a d2t map")
        elif c.vocab_size != tv:
            raise ConfigError(f"{name}: vocab_size {c.vocab_size} (drafter config) != the target vocab_size {tv}; "
                              "the drafter shares the target's embedding and LM head")
        if self.use_own_embedding and self.embed_tokens.num_embeddings < tv:
            raise ConfigError(f"{name}: embed_tokens has {self.embed_tokens.num_embeddings} rows, fewer than the "
                              f"target vocab_size {tv} (anchors can be any target token)")

    # ------------------------------------------------------------------ context
    def append_context(self, cache: KVCache, slots: list[int], starts: list[int], counts: list[int],
                       features: Tensor) -> None:
        """Write context K/V for features[r, :counts[r]] at positions starts[r]... (padding -> trash column)."""
        r, c = features.shape[0], features.shape[1]
        if r == 0 or c == 0:
            return
        if len(slots) != r or len(starts) != r or len(counts) != r:
            raise ValueError(f"append_context: {r} feature rows but {len(slots)} slots, {len(starts)} starts, "
                             f"{len(counts)} counts")
        end = max(s + n for s, n in zip(starts, counts))
        if end > cache.max_len:
            raise ValueError(f"append_context: context would reach position {end} beyond the cache ({cache.max_len})")
        # one host-to-device copy for the three (a prefill that feeds the drafter is host-bound at a busy
        # server: every copy and launch of it is a share of the step)
        slots_t, starts_t, counts_t = to_device([list(slots), list(starts), list(counts)], torch.int64, features.device)
        self.append_context_tensors(cache, slots_t, starts_t, counts_t, features, max(s + c for s in starts))

    def append_context_tensors(self, cache: KVCache, slots: Tensor, starts: Tensor, counts: Tensor,
                               features: Tensor, max_pos: int) -> None:
        """Device-only body of `append_context` (CUDA-graph capturable); max_pos bounds every position."""
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
            if self.attention_backend == "triton":
                layer.self_attn.store_context_kv(ctx, cos, sin, cache, i, meta)
            else:
                cache.write(i, meta, *layer.self_attn.context_kv(ctx, cos, sin))

    # ------------------------------------------------------------------ block
    def embed_block(self, ids: Tensor, embed: Callable[[Tensor], Tensor] | None) -> Tensor:
        if self.use_own_embedding:
            x = self.embed_tokens(ids)
        else:
            fn = embed
            if fn is None and self._target is not None:
                fn = self._target.embed
            if fn is None:
                raise ValueError(f"{type(self).__name__} has no embedding of its own: pass embed= or bind_target()")
            x = fn(ids)
        x = x.to(self.dtype)
        if self.config.input_embedding_scale != 1.0:
            x = x * self.config.input_embedding_scale
        return x

    def _block_bounds(self, ctx_t: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Per layer (lo, hi) [R, B]: the key positions each block row attends to. Context keys are
        positions < ctx_t, block keys ctx_t .. ctx_t + B - 1; the rules are the checkpoint's (causal
        or not, sliding window by query distance or by distance from the anchor)."""
        c = self.config
        b = positions.shape[1]
        last = (ctx_t + b - 1)[:, None].expand_as(positions)
        zero = torch.zeros_like(positions)
        out = []
        for lt, causal in zip(c.layer_types, c.causal):
            hi = positions if causal else last
            lo = zero
            if lt == "sliding_attention":
                w = c.sliding_window
                if c.window_mode == "query":
                    lo = (positions - w + 1).clamp(min=0)
                    if not causal:
                        hi = torch.minimum(hi, positions + w - 1)
                else:  # speculators: context keys within `window` before the anchor; block keys all
                    lo = (ctx_t[:, None] - w).clamp(min=0).expand_as(positions)
            # contiguous int32 once per block, the kernel's format, instead of a conversion per layer
            out.append((lo.to(torch.int32).contiguous(), hi.to(torch.int32).contiguous()))
        return out

    def _block_masks(self, ctx_t: Tensor, positions: Tensor, kv_len: int) -> list[Tensor]:
        """Reference layout: per layer [R, 1, B, kv_len + B] bool masks over [gathered context ; block]."""
        r, b = positions.shape
        key_pos = torch.cat([torch.arange(kv_len, device=positions.device).expand(r, kv_len), positions], dim=-1)
        ctx_valid = torch.cat([key_pos[:, :kv_len] < ctx_t[:, None], torch.ones_like(positions, dtype=torch.bool)],
                              dim=-1)
        return [(range_mask(lo, hi, key_pos) & ctx_valid[:, None, :]).unsqueeze(1)
                for lo, hi in self._block_bounds(ctx_t, positions)]

    def block_hidden(self, cache: KVCache, slots: list[int], ctx_lens: list[int], anchor_ids: Tensor,
                     embed: Callable[[Tensor], Tensor] | None = None) -> Tensor:
        """Final-normed hidden states [R, block_size, H] of ``[anchor, MASK...]`` at positions ctx_lens[r]...

        Queries are the block only; keys are the cached context [0, ctx_lens[r]) plus the block's own
        K/V, computed here and never written to the cache.
        """
        r = len(slots)
        if anchor_ids.shape[0] != r or len(ctx_lens) != r:
            raise ValueError(f"block_hidden: {len(slots)} slots, {len(ctx_lens)} ctx_lens, "
                             f"{anchor_ids.shape[0]} anchors")
        dev = anchor_ids.device
        kv_len = max(ctx_lens)
        if kv_len > cache.max_len:
            raise ValueError(f"block_hidden: context length {kv_len} beyond the cache ({cache.max_len})")
        ctx_t = to_device(ctx_lens, torch.int64, dev)
        slot_t = to_device(slots, torch.int64, dev)
        return self.block_hidden_tensors(cache, slot_t, ctx_t, anchor_ids, kv_len, embed)

    def block_hidden_tensors(self, cache: KVCache, slots: Tensor, ctx_lens: Tensor, anchor_ids: Tensor,
                             kv_len: int, embed: Callable[[Tensor], Tensor] | None = None) -> Tensor:
        """Device-only body of `block_hidden` (CUDA-graph capturable); kv_len >= every ctx_lens[r]."""
        r, b, dev = anchor_ids.shape[0], self.block_size, anchor_ids.device
        ids = torch.full((r, b), self.mask_token_id, dtype=torch.int64, device=dev)
        ids[:, 0] = anchor_ids
        x = self.embed_block(ids, embed)
        positions = ctx_lens[:, None] + torch.arange(b, device=dev)[None, :]
        cos, sin = self._rope(positions, kv_len + b)
        if self.attention_backend == "triton":
            meta = AttnMeta(slots, positions, positions, kv_len + b, {})
            block = CachedBlock(cache, meta, self._block_bounds(ctx_lens, positions))
            for i, layer in enumerate(self.layers):
                x = layer.forward_cached(x, cos, sin, block, i)
            return self.norm(x)
        masks = self._block_masks(ctx_lens, positions, kv_len)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, *cache.gather(i, slots, kv_len), masks[i])
        return self.norm(x)

    def slot_hidden(self, hidden: Tensor, k: int | None = None) -> Tensor:
        """[R, k, H] (k defaults to num_draft_slots): the block rows that propose the first k drafts,
        contiguous, so a head applied to them is one matrix product over all rows (a strided 3-D
        input makes torch run one product per request, reading the head's weights R times)."""
        return (hidden if self.anchor_first else hidden[:, 1:])[:, :k].contiguous()

    # ------------------------------------------------------------------ logits / vocab
    @property
    def draft_vocab_size(self) -> int | None:
        return self.lm_head.out_features if self.use_own_head else None

    def logits(self, hidden: Tensor, target: nn.Module | None = None) -> Tensor:
        """fp32 logits over the draft vocabulary (own LM head) or the target vocabulary (shared head)."""
        c = self.config
        if self.use_own_head:
            out = self.lm_head(hidden).float()
            if c.logit_scale != 1.0:
                out = out * c.logit_scale
        else:
            target = target if target is not None else self._target
            if target is None:
                raise ValueError(f"{type(self).__name__} shares the target's LM head: pass target= or bind_target()")
            out = target.compute_logits(hidden).float()
        if c.output_multiplier != 1.0:
            out = out * c.output_multiplier
        if c.final_logit_softcapping:
            cap = c.final_logit_softcapping
            out = torch.tanh(out / cap) * cap
        return out

    def draft_to_target(self, ids: Tensor) -> Tensor:
        """Draft-vocab ids -> target ids (EAGLE-3 offsets: target = draft + d2t[draft]); identity without d2t."""
        if self.d2t is None or not self.use_own_head:
            return ids
        return ids + self.d2t[ids]

    def target_index(self) -> Tensor | None:
        """Target id of every draft-vocab column, or None when the draft vocab is the target's."""
        if self.d2t is None or not self.use_own_head:
            return None
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def scatter_to_target(self, values: Tensor, target_vocab: int, fill: float = 0.0) -> Tensor:
        """[..., V_draft] -> [..., target_vocab]: draft columns placed at their target ids, `fill` elsewhere.

        fill=0 for probabilities (verification), -inf for logits.
        """
        index = self.target_index()
        if index is None:
            if values.shape[-1] == target_vocab:
                return values
            out = values.new_full((*values.shape[:-1], target_vocab), fill)
            out[..., : values.shape[-1]] = values
            return out
        out = values.new_full((*values.shape[:-1], target_vocab), fill)
        return out.scatter(-1, index.expand(*values.shape[:-1], -1), values)


class DFlashDraft(DraftModel):
    """DFlash drafter (z-lab ``DFlashDraftModel`` or speculators ``dflash``)."""


# ----------------------------------------------------------------------------------------- loading
def _strip_prefix(state: dict[str, Tensor]) -> dict[str, Tensor]:
    body = [k for k in state if not k.startswith(("lm_head.", "d2t", "t2d"))]
    if body and all(k.startswith("model.") for k in body):
        return {(k[len("model."):] if k.startswith("model.") else k): v for k, v in state.items()}
    return state


def backbone_state(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """HF-named drafter tensors -> blockspec names (fused qkv_proj / gate_up_proj inside layers.*)."""
    layers = fuse_hf_layer_names(state, "layers.", lambda n: "layers." + n)
    rest = {k: v for k, v in state.items() if not k.startswith("layers.")}
    return {**rest, **layers}


def unfuse_state(model: nn.Module) -> dict[str, Tensor]:
    """blockspec parameter names -> the HF / reference names (q/k/v_proj, gate/up_proj)."""
    out: dict[str, Tensor] = {}
    for name, t in model.state_dict().items():
        if name.startswith("rotary."):
            continue
        t = t.detach().contiguous()
        if ".self_attn.qkv_proj." in name:
            attn = model.layers[int(name.split(".")[1])].self_attn
            parts = t.split([attn.q_size, attn.kv_size, attn.kv_size], dim=0)
            for p, piece in zip(("q_proj", "k_proj", "v_proj"), parts):
                out[name.replace("qkv_proj", p)] = piece.contiguous()
        elif ".mlp.gate_up_proj." in name:
            gate, up = t.chunk(2, dim=0)
            out[name.replace("gate_up_proj", "gate_proj")] = gate.contiguous()
            out[name.replace("gate_up_proj", "up_proj")] = up.contiguous()
        else:
            out[name] = t
    return out


def _finish(model: DraftModel, state: dict[str, Tensor], source: str, device: str | torch.device,
            dtype: str | torch.dtype) -> DraftModel:
    if model.d2t is not None:
        d2t = state.pop("d2t")
        if d2t.dim() != 1 or d2t.shape[0] != model.d2t.shape[0] or d2t.dtype.is_floating_point:
            raise ModelLoadError(f"{source}: d2t must be an integer vector of draft_vocab_size "
                                 f"{model.d2t.shape[0]} entries, got {tuple(d2t.shape)} {d2t.dtype}")
        model.d2t.copy_(d2t.to(torch.int64))
        mapped = torch.arange(d2t.shape[0]) + model.d2t
        vocab = model.config.vocab_size
        if int(mapped.min()) < 0 or int(mapped.max()) >= vocab or mapped.unique().numel() != mapped.numel():
            raise ModelLoadError(f"{source}: d2t maps draft ids outside [0, {vocab}) or not one-to-one")
    assign_weights(model, state, source)
    dev = resolve_device(device)
    model.cast(dev, resolve_dtype(dtype, model.config.torch_dtype, dev))
    model.eval().requires_grad_(False)
    return model


def _build(cls: type, cfg: DrafterConfig, **kw: Any) -> Any:
    with torch.device("meta"):
        model = cls(cfg, **kw)
    model = model.to_empty(device="cpu")
    model.rotary = model._make_rotary("cpu")
    if model.d2t is not None:
        model.d2t = torch.zeros(model.d2t.shape[0], dtype=torch.int64)
    return model


def _speculators_vocab(state: dict[str, Tensor], cfg: DrafterConfig, source: str) -> dict[str, Any]:
    """Which vocabulary pieces a speculators checkpoint carries, checked against its config."""
    for k in ("t2d", "mask_embedding", "verifier_lm_head.weight", "verifier_norm.weight"):
        state.pop(k, None)  # training-only / placeholders
    embed = state.get("embed_tokens.weight")
    head = state.get("lm_head.weight")
    dv, tv = cfg.draft_vocab_size, cfg.vocab_size
    if head is not None and head.shape[0] != dv:
        raise ModelLoadError(f"{source}: lm_head.weight has {head.shape[0]} rows but draft_vocab_size is {dv}")
    reduced = dv is not None and dv < tv
    if reduced and head is None:
        raise ModelLoadError(f"{source}: reduced draft vocabulary (draft_vocab_size {dv} < vocab_size {tv}) needs "
                             "lm_head.weight in the checkpoint")
    if reduced and "d2t" not in state:
        raise ModelLoadError(f"{source}: reduced draft vocabulary (draft_vocab_size {dv} < vocab_size {tv}) needs "
                             "a d2t tensor in the checkpoint")
    if not reduced:
        state.pop("d2t", None)  # full vocab: identity map
    return dict(embed_rows=embed.shape[0] if embed is not None else None,
                head_rows=head.shape[0] if head is not None else None, has_d2t=reduced)


def _zlab_vocab(state: dict[str, Tensor], cfg: DrafterConfig, raw: dict[str, Any], source: str) -> dict[str, Any]:
    """z-lab checkpoints normally carry no embedding / LM head; some exports do (vLLM then keeps them)."""
    embed, head = state.get("embed_tokens.weight"), state.get("lm_head.weight")
    if embed is None and head is None:
        state.pop("d2t", None), state.pop("t2d", None)
        return {}
    state.pop("t2d", None)
    rows = head.shape[0] if head is not None else None
    declared = raw.get("draft_vocab_size")
    if rows is not None and declared is not None and declared != rows:
        raise ModelLoadError(f"{source}: lm_head.weight has {rows} rows but draft_vocab_size is {declared}")
    reduced = rows is not None and rows < cfg.vocab_size
    if reduced and "d2t" not in state:
        raise ModelLoadError(f"{source}: lm_head.weight has {rows} rows < vocab_size {cfg.vocab_size}: a reduced "
                             "draft vocabulary needs a d2t tensor")
    if not reduced:
        state.pop("d2t", None)
    return dict(embed_rows=embed.shape[0] if embed is not None else None, head_rows=rows, has_d2t=reduced)


def load_dflash(path_or_id: str | os.PathLike[str], device: str | torch.device = "auto",
                dtype: str | torch.dtype = "auto", use_own_head: bool = True) -> DFlashDraft:
    """Load a z-lab DFlash checkpoint (or a speculators-format ``dflash`` one)."""
    model_dir = resolve_model_dir(path_or_id, "DFlash drafter")
    cfg_path = model_dir / "config.json"
    raw = read_json(cfg_path)
    source = str(cfg_path)
    spec_type = raw.get("speculators_model_type")
    state = _strip_prefix(read_state_dict(model_dir))
    if spec_type is not None:
        if spec_type != "dflash":
            raise ModelLoadError(f"{source}: speculators_model_type {spec_type!r} is not a DFlash drafter"
                                 + (" (use load_dspark)" if spec_type == "dspark" else ""))
        cfg, _ = parse_speculators_config(raw, source, "dflash")
        kw = _speculators_vocab(state, cfg, source)
        fmt = "speculators"
    else:
        if any("DSpark" in a for a in raw.get("architectures") or []):
            raise ModelLoadError(f"{source}: {raw['architectures']} is a DSpark checkpoint (use load_dspark)")
        cfg = parse_zlab_config(raw, source)
        for old, new in (("encoder.fc.weight", "fc.weight"), ("encoder.output_norm_enc.weight", "hidden_norm.weight")):
            if old in state and new not in state:  # Muse-Glimmer "assistant" naming
                state[new] = state.pop(old)
        kw = _zlab_vocab(state, cfg, raw, source)
        if kw:
            cfg = replace(cfg, draft_vocab_size=kw["head_rows"])
        fmt = "zlab"
    state = backbone_state(state)
    _check_fc(state, cfg, source)
    model = _build(DFlashDraft, cfg, **kw)
    model.source_format = fmt
    model = _finish(model, state, str(model_dir), device, dtype)
    if not use_own_head and model.lm_head is not None:
        if model.d2t is not None:
            raise ModelLoadError(f"{source}: reduced draft vocabulary: the drafter's own lm_head must be used")
        model.use_own_head = False
    return model


def _check_fc(state: dict[str, Tensor], cfg: DrafterConfig, source: str) -> None:
    fc = state.get("fc.weight")
    if fc is None:
        raise ModelLoadError(f"{source}: weights do not fit the config: missing tensors: ['fc.weight']")
    want = len(cfg.target_layer_ids) * cfg.target_hidden_size
    if fc.shape[1] != want:
        raise ModelLoadError(f"{source}: fc.weight input size {fc.shape[1]} != {len(cfg.target_layer_ids)} target "
                             f"layers x target hidden size {cfg.target_hidden_size} = {want}")


# ------------------------------------------------------------------------------------------ saving
def backbone_hf_config(cfg: DrafterConfig, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """The Qwen3Config fields of the backbone (shared by all writers)."""
    rope_params: dict[str, Any] = {"rope_theta": cfg.rope.theta, "rope_type": cfg.rope.type}
    if cfg.rope.type != "default":
        rope_params.update(factor=cfg.rope.factor)
        if cfg.rope.original_max_position_embeddings is not None:
            rope_params["original_max_position_embeddings"] = cfg.rope.original_max_position_embeddings
        if cfg.rope.type == "llama3":
            rope_params.update(low_freq_factor=cfg.rope.low_freq_factor, high_freq_factor=cfg.rope.high_freq_factor)
        if cfg.rope.type == "yarn":
            rope_params.update(beta_fast=cfg.rope.beta_fast, beta_slow=cfg.rope.beta_slow)
            if cfg.rope.attention_factor is not None:
                rope_params["attention_factor"] = cfg.rope.attention_factor
    dtype_name = str(dtype).replace("torch.", "") if dtype is not None else cfg.torch_dtype
    out: dict[str, Any] = {
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope.theta,
        "rope_parameters": rope_params,
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": cfg.attention_bias,
        "attention_dropout": 0.0,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "layer_types": list(cfg.layer_types),
        "sliding_window": cfg.sliding_window,
        "use_sliding_window": cfg.sliding_window is not None,
        "max_window_layers": cfg.num_layers,
        "dtype": dtype_name,
    }
    if cfg.rope.type != "default":
        out["rope_scaling"] = dict(rope_params)
    return out


def _write(out_dir: Path, config: dict[str, Any], tensors: dict[str, Tensor]) -> Path:
    import json

    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    return out_dir


def speculators_config(model: DraftModel, kind: str, target_vocab: int | None = None) -> dict[str, Any]:
    c = model.config
    tl = backbone_hf_config(c, model.dtype)
    draft_vocab = model.lm_head.out_features if model.lm_head is not None else (target_vocab or c.vocab_size)
    cfg: dict[str, Any] = {
        "speculators_model_type": kind,
        "architectures": ["DSparkSpeculator" if kind == "dspark" else "DFlashSpeculator"],
        "transformer_layer_config": tl,
        "draft_vocab_size": draft_vocab,
        "block_size": c.block_size,
        "aux_hidden_state_layer_ids": [i + 1 for i in c.target_layer_ids],
        "mask_token_id": c.mask_token_id,
        "sample_from_anchor": c.anchor_first,
        "sliding_window_non_causal": c.sliding_window_non_causal or (
            any(lt == "sliding_attention" for lt in c.layer_types) and not any(c.causal)),
        "target_hidden_size": c.target_hidden_size,
        "speculators_version": "0.5.0",
    }
    if c.logit_scale != 1.0:
        cfg["logit_scale"] = c.logit_scale
    return cfg


def _t2d(model: DraftModel, target_vocab: int) -> Tensor:
    """speculators' training-side target->draft membership mask (written next to d2t)."""
    t2d = torch.zeros(target_vocab, dtype=torch.bool)
    t2d[model.target_index().cpu()] = True
    return t2d


def _vocab_tensors(model: DraftModel, state: dict[str, Tensor], target: nn.Module | None,
                   need_embed: bool, need_head: bool, what: str) -> None:
    if need_embed and "embed_tokens.weight" not in state:
        if target is None:
            raise ValueError(f"{what} needs embed_tokens: the drafter has none, pass target= to copy the target's")
        state["embed_tokens.weight"] = target.embed_tokens.weight.detach().to(model.dtype)
    if need_head and "lm_head.weight" not in state:
        if target is None:
            raise ValueError(f"{what} needs lm_head: the drafter has none, pass target= to copy the target's")
        state["lm_head.weight"] = target.lm_head.weight.detach().to(model.dtype)


def save_dflash(model: DraftModel, out_dir: str | os.PathLike[str], format: str = "zlab",
                target: nn.Module | None = None) -> Path:
    """Write `model` as a z-lab DFlash checkpoint (default) or a speculators ``dflash`` one."""
    out = Path(out_dir)
    c = model.config
    state = unfuse_state(model)
    if format == "zlab":
        if model.lm_head is not None or model.embed_tokens is not None:
            raise ValueError("save_dflash(format='zlab'): z-lab checkpoints carry no embedding/LM head; this drafter "
                             "has its own (save with format='speculators')")
        if c.anchor_first:
            raise ValueError("save_dflash(format='zlab'): z-lab DFlash is not anchor-first")
        config = backbone_hf_config(c, model.dtype)
        dflash_cfg: dict[str, Any] = {"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids),
                                      "block_size": c.block_size}
        config.update(architectures=["DFlashDraftModel"], auto_map={"AutoModel": "dflash.DFlashDraftModel"},
                      block_size=c.block_size, dflash_config=dflash_cfg)
        if c.num_target_layers is not None:
            config["num_target_layers"] = c.num_target_layers
        default_causal = tuple(lt == "sliding_attention" for lt in c.layer_types)
        if c.causal != default_causal:
            if len(set(c.causal)) != 1:
                raise ValueError("save_dflash: per-layer causality other than 'sliding layers causal' cannot be "
                                 "expressed in the z-lab format")
            config["is_causal"] = c.causal[0]
        elif c.is_causal is not None:
            config["is_causal"] = c.is_causal
        if c.window_mode != "query" and c.sliding_window is not None:
            raise ValueError("save_dflash(format='zlab'): speculators sliding-window semantics differ from z-lab's")
        for key in ("input_embedding_scale", "output_multiplier"):
            if getattr(c, key) != 1.0:
                dflash_cfg[key] = getattr(c, key)
        if c.final_logit_softcapping:
            dflash_cfg["final_logit_softcapping"] = c.final_logit_softcapping
        state.pop("d2t", None)
        return _write(out, config, state)
    if format == "speculators":
        config = speculators_config(model, "dflash")
        _vocab_tensors(model, state, target, True, True, "save_dflash(format='speculators')")
        if model.d2t is not None:
            state["t2d"] = _t2d(model, c.vocab_size)
        return _write(out, config, state)
    raise ValueError(f"save_dflash: format {format!r} (allowed: zlab, speculators)")


def load_drafter(method: str, path_or_id: str | os.PathLike[str], device: str | torch.device = "auto",
                 dtype: str | torch.dtype = "auto", **kw: Any) -> DraftModel:
    """``method`` is speculative_config.method: dflash or dspark."""
    if method == "dflash":
        return load_dflash(path_or_id, device, dtype, **kw)
    if method == "dspark":
        from blockspec.spec.dspark_model import load_dspark

        return load_dspark(path_or_id, device, dtype, **kw)
    raise ConfigError(f"speculative_config.method {method!r} not supported; allowed: ('dflash', 'dspark')")
