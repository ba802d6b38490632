"""DMA between the server's shared memory and a GPU, without staging copies.

A mapped segment is page-locked for the GPU (``cudaHostRegister``) region by region, the first
time a slot in the region is read or written through a CUDA device: a chunk slot then goes to or
from device memory by one DMA at the copy engine's rate (on an H200 host 55 GB/s registered
against 6.7 GB/s for the same pageable mapping). Regions of :data:`REGION_BYTES` keep the number
of registrations small and pin only the part of a lazy pool in use; all are unregistered when the
mapping closes.

Where registration is impossible (no CUDA, a driver that refuses it, a locked-memory limit) the
caller falls back to its host path, and the reason is logged once per mapping. Off unless
``KVDROP_CUDA_HOST_REGISTER=1`` (see :func:`enabled`).
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections.abc import Callable, Sequence

import torch

__all__ = ["REGION_BYTES", "HostRegistration", "device_to_slots", "slots_to_device"]

log = logging.getLogger(__name__)

#: Bytes page-locked at a time (the last region of a segment may be shorter).
REGION_BYTES = 1 << 30


def enabled() -> bool:
    """Whether GPU transfers may page-lock shared memory: ``KVDROP_CUDA_HOST_REGISTER=1``. Off by
    default: on an H200 the registered copy ran at 55 GB/s alone, but inside the engine's
    concurrent loads the DMA failed with ``cudaErrorInvalidValue`` (docs/engine/benchmarks.md)."""
    return os.environ.get("KVDROP_CUDA_HOST_REGISTER", "0") == "1"


def _cudart_call(name: str, *args: int) -> int:
    """A CUDA runtime call through torch; returns its error code (0 is success)."""
    fn = getattr(torch.cuda.cudart(), name)
    return int(fn(*args))


class HostRegistration:
    """The page-locked regions of one mapped segment of ``size`` bytes at address ``base``.

    ``register_fn``/``unregister_fn`` (tests) replace the CUDA runtime's calls; each takes
    ``(address, nbytes)`` and returns an error code, 0 for success."""

    def __init__(
        self,
        base: int,
        size: int,
        register_fn: Callable[[int, int], int] | None = None,
        unregister_fn: Callable[[int, int], int] | None = None,
    ) -> None:
        self.base, self.size = base, size
        self._register = register_fn or (lambda p, n: _cudart_call("cudaHostRegister", p, n, 0))
        self._unregister = unregister_fn or (lambda p, n: _cudart_call("cudaHostUnregister", p))
        self._regions: set[int] = set()
        self._lock = threading.Lock()
        #: Why registration failed (None while it works); set once, then every call says no.
        self.failed: str | None = None
        if register_fn is None and not enabled():
            self.failed = "off (KVDROP_CUDA_HOST_REGISTER=1 turns it on)"
        elif register_fn is None and not torch.cuda.is_available():
            self.failed = "CUDA is not available"
            log.warning(  # asked for, and impossible: say so once for this mapping
                "KVDROP_CUDA_HOST_REGISTER=1, but the server's shared memory cannot be "
                "page-locked for the GPU (%s): transfers use the host path",
                self.failed,
            )

    def ensure(self, offset: int, nbytes: int) -> bool:
        """Page-lock the regions covering ``[offset, offset + nbytes)``; False (and the reason
        in ``failed``, logged once) when that is impossible."""
        first, last = offset // REGION_BYTES, (offset + nbytes - 1) // REGION_BYTES
        with self._lock:
            for region in range(first, last + 1):
                if self.failed is not None:
                    return False
                if region in self._regions:
                    continue
                start = region * REGION_BYTES
                length = min(REGION_BYTES, self.size - start) // mmap.PAGESIZE * mmap.PAGESIZE
                err = self._register(self.base + start, length)
                if err != 0:
                    self.failed = f"cudaHostRegister of {length} bytes returned error {err}"
                    log.warning(
                        "the server's shared memory cannot be page-locked for the GPU (%s): "
                        "GPU transfers go through host staging copies instead",
                        self.failed,
                    )
                    return False
                self._regions.add(region)
        return True

    def give_up(self, exc: BaseException) -> None:
        """A DMA through the registered memory failed: every later transfer takes the host path
        (logged once)."""
        with self._lock:
            if self.failed is None:
                self.failed = f"a DMA failed: {exc}"
                log.warning("GPU transfers from shared memory go through the host: %s", self.failed)

    def close(self) -> None:
        """Unregister every region (before the mapping is closed)."""
        with self._lock:
            for region in sorted(self._regions):
                self._unregister(self.base + region * REGION_BYTES, 0)
            self._regions.clear()


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """This thread's copy stream on ``device``: transfers never queue behind the caller's
    compute on the default stream (an engine's decode steps)."""
    streams = _STREAMS.__dict__.setdefault("by_device", {})
    stream = streams.get(device)
    if stream is None:
        stream = streams[device] = torch.cuda.Stream(device)
    return stream


_STREAMS = threading.local()


def slots_to_device(slots: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Chunk slots ``(lead, L, c, W)`` (views of registered memory) as one device tensor
    ``(lead, L, n*c, W)``: one DMA per slot (into a chunk-sized device piece, then its place
    in the result). Complete on return, so the slots may be released; the tensor was made on a
    side stream, so a consumer on another stream must ``record_stream`` it."""
    stream = _side_stream(device)
    lead, layers, c, width = slots[0].shape
    with torch.cuda.stream(stream):
        out = torch.empty(
            (lead, layers, len(slots) * c, width), dtype=slots[0].dtype, device=device
        )
        piece = torch.empty(slots[0].shape, dtype=slots[0].dtype, device=device)
        for j, slot in enumerate(slots):
            piece.copy_(slot, non_blocking=True)  # one contiguous DMA
            out[:, :, j * c : (j + 1) * c].copy_(piece)  # in stream order, before the next DMA
    stream.synchronize()
    return out


def device_to_slots(parts: Sequence[torch.Tensor], slots: Sequence[torch.Tensor]) -> None:
    """Write device chunk ``parts[i]`` ``(lead, L, c, W)`` into ``slots[i]`` (views of registered
    memory) by DMA; complete on return."""
    device = parts[0].device
    stream = _side_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))  # the parts were written there
    with torch.cuda.stream(stream):
        for part, slot in zip(parts, slots, strict=True):
            slot.copy_(part.contiguous(), non_blocking=True)
    stream.synchronize()


def pinned_empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A page-locked host tensor (torch's caching host allocator): the host path's buffer when
    its data goes on to a GPU, so that copy is one DMA rather than the driver's pageable one."""
    return torch.empty(tuple(shape), dtype=dtype, pin_memory=True)


def to_host_pinned(t: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor's copy in page-locked host memory, complete on return (the host path of a
    store from the GPU)."""
    host = pinned_empty(t.shape, t.dtype)
    stream = _side_stream(t.device)
    stream.wait_stream(torch.cuda.current_stream(t.device))
    with torch.cuda.stream(stream):
        host.copy_(t, non_blocking=True)
    stream.synchronize()
    return host
