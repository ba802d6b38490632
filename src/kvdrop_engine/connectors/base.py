"""The engine's connector contract: :class:`KVConnector`, an ABC with declared defaults.

vLLM's ``KVConnectorBase`` shape: a connector is built with the :class:`QueryCapture` it serves
(which queries the engine keeps for the policies), and ``bind`` once registers the model's
layouts. Optional abilities are declared members with defaults, never probed: a connector that
stores query windows sets ``stores_windows`` and overrides :meth:`KVConnector.store_window`;
one that can tell cached query prefixes overrides :meth:`KVConnector.lookup_queries`.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import torch
from torch import Tensor

from kvdrop_engine.model import ModelConfig
from kvdrop_sdk.errors import SDKError
from kvdrop_sdk.query_capture import QueryCapture
from kvdrop_sdk.window import QueryWindow, TokenScores

__all__ = ["KVConnector"]


def check_server_args(model_name: object, transfer_query: object) -> None:
    """Check what every connector to a cache server takes: the model's name and the
    ``transfer_query`` switch (None follows the server). Raises ValueError saying which."""
    if not isinstance(model_name, str) or not model_name:
        raise ValueError(f"model_name must be a non-empty str, got {model_name!r}")
    if transfer_query is not None and not isinstance(transfer_query, bool):
        raise ValueError(f"transfer_query must be a bool or None, got {transfer_query!r}")


class KVConnector(abc.ABC):
    """What the engine needs from a KV-cache connector (``ServerConnector``, ``LMCacheConnector``).

    ``chunk_size`` and ``transfer_query`` are known after :meth:`bind`; ``queries`` is the
    capture the connector was built for; ``store_decoded`` asks the engine to store, at the end
    of a request, the KV of the whole chunks its generated tokens completed.
    """

    #: Whether :meth:`store_window` stores query windows (else every prompt query goes in chunks).
    stores_windows: bool = False
    #: Whether :meth:`store_scores` stores the reconstruction pass's per-token scores (kvzip).
    stores_scores: bool = False

    def __init__(self, queries: QueryCapture, *, store_decoded: bool = False) -> None:
        if not isinstance(queries, QueryCapture):
            raise ValueError(f"queries must be a QueryCapture, got {type(queries).__name__}")
        if not isinstance(store_decoded, bool):
            raise ValueError(f"store_decoded must be a bool, got {store_decoded!r}")
        self.queries = queries
        self.store_decoded = store_decoded
        self.chunk_size = 0
        self.transfer_query = False

    @property
    def query_capture(self) -> str:
        """ "full" (every prompt query in chunks) or "window" (the lean window)."""
        return "full" if self.queries.full else "window"

    @property
    def query_window(self) -> int:
        """W: the last positions a request's query window keeps."""
        return self.queries.window

    @property
    def query_stride(self) -> int:
        """S of the window's strided sample (0 = none)."""
        return self.queries.stride

    @abc.abstractmethod
    def bind(
        self, config: ModelConfig, dtype: torch.dtype, *, device: torch.device | None = None
    ) -> None:
        """Register the model's KV (and query) layout; called once by the engine. ``device``:
        where the engine's cache lives (a connector may load prefixes straight there)."""

    @abc.abstractmethod
    def load(self, tokens: Sequence[int], cache_salt: str = "") -> Tensor | None:
        """KV ``[2, L, T, Hkv*d]`` of the longest cached chunk-aligned prefix, or None."""

    @abc.abstractmethod
    def store(
        self,
        kv: Tensor,
        queries: Tensor | None,
        tokens: Sequence[int],
        cache_salt: str = "",
        *,
        query_offset: int = 0,
    ) -> int:
        """Store whole chunks of ``kv`` (and ``queries`` ``[1, L, T - query_offset, Hq*d]`` of
        tokens ``query_offset..``, the cached query prefix completing them) under ``tokens``;
        returns how many query tokens were stored."""

    def lookup_queries(self, tokens: Sequence[int], cache_salt: str = "") -> int:
        """Length of the longest cached chunk-aligned query prefix of ``tokens`` (default 0)."""
        return 0

    def store_window(
        self, tokens: Sequence[int], window: QueryWindow, cache_salt: str = ""
    ) -> bool:
        """Store the query window of the call over ``tokens`` (only where ``stores_windows``)."""
        raise SDKError(f"{type(self).__name__} does not store query windows")

    def store_scores(
        self, tokens: Sequence[int], scores: TokenScores, cache_salt: str = ""
    ) -> bool:
        """Store the reconstruction scores of the call over ``tokens`` (only where
        ``stores_scores``)."""
        raise SDKError(
            f"{type(self).__name__} does not store reconstruction scores (kvzip): they need a "
            "kvdrop server's window store"
        )

    def close(self) -> None:  # noqa: B027 (a declared default, not a forgotten abstract)
        """Release the connector's contexts (default: nothing to release)."""

    def __enter__(self) -> KVConnector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
