"""DSpark's verify budget (Algorithm 1 priced by whole steps: `StepCostTable`) against verifying every draft."""
import contextlib
import dataclasses

from cpu_ab import swapped

from blockspec.demo import continued_prompts, heldout_prompts
from blockspec.sampling_params import SamplingParams


def arms(llm):
    prop = llm.engine.proposer
    on = dataclasses.replace(prop.cfg, adaptive_verification=True)
    with swapped([(prop, "cfg", on)]):  # profile the verify forward before any timed unit
        llm.generate(continued_prompts(llm, heldout_prompts(2), 1), SamplingParams(temperature=0, max_tokens=32),
                     use_tqdm=False)
    t = prop.cost_table
    print({q: round(t.verify[(1, q)] * 1e3, 3) for q in range(1, t.max_rows + 1)}, flush=True)
    return {"every_draft": contextlib.nullcontext, "budget": lambda: swapped([(prop, "cfg", on)])}
