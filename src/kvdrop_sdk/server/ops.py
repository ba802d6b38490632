"""The server's request operations: one method per op, and the dispatch table that names them.

``RequestOps`` is the part of ``Server`` that answers a decoded request: it checks the fields,
the model's registered layout and the payload frames, then works on the chunk store, the pool and
the window store. ``HANDLERS`` maps each op name to its method; ``OPS`` (the names the server
understands) is derived from it, so the two cannot disagree.

Every request that names a layout (``layout`` in its header: what its client read from the
server) is refused with ``layout_changed`` when the registration differs: other bytes, or other
RoPE parameters when the request names some. Slots of a shared-memory pool are backed by
/dev/shm pages (``Pool.back``) before a client is told where to write, so a /dev/shm that filled
up after the server started is a ``no_space`` answer instead of a SIGBUS in client or server.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import zmq

from kvdrop_rope import RopeConfig, rerotate_rows
from kvdrop_sdk.cache_kind import CacheKind
from kvdrop_sdk.hashing import TOKEN_BYTES, chunk_keys, decode_tokens, encode_tokens, root_hash
from kvdrop_sdk.keep import decode_index
from kvdrop_sdk.layout import CacheLayout, dtype_name
from kvdrop_sdk.protocol import ProtocolError, check_salt
from kvdrop_sdk.server.config import ServerConfig
from kvdrop_sdk.server.pool import Pool, PoolSpaceError
from kvdrop_sdk.server.store import INTERNAL_OWNER, ChunkStore, StoreError
from kvdrop_sdk.server.windows import (
    WindowStore,
    parse_put,
    record_kind,
    reply_get,
    window_key,
)
from kvdrop_sdk.transport.buffers import copy_rows
from kvdrop_sdk.validate import is_int, is_number

__all__ = ["HANDLERS", "MAX_TOKEN_BYTES", "OPS", "Reply", "RequestOps", "owner_of"]

#: Largest token frame accepted (16 Mi tokens).
MAX_TOKEN_BYTES = TOKEN_BYTES * (1 << 24)

Reply = tuple[dict[str, Any], list[Any]]


def owner_of(header: dict[str, Any], peer: bytes) -> str:
    """Who owns the leases a request creates: its client token, else its connection."""
    client = header.get("client")
    if isinstance(client, str) and 0 < len(client) <= 128:
        return "c:" + client
    return "p:" + peer.hex()


def _field(header: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = header.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise ProtocolError("bad_field", f"field {name!r} must be {names}, got {value!r}")
    return value


def _salt(header: dict[str, Any]) -> str:
    try:
        return check_salt(header.get("salt", ""), "field 'salt'")
    except (TypeError, ValueError) as exc:
        raise ProtocolError("bad_field", str(exc)) from None


def _chunk_range(header: dict[str, Any], num_keys: int) -> tuple[int, int]:
    """``get``'s optional ``first_chunk`` (default 0) and ``max_chunks`` (default all): the
    chunks ``[first, end)`` of the prefix to send."""
    first = header.get("first_chunk", 0)
    if not is_int(first) or first < 0:
        raise ProtocolError("bad_field", f"field 'first_chunk' must be an int >= 0, got {first!r}")
    count = header.get("max_chunks", num_keys)
    if not is_int(count) or count < 1:
        raise ProtocolError("bad_field", f"field 'max_chunks' must be an int >= 1, got {count!r}")
    return first, min(num_keys, first + count)


class RequestOps:
    """The ops of a server (mixed into ``Server``, which sets these attributes in ``start``)."""

    config: ServerConfig
    pool: Pool | None
    store: ChunkStore | None
    windows: WindowStore | None
    _tls: threading.local

    @property
    def instance(self) -> str | None:
        """This start's instance id (sent in every reply and written in the segment header)."""
        return self.pool.instance_id if self.pool else None

    # -- checks --------------------------------------------------------------------------------
    def _model_kind(self, header: dict[str, Any]) -> tuple[str, CacheKind]:
        model = _field(header, "model", str)
        try:
            kind = CacheKind.parse(header.get("kind"))
        except ValueError as exc:
            raise ProtocolError("unknown_kind", str(exc)) from None
        if kind is CacheKind.QUERY and not self.config.transfer_query:
            raise StoreError(
                "query_disabled",
                "this server does not accept query tensors; start it with "
                "`kvdrop server --enable transfer_query`",
            )
        expected = kind.server_model_name(kind.base_model_name(model))
        if expected != model:
            raise ProtocolError(
                "bad_model", f"{kind.value}-kind model names look like {expected!r}, got {model!r}"
            )
        return model, kind

    def _layout(self, model: str, kind: CacheKind) -> CacheLayout:
        assert self.store is not None
        layout = self.store.layout(model, kind.value)
        if layout is None:
            raise StoreError(
                "unregistered",
                f"no layout registered for model {model!r} kind {kind.value!r}; an engine "
                "registers it when it connects, or pass layout=CacheLayout(num_layers, num_heads, "
                "head_dim, dtype) to connect() to register it yourself",
            )
        return layout

    def _checked_layout(self, header: dict[str, Any], model: str, kind: CacheKind) -> CacheLayout:
        """The registered layout; ``layout_changed`` when the request says it assumes another
        (its client read the layout before a re-registration or a server restart)."""
        layout = self._layout(model, kind)
        assumed = header.get("layout")
        if assumed is not None:
            try:
                same = layout.matches(CacheLayout.from_json(assumed))
            except ValueError as exc:
                raise ProtocolError("bad_layout", f"bad layout: {exc}") from None
            if not same:
                raise StoreError(
                    "layout_changed",
                    f"model {model!r} kind {kind.value!r} is registered with {layout.to_json()}, "
                    f"but the request assumes {assumed}; read the layout again (connect())",
                )
        return layout

    @property
    def _owner(self) -> str:
        return str(getattr(self._tls, "owner", "") or "")

    def _keys(
        self, header: dict[str, Any], frames: list[zmq.Frame], model: str, kind: CacheKind
    ) -> tuple[list[bytes], int]:
        if not frames:
            raise ProtocolError("bad_frames", "missing the token-id frame")
        raw = frames[0].buffer
        if len(raw) > MAX_TOKEN_BYTES or len(raw) % TOKEN_BYTES:
            raise ProtocolError(
                "bad_tokens",
                f"token frame must be a multiple of {TOKEN_BYTES} bytes and at most "
                f"{MAX_TOKEN_BYTES}, got {len(raw)}",
            )
        keys = chunk_keys(root_hash(model, kind.value, _salt(header)), raw, self.config.chunk_size)
        return keys, len(raw) // TOKEN_BYTES

    def _lease_s(self, header: dict[str, Any]) -> float:
        value = header.get("lease_s", 60.0)
        if not is_number(value) or not value > 0:
            raise ProtocolError(
                "bad_field", f"field 'lease_s' must be a positive number, got {value!r}"
            )
        return float(min(value, self.config.max_lease_s))

    def _slot(self, offset: int, layout: CacheLayout, kind: CacheKind) -> torch.Tensor:
        assert self.pool is not None
        nbytes = layout.nbytes(kind, self.config.chunk_size)
        flat = self.pool.data[offset : offset + nbytes].view(layout.dtype)
        return flat.view(layout.shape(kind, self.config.chunk_size))

    def _need_shm(self) -> None:
        if self.config.shm_name is None:
            raise StoreError(
                "no_shm", "this server has no shared memory; use the socket ops (get/put)"
            )

    def _back(self, lid: str, owner: str, offsets: list[int], nbytes: int) -> None:
        """Back the slots of reservation ``lid`` with memory before anyone writes to them; on a
        full /dev/shm the reservation is dropped and the answer is ``no_space``."""
        assert self.pool is not None and self.store is not None
        try:
            for off in offsets:
                self.pool.back(off, nbytes)
        except PoolSpaceError as exc:
            self.store.abort(lid, owner=owner)
            raise StoreError("no_space", str(exc)) from None

    # -- ops -----------------------------------------------------------------------------------
    def op_ping(self, header: dict[str, Any], frames: list[zmq.Frame]) -> Reply:
        """Liveness and the instance id."""
        return {"instance": self.instance}, []

    def op_register(self, header: dict[str, Any], frames: list[zmq.Frame]) -> Reply:
        """Register a model's layout (the rules: ``ChunkStore.register``)."""
        assert self.store is not None
        model, kind = self._model_kind(header)
        try:
            layout = CacheLayout.from_json(header.get("layout"))
        except ValueError as exc:
            raise ProtocolError("bad_layout", f"bad layout: {exc}") from None
        registered = self.store.register(model, kind.value, layout, owner=self._owner)
        return {"layout": registered.to_json()}, []

    def op_layout(self, header: dict[str, Any], frames: list[zmq.Frame]) -> Reply:
        """The registered layout of (model, kind)."""
        model, kind = self._model_kind(header)
        return {"layout": self._layout(model, kind).to_json()}, []

    def op_lookup(self, header: dict[str, Any], frames: list[zmq.Frame]) -> Reply:
        """How many leading tokens are cached."""
        assert self.store is not None
        model, kind = self._model_kind(header)
        self._checked_layout(header, model, kind)
        keys, _ = self._keys(header, frames, model, kind)
        return {"num_tokens": self.store.lookup(keys) * self.config.chunk_size}, []

    def op_pin(self, header: dict[str, Any], frames: list[zmq.Frame]) -> Reply:
        """Pin the cached prefix for a shared-memory read; the slots' offsets."""
        assert self.store is not None
        self._need_shm()
        model, kind = self._model_kind(header)
        layout = self._checked_layout(header, model, kind)
        keys, _ = self._keys(header, frames, model, kind)
        lease_s = self._lease_s(header)
        lid, slots = self.store.pin(keys, lease_s, owner=self._owner)
        return {
            "lease": lid,
            "lease_s": lease_s,
            "offsets": [off for off, _ in slots],
            "nbytes": layout.nbytes(kind, self.config.chunk_size),
            "num_tokens": len(slots) * self.config.chunk_size,
        }, []

    def op_release(self, header: dict[str, Any], frames: list[zmq.Frame]) -> Reply:
        """End a pin; how many chunks were still intact."""
        assert self.store is not None
        lease = _field(header, "lease", str)
        return {"valid_chunks": self.store.release(lease, owner=self._owner)}, []

    def op_reserve(self, header: dict[str, Any], frames: list[zmq.Frame]) -> Reply:
        """Reserve slots for a shared-memory write; their offsets."""
        assert self.store is not None
        self._need_shm()
        model, kind = self._model_kind(header)
        layout = self._checked_layout(header, model, kind)
        keys, _ = self._keys(header, frames, model, kind)
        nbytes = layout.nbytes(kind, self.config.chunk_size)
        owner, lease_s = self._owner, self._lease_s(header)
        lid, slots, dup, dropped = self.store.reserve(
            keys, nbytes, lease_s, owner=owner, tag=(model, kind.value)
        )
        if lid is not None:
            self._back(lid, owner, [off for _, off in slots], nbytes)
        return {
            "lease": lid,
            "lease_s": lease_s,
            **self._dropped_reason(dropped),
            "chunks": [i for i, _ in slots],
            "offsets": [off for _, off in slots],
            "nbytes": nbytes,
            "duplicates": dup,
            "dropped": dropped,
        }, []

    def op_commit(self, header: dict[str, Any], frames: list[zmq.Frame]) -> Reply:
        """Make a reservation's chunks visible."""
        assert self.store is not None
        lease = _field(header, "lease", str)
        return {"stored": self.store.commit(lease, owner=self._owner)}, []

    def op_abort(self, header: dict[str, Any], frames: list[zmq.Frame]) -> Reply:
        """Drop a reservation."""
        assert self.store is not None
        self.store.abort(_field(header, "lease", str), owner=self._owner)
        return {}, []

    def op_get(self, header: dict[str, Any], frames: list[zmq.Frame]) -> Reply:
        """The cached prefix's bytes as frames (socket read)."""
        assert self.store is not None and self.pool is not None
        model, kind = self._model_kind(header)
        layout = self._checked_layout(header, model, kind)
        keys, _ = self._keys(header, frames, model, kind)
        first, end = _chunk_range(header, len(keys))
        full = layout.shape(kind, 1)[0]
        lead = header.get("lead", full)
        if not is_int(lead) or not 1 <= lead <= full:
            raise ProtocolError(
                "bad_field", f"field 'lead' must be an int in [1, {full}], got {lead!r}"
            )
        # Pinned until ZMQ has sent the slots' bytes (no expiry: the worker unpins them). The
        # lease is the server's own: no client can release it early. With a range, the prefix
        # up to its end is pinned and only the range's chunks are sent (a client splits a large
        # read into ranges fetched in parallel, on several connections).
        lid, slots = self.store.pin(keys[:end], float("inf"), owner=INTERNAL_OWNER)
        if lid is not None and len(slots) <= first:
            self.store.release(lid, owner=INTERNAL_OWNER)
            return {"num_tokens": len(slots) * self.config.chunk_size, "first_chunk": first}, []
        if lid is None:
            return {"num_tokens": 0}, []
        try:
            # Chunks in slots a stalled writer may reach are sent from a checked copy.
            mem = memoryview(self.pool.buffer)
            copies = self.store.verified_copy(lid, lambda o, n: bytes(mem[o : o + n]))
            found = len(copies)
            if found <= first:
                self.store.release(lid, owner=INTERNAL_OWNER)
                return {"num_tokens": found * self.config.chunk_size, "first_chunk": first}, []
            # One frame per (chunk, kv/layer row): bounded frame sizes stream best over TCP.
            # ``lead`` (optional): only the first leading rows of each chunk (1: the keys).
            num_rows = lead * layout.num_layers
            span = self.config.chunk_size * layout.width * layout.itemsize
            sources = [
                memoryview(copy) if copy is not None else mem[off:]
                for copy, (off, _) in zip(copies[first:], slots[first:found], strict=True)
            ]
            slots = slots[first:found]
            out = [src[r * span : (r + 1) * span] for src in sources for r in range(num_rows)]
        except BaseException:
            self.store.release(lid, owner=INTERNAL_OWNER)
            raise
        store = self.store
        self._tls.after_send = lambda: store.release(lid, owner=INTERNAL_OWNER)
        shape = (lead, *layout.shape(kind, len(slots) * self.config.chunk_size)[1:])
        return {
            "num_tokens": found * self.config.chunk_size,
            "first_chunk": first,
            "shape": list(shape),
            "dtype": dtype_name(layout.dtype),
        }, out

    def _put_frames(
        self, header: dict[str, Any], frames: list[zmq.Frame], model: str, kind: CacheKind
    ) -> tuple[CacheLayout, list[bytes], list[zmq.Frame]]:
        """Check a put: (layout, keys of the chunks it carries data for, the data frames)."""
        layout = self._checked_layout(header, model, kind)
        keys, num_tokens = self._keys(header, frames, model, kind)
        c = self.config.chunk_size
        if num_tokens % c or not keys:
            raise ProtocolError(
                "bad_tokens",
                f"put takes one or more whole chunks: {num_tokens} tokens, chunk size {c}",
            )
        # ``first_chunk``: the tokens frame holds the whole prefix (for the key chain) but data
        # only for chunks [first_chunk, end), so one store can be split into pipelined requests.
        first = header.get("first_chunk", 0)
        if not is_int(first) or not 0 <= first < len(keys):
            raise ProtocolError(
                "bad_field",
                f"field 'first_chunk' must be an int in [0, {len(keys)}), got {first!r}",
            )
        keys = keys[first:]
        if header.get("dtype") != dtype_name(layout.dtype):
            raise ProtocolError(
                "dtype_mismatch",
                f"data dtype {header.get('dtype')!r} but {model!r} is registered with "
                f"{dtype_name(layout.dtype)!r}",
            )
        shape = list(layout.shape(kind, len(keys) * c))
        if header.get("shape") != shape:
            raise ProtocolError(
                "shape_mismatch", f"data shape {header.get('shape')!r}, expected {shape}"
            )
        num_rows, span = shape[0] * shape[1], c * shape[3] * layout.itemsize
        data = frames[1:]
        if len(data) != len(keys) * num_rows or any(len(f.buffer) != span for f in data):
            raise ProtocolError(
                "bad_data",
                f"put takes {len(keys) * num_rows} data frames (one per chunk and kv/layer row) "
                f"of {span} bytes each; got {len(data)} frames",
            )
        return layout, keys, data

    def op_put(self, header: dict[str, Any], frames: list[zmq.Frame]) -> Reply:
        """Store chunks sent as frames (socket write); first copy wins."""
        assert self.store is not None
        model, kind = self._model_kind(header)
        layout, keys, data = self._put_frames(header, frames, model, kind)
        nbytes = layout.nbytes(kind, self.config.chunk_size)
        num_rows = layout.shape(kind, 1)[0] * layout.num_layers
        lid, slots, dup, dropped = self.store.reserve(
            keys, nbytes, self.config.max_lease_s, owner=INTERNAL_OWNER, tag=(model, kind.value)
        )
        if lid is None:
            return {"stored": 0, "duplicates": dup, "dropped": dropped}, []
        self._back(lid, INTERNAL_OWNER, [off for _, off in slots], nbytes)
        try:
            for i, off in slots:
                slot_rows = self._slot(off, layout, kind).view(num_rows, -1)
                for r in range(num_rows):
                    src = torch.frombuffer(data[i * num_rows + r].buffer, dtype=layout.dtype)
                    copy_rows(slot_rows[r], src)
        except BaseException:
            self.store.abort(lid, owner=INTERNAL_OWNER)
            raise
        stored = self.store.commit(lid, owner=INTERNAL_OWNER)
        reply = {"stored": stored, "duplicates": dup, "dropped": dropped}
        return reply | self._dropped_reason(dropped), []

    def op_keep(self, header: dict[str, Any], frames: list[zmq.Frame]) -> Reply:
        """Store the kept rows of a cached prefix under the kept tokens (an index-only edit).

        Frames: the prefix's token ids (whole chunks, all cached under ``salt``) and the kept
        indices (:func:`~kvdrop_sdk.keep.decode_index`). The rows are gathered here, their keys
        re-rotated to ``0..k-1`` with ``rope`` (``RopeConfig.to_json()``, or null: not
        re-rotated) by :func:`kvdrop_rope.rerotate_rows`, and stored under ``dst_salt``; the
        answer is ``put``'s. It reads only what ``get`` with the same fields would send, so it
        gives a client no bytes it could not read; nothing is written on a bad request."""
        assert self.store is not None and self.pool is not None
        model, kind = self._model_kind(header)
        if kind is not CacheKind.KV:
            raise ProtocolError("unknown_kind", f"keep works on the KV kind, got {kind.value!r}")
        layout = self._checked_layout(header, model, kind)
        keys, num_tokens = self._keys(header, frames, model, kind)
        c = self.config.chunk_size
        if num_tokens % c or not keys or len(frames) != 2:
            raise ProtocolError(
                "bad_frames",
                "keep takes two frames: the token ids of whole chunks "
                f"({num_tokens} tokens, chunk size {c}) and the kept indices",
            )
        try:
            index = decode_index(frames[1].buffer, num_tokens, c)
            dst_salt = check_salt(header.get("dst_salt"), "field 'dst_salt'")
        except (TypeError, ValueError) as exc:
            raise ProtocolError("bad_index", str(exc)) from None
        rope = self._keep_rope(header.get("rope"), layout)
        kept = self._gather(keys, layout, index)
        if rope is not None:
            new = torch.arange(index.numel())
            rerotate_rows(kept[0], index, new, rope, num_tokens, index.numel())
            if not bool(torch.isfinite(kept[0]).all()):
                raise StoreError(
                    "not_finite", "re-rotated keys are not finite; check the RoPE parameters"
                )
        tokens = decode_tokens(frames[0].buffer)
        dst = encode_tokens([tokens[i] for i in index.tolist()])
        dst_keys = chunk_keys(root_hash(model, kind.value, dst_salt), dst, c)
        nbytes = layout.nbytes(kind, c)
        lid, slots, dup, dropped = self.store.reserve(
            dst_keys, nbytes, self.config.max_lease_s, owner=INTERNAL_OWNER, tag=(model, kind.value)
        )
        if lid is None:
            return {"stored": 0, "duplicates": dup, "dropped": dropped}, []
        self._back(lid, INTERNAL_OWNER, [off for _, off in slots], nbytes)
        try:
            for i, off in slots:
                copy_rows(self._slot(off, layout, kind), kept[:, :, i * c : (i + 1) * c])
        except BaseException:
            self.store.abort(lid, owner=INTERNAL_OWNER)
            raise
        stored = self.store.commit(lid, owner=INTERNAL_OWNER)
        reply = {"stored": stored, "duplicates": dup, "dropped": dropped}
        return reply | self._dropped_reason(dropped), []

    def _keep_rope(self, value: Any, layout: CacheLayout) -> RopeConfig | None:
        if value is None:
            return None
        try:
            rope = RopeConfig.from_json(value)
        except (TypeError, ValueError) as exc:
            raise ProtocolError("bad_rope", f"field 'rope': {exc}") from None
        if layout.width % rope.head_dim:
            raise ProtocolError(
                "bad_rope",
                f"field 'rope': head_dim={rope.head_dim} does not divide the KV width "
                f"{layout.width}",
            )
        return rope

    def _gather(self, keys: list[bytes], layout: CacheLayout, index: torch.Tensor) -> torch.Tensor:
        """The rows at ``index`` of the cached chunks ``keys`` (all of them must be cached), as
        a fresh ``[2, L, k, D]`` tensor; read from checked copies where a writer may reach."""
        assert self.store is not None and self.pool is not None
        c = self.config.chunk_size
        lid, slots = self.store.pin(keys, float("inf"), owner=INTERNAL_OWNER)
        try:
            mem = memoryview(self.pool.buffer)
            copies = (
                self.store.verified_copy(lid, lambda o, n: bytes(mem[o : o + n])) if lid else []
            )
            if len(copies) < len(keys):
                raise StoreError(
                    "not_cached",
                    f"keep needs all {len(keys) * c} tokens cached; {len(copies) * c} are "
                    "(evicted meanwhile?): retrieve and store instead",
                )
            shape = layout.shape(CacheKind.KV, c)
            out = torch.empty(layout.shape(CacheKind.KV, index.numel()), dtype=layout.dtype)
            # ``index`` is sorted, so each source chunk's kept rows are one run of ``out``.
            chunks, counts = torch.unique_consecutive(index // c, return_counts=True)
            start = 0
            for i, n in zip(chunks.tolist(), counts.tolist(), strict=True):
                copy = copies[i]
                slot = (
                    torch.frombuffer(bytearray(copy), dtype=layout.dtype).view(shape)
                    if copy is not None
                    else self._slot(slots[i][0], layout, CacheKind.KV)
                )
                local = index[start : start + n] - i * c
                if n == c:  # the whole chunk kept
                    copy_rows(out[:, :, start : start + n], slot)
                else:
                    copy_rows(out[:, :, start : start + n], slot.index_select(2, local))
                start += n
            return out
        finally:
            if lid is not None:
                self.store.release(lid, owner=INTERNAL_OWNER)

    def _dropped_reason(self, dropped: int) -> dict[str, str]:
        """``dropped_reason`` for a reply that dropped chunks: what holds the pool."""
        assert self.store is not None
        return {"dropped_reason": self.store.full_reason()} if dropped else {}

    def op_put_window(self, header: dict[str, Any], frames: list[zmq.Frame]) -> Reply:
        """Store one call's query window (first copy wins)."""
        assert self.windows is not None
        model, kind = self._model_kind(header)
        layout = self._checked_layout(header, model, kind)
        tokens, record = parse_put(header, frames, layout, (model, kind.value))
        key = window_key(model, kind.value, _salt(header), tokens, record_kind(header))
        return {"stored": self.windows.put(key, record)}, []

    def op_get_window(self, header: dict[str, Any], frames: list[zmq.Frame]) -> Reply:
        """Read the query window stored for exactly these tokens."""
        assert self.windows is not None
        model, kind = self._model_kind(header)
        self._checked_layout(header, model, kind)
        if len(frames) != 1:
            raise ProtocolError("bad_frames", "get_window takes one frame: the token ids")
        record = record_kind(header)
        key = window_key(model, kind.value, _salt(header), frames[0].buffer, record)
        return reply_get(self.windows.get(key), record)


#: op name -> method answering it (``Server.handle`` dispatches through this table).
HANDLERS: dict[str, Callable[[RequestOps, dict[str, Any], list[zmq.Frame]], Reply]] = {
    "ping": RequestOps.op_ping,
    "register": RequestOps.op_register,
    "layout": RequestOps.op_layout,
    "lookup": RequestOps.op_lookup,
    "get": RequestOps.op_get,
    "put": RequestOps.op_put,
    "reserve": RequestOps.op_reserve,
    "commit": RequestOps.op_commit,
    "abort": RequestOps.op_abort,
    "pin": RequestOps.op_pin,
    "release": RequestOps.op_release,
    "put_window": RequestOps.op_put_window,
    "get_window": RequestOps.op_get_window,
    "keep": RequestOps.op_keep,
}
#: Operations the server understands (see docs/sdk.md for each one's frames).
OPS: tuple[str, ...] = tuple(HANDLERS)
