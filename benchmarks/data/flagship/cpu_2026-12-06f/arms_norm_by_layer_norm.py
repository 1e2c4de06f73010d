"""RMSNorm on the CPU as one fused layer norm over [x, -x] (whose mean is zero, so its variance is x's mean
square) against `F.rms_norm`, which the CPU runs as six ops (pow, mean, add, rsqrt, mul, mul)."""
import contextlib

import torch
import torch.nn.functional as F
from cpu_ab import swapped

from blockspec.drafters import backbone
from blockspec.models import layers, moe

_DOUBLED: dict = {}
reference = layers.rms_norm


def doubled(weight):
    key = (weight.data_ptr(), weight._version)
    w2 = _DOUBLED.get(key)
    if w2 is None:
        w2 = _DOUBLED[key] = torch.cat([weight, weight]).detach()
    return w2


def by_layer_norm(x, weight, eps):
    if x.device.type != "cpu" or x.dtype != torch.float32 or (weight is not None and weight.dtype != torch.float32):
        return reference(x, weight, eps)
    n = x.shape[-1]
    return F.layer_norm(torch.cat([x, x.neg()], -1), (2 * n,), None if weight is None else doubled(weight), None,
                        eps)[..., :n]


def arms(llm):
    return {"rms_norm": contextlib.nullcontext,
            "layer_norm": lambda: swapped([(layers, "rms_norm", by_layer_norm), (backbone, "rms_norm", by_layer_norm),
                                           (moe, "rms_norm", by_layer_norm)])}
