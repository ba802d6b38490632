"""The shared-memory segment format, for the server that creates a pool segment and the client
that maps it (one owner: the transport; the server imports it, never the other way round).

A segment is a POSIX shared-memory file in /dev/shm. Its first :data:`HEADER_BYTES` hold
:data:`MAGIC`, the server's instance id (32 hex characters) and ``"pid N"``; the pool's slots
follow. A client maps a segment only when its header names the instance it talks to, and a
server reclaims a segment with the magic whose owner is gone.
"""

from __future__ import annotations

import os

__all__ = [
    "HEADER_BYTES",
    "MAGIC",
    "SHM_DIR",
    "belongs_to",
    "header_pid",
    "segment_header",
    "shm_path",
]

#: Segment magic; "L2" segments are locked by their live owner (older "L1" ones were not).
MAGIC = b"KVDROPL2"
#: Bytes before the first slot.
HEADER_BYTES = 4096
#: Where POSIX shared-memory objects live (Linux tmpfs).
SHM_DIR = "/dev/shm"
_INSTANCE_CHARS = 32


def shm_path(name: str) -> str:
    """Path of the POSIX shared-memory object ``name`` (Linux: a tmpfs file)."""
    return os.path.join(SHM_DIR, name)


def segment_header(instance_id: str, pid: int) -> bytes:
    """The header a server writes at offset 0 of its segment."""
    if len(instance_id) != _INSTANCE_CHARS:
        raise ValueError(f"instance id must be {_INSTANCE_CHARS} characters, got {instance_id!r}")
    return MAGIC + instance_id.encode("ascii") + f"pid {pid}".encode("ascii")


def belongs_to(head: bytes, instance: object) -> bool:
    """Whether a segment whose first bytes are ``head`` is the pool of server ``instance``."""
    expected = MAGIC + str(instance or "").encode("ascii", "replace")
    return bytes(head[: len(expected)]) == expected


def header_pid(head: bytes) -> str:
    """The ``"pid N"`` a header names ("" when unreadable)."""
    rest = bytes(head[len(MAGIC) + _INSTANCE_CHARS :])
    return rest.split(b"\0", 1)[0].decode("ascii", "replace").strip()
