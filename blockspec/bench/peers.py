"""Peers measured in the same run, on the same GPU and the very same weights: transformers `generate`
(plain) and transformers assisted generation (`assistant_model=`, where a real draft model is given).

The transformers model is built around blockspec's own weight tensors (split views of the fused
projections, no copy), so both engines read identical bytes; at T = 0 its greedy tokens are compared
with blockspec's plain decoding, a cross-check of both implementations.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from blockspec.bench.timing import peak_memory_gb, reset_peak_memory, spread, synchronize
from blockspec.models.llama import CausalLM
from blockspec.drafters.formats import unfuse_state

PEERS = ("transformers",)
ASSISTED_NEEDS_REAL = ("transformers assisted generation needs a real draft model, and with random target weights "
                       "no draft model agrees with the target, so there is nothing meaningful to time")
ASSISTED_NEEDS_DRAFT = ("transformers assisted generation needs a draft model with the target's tokenizer: pass "
                        "--peer-assistant DIR (e.g. a small model of the same family)")
ASSISTED_BATCH_ONE = "transformers assisted generation supports batch size 1 only"


def hf_twin(target: CausalLM, model_dir: Path | None = None) -> Any:
    """A transformers CausalLM whose parameters ARE `target`'s tensors (views, no copy).

    The config comes from the checkpoint directory when there is one (every HF field kept), else from
    blockspec's ModelConfig. Built on the meta device, so no second set of weights is ever allocated.
    """
    import transformers

    if model_dir is not None:
        config = transformers.AutoConfig.from_pretrained(str(model_dir))
    else:
        config = transformers.AutoConfig.for_model(**target.config.to_hf())
    weight = target.embed_tokens.weight
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=weight.dtype, attn_implementation="sdpa")
    state = {(k if k.startswith("lm_head.") else "model." + k): v for k, v in unfuse_state(target).items()}
    if target.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    hf.load_state_dict(state, strict=not target.config.tie_word_embeddings, assign=True)
    if target.config.tie_word_embeddings:
        hf.tie_weights()
    # Non-persistent buffers (RoPE inverse frequencies) are still on meta: rebuild them for real.
    for name, module in list(hf.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):
            parent, _, attr = name.rpartition(".")
            setattr(hf.get_submodule(parent), attr, type(module)(config=hf.config).to(weight.device))
    hf.generation_config.eos_token_id = None  # fixed-length runs, like ignore_eos in blockspec
    return hf.eval().requires_grad_(False)


def load_assistant(path: str, device: torch.device, dtype: torch.dtype, vocab_size: int) -> Any:
    """The draft model for assisted generation; its vocabulary must be the target's."""
    import transformers

    from blockspec.config import ConfigError
    from blockspec.models.loader import resolve_model_dir

    model_dir = resolve_model_dir(path, "assistant model")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device)
    if model.config.vocab_size != vocab_size:
        raise ConfigError(f"--peer-assistant {path}: vocab_size {model.config.vocab_size} != the target's "
                          f"{vocab_size} (assisted generation needs the target's tokenizer)")
    model.generation_config.eos_token_id = None
    return model.eval().requires_grad_(False)


def _batch(prompts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and attention mask (transformers' convention for batched generation)."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def measure_generate(hf: Any, prompts: list[list[int]], temperature: float, max_new_tokens: int, repeats: int,
                     seed: int, assistant: Any = None) -> tuple[dict[str, Any], list[list[int]]]:
    """Median of repeated `generate` calls after a warm-up. TTFT is the time of a 1-token generate (transformers
    has no per-token clock without a streamer); TPOT = (E2E - TTFT) / (tokens - 1)."""
    from transformers import GenerationConfig

    device = hf.device
    ids, mask = _batch(prompts, device)
    sampling: dict[str, Any] = {"do_sample": False}
    if temperature > 0:
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}

    def generate(n: int) -> tuple[float, torch.Tensor]:
        gen = GenerationConfig(max_new_tokens=n, min_new_tokens=0, eos_token_id=None, pad_token_id=0, **sampling)
        torch.manual_seed(seed)
        synchronize(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=mask, generation_config=gen, assistant_model=assistant)
        synchronize(device)
        return time.perf_counter() - t0, out[:, ids.shape[1]:]

    generate(min(8, max_new_tokens))  # warm-up
    reset_peak_memory(device)
    firsts = [generate(1)[0] for _ in range(repeats)]
    fulls = [generate(max_new_tokens) for _ in range(repeats)]
    peak = peak_memory_gb(device)
    ttft = spread(firsts)["median"]
    tokens = [out.numel() for _, out in fulls]
    e2e = [t for t, _ in fulls]
    decode = [max(t - ttft, 1e-9) for t in e2e]
    run = {
        "status": "ok",
        "num_requests": len(prompts),
        "output_tok_s": spread([n / t for n, t in zip(tokens, e2e)]),
        "decode_tok_s": spread([(n - len(prompts)) / d for n, d in zip(tokens, decode)]),
        "tpot_ms": {"p50": 1e3 * spread(decode)["median"] / max(max_new_tokens - 1, 1),
                    "p90": 1e3 * float(np.percentile(decode, 90)) / max(max_new_tokens - 1, 1)},
        "ttft_ms": {"p50": 1e3 * ttft, "p90": 1e3 * float(np.percentile(firsts, 90))},
        "ttft_method": "generate(max_new_tokens=1)",
        **peak,
    }
    return run, fulls[-1][1].tolist()
