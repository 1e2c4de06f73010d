"""An engine built from a model directory or hub id: the target (sharded by a tensor-parallel rank's
loader where given), its tokenizer and EOS ids, the drafter, the engine with its page plan, and the
warm-up; plus the `ModelInputs` that check user input for it."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, overload

import torch

from blockspec.assets import embedded
from blockspec.config import ConfigError, EngineArgs, EngineConfig, ModelConfig, SpeculativeConfig
from blockspec.drafters import load_drafter
from blockspec.engine import memory
from blockspec.engine.engine import Engine
from blockspec.errors import ModelLoadError
from blockspec.inputs import ModelInputs, read_chat_template
from blockspec.models.llama import CausalLM
from blockspec.models.loader import load_target, read_json, resolve_device, resolve_model_dir
from blockspec.sampling_params import SamplingError, SamplingParams

log = logging.getLogger("blockspec")

class Agree(Protocol):
    """Rank 0's decision, or list of decisions, on every tensor-parallel rank (each passes its own)."""

    @overload
    def __call__(self, decision: int) -> int: ...

    @overload
    def __call__(self, decision: list[int]) -> list[int]: ...


TargetLoader = Callable[[Path, "str | torch.dtype", torch.device, int, "str | None"], tuple[CausalLM, Path]]


def load_tokenizer(path: Path | None) -> Any:
    """The HF fast tokenizer of a model directory, or None when the directory has no tokenizer files."""
    if path is None or not ((path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:
        raise ModelLoadError(f"{path}: cannot load the tokenizer: {type(exc).__name__}: {exc}") from None


def generation_eos_ids(model_dir: Path, config_eos: Sequence[int], tokenizer: Any) -> list[int]:
    """EOS ids from generation_config.json, config.json and the tokenizer, merged."""
    ids = set(config_eos)
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        eos = read_json(gen).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


# generation_config.json fields that become default sampling parameters, as vLLM reads them (its
# max_new_tokens is max_tokens here)
GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                       "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(model_dir: Path, source: str, hub: dict[str, Any] | None = None) -> dict[str, Any]:
    """Default sampling parameters from a generation_config.json, as vLLM's `--generation-config`
    reads them: "auto" takes the model directory's, "vllm" none, anything else names a directory.
    The values the file sets (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens)
    replace SamplingParams' defaults; a file that sets none of them (EOS ids only) changes nothing. A hub id is
    fetched with `hub`'s options (`EngineArgs.hub`: the run's download directory and token)."""
    if source == "vllm":
        return {}
    folder = model_dir if source == "auto" else resolve_model_dir(source, "generation_config", **(hub or {}))
    path = folder / "generation_config.json"
    if not path.is_file():
        if source != "auto":
            raise ConfigError(f"generation_config: {folder} has no generation_config.json")
        return {}
    given = read_json(path)
    defaults = {ours: given[theirs] for theirs, ours in GENERATION_DEFAULTS.items() if given.get(theirs) is not None}
    try:  # checked at load, naming the file: not at a request that never gave the value
        SamplingParams(**defaults)
    except SamplingError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return defaults


@dataclass
class EngineSetup:
    engine: Engine
    inputs: ModelInputs
    model: CausalLM
    model_dir: Path
    tokenizer: Any
    speculative_config: SpeculativeConfig | None


def agreed_pages(config: EngineConfig, target: CausalLM, drafter: Any, spec: SpeculativeConfig | None,
                 fewest_pages: Callable[[int], int]) -> EngineConfig:
    """`config` with the KV pages the fewest any tensor-parallel rank's memory allows (a count given
    stands): ranks holding different pools would preempt at different steps and their steps part."""
    if config.num_kv_pages is not None:
        return config
    mine = memory.plan_pages(target, drafter, config, memory.cache_extent(config, spec, drafter)[1])
    return dataclasses.replace(config, num_kv_pages=fewest_pages(mine))


def agree_on_draft_length(engine: Engine, agree: Agree) -> None:
    """Have `engine` take its draft-length decisions through `agree` (rank 0's, on tensor-parallel
    ranks): an adaptive policy decides from each process's clock, and so does DSpark's load-aware verify
    budget (each request's drafts). A fixed K and a static confidence threshold need none."""
    if engine.proposer is None:
        return
    if engine.policy.adaptive:
        engine.agree = agree
    if engine.proposer.cfg.adaptive_verification:
        engine.proposer.agree_lengths = agree


def build_engine(
    model: str | os.PathLike[str],
    args: EngineArgs = EngineArgs(),
    *,
    load: TargetLoader = load_target,
    fewest_pages: Callable[[int], int] | None = None,
    agree: Agree | None = None,
) -> EngineSetup:
    """The engine of `LLM(model, ...)`. A tensor-parallel rank passes `load` (its shard of the
    target), `fewest_pages` (every rank must hold the pages the least of them can: the ranks'
    preemptions, and so their steps, would part otherwise) and `agree` (every rank takes rank 0's
    draft-length decisions)."""
    a = args
    spec = SpeculativeConfig.from_user(a.speculative_config)
    dev = resolve_device(a.device)
    model_dir = resolve_model_dir(model, **a.hub(a.revision))
    # the whole config.json is checked before anything hands the directory to transformers (the
    # tokenizer's AutoConfig), whose errors would neither name the file nor stay on one line
    config_path = model_dir / "config.json"
    cfg_len = ModelConfig.from_hf(read_json(config_path), str(config_path)).max_position_embeddings
    max_len = cfg_len if a.max_model_len == -1 else a.max_model_len or min(cfg_len, 4096)
    if max_len > cfg_len:
        raise ConfigError(f"max_model_len={max_len} exceeds the model's max_position_embeddings ({cfg_len})")
    defaults = generation_defaults(model_dir, a.generation_config, a.hub())  # before the weights: a bad file fails fast
    margin = 64  # RoPE rows for draft/verify positions past the committed length
    target, model_dir = load(model_dir, a.dtype, dev, max_len + margin, a.quantization)
    tok = load_tokenizer(resolve_model_dir(a.tokenizer, "tokenizer", **a.hub(a.tokenizer_revision)) if a.tokenizer
                         else model_dir)
    if a.tokenizer and tok is None:  # asked for by name: its absence is the mistake, not the model's
        raise ModelLoadError(f"tokenizer {str(a.tokenizer)!r}: no tokenizer files there (tokenizer.json or "
                             "tokenizer_config.json)")
    if a.chat_template is not None:
        if tok is None:
            raise ConfigError(f"chat_template needs a tokenizer; {model_dir} has none")
        tok.chat_template = read_chat_template(a.chat_template)
    eos = generation_eos_ids(model_dir, target.config.eos_token_ids, tok)
    drafter = None
    if spec is not None:
        weight = target.embed_tokens.weight
        source = resolve_model_dir(embedded(spec.model, spec.method), f"{spec.method} drafter", **a.hub(spec.revision))
        drafter = load_drafter(spec.method, source, weight.device, weight.dtype)
    config = a.engine_config(max_len)
    if fewest_pages is not None:
        config = agreed_pages(config, target, drafter, spec, fewest_pages)
    engine = Engine(target, tok, config, spec, drafter, eos)
    if agree is not None:
        agree_on_draft_length(engine, agree)
    if a.warmup:  # GPU: capture every CUDA graph now, not inside the first requests
        done = engine.warmup()
        if done["graphs"]:
            log.info("warm-up: %d CUDA graphs captured in %.1f s", done["graphs"], done["seconds"])
    inputs = ModelInputs(model_dir, tok, max_len, target.config.vocab_size, spec is not None, tuple(engine.eos_ids),
                         config.max_logprobs, sampling_defaults=defaults, think=engine.think)
    return EngineSetup(engine, inputs, target, model_dir, tok, spec)
