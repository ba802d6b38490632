"""What a request stream's context can do beyond the shape every context has (``kind``,
``chunk_size``, ``retrieve``, ``store``, ``lookup``), declared as types.

A kvdrop :class:`~kvdrop_sdk.context.Context` declares all of them; another SDK's context
(``lmcache.sdk``'s, wrapped by :class:`~kvdrop_sdk.foreign.ForeignContext`) none. The stream
and its helpers test these with ``isinstance`` (never by probing attributes), so a new kind of
context says what it offers in one place.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvdrop_sdk.cache_kind import CacheKind
from kvdrop_sdk.layout import CacheLayout
from kvdrop_sdk.query_capture import QueryCapture

if TYPE_CHECKING:
    from kvdrop_sdk.keep import KeepPlan

__all__ = [
    "CheapLookup",
    "KeepsOnServer",
    "KnowsLayout",
    "StoresRecords",
    "StreamContext",
    "TransfersToDevice",
]


class StreamContext(abc.ABC):
    """The shape every context of a request stream has: one cache ``kind`` in chunks of
    ``chunk_size`` tokens, ``retrieve`` / ``store`` / ``lookup`` by token ids and salt."""

    kind: CacheKind
    chunk_size: int

    @abc.abstractmethod
    def retrieve(self, tokens: Sequence[int], cache_salt: str = "") -> torch.Tensor | None: ...

    @abc.abstractmethod
    def store(self, tensor: torch.Tensor, tokens: Sequence[int], cache_salt: str = "") -> bool: ...

    @abc.abstractmethod
    def lookup(self, tokens: Sequence[int], cache_salt: str = "") -> int: ...


class KnowsLayout(abc.ABC):
    """Knows the registered layout of its model and kind (shapes, dtype, RoPE), and can read it
    again (the engine may register RoPE after the context first read it)."""

    @property
    @abc.abstractmethod
    def layout(self) -> CacheLayout: ...

    @abc.abstractmethod
    def register_caches(self) -> CacheLayout: ...


class CheapLookup(abc.ABC):
    """``lookup`` is one small call (no tensor moves), and what ``store`` stored is served when
    it returns: poll by looking up, never wait for a store to become visible."""

    @abc.abstractmethod
    def lookup(self, tokens: Sequence[int], cache_salt: str = "") -> int: ...


class StoresRecords(KnowsLayout):
    """Holds per-call records beside the chunks (query windows and token scores,
    :mod:`kvdrop_sdk.window`, decoded with its layout), and knows what the engine captures of
    the queries (``capture``: a stream reads only what is stored)."""

    kind: CacheKind
    server_model_name: str
    capture: QueryCapture

    @staticmethod
    @abc.abstractmethod
    def encode(tokens: Sequence[int]) -> bytes:
        """The wire form of ``tokens`` (validated)."""

    @abc.abstractmethod
    def record_call(
        self,
        op: str,
        tokens: bytes,
        cache_salt: str,
        fields: Mapping[str, Any],
        frames: Sequence[Any] = (),
    ) -> tuple[dict[str, Any], list[Any]]:
        """One call ``op`` on the record store for the call over ``tokens`` (encoded)."""


class TransfersToDevice(abc.ABC):
    """``retrieve(..., device=)`` returns the tensor on a device, and ``store`` takes a device
    tensor: between a GPU and the server's shared memory by DMA where the memory can be
    page-locked (:mod:`kvdrop_sdk.transport.cuda_host`), else through the host."""

    @abc.abstractmethod
    def retrieve(
        self,
        tokens: Sequence[int],
        cache_salt: str = "",
        request_configs: dict[str, object] | None = None,
        *,
        device: torch.device | str | None = None,
    ) -> torch.Tensor | None: ...


class KeepsOnServer(abc.ABC):
    """Its server applies an index-only edit itself (:mod:`kvdrop_sdk.keep`): ``keep`` stores
    the kept rows of a cached prefix under the kept tokens and ``dst_salt`` without the KV
    leaving the server, and ``retrieve_keys`` fetches only the keys (``[1, L, T, D]``).
    ``keep_rows`` does the same with the kept keys re-rotated in this process (on the edit's
    device) and the values gathered by index in the server's shared memory, where
    ``client_keep`` says this process maps it."""

    @property
    @abc.abstractmethod
    def client_keep(self) -> bool: ...

    @abc.abstractmethod
    def keep_rows(
        self,
        tokens: Sequence[int],
        plan: KeepPlan,
        cache_salt: str = "",
        *,
        dst_salt: str,
        device: torch.device | str | None = None,
        keys: torch.Tensor | None = None,
    ) -> tuple[bool, int]: ...

    @abc.abstractmethod
    def keep(
        self, tokens: Sequence[int], plan: KeepPlan, cache_salt: str = "", *, dst_salt: str
    ) -> bool: ...

    @abc.abstractmethod
    def retrieve_keys(
        self,
        tokens: Sequence[int],
        cache_salt: str = "",
        *,
        device: torch.device | str | None = None,
    ) -> torch.Tensor | None: ...
