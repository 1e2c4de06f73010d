"""The errors a user can cause (bad config, checkpoint, sampling value or request): reported as one
clear line by the CLI and as a 400 by the server, never as a stack trace."""

from __future__ import annotations

import json

from blockspec.config import ConfigError
from blockspec.engine.engine import RequestError
from blockspec.models.loader import ModelLoadError
from blockspec.sampling_params import SamplingError

USER_ERRORS: tuple[type[Exception], ...] = (ConfigError, ModelLoadError, SamplingError, RequestError,
                                            json.JSONDecodeError, FileNotFoundError)
