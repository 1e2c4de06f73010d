"""The block drafter's backbone, shared by DFlash and DSpark, and the interface the engine's step calls.

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
* Drafts. ``greedy_drafts`` and ``sample_drafts`` turn those rows into draft tokens; each family
  implements them (DFlash: every position at once; DSpark: left to right through its Markov head).

The reference implementations (z-lab ``dflash/model.py``, DeepSpec ``qwen3/modeling.py``) run the
context and the block through one forward with a growing ``DynamicCache`` that is cropped back to
the anchor after each draft; this module computes the same numbers over blockspec's paged cache,
for R requests of different lengths at once, without a host sync.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from blockspec.config import ConfigError, ModelConfig
from blockspec.drafters.config import DrafterConfig
from blockspec.kernels.attention import block_attention
from blockspec.kernels.ops import qkv_rope_store
from blockspec.models.kv_cache import AttnMeta, KVCache, PageTable, range_mask
from blockspec.models.layers import GatedMLP, RMSNorm, Rotary, apply_rotary, attention, dense, qkv_heads, rms_norm
from blockspec.models.quant import kept, linear_rows, reference_weight
from blockspec.sample import RowParams, sample_draft
from blockspec.transfer import to_device


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

    def store_context_kv(self, ctx: Tensor, cos: Tensor, sin: Tensor, cache: KVCache, layer: int,
                         meta: AttnMeta) -> None:
        """Kernel path of `DraftModel.context_kv` + `cache.write_layers`, a layer at a time: project, norm, rotate
        and store in one kernel."""
        qkv_rope_store(self._context_kv_proj(ctx), 0, self.kv_heads, self.head_dim, None, self.k_norm.weight,
                       self.k_norm.eps, cos, sin, cache.k[layer], cache.v[layer], cache.table, meta.slots,
                       meta.write_pos, cache.k_scales[layer], cache.v_scales[layer])

    def _context_kv_proj(self, ctx: Tensor) -> Tensor:
        """[k | v] of the context rows: the k and v slices of the fused projection."""
        return linear_rows(self.qkv_proj, ctx, self.q_size)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None) -> Tensor:
        """Reference: keys and values [R, kv_heads, C + n, hd] hold the gathered context's C positions, and the
        block's own n K/V are written into the n after them (`KVCache.gather_layers` leaves that room), so no
        concatenation copies the context each layer."""
        r, n, _ = x.shape
        q, k, v = qkv_heads(self.qkv_proj(x), self.heads, self.kv_heads, self.head_dim, self.q_norm.weight,
                            self.k_norm.weight, self.q_norm.eps, cos, sin)
        keys[:, :, -n:] = k
        values[:, :, -n:] = v
        out = attention(q, keys, values, mask, self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(r, n, self.q_size))

    def forward_cached(self, x: Tensor, cos: Tensor, sin: Tensor, block: "CachedBlock", layer: int,
                       norm: RMSNorm, residual: Tensor, rows: int | None = None) -> Tensor:
        """Kernel path of residual + attention(norm(x)): the block's K/V are written into the cache
        right after the context (columns the next context append overwrites) and the rows read keys
        in place, within `block.bounds`; the norm and the residual add fold into the products. With
        `rows`, only the first `rows` block rows query (every row's K/V is still a key)."""
        cache, meta = block.cache, block.meta
        q = qkv_rope_store(dense(x, self.qkv_proj, norm=norm), self.heads, self.kv_heads, self.head_dim,
                           self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cos, sin, cache.k[layer],
                           cache.v[layer], cache.table, meta.slots, meta.write_pos, cache.k_scales[layer],
                           cache.v_scales[layer])
        lo, hi = block.bounds[layer]
        if rows is not None:
            q, lo, hi, residual = q[:, :rows], lo[:, :rows], hi[:, :rows], residual[:, :rows]
        out = block_attention(q, cache.k[layer], cache.v[layer], cache.table, meta.slots, lo, hi, self.scale,
                              meta.kv_len, k_scale=cache.k_scales[layer], v_scale=cache.v_scales[layer])
        return dense(out.flatten(2), self.o_proj, residual=residual)

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

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, keys, values, mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_cached(self, x: Tensor, cos: Tensor, sin: Tensor, block: CachedBlock, layer: int,
                       rows: int | None = None) -> Tensor:
        x = self.self_attn.forward_cached(x, cos, sin, block, layer, self.input_layernorm, x, rows)
        return self.mlp(x, norm=self.post_attention_layernorm, residual=x)


class DraftModel(nn.Module):
    """Shared drafter backbone, and the interface the step calls (`greedy_drafts`, `sample_drafts`,
    the context and block forwards); see the module docstring for the data flow.

    Optional vocabulary pieces (speculators / DeepSpec checkpoints): ``embed_tokens`` (a copy of the
    target embedding, possibly with extra rows), ``lm_head`` (draft vocabulary, maybe reduced) and
    ``d2t`` (draft id -> target id offsets, ``target = draft + d2t[draft]``).
    """

    source_format: str = "zlab"
    # P(first k drafts accepted), k = 1.., measured for this checkpoint (its acceptance.json): the
    # draft-length policy's starting belief
    recorded_acceptance: tuple[float, ...] | None = None

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
        # the LM head's product where it is not the head module's own (the engine sets a bfloat16 one on a CPU
        # that has them: `models.cpu_linear.draft_head_product`)
        self.head_product: Callable[[Tensor], Tensor] | None = None
        self.rotary = self._make_rotary()
        self.attention_backend = "sdpa"  # the engine sets "triton" on GPUs (see kernels.attention)
        # the engine sets float8_e4m3fn for an FP8 cache (on the kernel path the block's own K/V are
        # read back from it too; the reference keeps them in the model's dtype)
        self.kv_cache_dtype: torch.dtype | None = None

    has_confidence = False  # a confidence head (DSpark) gives each draft a survival probability

    @property
    def plain_target_head(self) -> bool:
        """The drafter's logits are exactly the target LM head's (no own head or product, scale or softcap)."""
        c = self.config
        return (not self.use_own_head and self.head_product is None and c.output_multiplier == 1.0
                and not c.final_logit_softcapping)

    @property
    def feature_width(self) -> int:
        """Width of one token's tapped target features (every tap layer's hidden state, concatenated)."""
        return self.fc.in_features

    # ------------------------------------------------------------------ drafts
    def greedy_drafts(self, slot_hidden: Tensor, anchors: Tensor, top_k: int = 0,
                      head_argmax: Callable[[Tensor], Tensor] | None = None) -> tuple[Tensor, Tensor | None]:
        """Greedy drafts [R, K] (target ids) from the draft rows [R, K, H], and their confidences
        [R, K] (None without a confidence head). `head_argmax`: the target head's own argmax, taken
        where the drafter's logits are the target's."""
        raise NotImplementedError

    def sample_drafts(self, slot_hidden: Tensor, anchors: Tensor, params: RowParams, round_: Tensor, vocab: int,
                      top_k: int = 0) -> tuple[Tensor, Tensor, Tensor | None]:
        """Drafts drawn from the processed draft distribution: tokens [R, K], the distribution q
        [R, K, vocab] each was drawn from, and confidences (None without a confidence head)."""
        raise NotImplementedError

    def _sample_independent(self, slot_hidden: Tensor, params: RowParams, round_: Tensor,
                            vocab: int) -> tuple[Tensor, Tensor, None]:
        """Every position drawn at once (positions independent given the context); draft-vocabulary
        logits are placed into target-vocabulary rows (-inf elsewhere) first."""
        tokens, q = sample_draft(self.scatter_to_target(self.logits(slot_hidden), vocab, float("-inf")), params,
                                 round_)
        return tokens, q, None

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

    def share_target_copies(self, target: nn.Module) -> None:
        """Use the target's embedding / LM head where this checkpoint's own are bitwise copies of them
        (DeepSpec's exports carry such copies): the same numbers from one copy in memory, whose weights a
        step then streams once for the drafts and the verify rows instead of twice. Inference only: a
        trainer keeps the modules its export writes."""
        def same(own: nn.Module | None, theirs: nn.Module | None) -> bool:
            a, b = getattr(own, "weight", None), getattr(theirs, "weight", None)
            return (a is not None and b is not None and a.shape == b.shape and a.dtype == b.dtype
                    and a.device == b.device and bool(torch.equal(a, b)))

        if self.d2t is not None:
            return
        if self.use_own_embedding and same(self.embed_tokens, getattr(target, "embed_tokens", None)):
            self.use_own_embedding, self.embed_tokens = False, None
        if (self.use_own_head and self.config.logit_scale == 1.0
                and same(self.lm_head, getattr(target, "lm_head", None))):
            self.use_own_head, self.lm_head = False, None

    def _rope(self, positions: Tensor, max_pos: int) -> tuple[Tensor, Tensor]:
        if max_pos >= self.rotary.cos.shape[0]:  # host-side check; positions are known on the host
            self.rotary = Rotary(self.config.rope, self.config.head_dim, max(2 * max_pos, 64)).to(self.device)
        return self.rotary.cos[positions].to(self.dtype), self.rotary.sin[positions].to(self.dtype)

    def new_cache(self, table: PageTable | int, max_len: int, device: torch.device | str | None = None,
                  dtype: torch.dtype | None = None) -> KVCache:
        """The drafter's K/V pools over `table`'s pages (the target's: one page id names the same
        positions in both), `max_len` positions a slot (see `KVCache`)."""
        return KVCache(*self._cache_dims(), max_len, dtype or self.dtype, device or self.device, table,
                       self.kv_cache_dtype)

    def page_bytes(self, page_size: int, dtype: torch.dtype | None = None) -> int:
        """Bytes one page of the drafter's cache takes (every layer's K and V), stored in `dtype`
        (default: its cache dtype)."""
        return KVCache.page_bytes(*self._cache_dims(), page_size, dtype or self.kv_cache_dtype or self.dtype)

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
        shares = [what for what, own in (("embedding", self.use_own_embedding), ("LM head", self.use_own_head))
                  if not own]
        if shares and c.hidden_size != target_cfg.hidden_size:
            raise ConfigError(f"{name}: hidden_size {c.hidden_size} != the target's hidden_size "
                              f"{target_cfg.hidden_size}; the drafter shares the target's {' and '.join(shares)}")
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
        if self.attention_backend == "triton":
            for i, layer in enumerate(self.layers):
                layer.self_attn.store_context_kv(ctx, cos, sin, cache, i, meta)
        else:
            cache.write_layers(meta, *self.context_kv(ctx, cos, sin))

    def context_kv(self, ctx: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """Every layer's K/V of the context rows ctx [R, C, H] (the fused target features): k, v [layers, R,
        kv_heads, C, hd], k normed and rotated. The layers read the same features, so their k and v rows are
        one product, their k heads one norm (each head by its own layer's weight) and one rotation."""
        a = self.layers[0].self_attn
        weight, bias, norm_weight = self._context_projection(ctx.dtype)
        r, c, _ = ctx.shape
        n = len(self.layers)
        kv = F.linear(ctx, weight, bias).view(r, c, n, 2, a.kv_heads, a.head_dim)
        k = rms_norm(kv[:, :, :, 0].reshape(r, c, n * a.kv_heads, a.head_dim), None, a.k_norm.eps) * norm_weight
        k = apply_rotary(k.transpose(1, 2), cos, sin).view(r, n, a.kv_heads, c, a.head_dim).transpose(0, 1)
        return k, kv[:, :, :, 1].permute(2, 0, 3, 1, 4)

    def _context_projection(self, dtype: torch.dtype) -> tuple[Tensor, Tensor | None, Tensor]:
        """The layers' k and v rows of their fused projections stacked [layers x 2 kv_size, H] (and biases), and
        their k norms' weights a head [layers x kv_heads, hd]. Kept while none of those weights changes where no
        gradient is wanted (a step); made anew where one is (training), so that it reaches each layer's."""
        atts = [layer.self_attn for layer in self.layers]

        def make() -> tuple[Tensor, Tensor | None, Tensor]:
            weight = torch.cat([reference_weight(a.qkv_proj, dtype)[a.q_size:] for a in atts])
            bias = torch.cat([a.qkv_proj.bias[a.q_size:] for a in atts]) if atts[0].qkv_proj.bias is not None else None
            return weight, bias, torch.cat([a.k_norm.weight.expand(a.kv_heads, -1) for a in atts])

        if torch.is_grad_enabled():
            return make()
        sources = [t for a in atts for t in (*a.qkv_proj.parameters(), a.k_norm.weight)]
        return kept(self.__dict__, "_context_weights", (dtype, *((t.data_ptr(), t._version) for t in sources)), make)

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

    def _block_masks(self, ctx_t: Tensor, positions: Tensor, kv_len: int,
                     every_key: bool = False) -> list[Tensor | None]:
        """Reference layout: per layer [R, 1, B, kv_len + B] bool masks over [gathered context ; block], or
        None where every row sees every key: `every_key` (each request's context fills the kv_len keys
        gathered, as a single request's always does) on a non-causal layer of full attention, which SDPA
        then runs unmasked (on the CPU the masks and SDPA's masked path took about 2 % of a speculative
        step at batch 1)."""
        c = self.config
        open_layers = [every_key and not causal and lt != "sliding_attention"
                       for lt, causal in zip(c.layer_types, c.causal)]
        if all(open_layers):
            return [None] * len(open_layers)
        r, b = positions.shape
        key_pos = torch.cat([torch.arange(kv_len, device=positions.device).expand(r, kv_len), positions], dim=-1)
        ctx_valid = torch.cat([key_pos[:, :kv_len] < ctx_t[:, None], torch.ones_like(positions, dtype=torch.bool)],
                              dim=-1)
        return [None if open_ else (range_mask(lo, hi, key_pos) & ctx_valid[:, None, :]).unsqueeze(1)
                for open_, (lo, hi) in zip(open_layers, self._block_bounds(ctx_t, positions))]

    def block_hidden(self, cache: KVCache, slots: list[int], ctx_lens: list[int], anchor_ids: Tensor,
                     embed: Callable[[Tensor], Tensor] | None = None, rows: int | None = None) -> Tensor:
        """Final-normed hidden states [R, rows, H] (rows: block_size by default) of the first block rows
        of ``[anchor, MASK...]`` at positions ctx_lens[r]...

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
        return self.block_hidden_tensors(cache, slot_t, ctx_t, anchor_ids, kv_len, embed, rows,
                                         every_key=min(ctx_lens) == kv_len)

    def block_hidden_tensors(self, cache: KVCache, slots: Tensor, ctx_lens: Tensor, anchor_ids: Tensor,
                             kv_len: int, embed: Callable[[Tensor], Tensor] | None = None,
                             rows: int | None = None, every_key: bool = False) -> Tensor:
        """Device-only body of `block_hidden` (CUDA-graph capturable); kv_len >= every ctx_lens[r].

        With `rows` (`block_rows`: the rows that hold the drafts a step verifies) the kernel path's
        last layer runs attention, o_proj and the MLP for those rows only: every row's K/V still
        enters every layer, so the rows kept are the numbers of the whole block's forward, while a
        step verifying 8 of DFlash's 15 drafts computes 7 fewer rows of that layer. The reference
        path computes every row and returns the first `rows`; with `every_key` (every ctx_lens[r] is kv_len,
        known on the host) its layers of non-causal full attention run unmasked."""
        r, b, dev = anchor_ids.shape[0], self.block_size, anchor_ids.device
        ids = torch.full((r, b), self.mask_token_id, dtype=torch.int64, device=dev)
        ids[:, 0] = anchor_ids
        x = self.embed_block(ids, embed)
        positions = ctx_lens[:, None] + torch.arange(b, device=dev)[None, :]
        cos, sin = self._rope(positions, kv_len + b)
        if self.attention_backend == "triton":
            meta = AttnMeta(slots, positions, positions, kv_len + b, {})
            block = CachedBlock(cache, meta, self._block_bounds(ctx_lens, positions))
            *early, last = self.layers
            for i, layer in enumerate(early):
                x = layer.forward_cached(x, cos, sin, block, i)
            x = last.forward_cached(x, cos, sin, block, len(early), rows if rows and rows < b else None)
            return self.norm(x)
        masks = self._block_masks(ctx_lens, positions, kv_len, every_key)
        keys, values = cache.gather_layers(slots, kv_len, b)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, keys[i, :, :, : kv_len + b], values[i, :, :, : kv_len + b], masks[i])
        return self.norm(x[:, :rows])

    def block_rows(self, k: int) -> int:
        """Block rows whose hidden states hold the first k drafts (`slot_hidden`)."""
        return min(self.block_size, k + (0 if self.anchor_first else 1))

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
        if self.head_product is not None or self.use_own_head:
            out = (self.head_product or self.lm_head)(hidden).float()
            if self.use_own_head and c.logit_scale != 1.0:
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
