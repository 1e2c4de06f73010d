"""The vanilla Markov loop as torch ops (before 68bb9f9) against NumPy's (shipped)."""
import contextlib
import types

import torch
from cpu_ab import swapped


def torch_loop(self, base_logits, anchor_ids):
    base = base_logits.float()
    prev = anchor_ids.tolist()
    columns = []
    for k in range(base.shape[1]):
        bias = self.bias_rows.take(self.markov_head, prev, self.config.logit_scale)
        column = self.draft_to_target((base[:, k] + bias).max(dim=-1).indices)
        columns.append(column)
        prev = column.tolist()
    return torch.stack(columns, dim=1)


def arms(llm):
    dr = llm.engine.proposer.drafter
    return {"torch": lambda: swapped([(dr, "_draft_greedy_remembered", types.MethodType(torch_loop, dr))]),
            "numpy": contextlib.nullcontext}
