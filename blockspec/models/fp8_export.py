"""Write a checkpoint's FP8 twin: the HF fine-grained FP8 format (`quant_method` "fp8", e4m3 weights with
`weight_scale_inv` over 128 x 128 blocks), as Qwen/Qwen3-8B-FP8 ships and as vLLM, SGLang and blockspec load.

    blockspec quantize MODEL --out DIR [--block-size 128] [--kv-calibration FILE ... [--kv-scales head]]

Weight-only, as `models.quant` reads it: the decoder layers' attention, dense MLP and MoE expert
products become e4m3 (a step streams half the bytes; experts stored one by one, as the hub's
checkpoints and Qwen/Qwen3-30B-A3B-FP8 store them, transformers 5's stacked experts written so too);
embeddings, the LM head, norms, routers and shared experts stay as the checkpoint has them. Tokenizer
files and the rest of the directory are copied as they are.

With calibration text, each layer's FP8 KV cache scales are written too (`self_attn.k_scale` and
`v_scale`, the names vLLM and llm-compressor use): the largest |K| and |V| the model stores over the
text, over 448, so a `kv_cache_dtype="fp8"` cache spans e4m3's range without saturating, where the
default scale of 1.0 clips keys and values past 448 and stores those below 2**-6 at reduced precision.
Per head (`--kv-scales head`), each KV head's largest |K| and |V| instead: a head of small values is not pushed
below e4m3's normal range by its layer's loudest head.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import save_torch_state_dict

from blockspec.config import ConfigError, drafter_kind
from blockspec.kernels.fp8 import E4M3_MAX, quantize_blocks
from blockspec.models.kv_cache import KVScales, LayerScale, causal_meta
from blockspec.models.loader import load_target, quantization_config, read_json, read_state_dict, resolve_model_dir

# the products quantized: a decoder layer's attention, dense MLP and MoE experts (one by one)
QUANTIZED = re.compile(r"(^|\.)layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(experts\.\d+\.)?(gate|up|down)_proj)"
                       r"\.weight$")
# transformers 5's own MoE layout: a layer's experts stacked, gate_up [E, 2I, H] (gate rows first) and down [E, H, I]
STACKED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth")
BLOCK = 128  # rows and columns a weight scale covers, as the published FP8 checkpoints have it
MAX_BLOCK = 1024  # scale blocks past this have no use and would pad a weight to gigabytes


@dataclass
class Fp8Export:
    """What `write_fp8_checkpoint` wrote: the tensors it quantized and the weight bytes before and after."""

    out: Path
    quantized: int
    bytes_before: int
    bytes_after: int
    kv_scales: KVScales | None = None
    # products whose rows or columns are not whole blocks: blockspec and transformers' fine-grained FP8 read
    # their edge blocks, vLLM refuses such shapes in its block-FP8 layers
    ragged: tuple[str, ...] = ()


CALIBRATION_TOKENS = 16384  # token ids a KV cache calibration prefills, in all
CALIBRATION_LENGTH = 2048  # the longest prefill of it: contexts of the lengths a cache holds


def per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with stacked experts (`STACKED_EXPERTS`) written one by one under the hub's names
    (`experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`), the layout FP8 checkpoints store and engines read."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        m = STACKED_EXPERTS.match(name)
        if m is None or tensor.dim() != 3:
            out[name] = tensor
            continue
        prefix, part = m.groups()
        for e, expert in enumerate(tensor.unbind(0)):
            if part == "down_proj":
                out[f"{prefix}.{e}.down_proj.weight"] = expert
            else:
                gate, up = expert.chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = gate, up
    return out


def calibration_sequences(tokenizer: Any, texts: list[str], tokens: int = CALIBRATION_TOKENS,
                          length: int = CALIBRATION_LENGTH) -> list[list[int]]:
    """`texts` tokenized (a tokenizer's `encode`, no special tokens) and cut into prefills of at most `length`
    ids, `tokens` ids in all, taken from the texts in order."""
    if tokens <= 0 or length <= 0:
        raise ConfigError(f"KV cache calibration takes a positive token count and length, got {tokens} and {length}")
    out: list[list[int]] = []
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False, verbose=False)  # long texts are cut here
        for i in range(0, len(ids), length):
            left = tokens - sum(map(len, out))
            if left <= 0:
                return out
            out.append(ids[i : i + min(length, left)])
    return out


def calibrate_kv_scales(model_dir: Path, sequences: list[list[int]], device: str = "auto",
                        per_head: bool = False) -> KVScales:
    """Each layer's KV cache scales for `model_dir`: the largest |K| (normed and rotated, as the cache stores
    it) and |V| over prefills of `sequences` (token ids), over 448, of the layer or (`per_head`) of each KV
    head; 1.0 where the keys or values are all zero."""
    if not sequences or not all(sequences):
        raise ConfigError("KV cache calibration needs at least one non-empty token sequence")
    model, _ = load_target(model_dir, "auto", device)
    dev = model.embed_tokens.weight.device
    amax = torch.zeros(2, len(model.layers), model.config.num_key_value_heads, dtype=torch.float64)
    longest = model.config.max_position_embeddings  # a longer sequence is prefilled in pieces of the model's length
    with torch.no_grad():
        for seq in (whole[i:i + longest] for whole in sequences for i in range(0, len(whole), longest)):
            cache = model.new_cache(1, len(seq))  # the model's dtype: the values an FP8 cache would store
            meta = causal_meta([0], [0], [len(seq)], len(seq), cache.trash, dev, model.config.sliding_window,
                               model.config.layer_types)
            model(torch.tensor([seq], device=dev), meta, cache)
            for i in range(len(model.layers)):  # pages no row wrote hold zeros; pools [pages, heads, page, hd]
                for part, pool in enumerate((cache.k[i], cache.v[i])):
                    amax[part, i] = torch.maximum(amax[part, i], pool.abs().amax(dim=(0, 2, 3)).double().cpu())
    if not per_head:
        amax = amax.amax(dim=2, keepdim=True)

    def scales(row: torch.Tensor) -> LayerScale:
        values = tuple(float(a) / E4M3_MAX if a > 0 else 1.0 for a in row)
        return values if per_head else values[0]
    k, v = (tuple(map(scales, part)) for part in amax)
    return KVScales(k, v)


def tied_head(state: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """A .bin stores a tied model's embedding and LM head as one tensor under both names, of which the writer
    would keep one, the head, and drop the embedding: the head is left out where the config ties it (as
    save_pretrained leaves it out), else written as a copy of its own."""
    embed = next((n for n in state if n.endswith("embed_tokens.weight")), None)
    head = "lm_head.weight"
    if embed is None or head not in state:
        return
    if config.get("tie_word_embeddings") is True and torch.equal(state[head], state[embed]):
        del state[head]
    elif state[head].untyped_storage().data_ptr() == state[embed].untyped_storage().data_ptr():
        state[head] = state[head].clone()


def write_fp8_checkpoint(model: str | Path, out: Path, block: int = BLOCK, calibration: list[list[int]] | None = None,
                         device: str = "auto", per_head: bool = False, **hub) -> Fp8Export:
    """`model` (an HF directory or hub id; `hub`: `resolve_model_dir`'s revision, download_dir, token) as an FP8
    checkpoint in `out`, which must not exist or be empty; with `calibration` (token id sequences), its KV
    cache scales too, per layer or `per_head` ([kv_heads, 1, 1], compressed-tensors' "attn_head" shape),
    computed on `device` (`calibrate_kv_scales`)."""
    if not 1 <= block <= MAX_BLOCK:
        raise ConfigError(f"block_size must be in [1, {MAX_BLOCK}] rows and columns, got {block}")
    src = resolve_model_dir(str(model), **hub)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out}: the output must be a new or empty directory")
    config = read_json(src / "config.json")
    drafter = drafter_kind(config)
    if drafter:  # its FP8 twin would not load: a drafter quantizes at load
        raise ConfigError(f"{src} is a drafter ({drafter}): quantize writes FP8 targets; a drafter goes FP8 at load "
                          "with speculative_config quantization 'fp8'")
    quantized, source = quantization_config(src, config)
    if quantized.get("quantization_config") is not None:
        qc = quantized["quantization_config"]
        method = qc.get("quant_method") if isinstance(qc, dict) else None
        raise ConfigError(f"{source}: the checkpoint is quantized already (quant_method {method!r}); "
                          "quantize an unquantized one")
    # before the state is read: the calibrating model is freed first
    kv_scales = calibrate_kv_scales(src, calibration, device, per_head) if calibration is not None else None
    state = per_expert(read_state_dict(src))
    tied_head(state, config)
    written: dict[str, torch.Tensor] = {}
    quantized, ragged = 0, []
    before = sum(t.nbytes for t in {t.untyped_storage().data_ptr(): t for t in state.values()}.values())
    for name, tensor in state.items():
        if QUANTIZED.search(name) and tensor.dim() == 2 and tensor.is_floating_point():
            if tensor.shape[0] % block or tensor.shape[1] % block:
                ragged.append(name)
            weight, scale = quantize_blocks(tensor, (block, block))
            # own storage each (the quantizer may hand back views of a block-padded buffer)
            written[name], written[name.removesuffix(".weight") + ".weight_scale_inv"] = weight.clone(), scale.clone()
            quantized += 1
        else:
            written[name] = tensor
    if not quantized:
        raise ConfigError(f"{src}: no decoder layer products to quantize (names like "
                          "model.layers.0.self_attn.q_proj.weight)")
    if kv_scales is not None:
        prefix = "model." if any(n.startswith("model.") for n in state) else ""
        for i, (k, v) in enumerate(zip(kv_scales.k, kv_scales.v)):
            for kind, scale in (("k", k), ("v", v)):
                value = torch.tensor(scale, dtype=torch.float32)
                written[f"{prefix}layers.{i}.self_attn.{kind}_scale"] = value.view(-1, 1, 1) if per_head else value
    after = sum(t.nbytes for t in written.values())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [block, block]}
    out.parent.mkdir(parents=True, exist_ok=True)
    # written beside `out` and renamed into place whole: an interrupted run leaves no half checkpoint there
    partial = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        for path in src.iterdir():  # tokenizer, generation config, chat template, licence, card
            if path.is_file() and path.name != "config.json" and not path.name.endswith(WEIGHT_FILES) \
                    and not path.name.endswith(".index.json"):
                shutil.copy2(path, partial / path.name)
        save_torch_state_dict(written, partial)
        (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        umask = os.umask(0)
        os.umask(umask)
        partial.chmod(0o777 & ~umask)  # a new directory's mode (mkdtemp's is 0o700)
        partial.replace(out)  # an empty `out` is replaced
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return Fp8Export(out, quantized, before, after, kv_scales, tuple(ragged))
