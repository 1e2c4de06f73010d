"""The three trims together: the engine before them (the three swaps of the other arms files) against shipped."""
import contextlib
import importlib.util
import types
from pathlib import Path

from cpu_ab import swapped


def _load(name):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def arms(llm):
    markov, qk, append = _load("arms_markov"), _load("arms_qk"), _load("arms_append")
    dr, g = llm.engine.proposer.drafter, llm.engine.proposer.graphs
    shipped_append = type(g)._append
    before = ([(dr, "_draft_greedy_remembered", types.MethodType(markov.torch_loop, dr)),
               (g, "_append", types.MethodType(lambda self, control, rows=None: shipped_append(self, control, None), g))]
              + qk.swaps(llm))
    return {"old3": lambda: swapped(before), "new3": contextlib.nullcontext}
