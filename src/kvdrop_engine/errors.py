"""The engine's error types (a light module: the CLI raises them before torch is imported)."""

from __future__ import annotations

__all__ = [
    "EngineError",
    "EngineSetupError",
    "InvalidRequestError",
    "PolicyFailedError",
    "RequestTooLargeError",
]


class EngineError(RuntimeError):
    """The engine failed to serve a request (stopped, model or connector error)."""


class InvalidRequestError(EngineError, ValueError):
    """A request's prompt or sampling parameters are invalid; the message says what is expected."""


class RequestTooLargeError(InvalidRequestError):
    """A request needs more KV blocks than the engine's whole budget; it could never be admitted."""


class PolicyFailedError(EngineError):
    """A drop policy failed on one request's prompt (it raised, or chose rows that cannot be
    kept); the message names the policy. Only that request fails, before its blocks change."""


class EngineSetupError(ValueError):
    """The flags do not describe a model/engine that can be started; the message says what to
    fix."""
