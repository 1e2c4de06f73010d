"""DSpark's budget with the confidences read once and the survival, threshold and calibration done as host
arithmetic (the tree) against the tensor ops before it: survival by `torch.cumprod(...).tolist()`, the
calibration's sums as device tensor ops a step."""
import dataclasses
import functools

import torch
from cpu_ab import swapped

from blockspec.demo import continued_prompts, heldout_prompts
from blockspec.sampling_params import SamplingParams
from blockspec.speculative.confidence import StepCostTable, schedule_prefixes
from blockspec.speculative.proposer import profile_verify


def tensor_ops(prop, confidence, lens):
    """The budget as it ran before: tensor survival read to the host, calibration left to the device sums."""
    if prop.cost_table is None:
        prop.cost_table = StepCostTable(functools.partial(profile_verify, prop.runner), prop.num_speculative_tokens + 1)
    survival = torch.cumprod(confidence.float(), dim=1).tolist()
    lens = schedule_prefixes(survival, lens, prop.cost_table)
    prop.budget_history.append(sum(lens))
    return lens, None


def arms(llm):
    prop = llm.engine.proposer
    on = dataclasses.replace(prop.cfg, adaptive_verification=True)
    with swapped([(prop, "cfg", on)]):  # profile the verify forward before any timed unit
        llm.generate(continued_prompts(llm, heldout_prompts(2), 1), SamplingParams(temperature=0, max_tokens=32),
                     use_tqdm=False)
    return {"host": lambda: swapped([(prop, "cfg", on)]),
            "tensor_ops": lambda: swapped([(prop, "cfg", on),
                                           (prop, "_confident_lengths", functools.partial(tensor_ops, prop))])}
