"""Sampling and verification on the device: keyed noise, logits processing, samplers, acceptance rules."""

from blockspec.sample.processors import (CHUNK_ELEMS, Columns, Features, RowParams, bad_rows, expand_history,
                                         features, needs_full_processing, process_logits)
from blockspec.sample.rng import (STREAM_ACCEPT, STREAM_DRAFT, STREAM_RESIDUAL, STREAM_TARGET, gumbel,
                                  keyed_uniform)
from blockspec.sample.sampler import greedy_ids, logprobs, sample, sample_draft, sample_processed
from blockspec.sample.verify import verify_block, verify_greedy, verify_sample_and_match, verify_standard

__all__ = [
    "CHUNK_ELEMS", "Columns", "Features", "RowParams", "STREAM_ACCEPT", "STREAM_DRAFT", "STREAM_RESIDUAL",
    "STREAM_TARGET", "bad_rows", "expand_history", "features", "greedy_ids", "gumbel", "keyed_uniform", "logprobs",
    "needs_full_processing", "process_logits", "sample", "sample_draft", "sample_processed", "verify_block",
    "verify_greedy", "verify_sample_and_match", "verify_standard",
]
