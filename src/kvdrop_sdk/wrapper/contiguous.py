"""Moves a context's tensors to and from the server: shared memory when possible, else the socket.

Shared memory: the server's pool is a /dev/shm file this process maps; a store reserves slots,
copies each chunk straight into its slot (``torch`` ``copy_``, multi-threaded) and commits; a
retrieve pins the slots, copies them out into one contiguous tensor and releases them.
Socket: the tensor's bytes travel as one zero-copy ZMQ frame each way.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import time
from typing import Any
from urllib.parse import urlsplit

import torch

from kvdrop_sdk.cache_kind import CacheKind
from kvdrop_sdk.errors import SDKError
from kvdrop_sdk.layout import CacheLayout, dtype_name
from kvdrop_sdk.protocol import RpcClient

__all__ = ["MODES", "ContiguousTransferWrapper", "TransferHelper", "tensor_buffer"]

log = logging.getLogger("kvdrop_sdk.transfer")

MODES = ("auto", "shm", "socket")
_MAGIC = b"KVDROPL1"
_LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0", ""}


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


class ContiguousTransferWrapper:
    """The transfer helper a context holds (``ctx.transfer_ctx``); ``mode`` is "shm" or "socket"."""

    def __init__(
        self, rpc: RpcClient, server_config: dict[str, Any], url: str, transport: str = "auto"
    ) -> None:
        if transport not in MODES:
            raise SDKError(f"transport {transport!r} is unknown; expected one of {MODES}")
        self._rpc = rpc
        self._mm: mmap.mmap | None = None
        self._pool: torch.Tensor | None = None
        self.chunk_size = int(server_config["chunk_size"])
        self.mode = "socket"
        if transport == "socket":
            return
        reason = self._map(server_config, url)
        if reason is None:
            self.mode = "shm"
        elif transport == "shm":
            raise SDKError(f"transport='shm' was requested but {reason}")
        else:
            log.debug("using the socket transport: %s", reason)

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
        path = os.path.join("/dev/shm", name)
        size = cfg.get("shm_bytes")
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            return f"shared memory {path} cannot be opened ({exc})"
        try:
            if not isinstance(size, int) or os.fstat(fd).st_size != size:
                return f"shared memory {path} has an unexpected size"
            mm = mmap.mmap(fd, size)
        except (OSError, ValueError) as exc:
            return f"shared memory {path} cannot be mapped ({exc})"
        finally:
            os.close(fd)
        expected = _MAGIC + str(cfg.get("instance", "")).encode("ascii", "replace")
        if mm[: len(expected)] != expected:
            mm.close()
            return f"shared memory {path} belongs to another server instance"
        self._mm = mm
        self._pool = torch.frombuffer(mm, dtype=torch.uint8)
        return None

    def _slot(self, offset: Any, nbytes: int, layout: CacheLayout, kind: CacheKind) -> torch.Tensor:
        assert self._pool is not None
        if not isinstance(offset, int) or offset < 0 or offset + nbytes > self._pool.numel():
            raise SDKError(f"server returned slot offset {offset!r} outside the shared pool")
        flat = self._pool[offset : offset + nbytes].view(layout.dtype)
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
        if self.mode == "socket":
            kv = kv.contiguous()
            header = {
                **fields,
                "dtype": dtype_name(layout.dtype),
                "shape": list(kv.shape),
            }
            reply, _ = self._rpc.call("put", header, [token_bytes, tensor_buffer(kv)])
            return int(reply["stored"])
        reply, _ = self._rpc.call("reserve", {**fields, "lease_s": lease_s}, [token_bytes])
        lease = reply.get("lease")
        if lease is None:
            return 0
        started = time.monotonic()
        c = self.chunk_size
        try:
            if reply.get("nbytes") != layout.nbytes(kind, c):
                raise SDKError(f"server slot size {reply.get('nbytes')} does not match the layout")
            for i, off in zip(reply["chunks"], reply["offsets"]):
                if time.monotonic() - started > 0.8 * lease_s:
                    raise SDKError(f"store took longer than its {lease_s:g} s reservation")
                self._slot(off, reply["nbytes"], layout, kind).copy_(kv[:, :, i * c : (i + 1) * c])
        except BaseException:
            self._rpc.call("abort", {"lease": lease})
            raise
        reply, _ = self._rpc.call("commit", {"lease": lease})
        return int(reply["stored"])

    # -- retrieve ----------------------------------------------------------------------------------
    def retrieve(
        self,
        fields: dict[str, Any],
        token_bytes: bytes,
        layout: CacheLayout,
        kind: CacheKind,
        lease_s: float,
    ) -> torch.Tensor | None:
        """The longest cached chunk-aligned prefix as one contiguous tensor, or None."""
        if self.mode == "socket":
            reply, frames = self._rpc.call("get", fields, [token_bytes])
            n = int(reply.get("num_tokens", 0))
            if n == 0:
                return None
            shape = layout.shape(kind, n)
            if reply.get("shape") != list(shape) or len(frames) != 1:
                raise SDKError(f"server sent shape {reply.get('shape')}, expected {list(shape)}")
            buf = frames[0].buffer
            if len(buf) != layout.nbytes(kind, n):
                raise SDKError(f"server sent {len(buf)} bytes, expected {layout.nbytes(kind, n)}")
            return torch.frombuffer(buf, dtype=layout.dtype).view(shape)
        reply, _ = self._rpc.call("pin", {**fields, "lease_s": lease_s}, [token_bytes])
        lease = reply.get("lease")
        if lease is None:
            return None
        c = self.chunk_size
        offsets = reply["offsets"]
        out = torch.empty(layout.shape(kind, len(offsets) * c), dtype=layout.dtype)
        try:
            if reply.get("nbytes") != layout.nbytes(kind, c):
                raise SDKError(f"server slot size {reply.get('nbytes')} does not match the layout")
            for j, off in enumerate(offsets):
                out[:, :, j * c : (j + 1) * c].copy_(self._slot(off, reply["nbytes"], layout, kind))
        finally:
            released, _ = self._rpc.call("release", {"lease": lease})
        valid = int(released["valid_chunks"])
        if valid == 0:
            return None
        if valid < len(offsets):
            # The pin expired and some chunks were evicted meanwhile: return what is known good.
            out = out[:, :, : valid * c].contiguous()
        return out

    def close(self) -> None:
        """Unmap the shared pool (tensors already returned are independent copies)."""
        self._pool = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass
            self._mm = None


TransferHelper = ContiguousTransferWrapper
