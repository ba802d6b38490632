"""A connection to one kvdrop server for one model and one cache kind.

The context reads the server's settings over HTTP (``/config``), the model's layout over ZMQ, and
moves tensors through its transfer helper (``transfer_ctx``: shared memory or socket). It is safe
to share between threads: each call borrows its own socket.

A server that restarts (same address, same ``--shm-name``) is followed: the first call that meets
the new instance (a reply from it, or its "unregistered"/"layout_changed" answer) re-reads
``/config``, re-maps the new shared-memory segment, registers the layout again if this context
registered one, checks that the layout did not change, and is retried once. Calls made while the
server is down fail after ``timeout`` seconds with an SDKError. Closing is never needed for
correctness: an unclosed context is freed by the garbage collector without blocking.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

import requests
import torch

from kvdrop_rope import RopeConfig, rerotate_rows
from kvdrop_sdk.cache_kind import CacheKind
from kvdrop_sdk.capabilities import (
    CheapLookup,
    KeepsOnServer,
    StoresRecords,
    StreamContext,
    TransfersToDevice,
)
from kvdrop_sdk.edit import ModifyFnType
from kvdrop_sdk.errors import (
    CacheKindError,
    SDKError,
    ServerRestartedError,
    ServerUnavailableError,
)
from kvdrop_sdk.hashing import TOKEN_BYTES, encode_tokens
from kvdrop_sdk.keep import KeepPlan, decode_index, encode_index
from kvdrop_sdk.layout import CacheLayout, dtype_name
from kvdrop_sdk.protocol import RpcClient, RpcError, check_salt, server_hint
from kvdrop_sdk.query_capture import UPSTREAM_CAPTURE, QueryCapture
from kvdrop_sdk.transport.contiguous import MODES, ContiguousTransferWrapper, stored_chunks
from kvdrop_sdk.validate import edit_device, is_number, tensor_problem

__all__ = ["Context", "ModifyFnType", "connect"]

T = TypeVar("T")
#: Error codes that mean "this server does not know what the context assumes": re-synchronise.
_RESYNC_CODES = ("unregistered", "layout_changed")


class Context(StreamContext, CheapLookup, StoresRecords, TransfersToDevice, KeepsOnServer):
    """One server connection for ``model_name`` and ``kind``; see ``connect``."""

    def __init__(
        self,
        url: str,
        http_url: str,
        model_name: str,
        kind: CacheKind | str = CacheKind.KV,
        timeout: float = 60.0,
        *,
        layout: CacheLayout | None = None,
        transport: str = "auto",
        capture: QueryCapture | None = None,
    ) -> None:
        if isinstance(url, enum.Enum):
            raise SDKError(
                "Context takes (url, http_url, model_name, kind=CacheKind.KV, timeout=60.0), as "
                f"upstream's LMCacheSDKContext; got the cache kind {url!r} first (connect(kind, "
                "url, ...) is the function that takes the kind first)"
            )
        try:
            self.kind = CacheKind.parse(kind)
        except ValueError as exc:
            raise SDKError(str(exc)) from None
        if not isinstance(url, str) or not url.startswith("tcp://"):
            raise SDKError(f"url must look like tcp://HOST:PORT (the server's --port), got {url!r}")
        if not isinstance(http_url, str) or not http_url.startswith(("http://", "https://")):
            raise SDKError(
                f"http_url must look like http://HOST:PORT (the server's --http-port), "
                f"got {http_url!r}"
            )
        if not isinstance(model_name, str) or not model_name:
            raise SDKError(f"model_name must be a non-empty string, got {model_name!r}")
        if not is_number(timeout) or timeout <= 0:
            raise SDKError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if transport not in MODES:
            raise SDKError(f"transport {transport!r} is unknown; expected one of {MODES}")
        if layout is not None and not isinstance(layout, CacheLayout):
            raise SDKError(f"layout must be a CacheLayout, got {type(layout).__name__}")
        if capture is not None and not isinstance(capture, QueryCapture):
            raise SDKError(f"capture must be a QueryCapture, got {type(capture).__name__}")
        #: What the engine stores of the queries (a QUERY context's reads follow it); not told:
        #: upstream's full queries in chunks.
        self.capture = UPSTREAM_CAPTURE if capture is None else capture
        self.url = url
        self.http_url = http_url.rstrip("/")
        self.model_name = model_name
        self.server_model_name = self.kind.server_model_name(model_name)
        self.timeout = float(timeout)
        self._requested_layout = layout
        self._layout: CacheLayout | None = None
        self._closed = False
        self._sync_lock = threading.Lock()
        self._lookups: dict[str, int] = {}  # upstream's lookup sessions: request id -> tokens
        self.server_config = self._http_json("/config")
        _reject_lmcache_server(self.server_config, self.http_url, self.kind)
        try:
            self.chunk_size = int(self.server_config["chunk_size"])
        except (KeyError, TypeError, ValueError):
            raise SDKError(f"{self.http_url}/config has no valid chunk_size") from None
        features = self.server_config.get("features") or []
        if self.kind is CacheKind.QUERY and "transfer_query" not in features:
            raise SDKError(
                f"the server at {url} does not accept query tensors; start it with "
                "`kvdrop server --enable transfer_query`"
            )
        self._rpc = RpcClient(url, self.timeout, self.http_url)
        try:
            self.transfer_ctx = ContiguousTransferWrapper(
                self._rpc, self.server_config, url, transport
            )
        except BaseException:
            self._rpc.close()
            raise

    # -- plumbing -----------------------------------------------------------------------------
    def _http_json(self, path: str) -> dict[str, Any]:
        address = self.http_url + path
        try:
            with requests.Session() as session:
                session.trust_env = False  # talk to the server directly, never via HTTP(S)_PROXY
                resp = session.get(address, timeout=self.timeout)
            resp.raise_for_status()
            body = resp.json()
        except requests.RequestException as exc:
            raise ServerUnavailableError(
                f"cannot reach the kvdrop server at {address} ({type(exc).__name__}); "
                f"{server_hint(self.url, self.http_url)}"
            ) from None
        except ValueError:
            raise SDKError(f"{address} did not answer JSON; is it a kvdrop server?") from None
        if not isinstance(body, dict):
            raise SDKError(f"{address} answered {type(body).__name__}, expected a JSON object")
        return body

    def _fields(self, cache_salt: str = "") -> dict[str, Any]:
        try:
            check_salt(cache_salt)
        except (TypeError, ValueError) as exc:
            raise SDKError(str(exc)) from None
        return {"model": self.server_model_name, "kind": self.kind.value, "salt": cache_salt}

    def _check_open(self) -> None:
        if self._closed:
            raise SDKError("this context is closed; connect() again")

    @staticmethod
    def _check_request_configs(request_configs: Any) -> None:
        # Upstream sends these as request metadata that is not part of a chunk's identity; the
        # kvdrop server has no per-request settings, so they are validated and otherwise unused.
        if request_configs is not None and not isinstance(request_configs, dict):
            raise SDKError(
                f"request_configs must be a dict or None, got {type(request_configs).__name__}"
            )

    @property
    def _lease_s(self) -> float:
        return max(self.timeout, 30.0)

    @staticmethod
    def encode(tokens: Sequence[int]) -> bytes:
        """The wire form of token ids (a list or a 1-D integer tensor); SDKError when bad."""
        if isinstance(tokens, torch.Tensor):
            check_tensor(tokens, "token ids")
            if tokens.dim() != 1 or tokens.is_floating_point() or tokens.is_complex():
                raise SDKError(
                    f"token ids must be a 1-D integer tensor, got {tokens.dim()}-D {tokens.dtype}"
                )
            if tokens.dtype == torch.bool:
                raise SDKError("token ids must be integers, got a bool tensor")
            tokens = tokens.tolist()
        try:
            return encode_tokens(tokens)
        except ValueError as exc:
            raise SDKError(f"bad token ids: {exc}") from None

    def _call(
        self, op: str, fields: dict[str, Any], frames: Sequence[Any] = ()
    ) -> tuple[dict[str, Any], list[Any]]:
        """One RPC through the restart path (``_retry``), naming the layout it assumes."""
        return self._retry(
            lambda: self._rpc.call(op, {**fields, "layout": self.layout.to_json()}, frames)
        )

    def record_call(
        self,
        op: str,
        tokens: bytes,
        cache_salt: str,
        fields: Mapping[str, Any],
        frames: Sequence[Any] = (),
    ) -> tuple[dict[str, Any], list[Any]]:
        """One call ``op`` on the server's record store (query windows, token scores:
        :mod:`kvdrop_sdk.window`) for the call over ``tokens`` (:meth:`encode`'s bytes, sent
        first, then ``frames``), with this context's model, kind and ``cache_salt`` beside
        ``fields``, through the restart path."""
        self._check_open()
        return self._call(op, {**self._fields(cache_salt), **fields}, [tokens, *frames])

    def _fetch_layout(self) -> CacheLayout:
        """Register ``layout=`` (if given) and read the model's layout from the server."""
        fields = self._fields()
        fields.pop("salt")
        try:
            if self._requested_layout is not None:
                self._rpc.call("register", {**fields, "layout": self._requested_layout.to_json()})
            reply, _ = self._rpc.call("layout", fields)
        except RpcError as exc:
            raise SDKError(str(exc)) from None
        try:
            return CacheLayout.from_json(reply.get("layout"))
        except ValueError as exc:
            raise SDKError(f"server sent a bad layout: {exc}") from None

    def _resync(self) -> None:
        """Catch up with a restarted server (see the module docstring)."""
        with self._sync_lock:
            config = self._http_json("/config")
            if config.get("chunk_size") != self.chunk_size:
                raise SDKError(
                    f"the server at {self.url} now uses chunk size {config.get('chunk_size')!r}, "
                    f"not {self.chunk_size}; connect() again"
                )
            if config.get("instance") != self.transfer_ctx.instance:
                self.transfer_ctx.remap(config)
            self.server_config = config
            layout = self._fetch_layout()
            if self._layout is not None and layout != self._layout:
                raise SDKError(
                    f"the layout of {self.server_model_name!r} on the server changed from "
                    f"{self._layout.to_json()} to {layout.to_json()} (restarted or re-registered); "
                    "connect() again"
                )
            self._layout = layout

    def _retry(self, call: Callable[[], T]) -> T:
        """Run ``call``; after a server restart re-synchronise and run it once more."""
        try:
            return call()
        except ServerRestartedError:
            pass
        except RpcError as exc:
            if exc.code not in _RESYNC_CODES:
                raise
        self._resync()
        return call()

    # -- public API ---------------------------------------------------------------------------
    @property
    def layout(self) -> CacheLayout:
        """The model's registered layout (after ``register_caches``)."""
        if self._layout is None:
            raise SDKError("no layout yet: call register_caches() (connect() does it)")
        return self._layout

    def register_caches(self) -> CacheLayout:
        """Read this model's layout from the server; register ``layout=`` first if one was given."""
        self._check_open()
        self._layout = self._fetch_layout()
        return self._layout

    def lookup(self, tokens: Sequence[int], cache_salt: str = "") -> int:
        """How many leading tokens of ``tokens`` are cached (a multiple of ``chunk_size``)."""
        self._check_open()
        raw = self.encode(tokens)
        if len(raw) < self.chunk_size * TOKEN_BYTES:
            return 0
        fields = self._fields(cache_salt)
        reply, _ = self._retry(lambda: self._rpc.call("lookup", fields, [raw]))
        return int(reply["num_tokens"])

    def retrieve(
        self,
        tokens: Sequence[int],
        cache_salt: str = "",
        request_configs: dict[str, object] | None = None,
        *,
        device: torch.device | str | None = None,
    ) -> torch.Tensor | None:
        """The cached tensor of the longest chunk-aligned prefix of ``tokens``, or None on a miss.

        Shape ``(2, L, T, width)`` for KV, ``(1, L, T, width)`` for QUERY; one contiguous CPU
        tensor owned by the caller. ``request_configs`` (upstream's per-request metadata, not
        part of the cache key) is accepted and unused. ``device`` (kvdrop's): where the tensor
        lives instead; a GPU gets it by DMA straight from the server's shared memory (page-locked
        once; :mod:`kvdrop_sdk.transport.cuda_host`), complete on return.
        """
        self._check_open()
        self._check_request_configs(request_configs)
        return self._retrieve(tokens, cache_salt, device, lead=None)

    def store(
        self,
        kv: torch.Tensor,
        tokens: Sequence[int],
        cache_salt: str = "",
        request_configs: dict[str, object] | None = None,
    ) -> bool:
        """Store the whole chunks of ``kv`` under ``tokens``; False when all were cached already.

        ``kv`` is ``(2|1, L, T, width)`` with ``T == len(tokens)``; a tail shorter than a chunk is
        ignored. The first stored copy of a chunk wins. ``request_configs`` as in ``retrieve``.
        When the server's pool is so full of pinned or reserved chunks that some chunks cannot be
        kept, ``PartialStoreError`` (an SDKError) says how many were stored (a prefix) and how
        many were dropped.
        """
        self._check_open()
        self._check_request_configs(request_configs)
        layout = self.layout
        check_tensor(kv, "kv")
        raw = self.encode(tokens)
        num_tokens = len(raw) // TOKEN_BYTES
        if kv.dim() != 4 or kv.shape[2] != num_tokens:
            raise SDKError(
                f"kv has shape {tuple(kv.shape)} but {num_tokens} tokens were given; expected "
                f"len(tokens) == kv.shape[2] for a {layout.shape(self.kind, num_tokens)} tensor"
            )
        expected = layout.shape(self.kind, num_tokens)
        if tuple(kv.shape) != expected:
            raise SDKError(
                f"kv has shape {tuple(kv.shape)}, expected {expected} "
                f"({self.kind.value} layout of {self.server_model_name!r}: {layout.to_json()})"
            )
        if kv.dtype != layout.dtype:
            raise SDKError(
                f"kv has dtype {kv.dtype}, but {self.server_model_name!r} is registered with "
                f"{dtype_name(layout.dtype)}; convert with kv.to({layout.dtype})"
            )
        if num_tokens < self.chunk_size:
            return False
        kv = kv.detach()
        if kv.device.type not in ("cpu", "cuda"):
            kv = kv.cpu()  # a CUDA tensor goes to the slots by DMA (transport)
        fields = self._fields(cache_salt)
        stored = self._retry(
            lambda: self.transfer_ctx.store(fields, kv, raw, layout, self.kind, self._lease_s)
        )
        return stored > 0

    def retrieve_keys(
        self,
        tokens: Sequence[int],
        cache_salt: str = "",
        *,
        device: torch.device | str | None = None,
    ) -> torch.Tensor | None:
        """Only the keys of what ``retrieve`` returns: ``(1, L, T, width)`` (half the bytes), or
        None on a miss; to a GPU by DMA as ``retrieve``. KV contexts only (kvdrop's)."""
        self._check_open()
        self._need_kv("retrieve_keys")
        return self._retrieve(tokens, cache_salt, device, lead=1)

    def _retrieve(
        self,
        tokens: Sequence[int],
        cache_salt: str,
        device: torch.device | str | None,
        lead: int | None,
    ) -> torch.Tensor | None:
        """``retrieve``'s transfer of the longest chunk-aligned prefix; ``lead``: only that many
        leading planes of each slot (1: the keys), None: all of them."""
        layout = self.layout
        raw = self.encode(tokens)
        whole = len(raw) // (self.chunk_size * TOKEN_BYTES) * self.chunk_size * TOKEN_BYTES
        if whole == 0:
            return None
        fields = self._fields(cache_salt)
        where = edit_device(device)
        return self._retry(
            lambda: self.transfer_ctx.retrieve(
                fields, raw[:whole], layout, self.kind, self._lease_s, where, lead
            )
        )

    def keep(
        self, tokens: Sequence[int], plan: KeepPlan, cache_salt: str = "", *, dst_salt: str
    ) -> bool:
        """Store the rows ``plan.index`` of the prefix cached under ``tokens`` (whole chunks,
        all cached under ``cache_salt``) under the kept tokens and ``dst_salt``, keys re-rotated
        to ``0..k-1`` with ``plan.rope``: done by the server, no KV crosses the link (kvdrop's;
        see :mod:`kvdrop_sdk.keep`). False when every chunk was stored already; an SDKError
        (``RpcError`` with code ``bad_index``, ``not_cached``, ...) leaves the server unchanged."""
        self._check_open()
        self._need_kv("keep")
        fields = self._keep_fields(cache_salt, dst_salt, plan)
        try:
            index = encode_index(plan.index)
        except (TypeError, ValueError) as exc:
            raise SDKError(f"bad kept indices: {exc}") from None
        rope = None if plan.rope is None else dict(plan.rope)
        raw = self.encode(tokens)
        reply, _ = self._call("keep", {**fields, "dst_salt": dst_salt, "rope": rope}, [raw, index])
        return stored_chunks(reply) > 0

    def _keep_fields(self, cache_salt: str, dst_salt: str, plan: Any) -> dict[str, Any]:
        """The request fields of a keep (:meth:`keep`, :meth:`keep_rows`), its salts and plan
        checked: SDKError naming what was wrong."""
        fields = self._fields(cache_salt)
        try:
            check_salt(dst_salt, "dst_salt")
        except (TypeError, ValueError) as exc:
            raise SDKError(str(exc)) from None
        if not isinstance(plan, KeepPlan):
            raise SDKError(f"plan must be a KeepPlan, got {type(plan).__name__}")
        return fields

    @property
    def client_keep(self) -> bool:
        """Whether :meth:`keep_rows` can run here: this process maps the server's shared
        memory (not the socket transport)."""
        return self.transfer_ctx.mode == "shm"

    def keep_rows(
        self,
        tokens: Sequence[int],
        plan: KeepPlan,
        cache_salt: str = "",
        *,
        dst_salt: str,
        device: torch.device | str | None = None,
        keys: torch.Tensor | None = None,
    ) -> tuple[bool, int]:
        """:meth:`keep` with the kept keys re-rotated here, on ``device`` (a GPU: read and
        written by DMA), and the values gathered by index from the cached slots into the new
        ones in shared memory (a memcpy; no math on the server's CPU). ``keys``: the prefix's
        keys ``[1, L, T, D]`` when already fetched (a keys-reading edit); else only the source
        chunks holding kept rows have their keys read. The stored bytes equal what the policy's
        own call on the whole KV returns (the same gather, the same
        :func:`kvdrop_rope.rerotate_rows`). Returns (stored, KV bytes moved between the server
        and this process); ``client_keep`` False: SDKError (use :meth:`keep`)."""
        self._check_open()
        self._need_kv("keep_rows")
        if not self.client_keep:
            raise SDKError("keep_rows needs the shared-memory transport; use keep()")
        fields = self._keep_fields(cache_salt, dst_salt, plan)
        layout, c = self.layout, self.chunk_size
        raw = self.encode(tokens)
        num_tokens = len(raw) // TOKEN_BYTES
        try:
            index = decode_index(encode_index(plan.index), num_tokens, c)
            rope = None if plan.rope is None else RopeConfig.from_json(plan.rope)
        except (TypeError, ValueError) as exc:
            raise SDKError(f"bad keep plan: {exc}") from None
        if num_tokens % c:
            raise SDKError(f"keep_rows takes whole chunks of {c} tokens, got {num_tokens}")
        if keys is not None and tuple(keys.shape) != (1, *layout.shape(self.kind, num_tokens)[1:]):
            raise SDKError(f"keys must be the prefix's [1, L, T, D], got {tuple(keys.shape)}")
        token_list = list(tokens) if not isinstance(tokens, torch.Tensor) else tokens.tolist()
        dst = self.encode([token_list[i] for i in index.tolist()])
        k = index.numel()
        row_bytes = layout.num_layers * layout.width * layout.itemsize
        moved = [k * row_bytes]  # the kept keys written back

        def kept_keys(read: Callable[[Sequence[int]], torch.Tensor]) -> torch.Tensor:
            moved[0] = k * row_bytes  # (again, should the call be retried)
            if keys is not None:
                kept = keys.index_select(2, index.to(keys.device))
            else:
                chunks = torch.unique_consecutive(index // c)
                sub = read(chunks.tolist())
                moved[0] += chunks.numel() * c * row_bytes
                at = torch.searchsorted(chunks, index // c) * c + index % c
                kept = sub.index_select(2, at.to(sub.device))
            if rope is not None:
                rerotate_rows(kept[0], index, torch.arange(k), rope, num_tokens, k)
                if not bool(torch.isfinite(kept[0]).all()):
                    raise SDKError("re-rotated keys are not finite; check the RoPE parameters")
            return kept

        dst_fields = {**fields, "salt": dst_salt}
        where = edit_device(device)
        stored = self._retry(
            lambda: self.transfer_ctx.keep_rows(
                fields, raw, dst_fields, dst, layout, index, kept_keys, where, self._lease_s
            )
        )
        assert stored is not None
        return stored > 0, moved[0]

    def _need_kv(self, what: str) -> None:
        if self.kind is not CacheKind.KV:
            raise SDKError(f"{what} works on a KV context, this one is {self.kind.value!r}")

    @property
    def mq_timeout(self) -> float:
        """Seconds a server call may take (upstream's name for ``timeout``)."""
        return self.timeout

    # -- upstream's lookup sessions (a lookup by request id, read back, then ended) -----------
    def maybe_submit_lookup_request(
        self,
        request_id: str,
        token_ids: list[int],
        cache_salt: str = "",
        request_configs: dict[str, object] | None = None,
    ) -> None:
        """Look up ``token_ids`` under ``request_id`` (no-op when that id has one already); read
        the result with ``check_lookup_result`` and drop it with ``end_session``."""
        self._check_request_configs(request_configs)
        if request_id not in self._lookups:
            self._lookups[request_id] = self.lookup(token_ids, cache_salt)

    def check_lookup_result(self, request_id: str) -> int | None:
        """Cached tokens found by ``request_id``'s lookup (0 for an unknown id, as upstream)."""
        return self._lookups.get(request_id, 0)

    def end_session(self, request_id: str, block_ids: list[int] | None = None) -> None:
        """Forget ``request_id``'s lookup (``block_ids`` is accepted for upstream parity)."""
        self._lookups.pop(request_id, None)

    def prepare_dma(self) -> bool:
        """Page-lock the server's shared memory for GPU transfers now, all of it, instead of a
        region at a time inside the first transfers that touch it: a one-time cost per process
        (about 0.4 s per GiB on an H200 host) that an engine pays before it serves. False when
        there is nothing to lock (socket transport, no CUDA, ``KVDROP_CUDA_HOST_REGISTER=off``)
        or the platform refuses (transfers then take the host path, logged once)."""
        self._check_open()
        return self.transfer_ctx.prepare_dma()

    def close(self) -> None:
        """Release sockets and the shared-memory mapping (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.transfer_ctx.close()
        self._rpc.close()

    def __enter__(self) -> Context:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Context(kind={self.kind.value!r}, model={self.model_name!r}, url={self.url!r}, "
            f"transport={self.transfer_ctx.mode!r})"
        )


def connect(
    kind: CacheKind | str,
    url: str,
    http_url: str,
    model_name: str,
    timeout: float = 60.0,
    *,
    layout: CacheLayout | None = None,
    transport: str = "auto",
    capture: QueryCapture | None = None,
) -> Context:
    """Open a context for ``kind`` and register its caches (reads the layout from the server).

    ``layout=`` registers the layout first (offline use without an engine); ``transport`` is
    "auto" (shared memory when the server offers it and it can be mapped), "shm" or "socket".
    ``capture`` (a QUERY context's) is what the engine stores of the queries
    (:class:`~kvdrop_sdk.query_capture.QueryCapture`): a request stream then reads chunk queries
    only when it stores them (default: upstream's full queries).
    An unknown ``kind`` raises ``CacheKindError`` (an ``SDKError`` and, as upstream, a
    ``ValueError``).
    """
    try:
        kind = CacheKind.parse(kind)
    except ValueError as exc:
        raise CacheKindError(str(exc)) from None
    ctx = Context(
        url,
        http_url,
        model_name,
        kind,
        timeout,
        layout=layout,
        transport=transport,
        capture=capture,
    )
    try:
        ctx.register_caches()
    except BaseException:
        ctx.close()
        raise
    return ctx


def check_tensor(value: Any, what: str) -> None:
    """``SDKError`` unless ``value`` is a dense tensor with data (not sparse, not on ``meta``)."""
    problem = tensor_problem(value)
    if problem is not None:
        raise SDKError(f"{what} must be a torch.Tensor, dense and with data; {problem}")


def _reject_lmcache_server(config: dict[str, Any], http_url: str, kind: CacheKind) -> None:
    """Raise a clear ``SDKError`` when ``/config`` is an LMCache server's (``{"mp": {...}}``)."""
    mp = config.get("mp")
    if "chunk_size" in config or not isinstance(mp, dict) or "chunk_size" not in mp:
        return
    module = "qcache" if kind is CacheKind.QUERY else "kvcache"
    raise SDKError(
        f"{http_url} is an LMCache server (its /config has LMCache's 'mp' section), and "
        "kvdrop_sdk contexts speak only the kvdrop server's protocol. For an LMCache server use "
        f"`lmcache.sdk.{module}.connect(url, http_url, model_name)` -- kvdrop's batch, request "
        "streams and policies accept its contexts (see docs/lmcache.md) -- or start "
        "`kvdrop server` and point kvdrop_sdk at that."
    )
