"""CPU tensor memory for transfers: zero-copy byte views, recycled buffers, row-wise copies.

Shared by both ends: the SDK's transfer helper (``kvdrop_sdk.transport.contiguous``) and the
server (``kvdrop_sdk.server``), which copy chunks of ``[lead, L, T, W]`` tensors into and out of
pool slots and socket frames.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

__all__ = [
    "BufferCache",
    "copy_rows",
    "copy_threads",
    "empty_tensor",
    "rows",
    "run_copies",
    "tensor_buffer",
    "tune_malloc",
]

_RECYCLE_MIN_BYTES = 4 << 20


def tensor_buffer(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor that keeps the tensor alive.

    Used to hand tensor memory to ZMQ without a copy (no numpy dependency).
    """
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("tensor_buffer needs a contiguous CPU tensor")
    nbytes = t.numel() * t.element_size()
    holder_type = type("_TensorBytes", (ctypes.c_ubyte * nbytes,), {})
    holder = holder_type.from_address(t.data_ptr())
    holder.owner = t  # type: ignore[attr-defined]
    return memoryview(holder).cast("B")


class BufferCache:
    """Recycles the memory of large tensors this module handed out, once their owner drops them.

    Fresh pages cost a fault (and zeroing) each on first touch, which on small VMs makes a 256 MB
    allocation slower than the copy into it. A retrieved tensor is backed by an anonymous mapping;
    when the last reference to it (or any view of it) dies, the mapping goes back here and the
    next large retrieve reuses it. At most ``max_bytes`` are kept (env ``KVDROP_RECYCLE_BYTES``,
    default an eighth of the machine's memory, 1 to 16 GiB; 0 disables recycling).
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int, populate: bool = True) -> mmap.mmap:
        """A mapping of at least ``nbytes`` (reused if a free one is at most 4x larger); a fresh one
        is faulted in at once when ``populate`` (else by whoever first writes each page)."""
        size = -(-nbytes // _GRAIN) * _GRAIN
        with self._lock:
            fits = [m for m in self._free if size <= len(m) <= 4 * size]
            if fits:
                best = min(fits, key=len)
                self._free.remove(best)
                return best
        # MAP_POPULATE faults the pages in one call (~1.5x faster than on first touch).
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        if populate:
            flags |= getattr(mmap, "MAP_POPULATE", 0)
        return mmap.mmap(-1, size, flags=flags)

    def give(self, mm: mmap.mmap) -> None:
        """Keep ``mm`` for reuse if there is room (never blocks: may run inside a finaliser)."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            if sum(len(m) for m in self._free) + len(mm) <= self.max_bytes:
                self._free.append(mm)
        finally:
            self._lock.release()


def _recycle(holder: Any) -> None:
    try:
        holder._cache.give(holder._mm)
    except Exception:  # finaliser: e.g. at interpreter shutdown; the mapping is simply freed
        pass


def _default_recycle_bytes() -> int:
    """An eighth of the machine's memory, between 1 and 16 GiB. Large retrieves (a long prompt's
    KV is gigabytes) otherwise fault in fresh pages each time, which on a VM ran at a quarter of
    the speed of a copy into memory already mapped (measured on an H200 host: 8.8 vs 39 GB/s)."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 30
    return max(1 << 30, min(16 << 30, ram // 8))


_CACHE = BufferCache(int(os.environ.get("KVDROP_RECYCLE_BYTES", str(_default_recycle_bytes()))))
_GRAIN = 2 << 20
_HOLDER_TYPES: dict[int, type] = {}


def empty_tensor(shape: Sequence[int], dtype: torch.dtype, populate: bool = True) -> torch.Tensor:
    """An uninitialised CPU tensor; large ones reuse recycled memory (see ``BufferCache``).
    ``populate=False`` leaves a fresh mapping's pages to be faulted in by the (parallel) copy
    that fills it."""
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes < _RECYCLE_MIN_BYTES or _CACHE.max_bytes <= 0:
        return torch.empty(tuple(shape), dtype=dtype)
    mm = _CACHE.take(nbytes, populate)
    holder_type = _HOLDER_TYPES.get(len(mm))
    if holder_type is None:
        holder_type = type("_Recycled", (ctypes.c_ubyte * len(mm),), {"__del__": _recycle})
        _HOLDER_TYPES[len(mm)] = holder_type
    holder = holder_type.from_buffer(mm)
    holder._mm = mm
    holder._cache = _CACHE
    return torch.frombuffer(holder, dtype=dtype, count=numel).view(tuple(shape))


_MALLOC_TUNED = False


def tune_malloc() -> bool:
    """Raise glibc's heap trim threshold so freed ZMQ frame buffers are reused, not re-faulted.

    ZMQ allocates each received frame; with glibc's default the freed heap is handed back to the
    OS after every transfer and the next one faults in fresh pages (slower than the copy itself).
    Called once when a context uses the socket transport; set ``KVDROP_TUNE_MALLOC=0`` to skip.
    Returns whether the setting was applied.
    """
    global _MALLOC_TUNED
    if _MALLOC_TUNED or os.environ.get("KVDROP_TUNE_MALLOC", "1") == "0":
        return _MALLOC_TUNED
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: keep up to 1 GiB of free heap
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: buffers up to 32 MiB come from the heap
    except (OSError, AttributeError):
        return False
    _MALLOC_TUNED = True
    return True


def rows(t: torch.Tensor) -> torch.Tensor | None:
    """``(lead, L, T, W)`` as ``(lead * L, T * W)`` without copying, or None if strides forbid."""
    try:
        return t.view(t.shape[0] * t.shape[1], t.shape[2] * t.shape[3])
    except RuntimeError:
        return None


def copy_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for ``(lead, L, T, W)`` CPU views, one contiguous row at a time.

    Token slices of a ``[2, L, T, W]`` tensor are contiguous per (kv, layer) row, so the copy is
    a handful of ``memmove`` calls (ctypes releases the GIL). That is as fast as torch's
    multi-threaded ``copy_`` on an idle machine and much steadier on a loaded one: each parallel
    ``copy_`` is an OpenMP region whose barrier waits for descheduled threads.
    """
    if (
        dst.shape != src.shape
        or dst.dtype != src.dtype
        or dst.device.type != "cpu"
        or src.device.type != "cpu"
    ):
        dst.copy_(src)
        return
    if dst.numel() == 0:
        return
    es = dst.element_size()
    if dst.is_contiguous() and src.is_contiguous():
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), dst.numel() * es)
        return
    d, s = rows(dst), rows(src)
    if d is None or s is None or d.stride(1) != 1 or s.stride(1) != 1:
        dst.copy_(src)
        return
    nbytes = d.shape[1] * es
    dp, sp, dstep, sstep = d.data_ptr(), s.data_ptr(), d.stride(0) * es, s.stride(0) * es
    for r in range(d.shape[0]):
        ctypes.memmove(dp + r * dstep, sp + r * sstep, nbytes)


#: Copies of at least this many bytes in all are spread over the copy threads.
PARALLEL_MIN_BYTES = 16 << 20
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def copy_threads() -> int:
    """Threads that large copies use: ``KVDROP_COPY_THREADS``, default min(8, CPU count)."""
    env = os.environ.get("KVDROP_COPY_THREADS")
    if env is not None and env.strip().isdigit() and int(env) > 0:
        return int(env)
    return max(1, min(8, os.cpu_count() or 1))


def run_copies(tasks: Sequence[Callable[[], None]], nbytes: int) -> None:
    """Run copy ``tasks`` (each ``memmove``-bound, so they release the GIL); on the shared copy
    threads when ``nbytes`` in all is large enough and more than one thread is configured, else
    in order on this thread. The first error is raised once no task is running any more (none
    may outlive the caller's buffers); tasks not started by then are cancelled.

    One thread's ``memmove`` reaches a fraction of a large host's memory bandwidth (measured on a
    16-core host: a shm store moved 5.2 GB/s against 29 GB/s for a multi-threaded copy).
    """
    threads = copy_threads()
    if len(tasks) <= 1 or threads <= 1 or nbytes < PARALLEL_MIN_BYTES:
        for task in tasks:
            task()
        return
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL._max_workers != threads:  # type: ignore[attr-defined]
            _POOL = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvdrop-copy")
        pool = _POOL
    futures = [pool.submit(task) for task in tasks]
    error: BaseException | None = None
    for future in futures:
        try:
            future.result()
        except BaseException as exc:  # keep waiting: no task may outlive the caller's buffers
            if error is None:
                error = exc
            for other in futures:
                other.cancel()
    if error is not None:
        raise error
