"""blockspec: block-parallel speculative decoding (DFlash, DSpark), exact on the device."""

from blockspec.config import ConfigError, SpeculativeConfig
from blockspec.request import CompletionOutput, RequestOutput
from blockspec.llm import LLM
from blockspec.sampling_params import SamplingError, SamplingParams

__all__ = ["LLM", "SamplingParams", "SpeculativeConfig", "RequestOutput", "CompletionOutput", "ConfigError",
           "SamplingError"]
__version__ = "0.1.0"
