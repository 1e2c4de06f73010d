"""What a block drafter is, whatever checkpoint format it came from: `DrafterConfig` (the backbone's
shape and the block's semantics) and `DSparkHeads`, parsed from z-lab, speculators and DeepSpec
config.json files with one-line errors that name the file and the field."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from blockspec.config import ConfigError, RopeConfig, hf_field, hf_flag, rope_from_hf
from blockspec.errors import ModelLoadError

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


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


def _number(raw: dict[str, Any], name: str, source: str, default: float | None, kind: type = float) -> Any:
    """raw[name] (`default` where absent or null) as a positive `kind`, else a ModelLoadError naming it: int()
    and float() would take "16" or fail with Python's own words."""
    try:
        return hf_field(raw, name, source, default, kind)
    except ConfigError as exc:
        raise ModelLoadError(str(exc)) from None


def _flag(raw: dict[str, Any], name: str, source: str, default: bool | None) -> bool | None:
    """raw[name] as true / false (`default` where absent or null): bool("false") would be true."""
    try:
        return hf_flag(raw, name, source, default)
    except ConfigError as exc:
        raise ModelLoadError(str(exc)) from None


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
    for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                 "num_key_value_heads", "head_dim", "max_position_embeddings"):
        _number(tl, name, source, None, int)
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
        rms_norm_eps=_number(tl, "rms_norm_eps", source, 1e-6), rope=rope,
        max_position_embeddings=_number(tl, "max_position_embeddings", source, 4096, int),
        attention_bias=_flag(tl, "attention_bias", source, False), layer_types=layer_types, sliding_window=window,
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
    merged = {**raw, **{k: v for k, v in dcfg.items() if v is not None}}  # newest z-lab: dflash_config first

    top, inner = raw.get("block_size"), dcfg.get("block_size")
    if top is not None and inner is not None and top != inner:
        raise ModelLoadError(f"{source}: block_size {top} (top level) != dflash_config.block_size {inner}")
    block = inner if inner is not None else top
    if block is None:
        raise ModelLoadError(f"{source}: missing required field 'block_size' (top level or dflash_config.block_size)")
    block = _int_field(block, "block_size", source, 2)
    mask = merged.get("mask_token_id")
    if mask is None:
        raise ModelLoadError(f"{source}: missing required field 'dflash_config.mask_token_id'")
    mask = _int_field(mask, "dflash_config.mask_token_id", source)
    num_target_layers = raw.get("num_target_layers")
    ids = merged.get("target_layer_ids")
    if ids is None:
        if num_target_layers is None:
            raise ModelLoadError(f"{source}: missing 'dflash_config.target_layer_ids' (and no 'num_target_layers' "
                                 "to build the default from)")
        ids = build_target_layer_ids(_int_field(num_target_layers, "num_target_layers", source, 1),
                                     fields["num_layers"])
    ids = _layer_ids(ids, "dflash_config.target_layer_ids", source)
    explicit = _flag(raw, "is_causal", source, None)
    if explicit is None:
        explicit = _flag(dcfg, "is_causal", f"{source} dflash_config", _flag(dcfg, "causal", f"{source} dflash_config",
                                                                             None))
    layer_types = fields["layer_types"]
    causal = tuple(lt == "sliding_attention" if explicit is None else bool(explicit) for lt in layer_types)
    return DrafterConfig(
        **fields, block_size=block, mask_token_id=mask, target_layer_ids=ids,
        target_hidden_size=_number(raw, "target_hidden_size", source, fields["hidden_size"], int),
        causal=causal, window_mode="query", anchor_first=False, draft_vocab_size=None,
        num_target_layers=num_target_layers,
        input_embedding_scale=_number(merged, "input_embedding_scale", source, 1.0),
        output_multiplier=_number(merged, "output_multiplier", source, 1.0),
        # 0 (as some configs write it) is no cap
        final_logit_softcapping=_number(merged, "final_logit_softcapping", source, None)
        if merged.get("final_logit_softcapping") != 0 else None,
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
    sample_from_anchor = _flag(raw, "sample_from_anchor", source, kind == "dspark")
    non_causal = _flag(raw, "sliding_window_non_causal", source, False)
    causal = tuple(lt == "sliding_attention" and not non_causal for lt in fields["layer_types"])
    cfg = DrafterConfig(
        **fields, block_size=block, mask_token_id=mask,
        # speculators ids index HF hidden_states (0 = embeddings): tap = id - 1
        target_layer_ids=tuple(i - 1 for i in aux),
        target_hidden_size=_number(raw, "target_hidden_size", source, fields["hidden_size"], int),
        causal=causal, window_mode="anchor", anchor_first=sample_from_anchor, draft_vocab_size=draft_vocab,
        logit_scale=_number(raw, "logit_scale", source, _number(tl, "logit_scale", source, 1.0)),
        sliding_window_non_causal=non_causal,
    )
    return cfg, raw


@dataclass(frozen=True)
class DSparkHeads:
    markov_rank: int = 256
    markov_head_type: str | None = "vanilla"  # None when markov_rank == 0
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    num_anchors: int = 512  # DeepSpec training field, kept for writing checkpoints back

    def __post_init__(self) -> None:
        if self.markov_rank < 0:
            raise ConfigError(f"markov_rank must be >= 0, got {self.markov_rank}")
        if self.markov_rank > 0 and self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ConfigError(f"markov_head_type {self.markov_head_type!r} unknown; allowed: {MARKOV_HEAD_TYPES}")
        if self.enable_confidence_head and self.confidence_head_with_markov and self.markov_rank == 0:
            raise ConfigError("confidence_head_with_markov=true needs markov_rank > 0")


def _bool_field(raw: dict[str, Any], name: str, source: str, default: bool | None = None) -> bool:
    value = _flag(raw, name, source, default)
    if value is None:
        raise ModelLoadError(f"{source}: missing required field {name!r}")
    return value


def _head_type(value: Any, source: str) -> str:
    if value is None:
        raise ModelLoadError(f"{source}: missing required field 'markov_head_type' (markov_rank > 0)")
    if str(value).lower() not in MARKOV_HEAD_TYPES:
        raise ModelLoadError(f"{source}: unknown markov_head_type {value!r}; allowed: {', '.join(MARKOV_HEAD_TYPES)}")
    return str(value).lower()


def parse_deepspec_config(raw: dict[str, Any], source: str) -> tuple[DrafterConfig, DSparkHeads]:
    arch = raw.get("architectures") or []
    if any("Gemma4" in a for a in arch):
        raise ModelLoadError(f"{source}: {arch} (Gemma4 DSpark) is not supported; Qwen3DSparkModel only")
    fields = _arch_fields(raw, source)
    block = _int_field(raw.get("block_size"), "block_size", source, 1) if "block_size" in raw else None
    if block is None:
        raise ModelLoadError(f"{source}: missing required field 'block_size'")
    if raw.get("mask_token_id") is None:
        raise ModelLoadError(f"{source}: missing required field 'mask_token_id'")
    mask = _int_field(raw["mask_token_id"], "mask_token_id", source)
    if raw.get("target_layer_ids") is None:
        raise ModelLoadError(f"{source}: missing required field 'target_layer_ids'")
    ids = _layer_ids(raw["target_layer_ids"], "target_layer_ids", source)
    if any(i < -1 for i in ids) or any(b <= a for a, b in zip(ids, ids[1:])):
        raise ModelLoadError(f"{source}: target_layer_ids {list(ids)} must be strictly increasing, each -1 "
                             "(embeddings) or a decoder layer index")
    if raw.get("markov_rank") is None:
        raise ModelLoadError(f"{source}: missing required field 'markov_rank'")
    rank = _int_field(raw["markov_rank"], "markov_rank", source)
    head_type = _head_type(raw.get("markov_head_type"), source) if rank > 0 else None
    conf = _bool_field(raw, "enable_confidence_head", source)
    with_markov = _bool_field(raw, "confidence_head_with_markov", source) if conf else False
    if conf and with_markov and rank == 0:
        raise ModelLoadError(f"{source}: confidence_head_with_markov=true needs markov_rank > 0")
    cfg = DrafterConfig(
        **fields, block_size=block, mask_token_id=mask, target_layer_ids=ids, target_hidden_size=fields["hidden_size"],
        causal=(False,) * fields["num_layers"], window_mode="query", anchor_first=True,
        num_target_layers=raw.get("num_target_layers"),
    )
    heads = DSparkHeads(rank, head_type, conf, with_markov, _number(raw, "num_anchors", source, 512, int))
    return cfg, heads
