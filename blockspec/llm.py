"""Offline API shaped like vLLM's: `LLM(model, ...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import functools
import itertools
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from blockspec.config import ConfigError, EngineConfig, SpeculativeConfig
from blockspec.engine.engine import Engine
from blockspec.errors import RequestError
from blockspec.request import RequestOutput
from blockspec.models.loader import load_target, read_json, resolve_device, resolve_model_dir
from blockspec.errors import ModelLoadError
from blockspec.sampling_params import SamplingParams, is_int

log = logging.getLogger("blockspec")

PromptType = str | dict[str, Any]


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


def check_text(text: str, where: str) -> None:
    """Text must be valid Unicode to be tokenized: JSON can carry a lone surrogate (\\ud800) that no
    encoding represents."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(f"{where}: not valid Unicode: a lone surrogate {text[exc.start]!r} at character "
                           f"{exc.start}") from None


@dataclass
class ModelInputs:
    """What turning user input into checked token ids needs of a loaded model, without its weights:
    the tokenizer, the context length and the vocabulary. The offline API checks with it before any
    work starts, and the server's front process, which holds no weights, gets a copy of it."""

    model_dir: Path
    tokenizer: Any
    max_model_len: int
    vocab_size: int
    speculative: bool

    @functools.cached_property
    def max_prompt_chars(self) -> int:
        """Characters past which a text prompt cannot fit in max_model_len tokens, known without tokenizing
        it: a token stands for at most the longest token's characters, times 4 for normalisers that
        compose several characters into one. A prompt longer than this is refused before the
        tokenizer spends time and memory on it."""
        tokens = self.tokenizer.convert_ids_to_tokens(list(range(len(self.tokenizer))))
        return self.max_model_len * 4 * max(len(t) for t in tokens if t)

    def prompt_ids(self, prompt: PromptType, where: str) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(f"{where}: text prompt given but {self.model_dir} has no tokenizer; "
                                   "pass {'prompt_token_ids': [...]} instead")
            if not prompt:
                raise RequestError(f"{where}: the prompt is empty")
            check_text(prompt, where)
            if len(prompt) > self.max_prompt_chars:
                raise RequestError(f"{where}: the prompt has {len(prompt)} characters, more than max_model_len "
                                   f"({self.max_model_len}) tokens can hold (at most {self.max_prompt_chars})")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list) or not all(is_int(t) for t in ids):
                raise RequestError(f"{where}: prompt_token_ids must be a list of ints")
            return prompt.get("prompt"), ids
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self.prompt_ids(prompt["prompt"], where)
        raise RequestError(f"{where}: a prompt is a string or a dict with 'prompt_token_ids'; "
                           f"got {type(prompt).__name__}")

    def check_prompt(self, ids: list[int], params: SamplingParams, where: str) -> None:
        if not isinstance(params, SamplingParams):
            raise ConfigError(f"{where}: sampling_params must be SamplingParams, got {type(params).__name__}")
        limit = self.max_model_len
        if not ids:
            raise RequestError(f"{where}: the prompt is empty (no tokens)")
        if len(ids) >= limit:
            raise RequestError(f"{where}: prompt has {len(ids)} tokens; max_model_len is {limit}")
        vocab = self.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"{where}: token ids {bad[:5]} outside the vocabulary [0, {vocab})")
        params.check_vocab(vocab)


class LLM:
    """Load a target (and optionally a drafter) once; generate for many prompts in one batch."""

    def __new__(cls, *args: Any, tensor_parallel_size: int = 1, **kwargs: Any) -> Any:
        """tensor_parallel_size > 1 gives a blockspec.parallel.TPLLM: the same calls, served by that many
        rank processes across which the target is sharded."""
        if tensor_parallel_size == 1:
            return super().__new__(cls)
        from blockspec.parallel.tp import TPLLM

        return TPLLM(*args, tensor_parallel_size=tensor_parallel_size, **kwargs)

    def __init__(
        self,
        model: str | os.PathLike[str],
        tokenizer: str | os.PathLike[str] | None = None,
        dtype: str | torch.dtype = "auto",
        device: str = "auto",
        max_model_len: int | None = None,
        seed: int | None = None,
        speculative_config: SpeculativeConfig | dict[str, Any] | None = None,
        max_num_seqs: int = 64,
        max_prefill_tokens: int = 4096,
        graph_prefill_tokens: int = 2048,
        tensor_parallel_size: int = 1,  # > 1 is served by __new__
        attention_backend: str = "auto",
        gpu_memory_utilization: float = 0.9,
        kv_page_size: int = 64,
        num_kv_pages: int | None = None,
        async_scheduling: bool | None = None,
        warmup: bool = True,
    ) -> None:
        spec = SpeculativeConfig.from_user(speculative_config)
        dev = resolve_device(device)
        model_dir = resolve_model_dir(model)
        cfg_len = read_json(model_dir / "config.json").get("max_position_embeddings", 4096)
        if max_model_len is not None and (not isinstance(max_model_len, int) or max_model_len < 2):
            raise ConfigError(f"max_model_len must be an integer >= 2, got {max_model_len!r}")
        max_len = max_model_len or min(int(cfg_len), 4096)
        if max_len > cfg_len:
            raise ConfigError(f"max_model_len={max_len} exceeds the model's max_position_embeddings ({cfg_len})")
        if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be an integer >= 1, got {max_num_seqs!r}")
        margin = 64  # RoPE rows for draft/verify positions past the committed length
        self.model, self.model_dir = self._load_target(model_dir, dtype, dev, max_len + margin)
        self.tokenizer = load_tokenizer(resolve_model_dir(tokenizer, "tokenizer") if tokenizer else self.model_dir)
        eos = generation_eos_ids(self.model_dir, self.model.config.eos_token_ids, self.tokenizer)
        drafter = None
        if spec is not None:
            from blockspec.drafters import load_drafter

            weight = self.model.embed_tokens.weight
            drafter = load_drafter(spec.method, spec.model, weight.device, weight.dtype)
        engine_cfg = EngineConfig(max_model_len=max_len, max_num_seqs=max_num_seqs,
                                  max_prefill_tokens=max_prefill_tokens, graph_prefill_tokens=graph_prefill_tokens,
                                  seed=seed if seed is not None else 0,
                                  attention_backend=attention_backend,
                                  gpu_memory_utilization=gpu_memory_utilization, kv_page_size=kv_page_size,
                                  num_kv_pages=num_kv_pages, async_scheduling=async_scheduling)
        self.engine = self._make_engine(engine_cfg, spec, drafter, eos)
        if warmup:  # GPU: capture every CUDA graph now, not inside the first requests
            done = self.engine.warmup()
            if done["graphs"]:
                log.info("warm-up: %d CUDA graphs captured in %.1f s", done["graphs"], done["seconds"])
        self.speculative_config = spec
        self.inputs = ModelInputs(self.model_dir, self.tokenizer, max_len, self.model.config.vocab_size, spec is not None)
        self._ids = itertools.count()

    def _make_engine(self, config: EngineConfig, spec: SpeculativeConfig | None, drafter: Any,
                     eos: Iterable[int]) -> Engine:
        return Engine(self.model, self.tokenizer, config, spec, drafter, eos)

    def _load_target(self, model_dir: Path, dtype: str | torch.dtype, device: torch.device,
                     max_positions: int) -> tuple[Any, Path]:
        """Hook: a tensor-parallel rank (blockspec.parallel.tp) shards the target here, before the
        engine sizes its KV cache from it."""
        return load_target(model_dir, dtype, device, max_positions=max_positions)

    # ---------------------------------------------------------------- inputs
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for all prompts as one batch; outputs come back in prompt order.

        Every prompt and parameter is checked before any work starts, so one bad prompt cannot
        cost the others their results.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise RequestError("prompts must be a string, a dict with 'prompt_token_ids', or a list of them; got "
                               f"{type(prompts).__name__}")
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, (list, tuple)):
            params = list(sampling_params)
        else:
            raise ConfigError("sampling_params must be SamplingParams or a list of them; got "
                              f"{type(sampling_params).__name__}")
        if len(params) != len(prompts):
            raise ConfigError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; pass one or one each")
        prepared = [self.inputs.prompt_ids(p, f"prompt {i}") for i, p in enumerate(prompts)]
        for i, (_, ids) in enumerate(prepared):
            self.inputs.check_prompt(ids, params[i], f"prompt {i}")
        groups = []
        for (text, ids), sp in zip(prepared, params):
            groups.append(self.engine.add_request(str(next(self._ids)), text, ids, sp))
        try:
            self._run(sum((len(g) for g in groups), 0), use_tqdm)
        except BaseException:  # interrupted (Ctrl-C) or the engine broke: nothing of this call stays queued
            for group in groups:
                for req in group:
                    self.engine.abort(req.request_id)
            raise
        outputs = []
        for group in groups:
            first = group[0].to_output()
            first.request_id = group[0].request_id.rsplit("-", 1)[0] if len(group) > 1 else first.request_id
            first.outputs = [req.to_output().outputs[0] for req in group]
            errors = [req.error for req in group if req.error]
            first.error = errors[0] if errors else None
            outputs.append(first)
        return outputs

    def _run(self, total: int, use_tqdm: bool) -> None:
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=total, desc="Generating", unit="req", dynamic_ncols=True)
        done = 0
        while self.engine.has_unfinished():
            changed = self.engine.step()
            if bar is not None:
                finished = sum(1 for r in changed if r.finish_reason is not None)
                if finished:
                    bar.update(finished)
                    done += finished
        if bar is not None:
            bar.close()

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them, then generate."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise RequestError(f"{self.model_dir} has no tokenizer chat template; use generate() with plain text")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[PromptType] = []
        for i, conv in enumerate(conversations):
            if not conv or not all(isinstance(m, dict) and "role" in m and "content" in m for m in conv):
                raise RequestError(f"conversation {i}: messages must be a non-empty list of {{'role', 'content'}}")
            ids = self.tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt, tokenize=True)
            if not isinstance(ids, list):  # BatchEncoding in newer transformers
                ids = ids["input_ids"]
            prompts.append({"prompt_token_ids": list(ids)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def get_metrics(self) -> dict[str, Any]:
        """Aggregate speculation counters (vLLM names) and the draft / verify / rest time split."""
        return self.engine.metrics()
