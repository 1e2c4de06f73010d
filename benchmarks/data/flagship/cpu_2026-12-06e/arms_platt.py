"""DSpark's budget with the confidence head as it is against per-position Platt scaling fitted on 48 other
held-out prompts (confidence_fit.py over the samples of confidence_samples.py)."""
import dataclasses

import torch
from cpu_ab import swapped

from blockspec.demo import continued_prompts, heldout_prompts
from blockspec.sampling_params import SamplingParams

A = [1.39, 1.42, 1.21, 1.15, 1.40, 1.03, 0.84, 1.16]
B = [-0.16, 0.04, 0.34, 0.60, 0.58, 0.70, 0.97, 0.88]


def arms(llm):
    prop = llm.engine.proposer
    on = dataclasses.replace(prop.cfg, adaptive_verification=True)
    with swapped([(prop, "cfg", on)]):
        llm.generate(continued_prompts(llm, heldout_prompts(2), 1), SamplingParams(temperature=0, max_tokens=32),
                     use_tqdm=False)
    a, b = torch.tensor(A), torch.tensor(B)
    original = prop._confident_lengths

    def platt(confidence, lens):
        k = confidence.shape[1]
        logit = torch.logit(confidence.float().clamp(1e-6, 1 - 1e-6))
        return original(torch.sigmoid(a[:k] * logit + b[:k]), lens)

    return {"budget": lambda: swapped([(prop, "cfg", on)]),
            "budget_platt": lambda: swapped([(prop, "cfg", on), (prop, "_confident_lengths", platt)])}
