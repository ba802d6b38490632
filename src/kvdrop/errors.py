"""Errors of kvdrop policies and the registry: each says what was wrong and what is allowed."""

from __future__ import annotations

__all__ = [
    "MissingQueryError",
    "PolicyConflictError",
    "PolicyInputError",
    "PolicyNotFoundError",
    "PolicyOutputError",
    "PolicyParamError",
    "PolicyWarning",
]


class PolicyParamError(ValueError):
    """A policy parameter has a wrong name, type or range (raised when the factory is called)."""


class PolicyInputError(ValueError):
    """The tensors or tokens handed to an edit function have the wrong shape, dtype or length."""


class PolicyOutputError(ValueError):
    """A policy chose rows that cannot be kept: duplicate, unsorted or out-of-range indices
    (refused before anything is stored; the message names the policy)."""


class MissingQueryError(PolicyInputError):
    """A query-based policy was handed no query tensor."""

    def __init__(self, policy: str) -> None:
        super().__init__(
            f"policy {policy!r} scores tokens with the prefill query tensors, but none were "
            "passed. Start the server with `kvdrop server --enable transfer_query`, connect a "
            "query context (kvdrop_sdk.qcache.connect(...)) and pass both contexts to "
            "create_request(). On LMCache: start `lmcache server ... --enable transfer_query`, "
            'serve vLLM with "lmcache.mp.transfer_intermediate_tensors": true in '
            "kv_connector_extra_config (or kvdrop's engine with --cache-server lmcache) and pass "
            "lmcache.sdk.qcache.connect(...) too. Or pick a KV-only policy (`kvdrop list` shows "
            "which need queries)."
        )


class MissingTokenScoresError(PolicyInputError):
    """A policy that reads the engine's per-token scores (``kvzip``) was handed none."""

    def __init__(self, policy: str) -> None:
        super().__init__(
            f"policy {policy!r} scores tokens with the engine's reconstruction pass "
            "(EditContext.token_scores), but none were passed. It needs kvdrop's reference "
            "engine running that pass after prefill (QueryCapture(scores=True), which "
            "QueryCapture.for_policies turns on for this policy; kvdrop eval and kvdrop demo do "
            "it), a kvdrop server with `--enable transfer_query` (the scores are stored in its "
            "window store) and a query context passed to create_request(). An LMCache server has "
            "no store for these scores: pick another policy there (`knorm` or `keydiff` for "
            "caches compressed before the question is known)."
        )


class PolicyNotFoundError(KeyError):
    """No policy is registered under the requested name."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0])


class PolicyConflictError(RuntimeError):
    """Two sources (distributions or register() calls) claim the same policy name."""


class PolicyWarning(UserWarning):
    """A policy ran, but not as its parameters suggest (e.g. a composition part got no budget)."""
