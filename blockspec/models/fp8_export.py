"""Write a checkpoint's FP8 twin: the HF fine-grained FP8 format (`quant_method` "fp8", e4m3 weights with
`weight_scale_inv` over 128 x 128 blocks), as Qwen/Qwen3-8B-FP8 ships and as vLLM, SGLang and blockspec load.

    blockspec quantize MODEL --out DIR [--block-size 128]

Weight-only, as `models.quant` reads it: the decoder layers' attention and dense MLP products become
e4m3 (a step streams half the bytes); embeddings, the LM head, norms, routers and MoE experts stay as
the checkpoint has them. Tokenizer files and the rest of the directory are copied as they are.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub import save_torch_state_dict

from blockspec.config import ConfigError
from blockspec.kernels.fp8 import quantize_blocks
from blockspec.models.loader import read_json, read_state_dict, resolve_model_dir

# the products quantized: a decoder layer's attention and dense MLP (an MoE layer's experts stay as they are)
QUANTIZED = re.compile(r"(^|\.)layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)\.weight$")
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth")
BLOCK = 128  # rows and columns a weight scale covers, as the published FP8 checkpoints have it


@dataclass
class Fp8Export:
    """What `write_fp8_checkpoint` wrote: the tensors it quantized and the weight bytes before and after."""

    out: Path
    quantized: int
    bytes_before: int
    bytes_after: int


def write_fp8_checkpoint(model: str | Path, out: Path, block: int = BLOCK, **hub) -> Fp8Export:
    """`model` (an HF directory or hub id; `hub`: `resolve_model_dir`'s revision, download_dir, token) as an FP8
    checkpoint in `out`, which must not exist or be empty."""
    if block <= 0:
        raise ConfigError(f"block_size must be a positive number of rows and columns, got {block}")
    src = resolve_model_dir(str(model), **hub)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out}: the output must be a new or empty directory")
    config = read_json(src / "config.json")
    if config.get("quantization_config") is not None:
        method = config["quantization_config"].get("quant_method") if isinstance(config["quantization_config"],
                                                                                   dict) else None
        raise ConfigError(f"{src / 'config.json'}: the checkpoint is quantized already (quant_method {method!r}); "
                          "quantize an unquantized one")
    state = read_state_dict(src)
    written: dict[str, torch.Tensor] = {}
    quantized = before = 0
    for name, tensor in state.items():
        before += tensor.nbytes
        if QUANTIZED.search(name) and tensor.dim() == 2 and tensor.is_floating_point():
            weight, scale = quantize_blocks(tensor, (block, block))
            # own storage each (the quantizer may hand back views of a block-padded buffer)
            written[name], written[name.removesuffix(".weight") + ".weight_scale_inv"] = weight.clone(), scale.clone()
            quantized += 1
        else:
            written[name] = tensor
    if not quantized:
        raise ConfigError(f"{src}: no decoder layer products to quantize (names like "
                          "model.layers.0.self_attn.q_proj.weight)")
    after = sum(t.nbytes for t in written.values())
    out.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():  # tokenizer, generation config, chat template, licence, card
        if path.is_file() and path.name != "config.json" and not path.name.endswith(WEIGHT_FILES) \
                and not path.name.endswith(".index.json"):
            shutil.copy2(path, out / path.name)
    save_torch_state_dict(written, out)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [block, block]}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return Fp8Export(out, quantized, before, after)
