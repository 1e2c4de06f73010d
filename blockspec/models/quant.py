"""FP8 weights in the target: the `Fp8Linear` layer and a mixture of experts' `Fp8Experts`, FP8
checkpoints read into them, and on-the-fly quantization of a model dtype checkpoint (`quantization="fp8"`).

Weights only: each quantized product reads e4m3 weights with fp32 scales (`kernels.fp8`) and keeps
its activations in the model's dtype, so a step reads half the bytes and every path (plain decode,
verify, prefill, CPU) computes the same model up to the products' roundings. Embeddings, the LM head
and the norms stay in the model's dtype. A checkpoint's static activation scales (`input_scale`) are
therefore not used. Where no kernel streams the e4m3 weight (the CPU), a layer keeps its dequantized weight
and computes the reference product with it.

Checkpoints (`quantization_config.quant_method` "fp8", HF fine-grained FP8 as Qwen/Qwen3-8B-FP8 and
DeepSeek ship it; "fbgemm_fp8"; "compressed-tensors" in its float-quantized format with 8-bit float
weights, as llm-compressor writes FP8 models; and NVIDIA ModelOpt's FP8, "modelopt", from config.json or
its hf_quant_config.json): a linear layer is FP8 where its `weight` is float8_e4m3fn, with
`weight_scale_inv` over `weight_block_size` blocks, or `weight_scale` per tensor, per output channel, or
over the blocks (or K groups) the config declares. Layers a checkpoint keeps in bf16
(`modules_to_not_convert`, vLLM's `ignored_layers`, compressed-tensors' `ignore`, ModelOpt's
`exclude_modules`) load as ordinary linears. A checkpoint's calibrated KV cache scales (`take_kv_scales`, in any checkpoint,
quantized or not) are the target's FP8 cache scales under `kv_cache_dtype="fp8"`.
"""

from __future__ import annotations

import fnmatch
import math
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from blockspec.config import QUANTIZATIONS, ConfigError
from blockspec.errors import ModelLoadError
from blockspec.kernels.fp8 import (FP8, dequantize_reference, fp8_linear, quantize_blocks, quantize_per_channel,
                                   scale_shape)
from blockspec.kernels.moe import ExpertScales
from blockspec.kernels.ops import use_kernels
from blockspec.models.kv_cache import KVScales, LayerScale

QUANT_METHODS = ("fp8", "fbgemm_fp8", "compressed-tensors", "modelopt")  # checkpoint formats read
CT_STRATEGIES = ("tensor", "channel", "block", "group")  # compressed-tensors weight scales read
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # the decoder layers' products
ACTIVATION_SCALES = (".input_scale", ".input_scale_ub", ".activation_scale_ub")


class Fp8Linear(nn.Module):
    """y = x @ W^T + b with W = weight (e4m3) x weight_scale (fp32, over `block` (rows, columns)
    blocks). Both stay as they are under a dtype cast of the model; only the bias follows it."""

    def __init__(self, weight: Tensor, weight_scale: Tensor, block: tuple[int, int], bias: Tensor | None = None
                 ) -> None:
        super().__init__()
        n, k = weight.shape
        if weight.dtype != FP8 or tuple(weight_scale.shape) != scale_shape(n, k, block):
            raise ValueError(f"Fp8Linear: weight {weight.dtype} {tuple(weight.shape)} with scales "
                             f"{tuple(weight_scale.shape)} over {block} blocks (want float8_e4m3fn and "
                             f"{scale_shape(n, k, block)})")
        self.out_features, self.in_features = n, k
        self.block = (int(block[0]), int(block[1]))
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(weight_scale.float(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @staticmethod
    def from_linear(linear: nn.Linear) -> Fp8Linear:
        """`linear` quantized with one scale per output channel."""
        q, scale = quantize_per_channel(linear.weight.detach())
        return Fp8Linear(q, scale, (1, linear.in_features), linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        if use_kernels(x):
            return fp8_linear(x, self.weight, self.weight_scale, self.block, self.bias)
        return F.linear(x, self.dequantized(x.dtype), self.bias)

    def dequantized(self, dtype: torch.dtype) -> Tensor:
        """The weight as the reference path computes with it (`dequantize_reference`), made once and kept
        until the weight or its scales change: where no kernel streams the e4m3 weight (the CPU),
        dequantizing it for every product would cost three times the product itself."""
        key = (self.weight.data_ptr(), self.weight._version, self.weight_scale.data_ptr(), self.weight_scale._version,
               dtype)
        return kept(self.__dict__, "_dequantized", key,
                    lambda: dequantize_reference(self.weight, self.weight_scale, self.block, dtype))

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Fp8Linear:
        return apply_keeping_dtypes(self, ("weight", "weight_scale"), fn, recurse, super()._apply)  # bias: both

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"scale_block={self.block}")


def apply_keeping_dtypes(module: nn.Module, names: tuple[str, ...], fn: Callable[[Tensor], Tensor], recurse: bool,
                         apply: Callable[..., nn.Module]) -> nn.Module:
    """`module._apply(fn)` (`apply`: the base class's) for all but the parameters `names` (e4m3 weights and
    their scales), which only follow fn's device: a dtype cast of the model leaves them as they are."""
    held = {name: module._parameters.pop(name) for name in names}
    try:
        apply(fn, recurse)
    finally:
        module._parameters.update(held)
    device = fn(torch.zeros((), device=held[names[0]].device)).device  # where fn sends tensors
    for name, p in held.items():
        if p.device != device:
            moved = torch.empty_like(p, device=device) if p.is_meta else p.to(device)
            module._parameters[name] = nn.Parameter(moved, requires_grad=False)
    return module


def kept(state: dict, name: str, key: tuple, make: Callable[[], Any]) -> Any:
    """make(), kept in `state` (an object's __dict__) under `name` while `key` stays the same."""
    if state.get(name + "_key") != key:
        state[name], state[name + "_key"] = make(), key
    return state[name]


# a hub checkpoint's experts, one by one (after gate/up fusion): `<layer>.mlp.experts.<e>.<part>.weight`
PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_up_proj|down_proj)\.weight$")


class Fp8Experts(nn.Module):
    """A mixture-of-experts layer's stacked experts in e4m3 (gate_up [E, 2I, H], down [E, H, I], as
    `models.moe.Experts` stacks them) with fp32 scales over blocks (`kernels.moe.ExpertScales`). They keep
    their dtypes under a model's dtype cast; on CUDA the grouped kernels dequantize each tile as it
    streams, elsewhere (the reference) the dequantized weights are made once and kept."""

    PARTS = ("gate_up_proj", "gate_up_scale", "down_proj", "down_scale")

    def __init__(self, gate_up: Tensor, gate_up_scale: Tensor, down: Tensor, down_scale: Tensor,
                 gate_up_block: tuple[int, int], down_block: tuple[int, int]) -> None:
        super().__init__()
        for w, sc, block, name in ((gate_up, gate_up_scale, gate_up_block, "gate_up"),
                                   (down, down_scale, down_block, "down")):
            want = (w.shape[0], *scale_shape(w.shape[1], w.shape[2], block))
            if w.dtype != FP8 or w.dim() != 3 or tuple(sc.shape) != want:
                raise ValueError(f"Fp8Experts: {name} {w.dtype} {tuple(w.shape)} with scales {tuple(sc.shape)} over "
                                 f"{block} blocks (want float8_e4m3fn [E, N, K] and {want})")
        self.gate_up_block, self.down_block = tuple(map(int, gate_up_block)), tuple(map(int, down_block))
        for name, t in zip(self.PARTS, (gate_up, gate_up_scale.float(), down, down_scale.float())):
            setattr(self, name, nn.Parameter(t, requires_grad=False))

    @staticmethod
    def from_experts(gate_up: Tensor, down: Tensor, block: tuple[int, int] | None = None) -> Fp8Experts:
        """Stacked experts quantized expert by expert: one scale per output channel, or over `block` blocks."""
        def quantize(w: Tensor) -> tuple[Tensor, Tensor]:
            return quantize_per_channel(w.detach()) if block is None else quantize_blocks(w.detach(), block)
        parts = [[quantize(w[e]) for e in range(w.shape[0])] for w in (gate_up, down)]
        (gu, gs), (dw, ds) = ((torch.stack([q for q, _ in p]), torch.stack([sc for _, sc in p])) for p in parts)
        return Fp8Experts(gu, gs, dw, ds, block or (1, gate_up.shape[2]), block or (1, down.shape[2]))

    @property
    def scales(self) -> ExpertScales:
        return ExpertScales(self.gate_up_scale, self.down_scale, self.gate_up_block, self.down_block)

    def reference_weights(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """gate_up and down dequantized (`dequantize_reference`, expert by expert), kept until they change."""
        key = tuple((t.data_ptr(), t._version) for t in (self.gate_up_proj, self.gate_up_scale, self.down_proj,
                                                         self.down_scale)) + (dtype,)

        def make() -> tuple[Tensor, Tensor]:
            return tuple(torch.stack([dequantize_reference(w[e], sc[e], block, dtype) for e in range(w.shape[0])])
                         for w, sc, block in ((self.gate_up_proj, self.gate_up_scale, self.gate_up_block),
                                              (self.down_proj, self.down_scale, self.down_block)))
        return kept(self.__dict__, "_dequantized", key, make)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Fp8Experts:
        return apply_keeping_dtypes(self, self.PARTS, fn, recurse, super()._apply)

    def extra_repr(self) -> str:
        return f"experts={self.gate_up_proj.shape[0]}, blocks={self.gate_up_block}, {self.down_block}"


def reference_weight(proj: nn.Linear | Fp8Linear, dtype: torch.dtype) -> Tensor:
    """The weight the reference path multiplies by: a linear's own, an FP8 one's dequantized (kept)."""
    return proj.dequantized(dtype) if isinstance(proj, Fp8Linear) else proj.weight


def linear_rows(proj: nn.Linear | Fp8Linear, x: Tensor, lo: int) -> Tensor:
    """x @ W[lo:]^T + b[lo:]: the outputs of `proj` from row `lo` on (e.g. k and v of a fused qkv), for a
    linear or an FP8 one, whose scale blocks must then start at `lo`."""
    b = proj.bias[lo:] if proj.bias is not None else None
    if not isinstance(proj, Fp8Linear) or not use_kernels(x):
        return F.linear(x, reference_weight(proj, x.dtype)[lo:], b)
    rows = proj.block[0]
    if lo % rows:
        raise ValueError(f"linear_rows: row {lo} falls inside a scale block of {rows} rows")
    return fp8_linear(x, proj.weight[lo:], proj.weight_scale[lo // rows:], proj.block, b)


@dataclass
class Fp8Weight:
    """A checkpoint's FP8 weight and its scales, before it is installed in an `Fp8Linear`."""

    weight: Tensor
    scale: Tensor
    block: tuple[int, int]


@dataclass(frozen=True)
class Fp8Checkpoint:
    """A checkpoint's `quantization_config`: the declared scale blocks (None: per tensor or per channel)
    and the modules it keeps unquantized."""

    block: tuple[int, int] | None
    not_converted: tuple[str, ...]
    source: str
    # the config field that lists them, which says how an entry names modules: HF's `modules_to_not_convert` a
    # start of the name up to a module boundary, or its end; compressed-tensors' `ignore` the whole name or a
    # "re:" pattern; ModelOpt's `exclude_modules` the whole name with * wildcards
    field: str = "modules_to_not_convert"

    def keeps(self, module: str) -> str | None:
        """The entry of the unconverted list that keeps `module` unquantized, if one does."""
        def hit(entry: str) -> bool:
            if self.field == "exclude_modules":
                return fnmatch.fnmatchcase(module, entry)
            if self.field == "ignore":
                return bool(re.match(entry[3:], module)) if entry.startswith("re:") else entry == module
            # transformers' rule: from the start up to a module boundary (as a regex: "model.layers.1" keeps
            # model.layers.1.*, not model.layers.10.*), or as the name's end ("lm_head")
            boundary = r"(?:(?<=\.)|(?=\.|$))"
            try:
                starts = re.match(rf"(?:{entry}){boundary}", module)
            except re.error:  # not a pattern: the name itself
                starts = re.match(rf"(?:{re.escape(entry)}){boundary}", module)
            return bool(starts) or module.endswith(entry)
        return next((s for s in self.not_converted if hit(s)), None)


def checkpoint_quantization(raw: dict[str, Any], source: str) -> Fp8Checkpoint | None:
    """The FP8 format of a config.json (None: an unquantized checkpoint); any other quantization is a
    ConfigError naming the field and what is supported."""
    qc = raw.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ConfigError(f"{source}: quantization_config must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method not in QUANT_METHODS:
        raise ConfigError(f"{source}: quantization_config.quant_method {method!r} is not supported; supported: "
                          f"{', '.join(QUANT_METHODS)} (FP8 e4m3 weights with block, per-channel or per-tensor "
                          "scales, e.g. Qwen/Qwen3-8B-FP8), or an unquantized checkpoint")
    if method == "compressed-tensors":
        return compressed_tensors_fp8(qc, source)
    if method == "modelopt":
        return modelopt_fp8(qc, source)
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"{source}: quantization_config.fmt {fmt!r} is not supported; supported: e4m3")
    block = qc.get("weight_block_size")
    if block is not None:
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise ConfigError(f"{source}: quantization_config.weight_block_size must be two positive integers "
                              f"[rows, columns], got {block!r}")
        block = (block[0], block[1])
    skip = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or []
    if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
        raise ConfigError(f"{source}: quantization_config.modules_to_not_convert must be a list of module names")
    return Fp8Checkpoint(block, tuple(skip), source)


def modelopt_fp8(qc: dict[str, Any], source: str) -> Fp8Checkpoint:
    """NVIDIA ModelOpt's FP8 (`quant_algo` FP8: e4m3 weights with a `weight_scale` per tensor, static
    `input_scale`s, which weight-only FP8 does not use, and `k_scale` / `v_scale` for an FP8 KV cache);
    `exclude_modules` (whole names with * wildcards) stay unquantized."""
    field = "quantization_config"
    algo = qc.get("quant_algo")
    if algo != "FP8":
        raise ConfigError(f"{source}: {field}.quant_algo {algo!r} is not supported; supported: FP8 (ModelOpt's "
                          "NVFP4 and other algorithms are not)")
    kv = qc.get("kv_cache_quant_algo")
    if kv not in (None, "FP8"):
        raise ConfigError(f"{source}: {field}.kv_cache_quant_algo {kv!r} is not supported; supported: FP8 or none")
    exclude = qc.get("exclude_modules") or []
    if not isinstance(exclude, list) or not all(isinstance(s, str) for s in exclude):
        raise ConfigError(f"{source}: {field}.exclude_modules must be a list of module names")
    return Fp8Checkpoint(None, tuple(exclude), source, "exclude_modules")


def compressed_tensors_fp8(qc: dict[str, Any], source: str) -> Fp8Checkpoint:
    """A compressed-tensors `quantization_config` whose every scheme stores symmetric 8-bit float weights
    (float-quantized): the scale blocks they declare, and `ignore` (module names, or "re:" patterns) as
    the modules kept unquantized. Activation schemes are not read: blockspec's FP8 is weight-only."""
    field = "quantization_config"
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ConfigError(f"{source}: {field}.config_groups must be an object of quantization schemes")
    blocks = set()
    for name, scheme in groups.items():
        where = f"{field}.config_groups.{name}"
        if not isinstance(scheme, dict) or not isinstance(scheme.get("weights"), dict):
            raise ConfigError(f"{source}: {where}.weights must describe the weights' quantization "
                              "(a preset name in place of a scheme is not read)")
        layout = scheme.get("format") or qc.get("format")
        if layout not in ("float-quantized", "naive-quantized"):  # the older name of the same layout (llm-compressor)
            raise ConfigError(f"{source}: {where} is stored {layout!r}; supported: compressed-tensors' "
                              "float-quantized (or naive-quantized) format (FP8 e4m3 weights)")
        w = scheme["weights"]
        if (w.get("type"), w.get("num_bits")) != ("float", 8):
            raise ConfigError(f"{source}: {where}.weights are {w.get('num_bits')}-bit {w.get('type')}; supported: "
                              "8-bit float (FP8 e4m3)")
        if w.get("symmetric") is False:
            raise ConfigError(f"{source}: {where}.weights.symmetric is false; FP8 weights with zero points are "
                              "not supported")
        strategy = w.get("strategy")
        if strategy not in CT_STRATEGIES:
            raise ConfigError(f"{source}: {where}.weights.strategy {strategy!r} is not supported; supported: "
                              f"{', '.join(CT_STRATEGIES)}")
        if strategy in ("block", "group"):  # a group is a block of one row
            key = "block_structure" if strategy == "block" else "group_size"
            size = w.get(key) if strategy == "block" else [1, w.get(key)]
            if (not isinstance(size, list) or len(size) != 2
                    or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in size)):
                raise ConfigError(f"{source}: {where}.weights.{key} must be positive integers ([rows, columns] for "
                                  f"a block), got {w.get(key)!r}")
            blocks.add((size[0], size[1]))
    if len(blocks) > 1:
        raise ConfigError(f"{source}: {field}.config_groups declare weight scales over different blocks "
                          f"{sorted(blocks)}; one block shape a checkpoint is supported")
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(s, str) for s in ignore):
        raise ConfigError(f"{source}: {field}.ignore must be a list of module names")
    return Fp8Checkpoint(next(iter(blocks), None), tuple(ignore), source, "ignore")


def _scale_layout(name: str, weight: Tensor, scale: Tensor, fmt: Fp8Checkpoint) -> tuple[Tensor, tuple[int, int]]:
    """(scales, block) of one checkpoint weight, from the scale tensor's shape: the declared blocks,
    one value (per tensor, widened to per channel), or one per output row."""
    n, k = weight.shape
    scale = scale.float()
    if fmt.block is not None and tuple(scale.shape) == scale_shape(n, k, fmt.block):
        return scale.contiguous(), fmt.block
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(n, 1).contiguous(), (1, k)
    if tuple(scale.shape) in ((n,), (n, 1)):
        return scale.reshape(n, 1).contiguous(), (1, k)
    raise ModelLoadError(f"{fmt.source}: {name} has shape {tuple(scale.shape)}, which fits weight {tuple(weight.shape)} "
                         f"neither per tensor, per channel nor in weight_block_size {fmt.block} blocks")


def take_fp8_weights(state: dict[str, Tensor], fmt: Fp8Checkpoint) -> dict[str, Fp8Weight]:
    """Remove the FP8 weights, their scales and any activation scales from `state`; return the weights
    by their `.weight` names."""
    out: dict[str, Fp8Weight] = {}
    for name in [n for n, t in state.items() if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)]:
        weight = state.pop(name)
        module = name.removesuffix(".weight")
        if weight.dtype != FP8 or not name.endswith(".weight") or weight.dim() != 2:
            raise ModelLoadError(f"{fmt.source}: {name} is {weight.dtype} {tuple(weight.shape)}; only linear "
                                 "weights in float8_e4m3fn are supported")
        skipped = fmt.keeps(module)
        if skipped is not None:
            raise ModelLoadError(f"{fmt.source}: {name} is FP8 but quantization_config.{fmt.field} lists {skipped!r}")
        scale_name = module + (".weight_scale_inv" if module + ".weight_scale_inv" in state else ".weight_scale")
        if scale_name not in state:
            raise ModelLoadError(f"{fmt.source}: {name} is FP8 but the checkpoint has neither "
                                 f"{module}.weight_scale_inv nor {module}.weight_scale")
        scale, block = _scale_layout(scale_name, weight, state.pop(scale_name), fmt)
        if not torch.isfinite(scale).all():  # every product of the layer would be NaN, found only at decoding
            raise ModelLoadError(f"{fmt.source}: {scale_name} holds values that are not finite")
        out[name] = Fp8Weight(weight, scale, block)
    for name in [n for n in state if n.endswith(ACTIVATION_SCALES)]:
        del state[name]  # weight-only FP8: activations stay in the model's dtype
    return out


# A checkpoint's FP8 cache scales, by the names the formats give them (layer index, module, tensor): `self_attn.k_scale`
# (llm-compressor, AutoFP8), `self_attn.attn.k_scale` (saved from vLLM), `self_attn.k_proj.k_scale` (ModelOpt),
# `self_attn.k_proj.output_scale` (older compressed-tensors) and `self_attn.kv_scale` (one for both, deprecated).
# Query and softmax scales (`q_scale`, `prob_scale`, `q_proj.output_scale`) are for FP8 attention arithmetic,
# which blockspec does not use: attention computes in the model's dtype.
KV_SCALE_NAME = re.compile(r"^(?:model\.)?layers\.(\d+)\.self_attn\.(?:(attn|[kqv]_proj)\.)?"
                           r"(k_scale|v_scale|kv_scale|q_scale|prob_scale|output_scale)$")
KV_SCALE_KINDS = {(None, "k_scale"): "k", (None, "v_scale"): "v", (None, "kv_scale"): "kv", ("attn", "k_scale"): "k",
                  ("attn", "v_scale"): "v", ("k_proj", "k_scale"): "k", ("v_proj", "v_scale"): "v",
                  ("k_proj", "output_scale"): "k", ("v_proj", "output_scale"): "v"}


def take_kv_scales(state: dict[str, Tensor], num_layers: int, num_kv_heads: int, source: str) -> KVScales | None:
    """Remove a checkpoint's FP8 KV cache scales (and its FP8 attention scales) from `state`; return the K and
    V scales of every layer, or None where it has none. A layer's scale is one positive, finite value, or one
    per KV head ([kv_heads], or compressed-tensors' "attn_head" [kv_heads, 1, 1]); a checkpoint that scales
    some layers and not others is refused by name."""
    found: dict[tuple[int, str], tuple[LayerScale, str]] = {}
    for name in [n for n in state if KV_SCALE_NAME.match(n)]:
        layer, module, tensor = KV_SCALE_NAME.match(name).groups()
        value = state.pop(name)
        kind = KV_SCALE_KINDS.get((module, tensor))
        if kind is None:  # a query or softmax scale
            continue
        heads = value.numel() > 1
        if heads and (value.shape[0] != num_kv_heads or value.numel() != num_kv_heads):
            raise ModelLoadError(f"{source}: {name} holds {value.numel()} values {tuple(value.shape)}; a KV cache "
                                 f"scale is one value or one per KV head ({num_kv_heads})")
        values = [float(x) for x in value.float().reshape(-1)]
        bad = [x for x in values if not (math.isfinite(x) and x > 0)]
        if bad:
            raise ModelLoadError(f"{source}: {name} {'holds' if heads else 'is'} {bad[0]}; a KV cache scale must be "
                                 "positive and finite")
        if int(layer) >= num_layers:
            raise ModelLoadError(f"{source}: {name} names layer {layer}, but the model has {num_layers} layers")
        for part in kind:  # a deprecated kv_scale serves both
            if (int(layer), part) in found:
                raise ModelLoadError(f"{source}: layer {layer} has two {part.upper()} cache scales: "
                                     f"{found[int(layer), part][1]} and {name}")
            found[int(layer), part] = (tuple(values) if heads else values[0], name)
    if not found:
        return None
    missing = [f"{i}.{p}_scale" for i in range(num_layers) for p in "kv" if (i, p) not in found]
    if missing:
        raise ModelLoadError(f"{source}: the checkpoint has KV cache scales for some layers but not "
                             f"layers.{', layers.'.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    return KVScales(tuple(found[i, "k"][0] for i in range(num_layers)),
                    tuple(found[i, "v"][0] for i in range(num_layers)))


def concat_fp8(parts: list[Fp8Weight]) -> Fp8Weight:
    """The fused weight of parts stacked along the output rows (q/k/v, gate/up), with scales that
    still line up: block scales are stacked where every part but the last ends on a block boundary;
    otherwise each part's scales are spread to its rows (blocks of one row) first. Parts with
    different column blocks are brought to their common divisor."""
    k = parts[0].weight.shape[1]
    if any(p.weight.shape[1] != k for p in parts):
        raise ValueError(f"concat_fp8: parts of different widths {[p.weight.shape[1] for p in parts]}")
    cols = math.gcd(*(min(p.block[1], k) for p in parts))
    rows = parts[0].block[0]
    aligned = all(p.block[0] == rows for p in parts) and all(p.weight.shape[0] % rows == 0 for p in parts[:-1])
    scales = []
    for p in parts:
        s = p.scale
        width = min(p.block[1], k)
        if width != cols:  # each column block split into width / cols blocks
            s = s.repeat_interleave(width // cols, dim=1)[:, : -(-k // cols)]
        if not aligned and p.block[0] > 1:
            s = s.repeat_interleave(p.block[0], dim=0)[: p.weight.shape[0]]
        scales.append(s)
    block = (rows if aligned else 1, cols)
    return Fp8Weight(torch.cat([p.weight for p in parts]), torch.cat(scales).contiguous(), block)


def install_fp8_experts(model: nn.Module, weights: dict[str, Fp8Weight], source: str) -> dict[str, Tensor]:
    """Take a checkpoint's FP8 experts (one by one, `PER_EXPERT`) out of `weights` and put an `Fp8Experts`
    of them, stacked, in place of each layer's experts; returns the tensors to load into them."""
    groups: dict[str, dict[str, dict[int, Fp8Weight]]] = {}
    for name in [n for n in weights if PER_EXPERT.match(n)]:
        prefix, e, part = PER_EXPERT.match(name).groups()
        groups.setdefault(prefix, {}).setdefault(part, {})[int(e)] = weights.pop(name)
    state: dict[str, Tensor] = {}
    for prefix, parts in groups.items():
        parent_name, _, attr = prefix.rpartition(".")
        try:
            old = model.get_submodule(prefix)
        except AttributeError:
            raise ModelLoadError(f"{source}: FP8 experts {prefix} have no mixture-of-experts layer in the "
                                 "model") from None
        count = old.gate_up_proj.shape[0]
        stacked = []
        for part in ("gate_up_proj", "down_proj"):
            experts = parts.get(part, {})
            missing, extra = sorted(set(range(count)) - set(experts)), sorted(set(experts) - set(range(count)))
            if missing:
                raise ModelLoadError(f"{source}: {prefix}: the checkpoint's FP8 {part} lacks experts {missing[:8]} "
                                     f"of {count} (an MoE layer's experts are all FP8 or none)")
            if extra:
                raise ModelLoadError(f"{source}: {prefix}: the checkpoint has FP8 {part} of experts {extra[:8]}, "
                                     f"past the config's {count}")
            blocks = {w.block for w in experts.values()}
            if len(blocks) > 1:
                raise ModelLoadError(f"{source}: {prefix}.{part}: experts scaled over different blocks "
                                     f"{sorted(blocks)}")
            stacked.append((torch.stack([experts[e].weight for e in range(count)]),
                            torch.stack([experts[e].scale for e in range(count)]), blocks.pop()))
        (gu, gs, gb), (dw, ds, db) = stacked
        if (tuple(gu.shape), tuple(dw.shape)) != (tuple(old.gate_up_proj.shape), tuple(old.down_proj.shape)):
            raise ModelLoadError(f"{source}: {prefix}: FP8 experts {tuple(gu.shape)}, {tuple(dw.shape)} do not fit "
                                 f"the model's {tuple(old.gate_up_proj.shape)}, {tuple(old.down_proj.shape)}")
        device = old.gate_up_proj.device
        setattr(model.get_submodule(parent_name), attr,
                Fp8Experts(*(torch.empty(t.shape, dtype=t.dtype, device=device) for t in (gu, gs, dw, ds)), gb, db))
        state.update({f"{prefix}.{name}": t for name, t in zip(Fp8Experts.PARTS, (gu, gs, dw, ds))})
    return state


def install_fp8(model: nn.Module, weights: dict[str, Fp8Weight], source: str) -> dict[str, Tensor]:
    """Put an `Fp8Linear` where each weight goes (names as the model's, `<module>.weight`); returns the
    tensors to load into them (weight and weight_scale), for `assign_weights`."""
    state: dict[str, Tensor] = {}
    for name, w in weights.items():
        path = name.removesuffix(".weight")
        parent_name, _, attr = path.rpartition(".")
        try:
            parent = model.get_submodule(parent_name)
            old = getattr(parent, attr)
        except AttributeError:
            raise ModelLoadError(f"{source}: FP8 weight {name} has no linear layer in the model") from None
        if type(old) is not nn.Linear or tuple(old.weight.shape) != tuple(w.weight.shape):
            raise ModelLoadError(f"{source}: FP8 weight {name} {tuple(w.weight.shape)} does not fit the model's "
                                 f"{type(old).__name__} {tuple(getattr(old, 'weight', torch.empty(0)).shape)}")
        if getattr(model, "embed_tokens", None) is not None and old.weight is model.embed_tokens.weight:
            raise ModelLoadError(f"{source}: {name} is FP8 but tied to the embedding, which stays in the model dtype")
        device = old.weight.device
        setattr(parent, attr, Fp8Linear(torch.empty(w.weight.shape, dtype=FP8, device=device),
                                        torch.empty(w.scale.shape, dtype=torch.float32, device=device), w.block,
                                        old.bias))
        state[path + ".weight"], state[path + ".weight_scale"] = w.weight, w.scale
    return state


def quantize_model(model: nn.Module, method: str) -> int:
    """Quantize the decoder layers' products in place (`PROJECTIONS` directly under a layer's
    self_attn or mlp, and a mixture-of-experts layer's stacked experts), per output channel, on the
    device they are on; the embedding, the LM head, the norms, routers and shared experts keep their
    dtype. Returns the layers quantized."""
    if method not in QUANTIZATIONS:
        raise ConfigError(f"quantization {method!r} is not supported; supported: {', '.join(QUANTIZATIONS)}")
    done = 0
    for layer in model.layers:
        for block_name in ("self_attn", "mlp"):
            block = getattr(layer, block_name, None)
            for attr in PROJECTIONS:
                linear = getattr(block, attr, None) if block is not None else None
                if type(linear) is nn.Linear:
                    setattr(block, attr, Fp8Linear.from_linear(linear))
                    done += 1
            experts = getattr(block, "experts", None)
            if experts is not None and not isinstance(experts, Fp8Experts):
                block.experts = Fp8Experts.from_experts(experts.gate_up_proj, experts.down_proj)
                done += 1
    return done


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, (Fp8Linear, Fp8Experts)) for m in model.modules())
