"""Offline API shaped like vLLM's: `LLM(model, ...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Self

from blockspec.config import EngineArgs, SpeculativeConfig
from blockspec.engine.build import build_engine
from blockspec.engine.loop import OfflineRunner
from blockspec.inputs import PromptType
from blockspec.parallel.tp import RankGroup
from blockspec.request import RequestOutput
from blockspec.sampling_params import SamplingParams


class LLM:
    """Load a target (and optionally a drafter) once; generate for many prompts in one batch.

    With tensor_parallel_size N the target is split over N rank processes that answer the same calls
    (`blockspec.parallel`); `close()` (or leaving a `with` block) stops them."""

    def __init__(self, model: str | os.PathLike[str], tensor_parallel_size: int = 1, **options: Any) -> None:
        """`options`: the fields of `blockspec.config.EngineArgs` (tokenizer, dtype, device, max_model_len,
        seed, speculative_config, max_num_seqs, ...), by name."""
        args = EngineArgs(**options)
        self.tensor_parallel_size = tensor_parallel_size
        self.engine = self.ranks = None
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
        prepared, params = self.inputs.prepare(prompts, sampling_params)
        if self.ranks is not None:
            return self.ranks.call("run", prepared, params, use_tqdm=use_tqdm)
        return self._runner.run(prepared, params, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them, then generate."""
        return self.generate(self.inputs.chat_prompts(messages, add_generation_prompt), sampling_params, use_tqdm)

    def get_metrics(self) -> dict[str, Any]:
        """Aggregate speculation counters (vLLM names) and the draft / verify / rest time split."""
        return self.ranks.call("metrics") if self.ranks is not None else self.engine.metrics()

    def close(self) -> None:
        """Stop the rank processes of a tensor-parallel LLM (nothing to do for one process)."""
        if self.ranks is not None:
            self.ranks.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
