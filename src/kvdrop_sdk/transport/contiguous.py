"""Moves a context's tensors to and from the server: shared memory when possible, else the socket.

Shared memory: the server's pool is a /dev/shm file this process maps; a store reserves slots,
copies each chunk straight into its slot (row ``memmove``s, see ``buffers.copy_rows``) and
commits; a retrieve pins the slots, copies them out into one contiguous tensor and releases them.
Slot offsets are only ever applied to a mapping of the same server instance as the reply that
carried them: a reply from a restarted server raises ``ServerRestartedError`` before any byte is
touched, and the context re-maps (``remap``) the new segment and retries.
Socket: the bytes travel as ZMQ frames of bounded size (one per chunk and kv/layer row on store,
sent straight from the caller's tensor; one per chunk on retrieve), so large transfers reuse heap
memory instead of faulting in fresh pages.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import torch

from kvdrop_sdk.cache_kind import CacheKind
from kvdrop_sdk.errors import PartialStoreError, SDKError, ServerRestartedError
from kvdrop_sdk.layout import CacheLayout, dtype_name
from kvdrop_sdk.protocol import RpcClient, RpcError
from kvdrop_sdk.transport.buffers import (
    copy_rows,
    empty_tensor,
    gather_spans,
    populate_write,
    run_copies,
    shm_copy_mode,
    tensor_buffer,
    tune_malloc,
)
from kvdrop_sdk.transport.cuda_host import HostRegistration, pinned_empty, to_host_pinned
from kvdrop_sdk.transport.shm import HEADER_BYTES, belongs_to, shm_path
from kvdrop_sdk.validate import is_int

__all__ = [
    "MODES",
    "PUT_BATCH_BYTES",
    "SPLIT_GET_BYTES",
    "ContiguousTransferWrapper",
    "TransferHelper",
    "socket_streams",
    "stored_chunks",
]

log = logging.getLogger("kvdrop_sdk.transfer")

#: Transport modes a context accepts: "auto" picks shared memory when it can be mapped.
MODES = ("auto", "shm", "socket")
_LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0", ""}
#: Socket stores are split into pipelined requests of about this many bytes.
PUT_BATCH_BYTES = 32 << 20
#: Socket retrieves of at least this many bytes are split into ranges over several connections.
SPLIT_GET_BYTES = 64 << 20
_GET_POOL: ThreadPoolExecutor | None = None
_GET_POOL_LOCK = threading.Lock()


def socket_streams() -> int:
    """Connections a large socket retrieve uses at once: ``KVDROP_SOCKET_STREAMS``, default 4."""
    env = os.environ.get("KVDROP_SOCKET_STREAMS", "4")
    return int(env) if env.strip().isdigit() and int(env) > 0 else 4


def _get_pool(size: int) -> ThreadPoolExecutor:
    """The shared threads that wait for the ranges of split socket retrieves."""
    global _GET_POOL
    with _GET_POOL_LOCK:
        if _GET_POOL is None or _GET_POOL._max_workers < size:  # type: ignore[attr-defined]
            _GET_POOL = ThreadPoolExecutor(max_workers=size, thread_name_prefix="kvdrop-get")
        return _GET_POOL


def stored_chunks(reply: dict[str, Any]) -> int:
    """Chunks stored according to a put/commit reply; ``PartialStoreError`` when some (or all)
    chunks were dropped because the pool had no room."""
    stored, dropped = int(reply.get("stored", 0)), int(reply.get("dropped", 0))
    if dropped:
        reason = reply.get("dropped_reason")
        raise PartialStoreError(
            stored,
            dropped,
            int(reply.get("duplicates", 0)),
            reason if isinstance(reason, str) else None,
        )
    return stored


@dataclass
class _Mapping:
    """One mapped segment and the server instance it belongs to, shared by every transfer
    helper of this process that talks to that instance (``users`` of them)."""

    mm: mmap.mmap
    pool: torch.Tensor
    instance: str | None
    key: tuple[Any, ...] = ()
    users: int = 1
    populated: set[int] = field(default_factory=set)
    populated_lock: threading.Lock = field(default_factory=threading.Lock)
    #: Page-locked regions for DMA to and from a GPU (made on the first CUDA transfer).
    registration: HostRegistration | None = None
    registration_lock: threading.Lock = field(default_factory=threading.Lock)

    def dma(self, offsets: list[Any], nbytes: int) -> HostRegistration | None:
        """The registration through which slots at ``offsets`` go to or from a GPU by DMA
        (registering them), or None: they take the host path. One per mapping, made under a
        lock: two made by concurrent first transfers registered the same regions twice (error
        712 on the H200) and left regions the mapping never unregistered."""
        registration = self.registered()
        return registration if registration.ready(offsets, nbytes) else None

    def registered(self) -> HostRegistration:
        """This mapping's one registration (made under a lock on first use)."""
        with self.registration_lock:
            if self.registration is None:
                self.registration = HostRegistration(self.pool)
            return self.registration

    def unregister(self) -> None:
        if self.registration is not None:
            self.registration.close()


#: The mappings of this process by (path, inode, instance): one per server segment, so each
#: region is page-locked once per process (0.05-0.37 s per GiB on an H200 host), not once per
#: context; the last helper to let go unmaps it.
_SHARED: dict[tuple[Any, ...], _Mapping] = {}
_SHARED_LOCK = threading.Lock()


def _release(mapping: _Mapping) -> None:
    """One helper lets go of ``mapping``; the last one unregisters and unmaps it."""
    with _SHARED_LOCK:
        mapping.users -= 1
        if mapping.users > 0:
            return
        if _SHARED.get(mapping.key) is mapping:
            del _SHARED[mapping.key]
    mapping.unregister()
    mapping.pool = torch.empty(0, dtype=torch.uint8)
    try:
        mapping.mm.close()
    except BufferError:
        pass  # a tensor still views it: unmapped when that goes


class ContiguousTransferWrapper:
    """The transfer helper a context holds (``ctx.transfer_ctx``); ``mode`` is "shm" or "socket"."""

    def __init__(
        self, rpc: RpcClient, server_config: dict[str, Any], url: str, transport: str = "auto"
    ) -> None:
        self._rpc = rpc
        self._url = url
        self._transport = transport
        self._mapping: _Mapping | None = None
        self.chunk_size = int(server_config["chunk_size"])
        self.instance: str | None = server_config.get("instance")
        self.mode = "socket"
        reason = "transport='socket' was requested"
        if transport != "socket":
            reason = self._map(server_config, url)
        if reason is None:
            self.mode = "shm"
        elif transport == "shm":
            raise SDKError(f"transport='shm' was requested but {reason}")
        else:
            log.debug("using the socket transport: %s", reason)
            tune_malloc()

    def remap(self, server_config: dict[str, Any]) -> None:
        """Follow a restarted server: map its new segment (the old mapping is dropped once no
        transfer uses it). With ``transport="auto"`` a segment that cannot be mapped any more
        switches this helper to the socket transport; with "shm" it is an SDKError."""
        self.instance = server_config.get("instance")
        if self.mode != "shm":
            return
        old = self._mapping
        reason = self._map(server_config, self._url)
        if reason is not None:
            if self._transport == "shm":
                raise SDKError(f"the server restarted and its shared memory is unusable: {reason}")
            log.warning("the server restarted; using the socket transport: %s", reason)
            self._mapping = None
            self.mode = "socket"
            tune_malloc()
        if old is not None:
            _release(old)  # the same mapping again (same instance) was counted twice
            if old is not self._mapping:
                log.info("re-mapped the server's shared memory (instance %s)", self.instance)

    def prepare_dma(self) -> bool:
        """Page-lock the whole shared segment for DMA now (see
        :meth:`~kvdrop_sdk.transport.cuda_host.HostRegistration.register_all`); False when
        there is none to lock (the socket transport) or registration is off or impossible
        (then transfers take the host path, as they would anyway)."""
        if self.mode != "shm":
            return False
        return self._current().registered().register_all()

    def _current(self) -> _Mapping:
        mapping = self._mapping
        if mapping is None:
            raise SDKError("this transfer helper has no shared-memory mapping (closed?)")
        return mapping

    def _reserve(
        self,
        mapping: _Mapping,
        fields: dict[str, Any],
        token_bytes: bytes,
        layout: CacheLayout,
        lease_s: float,
    ) -> dict[str, Any]:
        """Reserve slots for the chunks of ``token_bytes`` on the server ``mapping`` maps (a
        store, or a keep's destination); the reply's ``lease`` is None when all were stored."""
        reply, _ = self._rpc.call(
            "reserve",
            {**fields, "lease_s": lease_s, "layout": layout.to_json()},
            [token_bytes],
        )
        self._same_server(mapping, reply, "reserve")
        return reply

    def _same_server(self, mapping: _Mapping, reply: dict[str, Any], op: str) -> None:
        """Raise ``ServerRestartedError`` (after ending the lease ``reply`` granted, if any)
        unless ``reply`` comes from the instance ``mapping`` belongs to."""
        if reply.get("instance") == mapping.instance:
            return
        lease = reply.get("lease")
        if lease is not None:
            undo = "release" if op == "pin" else "abort"
            try:
                self._rpc.call(undo, {"lease": lease})
            except SDKError:
                pass
        raise ServerRestartedError(
            f"the server at {self._url} restarted (instance {reply.get('instance')!r}, mapped "
            f"{mapping.instance!r}); nothing was read or written through the old mapping"
        )

    def _map(self, cfg: dict[str, Any], url: str) -> str | None:
        """Map the server's pool; returns None on success, else why it cannot be used."""
        name = cfg.get("shm_name")
        if not name:
            return "the server was started without --shm-name"
        host = urlsplit(url).hostname or ""
        if host not in _LOCAL_HOSTS:
            return f"the server host {host!r} is not this machine"
        if not isinstance(name, str) or "/" in name or name in (".", ".."):
            return f"the server reported a bad shm name {name!r}"
        path = shm_path(name)
        size = cfg.get("shm_bytes")
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            return f"shared memory {path} cannot be opened ({exc})"
        instance = cfg.get("instance")
        try:
            st = os.fstat(fd)
            if not is_int(size) or st.st_size != size:
                return f"shared memory {path} has an unexpected size"
            key = (path, st.st_dev, st.st_ino, size, instance)
            with _SHARED_LOCK:
                shared = _SHARED.get(key)
                if shared is not None:
                    shared.users += 1
                    self._mapping = shared
                    return None
            mm = mmap.mmap(fd, size)
        except (OSError, ValueError) as exc:
            return f"shared memory {path} cannot be mapped ({exc})"
        finally:
            os.close(fd)
        if not belongs_to(mm[:HEADER_BYTES], instance):
            mm.close()
            return f"shared memory {path} belongs to another server instance"
        mapping = _Mapping(mm, torch.frombuffer(mm, dtype=torch.uint8), instance, key)
        with _SHARED_LOCK:
            shared = _SHARED.get(key)
            if shared is not None:  # another helper mapped it meanwhile: use that one
                shared.users += 1
                self._mapping = shared
            else:
                _SHARED[key] = self._mapping = mapping
        if self._mapping is not mapping:
            mapping.pool = torch.empty(0, dtype=torch.uint8)
            try:
                mm.close()
            except BufferError:
                pass
        return None

    def _slot(
        self, mapping: _Mapping, offset: Any, nbytes: int, layout: CacheLayout, kind: CacheKind
    ) -> torch.Tensor:
        if not is_int(offset) or offset < 0 or offset + nbytes > mapping.pool.numel():
            raise SDKError(f"server returned slot offset {offset!r} outside the shared pool")
        if offset not in mapping.populated:
            # Map the slot's pages in one call instead of one fault per 4 KiB page.
            populate_write(mapping.pool.data_ptr() + offset, nbytes)
            with mapping.populated_lock:
                mapping.populated.add(offset)
        flat = mapping.pool[offset : offset + nbytes].view(layout.dtype)
        return flat.view(layout.shape(kind, self.chunk_size))

    # -- store -------------------------------------------------------------------------------------
    def store(
        self,
        fields: dict[str, Any],
        kv: torch.Tensor,
        token_bytes: bytes,
        layout: CacheLayout,
        kind: CacheKind,
        lease_s: float,
    ) -> int:
        """Store the whole chunks of ``kv`` (shape already checked); returns chunks newly stored."""
        c = self.chunk_size
        if self.mode == "socket":
            host = to_host_pinned(kv) if kv.is_cuda else kv
            return self._socket_store(fields, host, token_bytes, layout, kind)
        mapping = self._current()
        reply = self._reserve(mapping, fields, token_bytes, layout, lease_s)
        lease = reply.get("lease")
        if lease is None:
            return stored_chunks({"stored": 0, **reply})
        started = time.monotonic()
        try:
            if reply.get("nbytes") != layout.nbytes(kind, c):
                raise SDKError(f"server slot size {reply.get('nbytes')} does not match the layout")
            nbytes = reply["nbytes"]

            def copy_in(i: int, off: Any) -> None:
                # Checked per chunk: past the lease the server may have handed the slot on.
                if time.monotonic() - started > 0.8 * lease_s:
                    raise SDKError(f"store took longer than its {lease_s:g} s reservation")
                copy_rows(
                    self._slot(mapping, off, nbytes, layout, kind), kv[:, :, i * c : (i + 1) * c]
                )

            chunks = list(zip(reply["chunks"], reply["offsets"]))
            dma = None
            if kv.is_cuda:
                for _, off in chunks:  # bounds checked, pages mapped, before registering
                    self._slot(mapping, off, nbytes, layout, kind)
                dma = mapping.dma([off for _, off in chunks], nbytes)
            if dma is not None:
                parts = [kv[:, :, i * c : (i + 1) * c] for i, _ in chunks]
                if not dma.write(parts, [off for _, off in chunks]):
                    dma = None  # that DMA failed (logged, error cleared): the host path
            if dma is not None:
                if time.monotonic() - started > 0.8 * lease_s:
                    raise SDKError(f"store took longer than its {lease_s:g} s reservation")
            else:
                if kv.is_cuda:
                    kv = to_host_pinned(kv)
                run_copies(
                    [lambda i=i, off=off: copy_in(i, off) for i, off in chunks],
                    nbytes * len(chunks),
                )
        except BaseException:
            try:
                self._rpc.call("abort", {"lease": lease})
            except SDKError:
                pass  # the reservation lapses on its own
            raise
        committed, _ = self._rpc.call("commit", {"lease": lease})
        return stored_chunks({**reply, "stored": committed["stored"]})

    def _socket_store(
        self,
        fields: dict[str, Any],
        kv: torch.Tensor,
        token_bytes: bytes,
        layout: CacheLayout,
        kind: CacheKind,
    ) -> int:
        """Socket store: the whole chunks of host tensor ``kv`` in pipelined ``put`` requests."""
        c = self.chunk_size
        n = kv.shape[2] // c
        kv = kv.contiguous()
        # One zero-copy frame per (chunk, kv/layer row): each is contiguous in ``kv``.
        row_bytes = kv.shape[2] * kv.shape[3] * kv.element_size()
        span = c * kv.shape[3] * kv.element_size()
        base = tensor_buffer(kv)
        frames = [
            base[r * row_bytes + i * span : r * row_bytes + (i + 1) * span]
            for i in range(n)
            for r in range(kv.shape[0] * kv.shape[1])
        ]
        # Several pipelined requests of ~PUT_BATCH_BYTES each: server workers copy one batch
        # into the pool while the next is still on the wire.
        rows_per_chunk = kv.shape[0] * kv.shape[1]
        per_msg = max(1, PUT_BATCH_BYTES // layout.nbytes(kind, c))
        calls = []
        for first in range(0, n, per_msg):
            m = min(per_msg, n - first)
            header = {
                **fields,
                "layout": layout.to_json(),
                "dtype": dtype_name(layout.dtype),
                "shape": list(layout.shape(kind, m * c)),
                "first_chunk": first,
            }
            data = frames[first * rows_per_chunk : (first + m) * rows_per_chunk]
            calls.append(("put", header, [token_bytes[: (first + m) * c * 8], *data]))
        replies = self._rpc.call_many(calls)
        total = {"stored": 0, "dropped": 0, "duplicates": 0}
        for reply, _ in replies:
            for key in total:
                total[key] += int(reply.get(key, 0))
        reasons = [r["dropped_reason"] for r, _ in replies if r.get("dropped_reason")]
        return stored_chunks({**total, "dropped_reason": reasons[0] if reasons else None})

    # -- retrieve ----------------------------------------------------------------------------------
    def retrieve(
        self,
        fields: dict[str, Any],
        token_bytes: bytes,
        layout: CacheLayout,
        kind: CacheKind,
        lease_s: float,
        device: torch.device | None = None,
        lead: int | None = None,
    ) -> torch.Tensor | None:
        """The longest cached chunk-aligned prefix as one contiguous tensor, or None; on
        ``device`` when given (a GPU gets the slots by DMA from page-locked shared memory).
        ``lead=1`` fetches only the first of the ``[2, L, c, D]`` slot's leading rows: the keys
        (``[1, L, T, D]``, the first half of each slot's bytes)."""
        c = self.chunk_size
        full = layout.shape(kind, 1)[0]
        lead = full if lead is None else lead
        if not 1 <= lead <= full:
            raise SDKError(f"lead must be in [1, {full}], got {lead!r}")
        if self.mode == "socket":
            out = self._socket_retrieve(fields, token_bytes, layout, kind, lead)
            return out if out is None or device is None else out.to(device)
        mapping = self._current()
        reply, _ = self._rpc.call(
            "pin", {**fields, "lease_s": lease_s, "layout": layout.to_json()}, [token_bytes]
        )
        self._same_server(mapping, reply, "pin")
        lease = reply.get("lease")
        if lease is None:
            return None
        offsets = reply["offsets"]
        try:
            nbytes = reply.get("nbytes")
            if nbytes != layout.nbytes(kind, c):
                raise SDKError(f"server slot size {nbytes} does not match the layout")
            out = None
            gpu = device is not None and device.type == "cuda"
            dma = None
            if gpu:
                for off in offsets:  # bounds checked, pages mapped, before registering
                    self._slot(mapping, off, nbytes, layout, kind)
                dma = mapping.dma(offsets, nbytes)
            if dma is not None:
                assert device is not None
                # The first ``lead`` rows of a slot are its first bytes: keys alone by DMA too.
                slot_shape = (lead, *layout.shape(kind, c)[1:])
                out = dma.read(offsets, slot_shape, layout.dtype, device)  # None: it failed
            if out is None:
                shape = (lead, *layout.shape(kind, len(offsets) * c)[1:])
                out = (
                    pinned_empty(shape, layout.dtype)
                    if gpu
                    else empty_tensor(shape, layout.dtype, populate=False)
                )
                self._copy_out(mapping, out, offsets, nbytes, layout, kind)
                if device is not None:
                    out = out.to(device, non_blocking=gpu)
                    if gpu:
                        torch.cuda.current_stream(device).synchronize()
        finally:
            try:
                released, _ = self._rpc.call("release", {"lease": lease})
                valid = int(released["valid_chunks"])
            except RpcError as exc:
                if exc.code != "unknown_lease":
                    raise
                valid = 0  # the server restarted meanwhile: nothing read can be vouched for
        if valid == 0:
            return None
        if valid < len(offsets):
            # The pin expired and some chunks were evicted meanwhile: return what is known good.
            out = out[:, :, : valid * c].contiguous()
        return out

    # -- keep with the kept keys from this process ----------------------------------------------
    def keep_rows(
        self,
        fields: dict[str, Any],
        token_bytes: bytes,
        dst_fields: dict[str, Any],
        dst_token_bytes: bytes,
        layout: CacheLayout,
        index: torch.Tensor,
        kept_keys: Callable[[Callable[[Sequence[int]], torch.Tensor]], torch.Tensor],
        device: torch.device | None,
        lease_s: float,
    ) -> int | None:
        """Store rows ``index`` (sorted int64, CPU) of the prefix cached under ``token_bytes``
        (whole chunks, all cached) under ``dst_token_bytes`` and ``dst_fields``' salt: the keys
        from ``kept_keys(read)`` (``[1, L, k, D]`` on ``device``, re-rotated by the caller;
        ``read(chunks)`` gives the keys of those source chunks there, by DMA on a GPU), the
        values gathered by index from the pinned source slots straight into the reserved ones
        (memcpy, no math). The source stays pinned until the values are copied and is checked
        intact before the commit. Returns the chunks newly stored; None without shared memory
        (the caller has the server keep instead). An SDKError leaves nothing stored."""
        if self.mode != "shm":
            return None
        c = self.chunk_size
        kind = CacheKind.KV
        mapping = self._current()
        src_chunks = len(token_bytes) // (8 * c)
        reply, _ = self._rpc.call(
            "pin", {**fields, "lease_s": lease_s, "layout": layout.to_json()}, [token_bytes]
        )
        self._same_server(mapping, reply, "pin")
        lease = reply.get("lease")
        src: list[Any] = list(reply.get("offsets") or [])
        nbytes = layout.nbytes(kind, c)
        dst_lease = None
        started = time.monotonic()
        try:
            if lease is None or len(src) < src_chunks:
                raise SDKError(
                    f"keep needs all {src_chunks * c} tokens cached; {len(src) * c} are "
                    "(evicted meanwhile?): retrieve and store instead"
                )
            if reply.get("nbytes") != nbytes:
                raise SDKError(f"server slot size {reply.get('nbytes')} does not match the layout")
            gpu = device is not None and device.type == "cuda"
            for off in src:  # bounds checked, pages mapped
                self._slot(mapping, off, nbytes, layout, kind)
            dma = mapping.dma(src, nbytes) if gpu else None
            key_shape = (1, *layout.shape(kind, c)[1:])

            def read(chunks: Sequence[int]) -> torch.Tensor:
                offsets = [src[int(i)] for i in chunks]
                if dma is not None:
                    got = dma.read(offsets, key_shape, layout.dtype, device)  # type: ignore[arg-type]
                    if got is not None:
                        return got
                shape = (1, *layout.shape(kind, len(offsets) * c)[1:])
                out = (
                    pinned_empty(shape, layout.dtype)
                    if gpu
                    else torch.empty(shape, dtype=layout.dtype)
                )
                for j, off in enumerate(offsets):
                    copy_rows(
                        out[:, :, j * c : (j + 1) * c],
                        self._slot(mapping, off, nbytes, layout, kind)[:1],
                    )
                return out if device is None else out.to(device)

            keys = kept_keys(read)
            k = index.numel()
            if (
                tuple(keys.shape) != (1, layout.num_layers, k, layout.width)
                or keys.dtype != layout.dtype
            ):
                raise SDKError(
                    f"kept keys have shape {tuple(keys.shape)} {keys.dtype}, expected "
                    f"{(1, layout.num_layers, k, layout.width)} {layout.dtype}"
                )
            dreply = self._reserve(mapping, dst_fields, dst_token_bytes, layout, lease_s)
            dst_lease = dreply.get("lease")
            if dst_lease is None:
                return stored_chunks({"stored": 0, **dreply})
            if dreply.get("nbytes") != nbytes:
                raise SDKError(f"server slot size {dreply.get('nbytes')} does not match the layout")
            chunks = list(zip(dreply["chunks"], dreply["offsets"]))
            for _, off in chunks:
                self._slot(mapping, off, nbytes, layout, kind)
            parts = [keys[:, :, i * c : (i + 1) * c] for i, _ in chunks]
            wrote = False
            if keys.is_cuda:
                ddma = mapping.dma([off for _, off in chunks], nbytes)
                wrote = ddma is not None and ddma.write(parts, [off for _, off in chunks])
            if not wrote:
                host = to_host_pinned(keys) if keys.is_cuda else keys.contiguous()
                for i, off in chunks:
                    copy_rows(
                        self._slot(mapping, off, nbytes, layout, kind)[:1],
                        host[:, :, i * c : (i + 1) * c],
                    )

            _gather_values(mapping.pool, layout, c, src, chunks, index, nbytes)
            if time.monotonic() - started > 0.8 * lease_s:
                raise SDKError(f"keep took longer than its {lease_s:g} s reservation")
        except BaseException:
            if dst_lease is not None:
                try:
                    self._rpc.call("abort", {"lease": dst_lease})
                except SDKError:
                    pass  # the reservation lapses on its own
            raise
        finally:
            valid = 0
            if lease is not None:
                try:
                    released, _ = self._rpc.call("release", {"lease": lease})
                    valid = int(released["valid_chunks"])
                except RpcError as exc:
                    if exc.code != "unknown_lease":
                        raise
        if valid < src_chunks:  # evicted or overwritten while read: store nothing
            try:
                self._rpc.call("abort", {"lease": dst_lease})
            except SDKError:
                pass
            raise SDKError("the cached prefix changed while its kept rows were copied; retry")
        committed, _ = self._rpc.call("commit", {"lease": dst_lease})
        return stored_chunks({**dreply, "stored": committed["stored"]})

    def _copy_out(
        self,
        mapping: _Mapping,
        out: torch.Tensor,
        offsets: list[Any],
        nbytes: int,
        layout: CacheLayout,
        kind: CacheKind,
    ) -> None:
        """Fill host tensor ``out`` from the pinned slots at ``offsets``."""
        c = self.chunk_size

        lead = out.shape[0]

        def copy_out(j: int, off: Any) -> None:
            copy_rows(
                out[:, :, j * c : (j + 1) * c],
                self._slot(mapping, off, nbytes, layout, kind)[:lead],
            )

        if shm_copy_mode() == "torch":
            for off in offsets:  # bounds checked, pages mapped
                self._slot(mapping, off, nbytes, layout, kind)
            span = c * out.shape[3] * out.element_size()
            gather_spans(out, mapping.pool, offsets, span)
        else:
            run_copies(
                [lambda j=j, off=off: copy_out(j, off) for j, off in enumerate(offsets)],
                nbytes * len(offsets),
            )

    def _socket_retrieve(
        self,
        fields: dict[str, Any],
        token_bytes: bytes,
        layout: CacheLayout,
        kind: CacheKind,
        lead: int,
    ) -> torch.Tensor | None:
        """Socket retrieve: a large prefix in ``socket_streams()`` chunk ranges fetched at once
        on as many connections (one TCP stream moved 2 GB/s on an H200 host, four 3.9), then
        the frames copied into one tensor on the copy threads."""
        c = self.chunk_size
        max_chunks = len(token_bytes) // 8 // c
        streams = socket_streams()
        if max_chunks * layout.nbytes(kind, c) < SPLIT_GET_BYTES or max_chunks < 2:
            streams = 1
        per = -(-max_chunks // streams) if max_chunks else 1
        header = {**fields, "layout": layout.to_json()}
        if lead != layout.shape(kind, 1)[0]:
            header["lead"] = lead
        calls = [
            ("get", {**header, "first_chunk": f, "max_chunks": per}, [token_bytes])
            for f in range(0, max(max_chunks, 1), per)
        ]
        if len(calls) == 1:
            replies = [self._rpc.call(*calls[0])]
        else:
            replies = list(_get_pool(len(calls)).map(lambda call: self._rpc.call(*call), calls))
        # The prefix ends in the first range that came back short (chunks may be evicted
        # between the ranges' pins: later ranges are then dropped).
        parts: list[list[Any]] = []
        total = 0
        for (_, call, _), (reply, frames) in zip(calls, replies, strict=True):
            first = call["first_chunk"]
            found = int(reply.get("num_tokens", 0)) // c
            got = max(0, min(found, first + per) - first)
            self._check_part(reply, frames, layout, kind, got, lead)
            parts.append(frames)
            total = first + got
            if got < per:
                break
        if total == 0:
            return None
        shape = (lead, *layout.shape(kind, total * c)[1:])
        num_rows = shape[0] * shape[1]
        span = c * shape[3] * layout.itemsize
        frames = [f for part in parts for f in part][: total * num_rows]
        out = empty_tensor(shape, layout.dtype, populate=False)
        # Frame (chunk i, row r) goes to row r, tokens [i*c, (i+1)*c) of ``out``; one copy
        # task per chunk, spread over the copy threads (which fault in fresh pages too).
        row_bytes = total * span
        base = out.data_ptr()

        def copy_chunk(i: int) -> None:
            for r in range(num_rows):
                src = torch.frombuffer(frames[i * num_rows + r].buffer, dtype=torch.uint8)
                ctypes.memmove(base + r * row_bytes + i * span, src.data_ptr(), span)

        run_copies([lambda i=i: copy_chunk(i) for i in range(total)], span * len(frames))
        return out

    def _check_part(
        self,
        reply: dict[str, Any],
        frames: list[Any],
        layout: CacheLayout,
        kind: CacheKind,
        n: int,
        lead: int,
    ) -> None:
        """``SDKError`` unless a ``get`` reply carries ``n`` chunks' frames of the layout (the
        first ``lead`` leading rows of each)."""
        c = self.chunk_size
        shape = (lead, *layout.shape(kind, n * c)[1:])
        num_rows = shape[0] * shape[1]
        span = c * shape[3] * layout.itemsize
        if n == 0 and not frames:
            return
        if (
            reply.get("shape") != list(shape)
            or len(frames) != n * num_rows
            or any(len(f.buffer) != span for f in frames)
        ):
            raise SDKError(
                f"server sent shape {reply.get('shape')} in {len(frames)} frames, "
                f"expected {list(shape)} in {n * num_rows} frames of {span} bytes"
            )

    def close(self) -> None:
        """Let go of the shared pool, unmapped once no helper of this process uses it (tensors
        already returned are independent copies)."""
        mapping, self._mapping = self._mapping, None
        if mapping is not None:
            _release(mapping)


TransferHelper = ContiguousTransferWrapper


def _gather_values(
    pool: torch.Tensor,
    layout: CacheLayout,
    c: int,
    src: Sequence[Any],
    chunks: Sequence[tuple[int, Any]],
    index: torch.Tensor,
    nbytes: int,
) -> None:
    """Copy the kept values (rows ``index`` of the source slots at ``src``) into the V halves
    of the reserved slots ``chunks`` (``(i, offset)``: kept rows ``i*c .. (i+1)*c``), in the
    shared ``pool``. A source chunk kept whole is one ``memmove``; otherwise one gather per new
    chunk over the pool seen as ``[units, u]`` bytes into a reused buffer, then one ``memmove``;
    ``u`` is a KV row (``D`` values) where every slot starts on a row boundary, else the largest
    size dividing the row and every offset (a row is then ``row // u`` units). Pure copies."""
    layers = layout.num_layers
    row = layout.width * layout.itemsize
    unit = math.gcd(row, *(int(o) for o in src), *(int(o) for _, o in chunks))
    per = row // unit  # units per KV row
    plane = layers * c  # KV rows per (K or V) plane of a slot
    units = pool[: pool.numel() // unit * unit].view(-1, unit)
    src_rows = torch.tensor([int(o) // unit for o in src], dtype=torch.int64)
    src_rows += plane * per  # the V plane's first unit
    per_layer = (torch.arange(layers, dtype=torch.int64) * c * per)[:, None, None]
    in_row = torch.arange(per, dtype=torch.int64)[None, None, :]
    buffer = torch.empty((plane * per, unit), dtype=torch.uint8)
    half = nbytes // 2
    for i, off in chunks:
        kept = index[i * c : (i + 1) * c]
        first = int(kept[0])
        dst = pool.data_ptr() + int(off) + half
        if first % c == 0 and int(kept[-1]) == first + c - 1:  # a source chunk kept whole
            ctypes.memmove(dst, pool.data_ptr() + int(src[first // c]) + half, half)
            continue
        start = (src_rows[kept // c] + kept % c * per)[None, :, None]
        at = start + per_layer + in_row  # [L, c, per] pool units, in the slot's V order
        torch.index_select(units, 0, at.view(-1), out=buffer)
        ctypes.memmove(dst, buffer.data_ptr(), half)
