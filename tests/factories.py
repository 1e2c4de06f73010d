"""Tiny randomly initialised Hugging Face checkpoints of each supported family, written by transformers."""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("llama", "qwen2", "qwen3")


def hf_config(family: str, vocab: int = 96, hidden: int = 64, layers: int = 4, heads: int = 4, kv_heads: int = 2,
              head_dim: int | None = None, tie: bool = False, **extra):
    """A transformers config object for a tiny model of `family`."""
    import transformers

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden + 8, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                  tie_word_embeddings=tie, rms_norm_eps=1e-6, eos_token_id=1, bos_token_id=0, pad_token_id=None)
    if head_dim is not None:
        common["head_dim"] = head_dim
    common.update(extra)
    if family == "llama":
        common.setdefault("rope_scaling", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        common.setdefault("rope_theta", 500000.0)
        return transformers.LlamaConfig(**common)
    if family == "qwen2":
        common.setdefault("rope_theta", 1000000.0)
        return transformers.Qwen2Config(**common)
    if family == "qwen3":
        common.setdefault("rope_theta", 1000000.0)
        common.setdefault("head_dim", 32)
        return transformers.Qwen3Config(**common)
    raise ValueError(family)


def make_hf_model(family: str, seed: int = 0, **kw):
    import transformers

    torch.manual_seed(seed)
    cfg = hf_config(family, **kw)
    cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
           "qwen3": transformers.Qwen3ForCausalLM}[family]
    model = cls(cfg).eval()
    with torch.no_grad():  # wider weights than the default init, so greedy paths are not trivially flat
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08 if "embed" not in name else 0.5)
            elif "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0, 0.02)
    return model


def save_tiny(path: Path, family: str = "qwen3", seed: int = 0, max_shard_size: str | None = None, **kw) -> Path:
    """Write a tiny HF checkpoint (config, safetensors, generation config) to `path` and return it."""
    model = make_hf_model(family, seed, **kw)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return Path(path)
