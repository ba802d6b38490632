"""DMA between the server's shared memory and a GPU, without staging copies.

A mapped segment is page-locked for the GPU (``cudaHostRegister``) region by region, the first
time a slot in the region is read or written through a CUDA device: a chunk slot then goes to or
from device memory by DMA at the copy engine's rate (55 GB/s on an H200 host against 6.6 GB/s
for the same pageable mapping). Regions of :data:`REGION_BYTES` keep the number of
registrations small and pin only the part of a lazy pool in use; all are unregistered when the
mapping closes.

Measured on an H200 host (2026-12-02, ``.dev/register_probe.py``): registrations of 1 to 32 GiB
at any byte alignment succeed (about 0.37 s per GiB of fresh tmpfs pages, 0.05 s once the pages
exist), but **one copy whose host range spans two registrations fails** with
``cudaErrorInvalidValue``, and a failed ``cudaHostRegister`` leaves its error as the runtime's
last error, which the next kernel launch then reports as its own. So every copy here is split
at region boundaries (:func:`split_at_regions`), and every failed call is followed by
``cudaGetLastError`` (:meth:`CudaRuntime.clear_error`).

Where registration or a DMA fails (no CUDA, a driver that refuses it, a locked-memory limit) the
transfer takes the caller's host path instead, logged once; no request fails because of it. On
by default wherever CUDA is; ``KVDROP_CUDA_HOST_REGISTER`` (see :func:`register_mode`) turns it
off or makes every registration fail for real (to test the fallback).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch

__all__ = [
    "REGION_BYTES",
    "REGISTER_MODES",
    "CudaRuntime",
    "HostRegistration",
    "TorchRuntime",
    "enabled",
    "register_mode",
    "split_at_regions",
]

log = logging.getLogger(__name__)

#: Bytes page-locked at a time (the last region of a segment may be shorter).
REGION_BYTES = 1 << 30
#: What ``KVDROP_CUDA_HOST_REGISTER`` may say: ``on`` (the default; ``1`` too), ``off`` (``0``),
#: or ``fail``: every registration is made to fail in the real runtime (an invalid call, so the
#: error-clearing and the host fallback run exactly as after a driver's refusal).
REGISTER_MODES = ("on", "off", "fail")
#: Failed DMAs of one mapping after which it stops trying (each one fell back on its own).
MAX_DMA_FAILURES = 3


def register_mode() -> str:
    """``KVDROP_CUDA_HOST_REGISTER`` as one of :data:`REGISTER_MODES` (unset: ``on``);
    ``ValueError`` naming the accepted values otherwise."""
    raw = os.environ.get("KVDROP_CUDA_HOST_REGISTER", "on").strip().lower()
    mode = {"1": "on", "0": "off", "": "on"}.get(raw, raw)
    if mode not in REGISTER_MODES:
        raise ValueError(
            f"KVDROP_CUDA_HOST_REGISTER must be one of {', '.join(REGISTER_MODES)} (or 1/0), "
            f"got {raw!r}"
        )
    return mode


def enabled() -> bool:
    """Whether GPU transfers may page-lock shared memory: on unless
    ``KVDROP_CUDA_HOST_REGISTER=off`` (``fail`` counts as on: it tests the fallback)."""
    return register_mode() != "off"


def split_at_regions(offset: int, nbytes: int) -> list[tuple[int, int]]:
    """``[offset, offset + nbytes)`` cut at every multiple of :data:`REGION_BYTES`, as
    ``(start, end)`` pieces: each lies in one registration, so each may be one DMA."""
    pieces = []
    start, end = offset, offset + nbytes
    while start < end:
        stop = min(end, (start // REGION_BYTES + 1) * REGION_BYTES)
        pieces.append((start, stop))
        start = stop
    return pieces


class CudaRuntime(Protocol):
    """The CUDA calls a registration makes: the one seam tests replace (a recording runtime)."""

    def register(self, address: int, nbytes: int) -> int:
        """``cudaHostRegister``; returns the error code (0: success)."""
        ...

    def unregister(self, address: int) -> int:
        """``cudaHostUnregister``; returns the error code."""
        ...

    def clear_error(self) -> int:
        """``cudaGetLastError``: returns and resets the runtime's last error."""
        ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """One asynchronous copy between registered host memory and a device, on the current
        stream; raises ``RuntimeError`` when the runtime refuses it."""
        ...


class TorchRuntime:
    """The CUDA runtime torch loaded: registration through ``torch.cuda.cudart()``, and
    ``cudaGetLastError`` through ctypes on the same ``libcudart`` (torch exposes no binding
    for it), so the error it clears is the one torch's next launch check would read."""

    def __init__(self, fail: bool = False) -> None:
        self._fail = fail
        self._lib = _loaded_cudart()
        if self._lib is None:
            raise OSError("torch's libcudart is not among this process's mapped libraries")
        self._lib.cudaGetLastError.restype = ctypes.c_int

    def register(self, address: int, nbytes: int) -> int:
        if self._fail:  # a real, invalid call: it fails and sets the last error as a refusal does
            nbytes = 0
        return int(torch.cuda.cudart().cudaHostRegister(address, nbytes, 0))

    def unregister(self, address: int) -> int:
        return int(torch.cuda.cudart().cudaHostUnregister(address))

    def clear_error(self) -> int:
        return int(self._lib.cudaGetLastError())

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)


def _loaded_cudart() -> ctypes.CDLL | None:
    """The ``libcudart`` this process has mapped (torch's), or None."""
    torch.cuda.init()
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libcudart" in line})
    except OSError:
        return None
    return ctypes.CDLL(paths[0]) if paths else None


class HostRegistration:
    """The page-locked regions of one mapped segment, the uint8 tensor ``pool``, and the DMA
    to and from its slots.

    ``runtime`` (tests: a recording one) replaces the CUDA runtime; by default it is torch's,
    made only when CUDA is available and registration is on."""

    def __init__(self, pool: torch.Tensor, runtime: CudaRuntime | None = None) -> None:
        self.pool = pool
        self.base, self.size = pool.data_ptr(), pool.numel()
        self._regions: set[int] = set()
        #: Regions being registered by some thread, each with the event that says it is done.
        self._pending: dict[int, threading.Event] = {}
        #: Regions the runtime refused (a locked-memory limit, say): transfers touching them
        #: take the host path; the other regions keep their DMA.
        self._refused: set[int] = set()
        self._lock = threading.Lock()
        self._dma_failures = 0
        #: Why registration is not used at all (None while it may be); set once, then every
        #: call says no. ``refused``: why the first region was refused, if one was.
        self.failed: str | None = None
        self.refused: str | None = None
        self._runtime: CudaRuntime | None = runtime
        if runtime is None:
            self.failed = self._default_runtime()

    def _default_runtime(self) -> str | None:
        try:
            mode = register_mode()
        except ValueError as exc:
            return str(exc)
        if mode == "off":
            return "off (KVDROP_CUDA_HOST_REGISTER=off)"
        if not torch.cuda.is_available():
            if "KVDROP_CUDA_HOST_REGISTER" in os.environ:  # asked for: say why not, once
                log.warning(
                    "KVDROP_CUDA_HOST_REGISTER=%s, but CUDA is not available: the server's "
                    "shared memory is not page-locked for this mapping; transfers take the host "
                    "path",
                    os.environ["KVDROP_CUDA_HOST_REGISTER"],
                )
            return "CUDA is not available"
        try:
            self._runtime = TorchRuntime(fail=mode == "fail")
        except OSError as exc:
            return f"the CUDA runtime's error state cannot be cleared: {exc}"
        return None

    def ensure(self, offset: int, nbytes: int) -> bool:
        """Page-lock the regions covering ``[offset, offset + nbytes)``; False (the reason in
        ``failed`` or ``refused``, logged once, the runtime's error cleared) when that is
        impossible. A region the runtime refused stays refused; the others keep their DMA.

        A region is registered by the first caller that needs it, outside the lock (a GiB of
        fresh pages takes about 0.4 s): callers whose regions are registered already never
        wait for it; callers that need the same region wait for that one call."""
        first, last = offset // REGION_BYTES, (offset + nbytes - 1) // REGION_BYTES
        for region in range(first, last + 1):
            with self._lock:
                if self.failed is not None or self._runtime is None:
                    return False
                if region in self._regions:
                    continue
                if region in self._refused:
                    return False
                pending = self._pending.get(region)
                mine = pending is None
                if mine:
                    pending = self._pending[region] = threading.Event()
            assert pending is not None
            if mine:
                self._register_region(region, pending)
            else:
                pending.wait()
            with self._lock:
                if region not in self._regions:
                    return False
        return True

    def _register_region(self, region: int, done: threading.Event) -> None:
        """Register ``region`` (this thread claimed it), then wake whoever waits for it."""
        assert self._runtime is not None
        start = region * REGION_BYTES
        length = min(REGION_BYTES, self.size - start)
        try:
            err = self._runtime.register(self.base + start, length)
            if err != 0:
                self._runtime.clear_error()  # the last error is this thread's: cleared here
            with self._lock:
                if err == 0:
                    self._regions.add(region)
                else:
                    self._refused.add(region)
                    first = self.refused is None
                    if first:
                        self.refused = f"cudaHostRegister of {length} bytes returned error {err}"
            if err != 0 and first:
                log.warning(
                    "the server's shared memory cannot be page-locked for the GPU (%s): GPU "
                    "transfers touching that region (and any other refused) go through host "
                    "staging copies instead",
                    self.refused,
                )
        finally:
            with self._lock:
                self._pending.pop(region, None)
            done.set()

    def register_all(self) -> bool:
        """Page-lock every region now (skipping those done), in order: a process that will
        move most of the segment to and from a GPU pays the registration (about 0.4 s per GiB
        of pages this process has not touched, on an H200 host) before its first transfers
        rather than inside them. True when every region is registered; it stops at the first
        region the runtime refuses (the ones before it stay registered)."""
        return all(
            self.ensure(region * REGION_BYTES, 1) for region in range(-(-self.size // REGION_BYTES))
        )

    def ready(self, offsets: Sequence[int], nbytes: int) -> bool:
        """Whether slots of ``nbytes`` at ``offsets`` can go by DMA (registering them)."""
        return all(self.ensure(int(off), nbytes) for off in offsets)

    # -- copies ------------------------------------------------------------------------------
    def _copy_slot(self, device_bytes: torch.Tensor, offset: int, to_device: bool) -> None:
        """``device_bytes`` (a flat uint8 device tensor of the slot's size) to or from the slot
        at ``offset``, one DMA per region the slot touches."""
        assert self._runtime is not None
        for start, end in split_at_regions(offset, device_bytes.numel()):
            dev = device_bytes[start - offset : end - offset]
            host = self.pool[start:end]
            if to_device:
                self._runtime.copy(dev, host)
            else:
                self._runtime.copy(host, dev)

    def read(
        self,
        offsets: Sequence[int],
        shape: Sequence[int],
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor | None:
        """The chunk slots of ``shape`` ``(lead, L, c, W)`` at ``offsets`` as one device tensor
        ``(lead, L, n*c, W)``, complete on return; None when the DMA failed (the caller takes
        its host path). Made on a side stream: a consumer on another stream must
        ``record_stream`` it."""
        lead, layers, c, width = shape
        try:
            with _on_side_stream(device):
                out = torch.empty(
                    (lead, layers, len(offsets) * c, width), dtype=dtype, device=device
                )
                piece = torch.empty(tuple(shape), dtype=dtype, device=device)
                flat = piece.view(-1).view(torch.uint8)
                for j, off in enumerate(offsets):
                    self._copy_slot(flat, int(off), to_device=True)
                    out[:, :, j * c : (j + 1) * c].copy_(piece)  # in stream order
            return out
        except RuntimeError as exc:  # torch's CUDA errors; the host path still works
            self._dma_failed(exc)
            return None

    def write(self, parts: Sequence[torch.Tensor], offsets: Sequence[int]) -> bool:
        """Device chunk ``parts[i]`` ``(lead, L, c, W)`` into the slot at ``offsets[i]``,
        complete on return; False when the DMA failed (the caller takes its host path)."""
        if not parts:
            return True
        try:
            with _on_side_stream(parts[0].device, wait=True):
                for part, off in zip(parts, offsets, strict=True):
                    flat = part.contiguous().view(-1).view(torch.uint8)
                    self._copy_slot(flat, int(off), to_device=False)
            return True
        except RuntimeError as exc:
            self._dma_failed(exc)
            return False

    def _dma_failed(self, exc: BaseException) -> None:
        """A DMA failed: clear the runtime's error; after :data:`MAX_DMA_FAILURES` stop
        trying (logged once)."""
        with self._lock:
            if self._runtime is not None:
                self._runtime.clear_error()
            self._dma_failures += 1
            first = self._dma_failures == 1
            if self._dma_failures >= MAX_DMA_FAILURES and self.failed is None:
                self.failed = f"{self._dma_failures} DMAs failed, the last: {exc}"
        if first:
            log.warning(
                "a DMA from shared memory failed, that transfer went through the host: %s", exc
            )
        if self.failed is not None and self._dma_failures == MAX_DMA_FAILURES:
            log.warning("GPU transfers from shared memory go through the host: %s", self.failed)

    def close(self) -> None:
        """Unregister every region (before the mapping is closed), once the registrations in
        progress are done."""
        with self._lock:
            pending = list(self._pending.values())
        for event in pending:
            event.wait()
        with self._lock:
            if self._runtime is not None:
                for region in sorted(self._regions):
                    if self._runtime.unregister(self.base + region * REGION_BYTES) != 0:
                        self._runtime.clear_error()
            self._regions.clear()


@contextlib.contextmanager
def _on_side_stream(device: torch.device, wait: bool = False) -> Iterator[None]:
    """Run the body on this thread's copy stream of a CUDA ``device`` (transfers never queue
    behind the caller's compute on the default stream) and wait for it at the end; ``wait``:
    first wait for the current stream (the body reads what it wrote). A no-op off CUDA."""
    if device.type != "cuda":
        yield
        return
    stream = _side_stream(device)
    if wait:
        stream.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        stream.synchronize()


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """This thread's copy stream on ``device``."""
    streams = _STREAMS.__dict__.setdefault("by_device", {})
    stream = streams.get(device)
    if stream is None:
        stream = streams[device] = torch.cuda.Stream(device)
    return stream


_STREAMS = threading.local()


def pinned_empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A page-locked host tensor (torch's caching host allocator): the host path's buffer when
    its data goes on to a GPU, so that copy is one DMA rather than the driver's pageable one."""
    return torch.empty(tuple(shape), dtype=dtype, pin_memory=True)


def to_host_pinned(t: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor's copy in page-locked host memory, complete on return (the host path of a
    store from the GPU)."""
    host = pinned_empty(t.shape, t.dtype)
    with _on_side_stream(t.device, wait=True):
        host.copy_(t, non_blocking=True)
    return host
