"""Engine steps under torch.no_grad (before) against torch.inference_mode (now)."""
import types

import torch
from cpu_ab import swapped

from blockspec.engine.engine import Engine


def arms(llm):
    engine = llm.engine
    undecorated = Engine.step.__wrapped__

    def under(mode):
        def step(self):
            with mode():
                return undecorated(self)
        return lambda: swapped([(engine, "step", types.MethodType(step, engine))])

    return {"no_grad": under(torch.no_grad), "inference_mode": under(torch.inference_mode)}
