"""Checkpoint loading: Hugging Face directories or hub ids, safetensors (single or sharded) or .bin.

Every failure names the path and the field at fault, before any weights are touched where possible.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from blockspec.config import ConfigError, ModelConfig
from blockspec.errors import ModelLoadError

log = logging.getLogger("blockspec")

if TYPE_CHECKING:
    from blockspec.models.llama import CausalLM


HUB_PATTERNS = ["*.json", "*.model", "*.txt", "*.jinja"]  # configs, tokenizer files, chat templates
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")  # what read_state_dict reads, in its order


def hub_patterns(repo_id: str, revision: str | None, token: str | None) -> list[str]:
    """The files a hub download fetches: HUB_PATTERNS and one weights format, safetensors where the repo has
    them, else PyTorch's .bin (a repo shipping both would be fetched twice over). Where the listing fails
    (offline: the download reads the cache), both. The listing is the repo's info, one request: the paged file
    listing retries a failed connection with backoff, 23 s before an offline load reached the cache."""
    from huggingface_hub import HfApi

    try:
        files = [s.rfilename for s in HfApi().model_info(repo_id, revision=revision, token=token).siblings or []]
    except Exception:  # noqa: BLE001  offline, or the hub's error, which the download then names
        return HUB_PATTERNS + list(WEIGHT_PATTERNS)
    has = [p for p in WEIGHT_PATTERNS if any(fnmatch.fnmatch(f, p) for f in files)]
    return HUB_PATTERNS + has[:1]


def resolve_model_dir(name_or_path: str | os.PathLike[str], what: str = "model", revision: str | None = None,
                      download_dir: str | os.PathLike[str] | None = None, token: str | None = None) -> Path:
    """A local directory, or a hub id downloaded (or found in the local hub cache) with huggingface_hub:
    at `revision` (a branch, tag or commit; None: the default branch), into `download_dir` (None: the hub
    cache), with `token` (None: the one huggingface_hub finds, e.g. HF_TOKEN)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    text = str(name_or_path)
    if path.exists():
        raise ModelLoadError(f"{what} path {text!r} is a file; expected a Hugging Face model directory")
    looks_like_path = text.startswith((".", "/", "~")) or text.count("/") != 1
    if looks_like_path:
        raise ModelLoadError(f"{what} directory {text!r} does not exist (and is not a hub id of the form 'org/name')")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=text, allow_patterns=hub_patterns(text, revision, token),
                                      revision=revision, cache_dir=download_dir, token=token))
    except Exception as exc:  # hub errors come in many classes; the user needs the id and the cause
        at = f" at revision {revision!r}" if revision else ""
        cause = " ".join(str(exc).split())  # on one line: a failed connection's message has the hub's advice below
        raise ModelLoadError(
            f"{what} {text!r}{at} is not a local directory and could not be fetched from the Hugging Face hub: "
            f"{type(exc).__name__}: {cause}"
        ) from None


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing")
    try:  # JSON is UTF-8 whatever the locale's encoding (ASCII under LC_ALL=C, a code page on Windows)
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ModelLoadError(f"{path} is not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    return data


def read_state_dict(model_dir: Path) -> dict[str, Tensor]:
    """All tensors of a checkpoint directory: safetensors (one file or a sharded index), else PyTorch's .bin (one
    file or a sharded index, as older checkpoints ship them)."""
    for single, index in (("model.safetensors", "model.safetensors.index.json"),
                          ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        if (model_dir / single).is_file():
            files = [model_dir / single]
            break
        if (model_dir / index).is_file():
            files = shard_files(model_dir / index)
            break
    else:
        raise ModelLoadError(f"{model_dir}: no weights found (model.safetensors, model.safetensors.index.json, "
                             "pytorch_model.bin or pytorch_model.bin.index.json)")
    state: dict[str, Tensor] = {}
    for f in files:
        if not f.is_file():
            raise ModelLoadError(f"{f}: shard listed in the index is missing")
        state.update(read_weights_file(f))
    return state


def shard_files(index: Path) -> list[Path]:
    """The shard files a sharded checkpoint's index names, each once."""
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ModelLoadError(f"{index}: missing 'weight_map'")
    bad = next(((name, f) for name, f in weight_map.items() if not isinstance(f, str) or not f), None)
    if bad is not None:
        raise ModelLoadError(f"{index}: weight_map[{bad[0]!r}] must name a shard file, got {bad[1]!r}")
    return [index.parent / f for f in sorted(set(weight_map.values()))]


def read_weights_file(path: Path) -> dict[str, Tensor]:
    """One safetensors file, or a .bin read with weights_only (tensors, never pickled code)."""
    from safetensors.torch import load_file

    try:
        if path.suffix == ".safetensors":
            return load_file(str(path))
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or foreign file: pickle's and zipfile's errors name neither
        kind = "safetensors file" if path.suffix == ".safetensors" else "checkpoint"
        raise ModelLoadError(f"{path}: cannot read the {kind}: "
                             f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None


def assign_weights(module: nn.Module, state: dict[str, Tensor], source: str, optional: tuple[str, ...] = ()) -> None:
    """Copy `state` into `module`'s parameters by name; name every missing, unexpected or mis-shaped tensor."""
    params = dict(module.named_parameters())
    missing = [n for n in params if n not in state and not n.startswith(optional)]
    unexpected = [n for n in state if n not in params]
    problems = []
    if missing:
        problems.append(f"missing tensors: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        problems.append(f"unexpected tensors: {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    for name, t in state.items():
        if name in params and tuple(params[name].shape) != tuple(t.shape):
            problems.append(f"{name}: checkpoint shape {tuple(t.shape)} != expected {tuple(params[name].shape)}")
    if problems:
        raise ModelLoadError(f"{source}: weights do not fit the config: " + "; ".join(problems))
    with torch.no_grad():
        for name, t in state.items():
            params[name].copy_(t)


def fuse_hf_layer_names(state: dict[str, Any], prefix: str, rename: Callable[[str], str],
                        concat: Callable[[list[Any]], Any] = torch.cat) -> dict[str, Any]:
    """Map HF per-layer q/k/v and gate/up tensors onto blockspec's fused qkv_proj and gate_up_proj
    (`concat` stacks the parts along the output rows: FP8 weights bring their scales along)."""
    out: dict[str, Tensor] = {}
    groups: dict[str, dict[str, Tensor]] = {}
    for name, t in state.items():
        if not name.startswith(prefix):
            continue
        short = rename(name[len(prefix):])
        for parts, fused in ((("q_proj", "k_proj", "v_proj"), "qkv_proj"), (("gate_proj", "up_proj"), "gate_up_proj")):
            hit = next((p for p in parts if f".{p}." in short), None)
            if hit:
                key = short.replace(f".{hit}.", f".{fused}.")
                groups.setdefault(key, {})[hit] = t
                break
        else:
            out[short] = t
    order = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    for key, parts in groups.items():
        fused = "qkv_proj" if ".qkv_proj." in key else "gate_up_proj"
        need = order[fused]
        if set(parts) != set(need):
            raise ModelLoadError(f"{key}: checkpoint has {sorted(parts)} but needs all of {list(need)}")
        widths = {tuple(parts[p].shape[1:]) for p in need if isinstance(parts[p], Tensor)}
        if len(widths) > 1:  # torch.cat would fail in its own words, naming no tensor
            raise ModelLoadError(f"{key}: its parts' shapes past the output rows differ: "
                                 + ", ".join(f"{p} {list(parts[p].shape)}" for p in need))
        out[key] = concat([parts[p] for p in need])
    return out


def resolve_dtype(dtype: str | torch.dtype, config_dtype: str, device: torch.device) -> torch.dtype:
    """'auto' = the checkpoint's dtype on GPU, float32 on CPU (CPU half-precision matmuls are slow)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16, "half": torch.float16}
    if dtype == "auto":
        return names.get(config_dtype, torch.float32) if device.type == "cuda" else torch.float32
    if dtype not in names:
        raise ConfigError(f"dtype {dtype!r} not supported; allowed: auto, {', '.join(names)}")
    return names[dtype]


def resolve_device(device: str | torch.device) -> torch.device:
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"device {device!r} not understood; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} asked for but CUDA is not available on this machine")
    return dev


MODELOPT_CONFIG = "hf_quant_config.json"  # where NVIDIA ModelOpt checkpoints describe their quantization


def quantization_config(model_dir: Path, raw: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The checkpoint's config with its quantization (config.json's `quantization_config`, or ModelOpt's
    own file beside it, as `quant_method` "modelopt"), and the path that says it."""
    source = model_dir / MODELOPT_CONFIG
    if raw.get("quantization_config") is None and source.is_file():
        quantization = read_json(source).get("quantization")
        if not isinstance(quantization, dict):
            raise ModelLoadError(f"{source}: 'quantization' must be an object (quant_algo, exclude_modules, ...)")
        return dict(raw, quantization_config={"quant_method": "modelopt", **quantization}), str(source)
    return raw, str(model_dir / "config.json")


def load_target(
    name_or_path: str | os.PathLike[str],
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
    max_positions: int | None = None,
    quantization: str | None = None,
) -> tuple[CausalLM, Path]:
    """Load a Llama/Qwen2/Qwen3 causal LM from a HF directory or hub id. An FP8 checkpoint keeps its
    e4m3 weights; `quantization="fp8"` quantizes an unquantized one's decoder products at load, on the
    device (`models.quant`)."""
    from blockspec.models import quant
    from blockspec.models.layers import Rotary
    from blockspec.models.llama import CausalLM
    from blockspec.models.moe import stack_experts

    model_dir = resolve_model_dir(name_or_path)
    raw = read_json(model_dir / "config.json")
    cfg = ModelConfig.from_hf(raw, str(model_dir / "config.json"))
    fp8 = quant.checkpoint_quantization(*quantization_config(model_dir, raw))
    if quantization is not None and quantization not in quant.QUANTIZATIONS:
        raise ConfigError(f"quantization {quantization!r} is not supported; supported: "
                          f"{', '.join(quant.QUANTIZATIONS)} (or None)")
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, cfg.torch_dtype, dev)
    state = read_state_dict(model_dir)
    kv_scales = quant.take_kv_scales(state, cfg.num_hidden_layers, cfg.num_key_value_heads, str(model_dir))
    if fp8 is not None:
        packed = quant.take_fp8_weights(state, fp8)
    elif (stray := next((n for n, t in state.items() if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)), None)):
        raise ModelLoadError(f"{model_dir}: {stray} is {state[stray].dtype}, but config.json has no "
                             "quantization_config to say how its scales read (an FP8 checkpoint names its format there)")
    else:
        packed = {}
    prefix = "model." if any(k.startswith("model.") for k in state) else ""
    embed, head = state.get(f"{prefix}embed_tokens.weight"), state.get("lm_head.weight")
    if cfg.tie_word_embeddings and head is not None and embed is not None and not torch.equal(head, embed):
        log.warning("%s: tie_word_embeddings is true but lm_head.weight differs from the embedding; the two are "
                    "kept apart, as transformers keeps them (set tie_word_embeddings false to silence this)",
                    model_dir / "config.json")
        cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
    mapped = fuse_hf_layer_names(state, prefix, lambda n: n)
    packed_mapped = fuse_hf_layer_names(packed, prefix, lambda n: n, concat=quant.concat_fp8)
    if "lm_head.weight" in packed:
        packed_mapped["lm_head.weight"] = packed["lm_head.weight"]
    if "lm_head.weight" in state and not cfg.tie_word_embeddings:
        mapped["lm_head.weight"] = state["lm_head.weight"]
    mapped = {k: v for k, v in mapped.items() if not k.endswith("rotary_emb.inv_freq")}
    with torch.device("meta"):
        model = CausalLM(cfg, max_positions)
    model = model.to_empty(device="cpu")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    # FP8 experts first: a layer whose experts are partly FP8 is then named as such
    mapped.update(quant.install_fp8_experts(model, packed_mapped, str(model_dir)))
    mapped = stack_experts(mapped, str(model_dir))  # hub checkpoints store MoE experts one by one
    mapped.update(quant.install_fp8(model, packed_mapped, str(model_dir)))
    assign_weights(model, mapped, str(model_dir))
    model = model.to(device=dev, dtype=torch_dtype)  # FP8 weights and their scales keep their dtypes
    if quantization is not None and fp8 is None:
        quant.quantize_model(model, quantization)
    # RoPE tables stay fp32 (built after the dtype cast); they are cast per use.
    model.rotary = Rotary(cfg.rope, cfg.head_dim, max_positions or cfg.max_position_embeddings).to(dev)
    model.kv_scales = kv_scales  # taken by an FP8 cache (`kv_cache_dtype="fp8"`); a model-dtype cache needs none
    model.eval().requires_grad_(False)
    return model, model_dir
