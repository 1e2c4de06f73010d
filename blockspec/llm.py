"""Offline API shaped like vLLM's: `LLM(model, ...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, Self

from blockspec.assets import embedded
from blockspec.config import ConfigError, EngineArgs, SpeculativeConfig
from blockspec.engine.build import build_engine
from blockspec.engine.loop import OfflineRunner
from blockspec.inputs import PromptType
from blockspec.metrics_reader import Metric, metrics_of
from blockspec.parallel.tp import RankGroup
from blockspec.request import RequestOutput
from blockspec.sampling_params import SamplingParams

log = logging.getLogger("blockspec")


def engine_args(options: dict[str, Any]) -> EngineArgs:
    """`EngineArgs` from LLM's keyword options; an option blockspec does not have (a vLLM one it lacks,
    or a misspelling) is a ConfigError naming it, not a TypeError."""
    known = {f.name for f in dataclasses.fields(EngineArgs) if f.init}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(f"LLM(): blockspec has no option {', '.join(unknown)}; its options: {', '.join(sorted(known))}")
    return EngineArgs(**options)


class LLM:
    """Load a target (and optionally a drafter) once; generate for many prompts in one batch.

    With tensor_parallel_size N the target is split over N rank processes that answer the same calls
    (`blockspec.parallel`); `close()` (or leaving a `with` block) stops them."""

    def __init__(self, model: str | os.PathLike[str], tensor_parallel_size: int = 1, **options: Any) -> None:
        """`options`: the fields of `blockspec.config.EngineArgs` (tokenizer, dtype, device, max_model_len,
        seed, speculative_config, max_num_seqs, ...), by name."""
        args = engine_args(options)
        served = args.served_model_name
        self.model_name = served if isinstance(served, str) else served[0] if served else str(model)  # metrics' label
        model = embedded(str(model))  # 'default': the embedded target
        for note in args.unhonoured():
            log.warning(note)
        self.tensor_parallel_size = tensor_parallel_size
        self.engine = self.ranks = None
        # one call drives the engine (or the ranks' pipe) at a time: calls from other threads wait their turn
        # (two at once stepped one engine from both, committing each step's tokens twice)
        self._driving = threading.Lock()
        if tensor_parallel_size == 1:
            setup = build_engine(model, args)
            self.engine, self.inputs, self.model = setup.engine, setup.inputs, setup.model
            self.speculative_config = setup.speculative_config
            self._runner = OfflineRunner(self.engine)
        else:
            self.ranks = RankGroup(model, args, tensor_parallel_size)
            self.inputs = self.ranks.inputs
            self.speculative_config = SpeculativeConfig.from_user(args.speculative_config)
        self.model_dir, self.tokenizer = self.inputs.model_dir, self.inputs.tokenizer
        if self.inputs.sampling_defaults:
            log.warning("default sampling parameters from generation_config.json (generation_config=%r): %s; "
                        "generation_config='vllm' ignores the file", args.generation_config,
                        ", ".join(f"{k}={v}" for k, v in self.inputs.sampling_defaults.items()))

    def get_tokenizer(self) -> Any:
        """The Hugging Face tokenizer prompts are encoded with (None for a model directory without one)."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() and chat() decode with when given no SamplingParams: generation_config.json's
        sampling values (unless generation_config='vllm') over SamplingParams' defaults."""
        return self.inputs.default_sampling_params()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: None = None,
        priority: Sequence[int] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate for all prompts as one batch; outputs come back in prompt order (`use_tqdm`: a progress
        bar, or the bar's class, as vLLM takes it). `lora_request` and `priority` are vLLM's, taken where
        they ask for nothing: no adapter, equal priorities; `tokenization_kwargs` too (`truncate_prompt_tokens`,
        where current vLLM takes it, for every prompt).

        Every prompt and parameter is checked before any work starts, so one bad prompt cannot
        cost the others their results.
        """
        if lora_request is not None:
            raise ConfigError("lora_request: blockspec serves no LoRA adapters; merge the adapter into the model")
        if priority is not None and any(p != 0 for p in priority):
            raise ConfigError("priority: blockspec schedules requests first come, first served; give none, or 0 "
                              "for every prompt")
        prepared, params = self.inputs.prepare(prompts, self._truncating(sampling_params, tokenization_kwargs))
        with self._driving:
            if self.ranks is not None:
                return self.ranks.call("run", prepared, params, use_tqdm=use_tqdm)
            return self._runner.run(prepared, params, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template (the tokenizer's, or `chat_template`: Jinja text or a file) to one
        conversation or a list of them, then generate; the arguments in vLLM's order. `chat_template_kwargs`
        are the template's extra variables, e.g. {"enable_thinking": False} for Qwen3. `continue_final_message`
        (with add_generation_prompt=False): the model continues the last message, e.g. a reply's first words.
        `tools`: function definitions (OpenAI's form) the template shows the model, as vLLM's chat takes them;
        the reply is text (the server's tool_choice parses calls out of it). `lora_request`,
        `chat_template_content_format`, `tokenization_kwargs` and `mm_processor_kwargs` are vLLM's, taken where
        they ask for nothing blockspec lacks (text content is given to the template as text: "auto" or
        "string"; tokenization_kwargs as `generate` takes them)."""
        if chat_template_content_format not in ("auto", "string"):
            raise ConfigError(f"chat_template_content_format {chat_template_content_format!r}: blockspec gives "
                              "text content to the template as a string; allowed: 'auto', 'string'")
        if mm_processor_kwargs is not None:
            raise ConfigError("mm_processor_kwargs: blockspec serves text models; give none")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise ConfigError(f"chat_template_kwargs must be a dict of the template's variables or None, got "
                              f"{type(chat_template_kwargs).__name__}")
        if tools is not None and not (isinstance(tools, (list, tuple)) and all(isinstance(t, dict) for t in tools)):
            raise ConfigError("tools must be a list of tool definitions (dicts, OpenAI's form) or None, got "
                              f"{type(tools).__name__}")
        if tools is not None:
            chat_template_kwargs = {**(chat_template_kwargs or {}), "tools": tools}
        prompts = self.inputs.chat_prompts(messages, add_generation_prompt, chat_template, chat_template_kwargs,
                                           continue_final_message)
        return self.generate(prompts, sampling_params, use_tqdm, lora_request, tokenization_kwargs=tokenization_kwargs)

    def _truncating(self, sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                    tokenization_kwargs: dict[str, Any] | None) -> SamplingParams | Sequence[SamplingParams] | None:
        """The parameters with vLLM's tokenization_kwargs applied: `truncate_prompt_tokens` (keep a prompt's last k
        tokens), the one key blockspec takes; a SamplingParams asking otherwise is refused."""
        if not tokenization_kwargs:
            return sampling_params
        if not isinstance(tokenization_kwargs, dict) or set(tokenization_kwargs) != {"truncate_prompt_tokens"}:
            raise ConfigError(f"tokenization_kwargs {sorted(tokenization_kwargs)}: blockspec takes "
                              "truncate_prompt_tokens only (the tokenizer's other options are the model's)")
        keep = tokenization_kwargs["truncate_prompt_tokens"]

        def truncated(p: SamplingParams) -> SamplingParams:
            if p.truncate_prompt_tokens not in (None, keep):
                raise ConfigError(f"tokenization_kwargs truncate_prompt_tokens={keep} and SamplingParams."
                                  f"truncate_prompt_tokens={p.truncate_prompt_tokens} disagree; give one of them")
            return dataclasses.replace(p, truncate_prompt_tokens=keep)

        given = sampling_params if sampling_params is not None else self.get_default_sampling_params()
        return truncated(given) if isinstance(given, SamplingParams) else [truncated(p) for p in given]

    def get_stats(self) -> dict[str, Any]:
        """The engine's counters as a dict: speculation (vLLM's names), the draft-length policy's choices
        (`policy_steps`: decode steps by the number of drafts verified, 0 = plain), the draft / verify /
        rest time split, tokens, preemptions."""
        with self._driving:
            return self.ranks.call("metrics") if self.ranks is not None else self.engine.metrics()

    def reset_prefix_cache(self) -> bool:
        """Forget every remembered KV page (vLLM's): later prompts prefill in full until pages are remembered
        again; pages running requests hold stay theirs. False where prefix caching is off."""
        with self._driving:
            return self.ranks.call("reset_prefix_cache") if self.ranks is not None else self.engine.reset_prefix_cache()

    def get_metrics(self) -> list[Metric]:
        """The counters as vLLM's `LLM.get_metrics()` gives them: Counter, Gauge and Vector objects named
        `vllm:...` (`vllm:spec_decode_num_drafts`, `vllm:spec_decode_num_accepted_tokens_per_pos`, ...),
        and the policy's choices as `blockspec:spec_decode_policy_steps` by draft_length."""
        return metrics_of(self.get_stats(), self.model_name, self.speculative_config is not None)

    def close(self) -> None:
        """Stop the rank processes of a tensor-parallel LLM (nothing to do for one process)."""
        if self.ranks is not None:
            self.ranks.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
