"""Plain greedy decoding with the target head's ids screened through a bfloat16 copy of the head
(`cpu_linear.ScreenedGreedy`, the speculative verify's; exact: the float32 argmax's ids) at every row count,
one row included, against the float32 head (one row on `F.linear`, more from the packed float32 copy)."""
import contextlib

import torch
from cpu_ab import swapped

from blockspec.models.cpu_linear import PackedProduct, ScreenedGreedy
from blockspec.models.runner import ModelRunner


def arms(llm):
    runner = llm.engine.runner
    head = llm.engine.model.lm_head.weight
    screen = ScreenedGreedy(head, PackedProduct(head, torch.bfloat16))
    plain_ids = ModelRunner.greedy_ids

    def screened_ids(hidden, max_bytes=1 << 28):
        ids = screen(hidden.reshape(-1, hidden.shape[-1]))
        return ids.view(hidden.shape[:-1]) if ids is not None else plain_ids(runner, hidden, max_bytes)

    return {"float32_head": contextlib.nullcontext,
            "screened_head": lambda: swapped([(runner, "greedy_ids", screened_ids)])}
