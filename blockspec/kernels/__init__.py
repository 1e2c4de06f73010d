"""Every Triton kernel of blockspec, each with a PyTorch reference its tests hold it to: the decoder's
ops (`ops`), paged attention (`attention`), Gumbel-max sampling (`gumbel`), acceptance by token match
(`accept`), DSpark's greedy Markov drafting (`markov`) and the mixture-of-experts MLP (`moe`).

Without the triton package (CPU-only installs) `triton` is None and callers take the references.
"""

from __future__ import annotations

import functools

try:
    import triton
except ImportError:  # CPU-only installs: the reference paths are used
    triton = None


@functools.cache
def triton_available() -> bool:
    return triton is not None
