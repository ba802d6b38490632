"""The L1 pool's bytes: anonymous memory, or a POSIX shared-memory file clients can map.

The first ``HEADER_BYTES`` hold a magic string and the server's instance id, so a client can check
that the segment it mapped belongs to the server it talks to.
"""

from __future__ import annotations

import mmap
import os
import uuid

import torch

__all__ = ["HEADER_BYTES", "MAGIC", "Pool", "shm_path", "unique_shm_name"]

MAGIC = b"KVDROPL1"
HEADER_BYTES = 4096
_SHM_DIR = "/dev/shm"


def shm_path(name: str) -> str:
    """Path of the POSIX shared-memory object ``name`` (Linux: a tmpfs file)."""
    return os.path.join(_SHM_DIR, name)


def unique_shm_name(prefix: str = "kvdrop") -> str:
    """A shared-memory name no other server uses (``--shm-name`` for a server started here)."""
    return f"{prefix}_{os.getpid()}_{uuid.uuid4().hex[:8]}"


class Pool:
    """``nbytes`` of memory as a flat uint8 tensor (``.data``), shared through /dev/shm if named."""

    def __init__(self, nbytes: int, shm_name: str | None = None, lazy: bool = True) -> None:
        self.nbytes = HEADER_BYTES + nbytes
        self.shm_name = shm_name
        self.instance_id = uuid.uuid4().hex
        self._mm: mmap.mmap | None = None
        self._path: str | None = None
        if shm_name is None:
            # No MADV_HUGEPAGE: with THP defrag=madvise, faults may stall for seconds compacting.
            self._mm = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.data = torch.frombuffer(self._mm, dtype=torch.uint8)
        else:
            path = shm_path(shm_name)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                raise FileExistsError(
                    f"shared memory {path} already exists (another server, or a crashed one); "
                    f"choose another --shm-name or remove the file if no server uses it"
                ) from None
            self._path = path
            try:
                if lazy:
                    os.ftruncate(fd, self.nbytes)
                else:
                    os.posix_fallocate(fd, 0, self.nbytes)
                self._mm = mmap.mmap(fd, self.nbytes)
            except BaseException:
                os.close(fd)
                self.unlink()
                raise
            os.close(fd)
            self.data = torch.frombuffer(self._mm, dtype=torch.uint8)
        if not lazy:
            self.data.zero_()
        header = MAGIC + self.instance_id.encode("ascii")
        self.data[: len(header)].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))

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
        """Unlink the segment and drop the mapping."""
        self.unlink()
        self.data = torch.empty(0, dtype=torch.uint8)
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # a tensor view is still alive; the mapping goes with it
            self._mm = None
