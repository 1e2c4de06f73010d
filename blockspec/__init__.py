"""blockspec: block-parallel speculative decoding (DFlash, DSpark), exact on the device.

The names below load on first use (PEP 562), so `import blockspec.cli` loads no torch until a command runs."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from blockspec.config import ConfigError, SpeculativeConfig
    from blockspec.llm import LLM
    from blockspec.request import CompletionOutput, RequestOutput
    from blockspec.sampling_params import SamplingError, SamplingParams

_HOMES = {"ConfigError": "blockspec.config", "SpeculativeConfig": "blockspec.config", "LLM": "blockspec.llm",
          "CompletionOutput": "blockspec.request", "RequestOutput": "blockspec.request",
          "SamplingError": "blockspec.sampling_params", "SamplingParams": "blockspec.sampling_params"}

__all__ = ["LLM", "SamplingParams", "SpeculativeConfig", "RequestOutput", "CompletionOutput", "ConfigError",
           "SamplingError"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'blockspec' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
