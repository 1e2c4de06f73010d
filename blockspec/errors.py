"""The errors a user can cause (bad config, checkpoint, sampling value or request): reported as one
clear line by the CLI and as a 400 by the server, never as a stack trace."""

from __future__ import annotations

import json

from blockspec.config import ConfigError
from blockspec.sampling_params import SamplingError


class ModelLoadError(ValueError):
    """A checkpoint is missing, malformed or does not fit; the message names the path and the problem."""


class RequestError(ValueError):
    """A request cannot be served as given (empty, too long, ids outside the vocabulary)."""


class ConversationError(RequestError):
    """A chat conversation cannot be rendered: its messages, or the chat template on them (the server's 400
    names `messages`)."""


class ConstraintError(RequestError):
    """A request's structured-output constraint cannot be compiled: `reason` says why in one line, the
    message names the request too."""

    reason = ""

    @classmethod
    def of(cls, where: str, reason: str) -> ConstraintError:
        exc = cls(f"{where}: structured_outputs: {reason}")
        exc.reason = reason
        return exc


class RanksParted(RuntimeError):
    """A tensor-parallel step failed on some ranks but not on all (one device out of memory): the ranks no longer
    step in lockstep, so none can go on and the LLM's ranks are closed (a new LLM starts them again)."""


USER_ERRORS: tuple[type[Exception], ...] = (ConfigError, ModelLoadError, SamplingError, RequestError,
                                            json.JSONDecodeError, FileNotFoundError)
