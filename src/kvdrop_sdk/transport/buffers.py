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
    "gather_spans",
    "populate_write",
    "rows",
    "run_copies",
    "shm_copy_mode",
    "tensor_buffer",
    "tune_malloc",
]

_RECYCLE_MIN_BYTES = 4 << 20
#: Transparent huge pages for fresh buffers: ``KVDROP_HUGE_PAGES`` 1/0, default on with 8 or
#: more CPUs (a 16-core H200 host: kept retrieves 9.2 instead of 7.3 GB/s). On a small VM short
#: of free memory the kernel's compaction for them stalled kept retrieves instead.
_HUGE_DEFAULT = "1" if (os.cpu_count() or 1) >= 8 else "0"
_MADV_HUGEPAGE: int | None = (
    getattr(mmap, "MADV_HUGEPAGE", None)
    if os.environ.get("KVDROP_HUGE_PAGES", _HUGE_DEFAULT) == "1"
    else None
)
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; older kernels answer EINVAL and pages fault lazily
_LIBC: Any = None


def populate_write(addr: int, nbytes: int) -> None:
    """Fault in the pages of ``[addr, addr + nbytes)`` for writing (``MADV_POPULATE_WRITE``).

    Through ctypes, which releases the GIL for the call: ``mmap.madvise`` holds it, and faulting
    in a large slot of fresh shared memory takes milliseconds (about 3 GB/s on an H200 host's
    VM), during which every other thread of the process -- the engine loop among them -- waited.
    Older kernels refuse the advice (EINVAL); the pages are then faulted in by the copy."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(None, use_errno=True)
            _LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, AttributeError):
            _LIBC = False
    if not _LIBC:
        return
    page = mmap.PAGESIZE
    start = addr - addr % page
    _LIBC.madvise(start, addr + nbytes - start, _MADV_POPULATE_WRITE)


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
    default an eighth of the machine's memory, 1 to 16 GiB; 0 disables recycling). Fresh
    mappings ask for transparent huge pages on hosts of 8+ CPUs (env ``KVDROP_HUGE_PAGES``).
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
        mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        # Transparent huge pages: one fault (and one zeroing) per 2 MiB instead of per 4 KiB --
        # the case of every retrieved tensor its caller keeps (see _MADV_HUGEPAGE).
        if _MADV_HUGEPAGE is not None:
            try:
                mm.madvise(_MADV_HUGEPAGE)
            except OSError:
                pass  # THP disabled ("never"): 4 KiB pages as before
        if populate:  # fault the pages in one call (~1.5x faster than on first touch)
            buf = (ctypes.c_ubyte * size).from_buffer(mm)
            populate_write(ctypes.addressof(buf), size)
            del buf
        return mm

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
    """Threads that large copies use: ``KVDROP_COPY_THREADS``, default min(16, CPU count).

    One thread's ``memmove`` moves a fraction of a host's memory bandwidth (7 GB/s of 39 on an
    H200 host with eight), so a 16-core host uses all its cores as ``torch``'s ``copy_`` does."""
    env = os.environ.get("KVDROP_COPY_THREADS")
    if env is not None and env.strip().isdigit() and int(env) > 0:
        return int(env)
    return max(1, min(16, os.cpu_count() or 1))


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


def shm_copy_mode() -> str:
    """How shm retrieves copy slots out: ``KVDROP_SHM_COPY`` = ``torch`` (one ``index_select``
    over the whole retrieve, parallel in torch's own threads, no Python between rows; default
    with 8 or more CPUs) or ``threads`` (row ``memmove``s on the copy threads; default below).
    Measured: a 16-core H200 host retrieved 28.6 GB/s with ``torch`` and 14.6 with ``threads``;
    a loaded 2-core VM 1.9 and 4.6 (OpenMP teams wait for descheduled threads there)."""
    default = "torch" if (os.cpu_count() or 1) >= 8 else "threads"
    mode = os.environ.get("KVDROP_SHM_COPY", default)
    return mode if mode in ("threads", "torch") else default


def gather_spans(out: torch.Tensor, pool: torch.Tensor, offsets: Sequence[int], span: int) -> None:
    """Fill contiguous ``out`` (``num_rows * len(offsets) * span`` bytes, row-major over (row,
    chunk)) with ``pool[offsets[j] + r * span :][:span]`` for row ``r`` and chunk ``j``: the
    layout of a ``[lead, L, T, W]`` tensor assembled from per-chunk slots. One ``index_select``
    over rows of ``g = gcd(span, offsets)`` bytes of the uint8 ``pool``."""
    flat = out.view(-1).view(torch.uint8)
    num_rows = flat.numel() // (span * max(len(offsets), 1))
    if not offsets or num_rows == 0:
        return
    grain = math.gcd(span, *offsets)
    starts = (
        torch.tensor(offsets, dtype=torch.int64)[None, :] + span * torch.arange(num_rows)[:, None]
    )
    index = (starts[..., None] + torch.arange(0, span, grain)).flatten() // grain
    rows = pool[: pool.numel() // grain * grain].view(-1, grain)
    torch.index_select(rows, 0, index, out=flat.view(-1, grain))
