"""One place for the engine's configuration: model shape, engine limits, speculation.

Every user-facing knob is validated here, so a bad value fails before any work starts and the
message names the field and the allowed values.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any


class ConfigError(ValueError):
    """A configuration value does not fit; the message names the field and what is allowed."""


SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "qwen2_moe")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
REASONING_PARSERS = ("qwen3", "deepseek_r1")  # blockspec.reasoning


@dataclass(frozen=True)
class RopeConfig:
    """RoPE frequencies: base plus an optional scaling rule (HF `rope_scaling`/`rope_parameters`)."""

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    # yarn: the attention factor's log(factor) weights, above and below the ratio (DeepSeek's), where both are
    # given and attention_factor is not; and whether the correction range is rounded out to whole dimensions
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.type in ("llama3", "yarn") and self.original_max_position_embeddings is None:
            raise ConfigError(f"rope type {self.type!r} needs original_max_position_embeddings")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder (Llama-3.x, Qwen2/2.5, Qwen3, and the Qwen3-MoE / Qwen2-MoE sparse
    variants), read from HF config.json."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 4096
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    torch_dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # mixture of experts (Qwen3-MoE, Qwen2-MoE): the layers in `moe_layers` route each row to
    # `num_experts_per_tok` of `num_experts` SwiGLU experts of width `moe_intermediate_size`; the
    # others keep the dense MLP of `intermediate_size`
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert, gated by a sigmoid (0: none)
    moe_layers: tuple[int, ...] = ()

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    @staticmethod
    def from_hf(cfg: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        """Build from a HF config dict; raise ConfigError naming the field for anything that won't fit."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"{source}: model_type {model_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} (Llama-3.x, Qwen2/2.5, Qwen3 families, Qwen3-MoE, Qwen2-MoE)"
            )
        if "text_config" in cfg and "hidden_size" not in cfg:
            raise ConfigError(f"{source}: multimodal configs (text_config) are not supported")
        heads_on = [str(a) for a in cfg.get("architectures") or [] if not str(a).endswith("ForCausalLM")]
        if heads_on:  # a classifier's or reward model's weights under a causal LM's model_type
            raise ConfigError(f"{source}: architectures {heads_on} are not supported; blockspec generates text with "
                              "*ForCausalLM models")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if cfg.get(name) is None:
                raise ConfigError(f"{source}: field {name!r} must be a positive integer, got None")
            hf_field(cfg, name, source)
        if cfg.get("hidden_act", "silu") not in ("silu", "swish"):  # transformers' swish is SiLU
            raise ConfigError(f"{source}: field 'hidden_act' {cfg.get('hidden_act')!r} is not supported (silu only)")
        dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        if str(dtype).replace("torch.", "") not in HF_DTYPES:
            raise ConfigError(f"{source}: field 'torch_dtype' {dtype!r} is not supported; allowed: {', '.join(HF_DTYPES)}")
        heads = cfg["num_attention_heads"]
        kv_heads = hf_field(cfg, "num_key_value_heads", source, heads)
        if heads % kv_heads:
            raise ConfigError(
                f"{source}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
            )
        # transformers' defaults where config.json has none: Qwen3Config's 128, else hidden / heads
        head_dim = hf_field(cfg, "head_dim", source, 128 if model_type == "qwen3" else cfg["hidden_size"] // heads)
        if head_dim % 2:
            raise ConfigError(f"{source}: head_dim must be even for RoPE, got {head_dim}")
        layers = cfg["num_hidden_layers"]
        window, layer_types = sliding_layers(cfg, model_type, layers, source)
        bos_ids = token_ids(cfg, "bos_token_id", source, many=False)
        attention_bias = hf_flag(cfg, "attention_bias", source)
        return ModelConfig(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_field(cfg, "rms_norm_eps", source, 1e-6, float),
            rope=rope_from_hf(cfg, source),
            max_position_embeddings=hf_field(cfg, "max_position_embeddings", source, 4096),
            qkv_bias=hf_flag(cfg, "qkv_bias", source, True) if model_type == "qwen2_moe"
            else attention_bias or model_type == "qwen2",
            o_bias=attention_bias and model_type in ("llama", "mistral", "qwen3", "qwen3_moe"),
            mlp_bias=hf_flag(cfg, "mlp_bias", source),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            tie_word_embeddings=hf_flag(cfg, "tie_word_embeddings", source),
            sliding_window=window,
            layer_types=layer_types,
            torch_dtype=str(dtype).replace("torch.", ""),
            eos_token_ids=token_ids(cfg, "eos_token_id", source),
            bos_token_id=bos_ids[0] if bos_ids else None,
            **moe_from_hf(cfg, model_type, layers, source),
        )

    def to_hf(self) -> dict[str, Any]:
        """The HF config.json dict for this shape (used when blockspec writes checkpoints)."""
        cfg: dict[str, Any] = {
            "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                               "mistral": "MistralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                               "qwen2_moe": "Qwen2MoeForCausalLM"}[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope.theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "torch_dtype": self.torch_dtype,
            "attention_bias": self.qkv_bias if self.model_type != "qwen2" else False,
        }
        if self.rope.type != "default":
            cfg["rope_scaling"] = {k: v for k, v in dataclasses.asdict(self.rope).items() if k != "theta" and v is not None}
            cfg["rope_scaling"]["rope_type"] = cfg["rope_scaling"].pop("type")
        if self.eos_token_ids:
            cfg["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0]
        if self.bos_token_id is not None:
            cfg["bos_token_id"] = self.bos_token_id
        if self.mlp_bias:
            cfg["mlp_bias"] = True
        if self.sliding_window is not None:  # the window, and which layers take it, as `sliding_layers` reads them
            cfg.update(sliding_window=self.sliding_window, use_sliding_window=True)
            if self.model_type != "qwen3_moe" and set(self.layer_types) != {"sliding_attention"}:
                cfg["layer_types"] = list(self.layer_types)
        if self.model_type in ("qwen3_moe", "qwen2_moe"):
            cfg.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                       moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                       decoder_sparse_step=1,
                       mlp_only_layers=[i for i in range(self.num_hidden_layers) if i not in self.moe_layers])
            if self.model_type == "qwen2_moe":
                cfg.update(shared_expert_intermediate_size=self.shared_expert_intermediate_size, qkv_bias=self.qkv_bias)
        return cfg


HF_DTYPES = ("float32", "float", "bfloat16", "float16", "half")  # a checkpoint's torch_dtype


def hf_field(cfg: dict[str, Any], name: str, source: str, default: Any = None, kind: type = int,
             zero: bool = False) -> Any:
    """cfg[name] as a positive `kind` (int: not a bool; float: a finite int or float; `zero`: 0 too), `default`
    where it is absent or null; a ConfigError naming the file and field otherwise."""
    value = cfg.get(name)
    if value is None:
        return default
    number = isinstance(value, int) if kind is int else isinstance(value, (int, float)) and math.isfinite(value)
    if not number or isinstance(value, bool) or value < 0 or (value == 0 and not zero):
        what = ("a positive integer" if kind is int else "a positive number") + (" or 0" if zero else "")
        raise ConfigError(f"{source}: field {name!r} must be {what}, got {value!r}")
    return kind(value)


def hf_flag(cfg: dict[str, Any], name: str, source: str, default: bool = False) -> bool:
    """cfg[name] as a bool, `default` where it is absent or null: bool("false") would read a string as true."""
    value = cfg.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"{source}: field {name!r} must be true or false, got {value!r}")
    return value


def token_ids(cfg: dict[str, Any], name: str, source: str, many: bool = True) -> tuple[int, ...]:
    """cfg[name] as token ids: an integer >= 0, a list of them where `many`, or null (none)."""
    value = cfg.get(name)
    ids = value if many and isinstance(value, list) else [] if value is None else [value]
    if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in ids):
        what = "a token id (an integer >= 0)" + (", a list of them" if many else "")
        raise ConfigError(f"{source}: field {name!r} must be {what} or null, got {value!r}")
    return tuple(ids)


def sliding_layers(cfg: dict[str, Any], model_type: str, layers: int,
                   source: str) -> tuple[int | None, tuple[str, ...]]:
    """The sliding window's width and each layer's attention, as transformers 5 reads each family's config: Llama
    never slides; Mistral slides every layer while sliding_window is set (4096 where the key is absent; a
    layer_types list is Ministral's, per layer); the Qwen families only with use_sliding_window, Qwen2 and Qwen3
    from layer max_window_layers on (28 where absent), Qwen2-MoE every other layer below it, unless layer_types
    lists them, and Qwen3-MoE every layer."""
    full = ("full_attention",) * layers
    given = cfg.get("layer_types") or ()
    if not isinstance(given, list | tuple) or not all(isinstance(t, str) for t in given):
        raise ConfigError(f"{source}: field 'layer_types' must be a list of strings, got {given!r}")
    if given and len(given) != layers:
        raise ConfigError(f"{source}: layer_types has {len(given)} entries for {layers} layers")
    if model_type == "llama":
        return None, full
    if model_type == "mistral":
        window = hf_field(cfg, "sliding_window", source, 4096 if "sliding_window" not in cfg else None)
        types = tuple(given) or (("sliding_attention",) * layers if window is not None else full)
    else:
        # sliding_window is read only where the flag is on (Qwen configs carry one they do not use)
        window = hf_field(cfg, "sliding_window", source) if hf_flag(cfg, "use_sliding_window", source) else None
        if window is None:
            return None, full
        bound = cfg.get("max_window_layers", 28)
        if not isinstance(bound, int) or isinstance(bound, bool) or bound < 0:
            raise ConfigError(f"{source}: field 'max_window_layers' must be an integer >= 0, got {bound!r}")
        rule = {"qwen2_moe": lambda i: (i + 1) % 2 == 1 and i < bound, "qwen3_moe": lambda i: True}.get(
            model_type, lambda i: i >= bound)
        computed = tuple("sliding_attention" if rule(i) else "full_attention" for i in range(layers))
        types = computed if model_type == "qwen3_moe" or not given else tuple(given)
    bad = sorted(set(types) - {"full_attention", "sliding_attention"})
    if bad:
        raise ConfigError(f"{source}: layer_types {bad} not supported (full_attention, sliding_attention)")
    if "sliding_attention" in types and window is None:
        raise ConfigError(f"{source}: sliding_attention layers need a positive sliding_window")
    return (window if "sliding_attention" in types else None), types


# the rope_scaling / rope_parameters fields transformers' rope validation requires for each type. llama3's
# original_max_position_embeddings is required as transformers 4 requires it (5 fills in max_position_embeddings,
# which for Llama 3.1 is not the pre-training length); yarn's defaults to max_position_embeddings in both
ROPE_REQUIRED = {"linear": ("factor",), "yarn": ("factor",),
                 "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def rope_from_hf(cfg: dict[str, Any], source: str) -> RopeConfig:
    """Read RoPE settings from either transformers 4.x (`rope_theta` + `rope_scaling`) or 5.x (`rope_parameters`);
    where a config has both, transformers' choice (`rope_scaling`)."""
    for name in ("rope_parameters", "rope_scaling"):
        if not isinstance(cfg.get(name) or {}, dict):
            raise ConfigError(f"{source}: field {name!r} must be an object (or null), got {cfg[name]!r}")
    # transformers takes a non-empty rope_scaling whole, in place of rope_parameters
    given = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    params = cfg.get(given) or {}
    where = f"{source} (rope)"
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type in ("llama3", "yarn") and cfg.get("original_max_position_embeddings") is not None:
        # transformers' rule: a top-level original_max_position_embeddings wins over the rope dict's
        params = {**params, "original_max_position_embeddings": cfg["original_max_position_embeddings"]}
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{source}: rope type {rope_type!r} not supported; supported: {', '.join(ROPE_TYPES)}")
    missing = [f"{given}.{name}" for name in ROPE_REQUIRED.get(rope_type, ()) if params.get(name) is None]
    if missing:
        raise ConfigError(f"{source}: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} required for "
                          f"rope type {rope_type}")
    original = hf_field(params, "original_max_position_embeddings", where)
    if original is None and rope_type == "yarn":
        original = hf_field(cfg, "max_position_embeddings", source, 4096)
    return RopeConfig(
        theta=hf_field(params, "rope_theta", where, hf_field(cfg, "rope_theta", source, 10000.0, float), float),
        type=rope_type,
        factor=hf_field(params, "factor", where, 1.0, float),
        low_freq_factor=hf_field(params, "low_freq_factor", where, 1.0, float),
        high_freq_factor=hf_field(params, "high_freq_factor", where, 4.0, float),
        original_max_position_embeddings=original,
        beta_fast=hf_field(params, "beta_fast", where, 32.0, float),
        beta_slow=hf_field(params, "beta_slow", where, 1.0, float),
        attention_factor=hf_field(params, "attention_factor", where, None, float),
        mscale=hf_field(params, "mscale", where, None, float, zero=True),
        mscale_all_dim=hf_field(params, "mscale_all_dim", where, None, float, zero=True),
        truncate=hf_flag(params, "truncate", where, True),
    )


def moe_from_hf(cfg: dict[str, Any], model_type: str, layers: int, source: str) -> dict[str, Any]:
    """The mixture-of-experts fields of a Qwen3-MoE / Qwen2-MoE config (none for dense types), as HF
    builds them: layer i is sparse unless it is in mlp_only_layers or (i + 1) % decoder_sparse_step != 0."""
    if model_type not in ("qwen3_moe", "qwen2_moe"):
        return {}
    # transformers 5 writes num_local_experts; the hub checkpoints have num_experts
    name = "num_experts" if "num_experts" in cfg else "num_local_experts"
    fields = {"num_experts": cfg.get(name), "num_experts_per_tok": cfg.get("num_experts_per_tok"),
              "moe_intermediate_size": cfg.get("moe_intermediate_size")}
    for field_name, value in fields.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{source}: field {name if field_name == 'num_experts' else field_name!r} must be a "
                              f"positive integer, got {value!r}")
    if fields["num_experts_per_tok"] > fields["num_experts"]:
        raise ConfigError(f"{source}: field 'num_experts_per_tok' ({fields['num_experts_per_tok']}) exceeds "
                          f"{name} ({fields['num_experts']})")
    step = cfg.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ConfigError(f"{source}: field 'decoder_sparse_step' must be an integer >= 1, got {step!r}")
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or any(not isinstance(i, int) or not 0 <= i < layers for i in dense):
        raise ConfigError(f"{source}: field 'mlp_only_layers' must list layer indices in [0, {layers}), got {dense!r}")
    shared = 0
    if model_type == "qwen2_moe":  # its sparse block always has the shared expert
        shared = cfg.get("shared_expert_intermediate_size")
        if not isinstance(shared, int) or isinstance(shared, bool) or shared <= 0:
            raise ConfigError(f"{source}: field 'shared_expert_intermediate_size' must be a positive integer, "
                              f"got {shared!r}")
    return {**fields, "norm_topk_prob": hf_flag(cfg, "norm_topk_prob", source),
            "shared_expert_intermediate_size": shared,
            "moe_layers": tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)}


SPEC_METHODS = ("dflash", "dspark")


def drafter_method(model: str | os.PathLike[str]) -> str | None:
    """The speculative method a local drafter checkpoint's config.json names (its architectures or speculators'
    model type), or None (a hub id, no such file, or a config that names neither)."""
    path = Path(model) / "config.json"
    try:
        kind = (drafter_kind(json.loads(path.read_text(encoding="utf-8"))) or "").lower()
    except (OSError, ValueError, AttributeError):
        return None
    return next((m for m in SPEC_METHODS if m in kind), None)


def infer_method(model: str, revision: str | None = None, download_dir: str | os.PathLike[str] | None = None,
                 token: str | None = None) -> str:
    """speculative_config's method where a user names only the drafter (vLLM infers it from the draft model too):
    the family its config.json names, read from a local directory or, for a hub id, fetched alone at `revision`
    into `download_dir` with `token` (the hub cache answers where it holds it); DFlash for the embedded 'default',
    and where the config names neither or cannot be fetched (the drafter's load then says what is wrong). Fetched
    as the load fetches the drafter, a snapshot: offline it asks the hub once (a single file's download retries
    with backoff, 23 s before it read the cache)."""
    path = Path(model).expanduser()
    if model == "default":
        return SPEC_METHODS[0]
    if not path.is_dir() and model.count("/") == 1 and not model.startswith((".", "/", "~")):
        try:
            from huggingface_hub import snapshot_download

            path = Path(snapshot_download(repo_id=model, allow_patterns=["config.json"], revision=revision,
                                          cache_dir=download_dir, token=token))
        except Exception:  # noqa: BLE001  offline and not cached, or no such repo: the drafter's download names why
            return SPEC_METHODS[0]
    return drafter_method(path) or SPEC_METHODS[0]


def drafter_kind(config: dict[str, Any]) -> str | None:
    """What names a checkpoint's config.json as a drafter's (a DFlash / DSpark architecture, or speculators'
    model type), or None for any other model's."""
    named = [str(a) for a in config.get("architectures") or [] if any(k in str(a) for k in ("DFlash", "DSpark"))]
    return ", ".join(named) or config.get("speculators_model_type")
SEED_RANGE = (-(2**63), 2**63 - 1)  # an engine's seed is kept as an int64, as a request's is


def check_integer(cfg: Any, name: str, low: int, high: int | None = None, optional: bool = False,
                  prefix: str = "") -> None:
    """A ConfigError naming the field (after `prefix`) unless cfg.<name> is an integer (not a bool) in
    [low, high] (or None where optional)."""
    value = getattr(cfg, name)
    if optional and value is None:
        return
    if isinstance(value, int) and not isinstance(value, bool) and value >= low and (high is None or value <= high):
        return
    bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
    raise ConfigError(f"{prefix}{name} must be an integer {bounds}{' or None' if optional else ''}, got {value!r}")


def check_number(cfg: Any, name: str, allowed: str, inside: Callable[[float], bool], prefix: str = "") -> None:
    """A ConfigError naming the field unless cfg.<name> is a number (not a bool) for which `inside` holds;
    `allowed` says which in the message ("in (0, 1]")."""
    value = getattr(cfg, name)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and inside(value):
        return
    raise ConfigError(f"{prefix}{name} must be a number {allowed}, got {value!r}")


def check_bool(cfg: Any, name: str, optional: bool = False, prefix: str = "") -> None:
    """A ConfigError naming the field unless cfg.<name> is True or False (or None where optional): a
    string "false" would otherwise count as true."""
    value = getattr(cfg, name)
    if isinstance(value, bool) or (optional and value is None):
        return
    raise ConfigError(f"{prefix}{name} must be {'true, false or None' if optional else 'true or false'}, got {value!r}")


# vLLM's names for DSpark's options -> this config's
VLLM_SPEC_NAMES = {"enable_adaptive_verification": "adaptive_verification", "dspark_draft_topk": "markov_top_k"}
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
REJECTION_SAMPLE_METHODS = ("standard", "block")


@dataclass(frozen=True)
class SpeculativeConfig:
    """`speculative_config` as users pass it to `LLM(...)` (vLLM's field names)."""

    method: str
    model: str
    num_speculative_tokens: int | None = None
    draft_sample_method: str = "greedy"
    rejection_sample_method: str = "standard"
    confidence_threshold: float = 0.0
    adaptive_verification: bool = False
    markov_top_k: int = 0  # DSpark: restrict each Markov step to the top-k base logits (0 = whole vocabulary)
    adaptive_draft_length: bool = True  # pick per step the draft length with the most tokens/s (0 = plain)
    # the draft lengths that choice is among, besides 0 (plain) and the largest; None: those below it whose
    # K + 1 verify rows a request fill whole row tiles, 1, 3, 5, 7, ... (policy.aligned_lengths)
    draft_length_candidates: tuple[int, ...] | None = None
    max_batch_for_speculation: int | None = None
    quantization: str | None = None  # the drafter's: "fp8" quantizes its decoder products at load (per channel)
    revision: str | None = None  # the drafter's branch, tag or commit, for a hub id (None: the default branch)

    @staticmethod
    def _with_our_names(value: dict[str, Any]) -> dict[str, Any]:
        """vLLM's spellings of DSpark's options (VLLM_SPEC_NAMES) as this config's; both given and differing is a
        ConfigError naming both."""
        value = dict(value)
        for theirs, ours in VLLM_SPEC_NAMES.items():
            if theirs not in value:
                continue
            given = value.pop(theirs)
            given = 0 if theirs == "dspark_draft_topk" and given is None else given  # vLLM's None: no pruning
            if ours in value and value[ours] != given:
                raise ConfigError(f"speculative_config: {theirs}={given!r} and {ours}={value[ours]!r} name the same "
                                  "option; give one of them")
            value[ours] = given
        return value

    @staticmethod
    def from_user(value: "SpeculativeConfig | dict[str, Any] | None") -> "SpeculativeConfig | None":
        if value is None:
            return None
        if isinstance(value, SpeculativeConfig):  # built by hand: checked as a dict is
            value.validate()
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"speculative_config must be a dict or None, got {type(value).__name__}")
        value = SpeculativeConfig._with_our_names(value)
        known = {f.name for f in dataclasses.fields(SpeculativeConfig)} | set(VLLM_SPEC_NAMES)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"speculative_config: unknown field(s) {unknown}; known: {sorted(known)}")
        if value.get("method", SPEC_METHODS[0]) not in SPEC_METHODS:  # before the model: ngram takes none
            raise ConfigError(f"speculative_config.method {value['method']!r} not supported; allowed: {SPEC_METHODS}")
        if "method" not in value or "model" not in value:
            raise ConfigError("speculative_config needs 'method' and 'model' (a drafter directory or hub id)")
        cfg = SpeculativeConfig(**value)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        at = "speculative_config."
        if self.method not in SPEC_METHODS:
            raise ConfigError(f"{at}method {self.method!r} not supported; allowed: {SPEC_METHODS}")
        if not isinstance(self.model, (str, os.PathLike)) or not str(self.model):
            raise ConfigError(f"{at}model must be a drafter directory or hub id, got {self.model!r}")
        check_integer(self, "num_speculative_tokens", 1, optional=True, prefix=at)
        if self.draft_sample_method not in DRAFT_SAMPLE_METHODS:
            raise ConfigError(f"{at}draft_sample_method {self.draft_sample_method!r}; allowed: {DRAFT_SAMPLE_METHODS}")
        if self.rejection_sample_method not in REJECTION_SAMPLE_METHODS:
            raise ConfigError(f"{at}rejection_sample_method {self.rejection_sample_method!r}; allowed: "
                              f"{REJECTION_SAMPLE_METHODS}")
        check_number(self, "confidence_threshold", "in [0, 1)", lambda v: 0.0 <= v < 1.0, prefix=at)
        for name in ("adaptive_verification", "adaptive_draft_length"):
            check_bool(self, name, prefix=at)
        check_integer(self, "markov_top_k", 0, prefix=at)
        c = self.draft_length_candidates
        if c is not None and (not isinstance(c, (list, tuple)) or not c
                              or any(not isinstance(k, int) or isinstance(k, bool) or k < 1 for k in c)):
            raise ConfigError(f"{at}draft_length_candidates must be a non-empty list of draft lengths "
                              f">= 1 (at most num_speculative_tokens), got {c!r}")
        k = self.num_speculative_tokens
        if c is not None and k is not None and max(c) > k:  # the drafter's own K is known only at load
            raise ConfigError(f"{at}draft_length_candidates {list(c)}: each must be in 1..{k} "
                              "(num_speculative_tokens)")
        if c is not None and self.adaptive_draft_length is False:
            raise ConfigError(f"{at}draft_length_candidates are the adaptive draft-length policy's choices; with "
                              "adaptive_draft_length false every step verifies num_speculative_tokens")
        check_integer(self, "max_batch_for_speculation", 1, optional=True, prefix=at)
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"{at}quantization {self.quantization!r} is not supported; supported: "
                              f"{', '.join(QUANTIZATIONS)} or None")
        if self.revision is not None and not isinstance(self.revision, str):
            raise ConfigError(f"{at}revision must be a branch, tag or commit name, got {self.revision!r}")


ATTENTION_BACKENDS = ("auto", "triton", "sdpa")
QUANTIZATIONS = ("fp8",)  # EngineArgs.quantization: applied to an unquantized checkpoint at load
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # auto: the model's dtype; fp8 (vLLM's fp8_e4m3): e4m3
# what a sampled token's logprobs are (vLLM's logprobs_mode): of the model's raw logits (vLLM's default),
# the raw logits themselves, or the processed distribution that was sampled from (temperature, penalties,
# top-k / top-p, masks)
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs")


def output_dir(path: str | os.PathLike[str], flag: str) -> Path:
    """`path` made now as the directory a run's results go into, before any work: a long run must not end
    in an error at its first write (a file in the way, no permission)."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocker = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), out)
        where = "exists and is not a directory" if blocker == out else f"{blocker} is a file, not a directory"
        raise ConfigError(f"{flag} {path}: {where}") from None
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot create it ({exc.strerror})") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: not writable")
    return out


@dataclass
class EngineConfig:
    """Limits of one engine instance (memory is planned from these at start-up)."""

    max_model_len: int = 2048
    max_num_seqs: int = 64
    max_prefill_tokens: int = 4096
    # on CUDA with the Triton attention kernel, prefill batches of at most this many padded tokens
    # (batch bucket x width, widths powers of two from 16) replay CUDA graphs captured at start-up
    # instead of launching each layer's kernels from Python (capped at max_prefill_tokens; 0: eager)
    graph_prefill_tokens: int = 2048
    seed: int = 0
    # auto: the Triton kernel on CUDA when triton is installed, else SDPA (blockspec.kernels.attention)
    attention_backend: str = "auto"
    # share of the GPU's memory the engine may hold (weights, KV caches, activations): on CUDA the KV
    # pages fill what is left of it (at most what max_num_seqs x max_model_len can use)
    gpu_memory_utilization: float = 0.9
    # positions a KV page holds (the target's and the drafter's caches share pages)
    kv_page_size: int = 64
    # KV pages of the shared pool (None: from gpu_memory_utilization on CUDA, enough for max_num_seqs x
    # max_model_len on the CPU); fewer than that makes the engine preempt the newest requests when
    # they run short and recompute them later. At least one max_model_len sequence must fit
    num_kv_pages: int | None = None
    # plain and speculative greedy steps launch the next step before the host commits this one (a
    # plain step from the device's ids, a speculative one from the read-back counts), so the host's
    # bookkeeping overlaps the GPU's work; sampled verification launches only the next draft ahead
    # (None: on for CUDA, off for CPU, where a launch runs synchronously)
    async_scheduling: bool | None = None
    # no CUDA graph anywhere (target decode and prefill, the draft step, the chained speculative step): every
    # forward launches its kernels from Python (vLLM's enforce_eager); for debugging, and a faster start-up
    enforce_eager: bool = False
    # the target's and the drafter's K/V pools: "auto", the model's dtype; "fp8", e4m3 scaled by the
    # checkpoint's calibrated k/v scales, else 1.0 (half the bytes a decode step reads and a page holds;
    # models.kv_cache)
    kv_cache_dtype: str = "auto"
    logprobs_mode: str = "raw_logprobs"  # LOGPROBS_MODES
    # the most logprobs a request may ask for a token (SamplingParams.logprobs, prompt_logprobs; vLLM's
    # default); -1: the whole vocabulary
    max_logprobs: int = 20
    # vLLM's automatic prefix caching: full KV pages are remembered by their tokens and a prompt that
    # starts with them skips their prefill (None: off, as False; kv_cache.PrefixCache)
    enable_prefix_caching: bool | None = None
    # how a thinking model's think block is read (vLLM's reasoning_parser: "qwen3", "deepseek_r1"; None: no
    # block): a structured output's grammar then starts after it, and the server returns it as reasoning_content
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        for name, low in (("max_num_seqs", 1), ("max_prefill_tokens", 1), ("graph_prefill_tokens", 0)):
            check_integer(self, name, low)
        check_integer(self, "max_model_len", 2, optional=True)  # optional in EngineArgs (the model's)
        check_integer(self, "seed", SEED_RANGE[0], SEED_RANGE[1], optional=True)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}"
                              + (" (processed logits before their normalisation are not kept)"
                                 if self.logprobs_mode == "processed_logits" else ""))
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        check_integer(self, "kv_page_size", 1, 1024)
        check_integer(self, "max_logprobs", -1)
        check_integer(self, "num_kv_pages", 1, optional=True)  # None: auto
        check_number(self, "gpu_memory_utilization", "in (0, 1]", lambda v: 0 < v <= 1)
        for name in ("enable_prefix_caching", "async_scheduling"):  # None: off / auto
            check_bool(self, name, optional=True)
        check_bool(self, "enforce_eager")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ConfigError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)} or None, got "
                              f"{self.reasoning_parser!r}")


@dataclass
class EngineArgs(EngineConfig):
    """What `LLM(model, ...)` takes besides the model and tensor_parallel_size (vLLM's EngineArgs): an
    engine's limits, and how to load the model. Built alike in this process and in every
    tensor-parallel rank."""

    tokenizer: str | os.PathLike[str] | None = None  # directory or hub id (None: the model's)
    # hub ids: the model's branch, tag or commit (None: the default branch), the tokenizer's (None: the
    # default branch), where downloads go (None: the hub cache), and the token (None: huggingface_hub's own)
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | os.PathLike[str] | None = None
    hf_token: str | None = None
    dtype: Any = "auto"  # "auto" (fp32 on CPU, the checkpoint's on GPU), a name or a torch.dtype
    # "fp8": the decoder layers' products quantized at load to e4m3 weights with per-channel scales
    # (embeddings, LM head and norms stay in dtype); an FP8 checkpoint loads as FP8 whatever this is
    quantization: str | None = None
    device: str = "auto"
    # None: the model config's, at most 4096; -1 or "auto" (vLLM's): the model config's whole length (one sequence
    # of it must fit the KV pages, or the start is refused)
    max_model_len: int | str | None = None
    seed: int | None = None  # the engine's seed for requests that give none (None: 0)
    speculative_config: SpeculativeConfig | dict[str, Any] | None = None
    warmup: bool = True  # capture every CUDA graph at start-up, not inside the first requests
    # a chat template (a file, or the Jinja text itself) used instead of the tokenizer's
    chat_template: str | None = None
    # where default sampling parameters come from (vLLM's --generation-config): "auto", the model
    # directory's generation_config.json; "vllm", none (SamplingParams' own defaults); else a directory
    # holding a generation_config.json
    generation_config: str = "auto"
    # vLLM's name for the tokens one step may hold; here it sets max_prefill_tokens, the prompt tokens
    # one step prefills (the decode rows of running requests come on top)
    max_num_batched_tokens: int | None = None
    # accepted for vLLM's sake: blockspec runs no code from a model's repository, so there is nothing to trust
    trust_remote_code: bool = False
    # vLLM's switch for the counters `get_metrics` reads (its examples pass False): blockspec always keeps them
    disable_log_stats: bool = False
    # vLLM's name for kv_page_size (a KV block's positions)
    block_size: int | None = None
    # vLLM's tokenizer choice: "auto" and "hf" load the fast tokenizer, as blockspec always does
    tokenizer_mode: str = "auto"
    # vLLM's model task ("auto", "generate") and runner ("auto", "generate"): blockspec generates text only
    task: str = "auto"
    runner: str = "auto"
    # the name metrics label the model with (vLLM's; a list: its first); None: the model as given
    served_model_name: str | list[str] | None = None
    # vLLM knobs with nothing to set here (`unhonoured` says what blockspec does instead)
    enable_chunked_prefill: bool | None = None
    swap_space: float | None = None
    disable_custom_all_reduce: bool = False
    max_seq_len_to_capture: int | None = None

    def __post_init__(self) -> None:
        whole = self.max_model_len in (-1, "auto")  # the model's whole length, known once its config is read
        if whole:
            self.max_model_len = None
        super().__post_init__()
        if whole:
            self.max_model_len = -1
        spec = self.speculative_config
        if isinstance(spec, dict) and "method" not in spec and isinstance(spec.get("model"), (str, os.PathLike)):
            # the drafter's own config names its family, as vLLM infers a method from the draft model
            self.speculative_config = {**spec, "method": infer_method(str(spec["model"]), spec.get("revision"),
                                                                      self.download_dir, self.hf_token)}
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization {self.quantization!r} is not supported; supported: "
                              f"{', '.join(QUANTIZATIONS)} (FP8 checkpoints load as FP8 without it)")
        for name in ("trust_remote_code", "warmup", "disable_custom_all_reduce", "disable_log_stats"):
            check_bool(self, name)
        check_bool(self, "enable_chunked_prefill", optional=True)
        if self.swap_space is not None:
            check_number(self, "swap_space", "of GiB >= 0 or None", lambda v: v >= 0)
        check_integer(self, "max_seq_len_to_capture", 1, optional=True)
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ConfigError(f"generation_config must be 'auto', 'vllm' or a directory, got {self.generation_config!r}")
        for name, allowed in (("tokenizer_mode", ("auto", "hf")), ("task", ("auto", "generate")),
                              ("runner", ("auto", "generate"))):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} {getattr(self, name)!r} is not supported; allowed: "
                                  f"{', '.join(map(repr, allowed))} (blockspec generates text with a fast tokenizer)")
        names = self.served_model_name
        if names is not None and not (isinstance(names, str) and names or isinstance(names, (list, tuple)) and names
                                      and all(isinstance(n, str) and n for n in names)):
            raise ConfigError(f"served_model_name must be a non-empty string, a list of them, or None; got {names!r}")
        check_integer(self, "block_size", 1, 1024, optional=True)
        check_integer(self, "max_num_batched_tokens", 1, optional=True)
        for theirs, ours in (("block_size", "kv_page_size"), ("max_num_batched_tokens", "max_prefill_tokens")):
            self._take_alias(theirs, ours)

    def _take_alias(self, theirs: str, ours: str) -> None:
        """vLLM's name `theirs` for the limit `ours`: its value, given, sets ours; both given and differing is
        a ConfigError naming both."""
        value = getattr(self, theirs)
        if value is None:
            return
        if getattr(self, ours) not in (getattr(EngineConfig, ours), value):
            raise ConfigError(f"{theirs}={value} and {ours}={getattr(self, ours)} name the same limit; give one of them")
        setattr(self, ours, value)

    def unhonoured(self) -> list[str]:
        """One line for each vLLM option given that blockspec accepts but cannot honour, and for a
        combination whose cost a user should know of."""
        notes = []
        spec = SpeculativeConfig.from_user(self.speculative_config)
        # only greedy drafts verified by sample-and-match give a seeded request the same tokens at any draft length
        keyed = spec is not None and spec.draft_sample_method == "greedy" and spec.rejection_sample_method == "standard"
        if spec is not None and not keyed and spec.adaptive_draft_length:
            how = "probabilistic drafts" if spec.draft_sample_method == "probabilistic" else "block verification"
            notes.append(f"speculative_config: {how} with adaptive_draft_length: a seeded request's "
                         "tokens depend on how many drafts each step verified, chosen from measured step times, so "
                         "seeded runs may differ; adaptive_draft_length=False makes them repeat")
        if self.trust_remote_code:
            notes.append("trust_remote_code=True is not needed: blockspec runs no code from the model's repository "
                         "(it loads Llama / Qwen weights into its own model classes); ignored")
        if self.disable_log_stats:
            notes.append("disable_log_stats=True: blockspec keeps its counters (get_stats, get_metrics) whatever it "
                         "is and logs none of them periodically offline; ignored")
        if self.enable_chunked_prefill is False:
            notes.append("enable_chunked_prefill=False: blockspec always prefills a prompt longer than "
                         f"max_prefill_tokens ({self.max_prefill_tokens}) in chunks beside running decodes; ignored")
        if self.swap_space is not None:
            notes.append("swap_space: blockspec recomputes a preempted request through a prefill instead of swapping "
                         "its KV to CPU memory; ignored")
        if self.disable_custom_all_reduce:
            notes.append("disable_custom_all_reduce: blockspec's tensor-parallel ranks all-reduce through "
                         "torch.distributed (NCCL, gloo on CPU), no custom kernel; ignored")
        if self.max_seq_len_to_capture is not None:
            notes.append("max_seq_len_to_capture: blockspec's decode graphs serve every context length (attention "
                         "reads the page table at run time); prefill graphs go up to graph_prefill_tokens; ignored")
        return notes

    def hub(self, revision: str | None = None) -> dict[str, Any]:
        """`resolve_model_dir`'s hub options: this run's download directory and token, at `revision`."""
        return {"revision": revision, "download_dir": self.download_dir, "token": self.hf_token}

    def engine_config(self, max_model_len: int) -> EngineConfig:
        """The engine's limits, with the context length the model allows."""
        limits = {f.name: getattr(self, f.name) for f in dataclasses.fields(EngineConfig)}
        return EngineConfig(**{**limits, "max_model_len": max_model_len, "seed": self.seed or 0})


@dataclass(frozen=True)
class ServerConfig:
    """What the HTTP server accepts, beyond what the engine checks."""

    # with a key (or several, any one opening them), /v1/ routes need `Authorization: Bearer <key>` (None: open, for a
    # loopback server)
    api_key: str | tuple[str, ...] | None = None
    # request bodies larger than this are refused (413) before they are parsed: 4 MiB holds a prompt of
    # a 128K-token context, as text or as token ids, several times over
    max_request_bytes: int = 4 << 20
    # whether a request may bring its own chat template (`chat_template`): rendering one runs the
    # request's code on the server, so only an operator who trusts its clients turns this on
    trust_request_chat_template: bool = False
    # how tool calls are found in a model's text for tool_choice "auto" ("hermes": Qwen, "llama3_json":
    # Llama 3; None: "auto" is refused, "required" and named functions still work)
    tool_call_parser: str | None = None
    # chat template variables for every chat request (vLLM's --default-chat-template-kwargs); a request's win
    default_chat_template_kwargs: dict[str, Any] | None = None
    # tool_choice "none" leaves the request's tools out of the chat template (vLLM's flag; by default the
    # model is shown the tools it may not call)
    exclude_tools_when_tool_choice_none: bool = False
    # the prefix of the metrics vLLM also has: "vllm" (vLLM's dashboards read them unchanged) or "blockspec"
    metrics_prefix: str = "vllm"
    # seconds between the log's throughput lines while the server is busy (None: no such lines)
    log_stats_interval_s: float | None = 10.0
    # CORS, as vLLM's defaults: browsers on any origin may call the API (the API key still guards /v1/)
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allowed_credentials: bool = False
    # the role a chat response's message has when the request adds a generation prompt (vLLM's
    # --response-role); a request that continues its last message gets that message's role
    response_role: str = "assistant"

    def __post_init__(self) -> None:
        if not isinstance(self.response_role, str) or not self.response_role:
            raise ConfigError(f"response_role must be a non-empty string, got {self.response_role!r}")
        if self.metrics_prefix not in ("vllm", "blockspec"):
            raise ConfigError(f"metrics_prefix must be 'vllm' or 'blockspec', got {self.metrics_prefix!r}")
        if self.log_stats_interval_s is not None and not self.log_stats_interval_s > 0:
            raise ConfigError(f"log_stats_interval_s must be > 0 or None, got {self.log_stats_interval_s!r}")
        if not isinstance(self.max_request_bytes, int) or self.max_request_bytes < 1024:
            raise ConfigError(f"max_request_bytes must be an integer >= 1024, got {self.max_request_bytes!r}")
        keys = [self.api_key] if isinstance(self.api_key, str) else self.api_key
        if keys is not None and not (isinstance(keys, (list, tuple)) and keys
                                     and all(isinstance(k, str) and k.strip() for k in keys)):
            raise ConfigError(f"api_key must be a non-empty string, a list of them (vLLM's: any one opens /v1/), or "
                              f"None; got {self.api_key!r}")
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            value = getattr(self, name)
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
                raise ConfigError(f"{name} must be a list of non-empty strings, got {value!r}")
        check_bool(self, "allowed_credentials")
        check_bool(self, "exclude_tools_when_tool_choice_none")
        if self.tool_call_parser not in (None, "hermes", "llama3_json"):
            raise ConfigError(f"tool_call_parser must be hermes or llama3_json, got {self.tool_call_parser!r}")
        if not isinstance(self.default_chat_template_kwargs, dict | None):
            raise ConfigError(f"default_chat_template_kwargs must be a JSON object, got "
                              f"{self.default_chat_template_kwargs!r}")
