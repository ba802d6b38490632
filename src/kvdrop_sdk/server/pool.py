"""The L1 pool's bytes: anonymous memory, or a POSIX shared-memory file clients can map.

The first ``HEADER_BYTES`` hold a magic string, the server's instance id and its pid, so a client
can check that the segment it mapped belongs to the server it talks to (the format is
:mod:`kvdrop_sdk.transport.shm`'s, shared with the client). A server holds an
exclusive ``flock`` on its segment for as long as it runs: a segment with the magic and no lock
holder belongs to a server that died without cleaning up (SIGKILL, OOM kill), and is reclaimed
(``reap_stale_segments``, and a restart under the same ``--shm-name``). Files without the magic
are never touched.

``check_pool_size`` refuses, before anything is allocated, a pool the machine cannot hold. A lazy
shared pool gets its pages only as slots are used, and /dev/shm may fill up after the start (other
processes write there too); touching a page tmpfs cannot back is a SIGBUS in every process that
maps it. So ``back(offset, nbytes)`` reserves a slot's pages with ``posix_fallocate`` before the
slot is handed out: it fails with ``PoolSpaceError`` instead, which the server answers as
``no_space``, and stays up. Backed blocks stay backed (as touched pages stay resident).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import threading
import uuid

import torch

from kvdrop_sdk.transport.shm import (
    HEADER_BYTES,
    MAGIC,
    SHM_DIR,
    header_pid,
    segment_header,
    shm_path,
)

__all__ = [
    "HEADER_BYTES",
    "MAGIC",
    "Pool",
    "PoolSizeError",
    "PoolSpaceError",
    "SegmentInUseError",
    "check_pool_size",
    "reap_stale_segments",
    "shm_path",
    "unique_shm_name",
]

log = logging.getLogger("kvdrop_sdk.server")

_GIB = 1024**3
#: Granularity of ``Pool.back`` (bytes reserved per ``posix_fallocate`` call at most).
BACK_BLOCK = 2 << 20


class PoolSizeError(ValueError):
    """The pool does not fit in this machine's memory or in /dev/shm (the message says what to
    change)."""


class PoolSpaceError(RuntimeError):
    """/dev/shm has no room left for pages of a lazy shared pool (the message says what to do)."""


class SegmentInUseError(FileExistsError):
    """The shared-memory name belongs to a running server."""


def unique_shm_name(prefix: str = "kvdrop") -> str:
    """A shared-memory name no other server uses (``--shm-name`` for a server started here)."""
    return f"{prefix}_{os.getpid()}_{uuid.uuid4().hex[:8]}"


def _gib(n: int) -> str:
    """``n`` bytes in GiB for messages: "0.25", "23.4", "100,000"."""
    return f"{n / _GIB:,.2f}".rstrip("0").rstrip(".")


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                name, _, rest = line.partition(":")
                out[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def _cgroup_limit() -> int | None:
    try:
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as fh:
            text = fh.read().strip()
        return None if text == "max" else int(text)
    except (OSError, ValueError):
        return None


def check_pool_size(
    nbytes: int,
    *,
    shm: bool,
    lazy: bool,
    memory: int | None = None,
    shm_free: int | None = None,
    available: int | None = None,
) -> None:
    """Raise ``PoolSizeError`` when a pool of ``nbytes`` cannot be held: more than the machine's
    memory (or the cgroup's limit), more than the memory available now when every page is touched
    at start (``lazy=False``), or more than /dev/shm's free space for a shared pool (tmpfs fails
    writes past it with SIGBUS). Unknown figures (None and not readable) are not checked."""
    info = _meminfo()
    if memory is None:
        limits = [v for v in (info.get("MemTotal"), _cgroup_limit()) if v]
        memory = min(limits) if limits else None
    if memory is not None and nbytes > memory:
        raise PoolSizeError(
            f"--l1-size-gb asks for a pool of {_gib(nbytes)} GiB, more than this machine's "
            f"{_gib(memory)} GiB of memory; lower --l1-size-gb"
        )
    if not lazy:
        if available is None:
            available = info.get("MemAvailable")
        if available is not None and nbytes > available:
            raise PoolSizeError(
                f"--no-l1-use-lazy touches the whole {_gib(nbytes)} GiB pool at start but only "
                f"{_gib(available)} GiB of memory is available; lower --l1-size-gb or allocate "
                "on demand (--l1-use-lazy)"
            )
    if shm:
        if shm_free is None:
            shm_free = _shm_free()
        if shm_free is not None and nbytes > shm_free:
            raise PoolSizeError(
                f"a shared pool of {_gib(nbytes)} GiB does not fit: {SHM_DIR} has "
                f"{_gib(shm_free)} GiB free; lower --l1-size-gb or enlarge {SHM_DIR}"
            )


def _shm_free() -> int | None:
    """Free bytes in /dev/shm, or None when unknown."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _claim_stale(path: str) -> bool:
    """Remove ``path`` if it is the segment of a dead server; True if removed.

    ``SegmentInUseError`` if a live server holds it; ``FileExistsError`` if it is not a kvdrop
    segment (someone else's file: left alone).
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise FileExistsError(
            f"shared memory {path} already exists and cannot be opened ({exc.strerror}); "
            "choose another --shm-name"
        ) from None
    try:
        head = os.pread(fd, 64, 0)
        if not head.startswith(MAGIC):
            raise FileExistsError(
                f"shared memory {path} already exists and is not a kvdrop segment; choose "
                "another --shm-name or remove the file if nothing uses it"
            )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = header_pid(head)
            raise SegmentInUseError(
                f"shared memory {path} is in use by a running server ({pid or 'pid unknown'}); "
                "stop it or choose another --shm-name"
            ) from None
        mine = os.fstat(fd)
        try:
            now = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino):
            return False  # replaced meanwhile by a new segment: not ours to remove
        os.unlink(path)
        return True
    finally:
        os.close(fd)


def reap_stale_segments() -> list[str]:
    """Remove every kvdrop segment in /dev/shm whose server died (magic present, no lock holder,
    readable by this user); returns the paths removed."""
    removed = []
    try:
        entries = list(os.scandir(SHM_DIR))
    except OSError:
        return removed
    uid = os.getuid()
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
            if not entry.is_file(follow_symlinks=False) or st.st_uid != uid:
                continue
            if st.st_size < HEADER_BYTES:
                continue
            if _claim_stale(entry.path):
                removed.append(entry.path)
        except OSError:  # in use, someone else's, or gone meanwhile
            continue
    return removed


class Pool:
    """``nbytes`` of memory as a flat uint8 tensor (``.data``), shared through /dev/shm if named."""

    def __init__(self, nbytes: int, shm_name: str | None = None, lazy: bool = True) -> None:
        self.nbytes = HEADER_BYTES + nbytes
        self.shm_name = shm_name
        self.instance_id = uuid.uuid4().hex
        self._mm: mmap.mmap | None = None
        self._path: str | None = None
        self._lock_fd: int | None = None
        self._backed = bytearray(-(-self.nbytes // BACK_BLOCK))  # 1 = pages reserved
        self._back_lock = threading.Lock()
        try:
            if shm_name is None:
                # No MADV_HUGEPAGE: with THP defrag=madvise, faults may stall for seconds.
                self._mm = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            else:
                self._mm = self._create_segment(shm_path(shm_name), lazy)
        except OSError as exc:
            if exc.errno in (errno.ENOMEM, errno.ENOSPC):
                raise PoolSizeError(
                    f"cannot allocate a pool of {_gib(nbytes)} GiB ({exc.strerror}); lower "
                    "--l1-size-gb" + (" or enlarge /dev/shm" if shm_name else "")
                ) from None
            raise
        if not lazy or shm_name is None:
            self._backed[:] = b"\x01" * len(self._backed)  # all reserved, or not tmpfs at all
        else:
            try:
                self.back(0, HEADER_BYTES)
            except PoolSpaceError as exc:
                self.close()
                raise PoolSizeError(str(exc)) from None
        self.data = torch.frombuffer(self._mm, dtype=torch.uint8)
        if not lazy:
            self.data.zero_()
        header = segment_header(self.instance_id, os.getpid())
        self.data[: len(header)].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))

    def _create_segment(self, path: str, lazy: bool) -> mmap.mmap:
        if os.path.lexists(path) and _claim_stale(path):
            log.warning("reclaimed %s, left behind by a server that died", path)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            raise FileExistsError(
                f"shared memory {path} already exists (another server is starting with this "
                "name); choose another --shm-name"
            ) from None
        self._path = path
        try:
            # Held until close(): while it is held, nobody takes the segment for a stale one.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if lazy:
                os.ftruncate(fd, self.nbytes)
            else:
                os.posix_fallocate(fd, 0, self.nbytes)
            mm = mmap.mmap(fd, self.nbytes)
        except BaseException:
            os.close(fd)
            self.unlink()
            raise
        self._lock_fd = fd
        return mm

    def back(self, offset: int, nbytes: int) -> None:
        """Make sure the pages of ``[offset, offset + nbytes)`` are reserved in /dev/shm (a no-op
        for anonymous or fully reserved pools); ``PoolSpaceError`` when /dev/shm is full."""
        first, last = offset // BACK_BLOCK, (offset + max(nbytes, 1) - 1) // BACK_BLOCK
        if all(self._backed[first : last + 1]):
            return
        with self._back_lock:
            for block in range(first, last + 1):
                if self._backed[block] or self._lock_fd is None:
                    continue
                start = block * BACK_BLOCK
                length = min(BACK_BLOCK, self.nbytes - start)
                try:
                    os.posix_fallocate(self._lock_fd, start, length)
                except OSError as exc:
                    free = _shm_free()
                    raise PoolSpaceError(
                        f"{SHM_DIR} is full ({exc.strerror}; {_gib(free or 0)} GiB free): the "
                        f"pool could not reserve {length} bytes for this request; free space in "
                        f"{SHM_DIR}, or restart the server with a smaller --l1-size-gb or "
                        "--no-l1-use-lazy (which reserves the whole pool at start)"
                    ) from None
                self._backed[block] = 1

    @property
    def buffer(self) -> mmap.mmap:
        """The pool's memory as a buffer (for zero-copy sends of pinned slots)."""
        assert self._mm is not None
        return self._mm

    def unlink(self) -> None:
        """Remove the shared-memory file (idempotent); mapped clients keep their mapping."""
        if self._path is not None:
            try:
                os.unlink(self._path)
            except FileNotFoundError:
                pass
            self._path = None

    def close(self) -> None:
        """Unlink the segment, drop the lock and the mapping."""
        self.unlink()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        self.data = torch.empty(0, dtype=torch.uint8)
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # a tensor view is still alive; the mapping goes with it
            self._mm = None
