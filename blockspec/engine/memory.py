"""The KV pages an engine holds: planned once at start-up from the GPU's free memory (or the user's
count), refused with the numbers when they cannot hold one sequence of max_model_len."""

from __future__ import annotations

from typing import Any

import torch

from blockspec.config import ConfigError, EngineConfig, SpeculativeConfig
from blockspec.models.kv_cache import PageTable, kv_storage_dtype
from blockspec.models.llama import CausalLM
from blockspec.models.quant import Fp8Linear
from blockspec.speculative.proposer import draft_length


def cache_extent(config: EngineConfig, spec: SpeculativeConfig | None, drafter: Any) -> tuple[int, int]:
    """(margin, positions a slot's page table covers): verify rows reach past the committed length
    by the draft length (the margin), the drafter's block past its context; every cache and the
    page table leave room for them."""
    if spec is None or drafter is None:
        return 1, config.max_model_len + 1
    margin = draft_length(spec, drafter) + 1
    return margin, config.max_model_len + max(margin, drafter.block_size + 1)


def plan_pages(model: CausalLM, drafter: Any, config: EngineConfig, table_len: int) -> int:
    """KV pages to allocate: `num_kv_pages` if given; on a GPU what `gpu_memory_utilization` leaves
    after the weights and a reserve for activations, at most what max_num_seqs x max_model_len can
    use; on the CPU that most. Refuses, with the numbers, a plan that cannot hold one sequence
    of max_model_len, instead of failing inside an allocation or mid-request."""
    size = config.kv_page_size
    dtype = model.embed_tokens.weight.dtype
    kv = kv_storage_dtype(config.kv_cache_dtype, dtype)
    per_page = model.page_bytes(size, kv) + (drafter.page_bytes(size, kv) if drafter is not None else 0)
    per_seq = PageTable.columns_for(table_len, size)
    most = config.max_num_seqs * per_seq
    if config.num_kv_pages is not None:
        return check_plan(config.num_kv_pages, per_seq, per_page, config)
    device = model.embed_tokens.weight.device
    if device.type != "cuda":
        return most
    itemsize = dtype.itemsize
    mc = model.config
    # a prefill chunk's activations (residual, norms, qkv, MLP), greedy logits, graph pools and cuBLAS,
    # the outputs the prefill graphs share (hidden rows and taps), the drafter's held taps
    reserve = config.max_prefill_tokens * (8 * mc.hidden_size + 3 * mc.intermediate_size) * itemsize + (3 << 29)
    # an FP8 product over more rows than kernels.fp8.MULTIROW_MAX_ROWS dequantizes its weight first
    reserve += max((m.weight.numel() * itemsize for m in model.modules() if isinstance(m, Fp8Linear)), default=0)
    tap_width = drafter.feature_width if drafter is not None else 0
    reserve += min(config.graph_prefill_tokens, config.max_prefill_tokens) * (mc.hidden_size + tap_width) * itemsize
    if drafter is not None:
        reserve += (config.max_num_seqs + 1) * (drafter.block_size + 1) * tap_width * itemsize
    free, total = torch.cuda.mem_get_info(device)
    budget = config.gpu_memory_utilization * total - (total - free) - reserve
    return check_plan(min(most, max(0, int(budget // per_page)) - 1), per_seq, per_page, config,
                      budget=(budget, total, total - free, reserve))


def check_plan(pages: int, per_seq: int, per_page: int, config: EngineConfig,
               budget: tuple[float, int, int, int] | None = None) -> int:
    """`pages` if they hold one sequence of max_model_len (`per_seq` pages), else a ConfigError with
    the numbers. `budget` = (bytes left for pages, the card's total, in use, reserved for
    activations) when the count came from the GPU's memory; None when the user gave it."""
    if pages >= per_seq:
        return pages
    gib = 1 << 30
    size = config.kv_page_size
    if budget is None:
        raise ConfigError(f"num_kv_pages={pages} ({pages * size} positions of kv_page_size={size}) cannot hold one "
                          f"sequence of max_model_len={config.max_model_len}, which needs {per_seq} pages (a slot "
                          "also holds the positions a step writes past the context: the next token, and with a "
                          f"drafter its verify rows and block): num_kv_pages >= {per_seq}, or a lower max_model_len")
    left, total, used, reserve = budget
    raise ConfigError(
        f"one sequence of max_model_len={config.max_model_len} needs {per_seq} KV pages "
        f"({per_seq * per_page / gib:.2f} GiB), but {max(left, 0) / gib:.2f} GiB are left of "
        f"gpu_memory_utilization={config.gpu_memory_utilization} x {total / gib:.1f} GiB after the weights "
        f"({used / gib:.1f} GiB in use) and {reserve / gib:.1f} GiB for activations: lower max_model_len or "
        f"raise gpu_memory_utilization")
