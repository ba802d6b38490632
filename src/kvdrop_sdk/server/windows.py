"""The server's store of query windows: the few query rows of one engine call that policies read.

An engine that captures queries keeps, per call, only the rows a policy can use (the last ``W``
tokens of the call's whole sequence and a strided sample, see ``kvdrop_engine.capture``) and
stores them here as one record, keyed by ``sha256(model, cache kind, salt, every token id of the
call)``: exactly that request finds it, nothing else. A record is ``[1, L, R, Dq]`` query rows in
the model's query layout plus their ``R`` positions (int64, strictly increasing, each below the
number of tokens). Records live on the heap beside the chunk pool, bounded by ``capacity_bytes``
with LRU eviction; a record counts its payload plus its real heap overhead
(``RECORD_OVERHEAD_BYTES``), so a store full of 4-byte records is as large as its bound says.
The first copy of a key wins, as for chunks: a later put under the same key is not kept,
whatever its size (a put could otherwise replace another client's window). Records count as
data held under their (model, kind) registration (``held``): while one exists, the registration
cannot be replaced by another layout.

Ops (``put_window`` / ``get_window``): frames ``[token ids, positions (little-endian int64),
rows, (lse)]`` in, ``[positions, rows, (lse)]`` out; the header carries ``model``, ``kind``
("query"), ``salt`` and, on put, ``rows``, ``dtype`` and ``lse: true`` when the rows' attention
log-normalisers follow (float32 ``[1, L, R, Hq]``).

A second record kind, ``record: "scores"``, holds per-token importance scores of one call (KVzip's
reconstruction pass, ``kvdrop_engine.reconstruct``): float32 ``[L, H, N]`` for the call's first
``N`` tokens, ``H`` dividing the query layout's heads (``heads`` in the header). Frames
``[token ids, scores]`` in, ``[scores]`` out; its key differs from the call's query window's.
"""

from __future__ import annotations

import hashlib
import itertools
import struct
import threading
import warnings
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from kvdrop_sdk.hashing import TOKEN_BYTES, decode_tokens
from kvdrop_sdk.layout import CacheLayout, dtype_name
from kvdrop_sdk.protocol import ProtocolError
from kvdrop_sdk.validate import is_int

__all__ = [
    "MAX_WINDOW_ROWS",
    "RECORD_KINDS",
    "ScoresRecord",
    "WindowRecord",
    "WindowStore",
    "parse_put",
    "record_kind",
    "reply_get",
    "window_key",
]

#: Most rows one record may hold (a strided sample of a 1M-token sequence at stride 16, say).
MAX_WINDOW_ROWS = 1 << 16
_VERSION = b"kvdrop-window-v2"
Tag = tuple[str, str]
#: Record kinds of the store: query windows and per-token scores.
RECORD_KINDS = ("query", "scores")
#: Heap bytes one record costs beyond its payload: the record object, its bytes objects' headers,
#: the 32-byte key and its OrderedDict entry (about 500 measured; test_windows checks the bound).
RECORD_OVERHEAD_BYTES = 640


def record_kind(header: dict[str, Any]) -> str:
    """The header's ``record`` field ("query" when absent); ``ProtocolError`` if unknown."""
    kind = header.get("record", "query")
    if kind not in RECORD_KINDS:
        raise ProtocolError(
            "bad_field", f"field 'record' must be one of {list(RECORD_KINDS)}, got {kind!r}"
        )
    return str(kind)


def window_key(
    model: str, kind: str, salt: str, token_bytes: bytes | memoryview, record: str = "query"
) -> bytes:
    """The record key of one call: model, cache kind, salt and every token id (length-prefixed
    fields); a scores record's key also names its record kind."""
    h = hashlib.sha256(_VERSION)
    fields = [model.encode("utf-8"), kind.encode("utf-8"), salt.encode("utf-8")]
    if record != "query":
        fields.append(record.encode("utf-8"))
    for field in fields:
        h.update(struct.pack("<Q", len(field)) + field)
    h.update(bytes(token_bytes))
    return h.digest()


@dataclass(frozen=True, slots=True)
class WindowRecord:
    """One stored window: ``rows`` query rows (bytes of ``[1, L, rows, width]``) and positions."""

    rows: int
    dtype: str
    positions: bytes
    data: bytes
    lse: bytes | None = None
    tag: Tag = ("", "")

    @property
    def nbytes(self) -> int:
        """What the record costs the store: payload plus ``RECORD_OVERHEAD_BYTES``."""
        return len(self.positions) + len(self.data) + len(self.lse or b"") + RECORD_OVERHEAD_BYTES


@dataclass(frozen=True, slots=True)
class ScoresRecord:
    """One call's per-token scores: float32 bytes of ``[layers, heads, rows]``."""

    rows: int
    heads: int
    layers: int
    data: bytes
    tag: Tag = ("", "")

    @property
    def nbytes(self) -> int:
        """What the record costs the store: payload plus ``RECORD_OVERHEAD_BYTES``."""
        return len(self.data) + RECORD_OVERHEAD_BYTES


Record = WindowRecord | ScoresRecord


class WindowStore:
    """Key -> :class:`WindowRecord` or :class:`ScoresRecord`, LRU-bounded by bytes;
    thread-safe."""

    def __init__(self, capacity_bytes: int) -> None:
        if not is_int(capacity_bytes) or capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self._records: OrderedDict[bytes, Record] = OrderedDict()
        self._tags: Counter[Tag] = Counter()
        self._used = 0
        self._evictions = 0
        self._lock = threading.Lock()

    def put(self, key: bytes, record: Record) -> bool:
        """Keep ``record`` unless a record is stored under ``key`` already (first copy wins);
        False when not kept (also when it is larger than the whole capacity)."""
        if record.nbytes > self.capacity_bytes:
            return False
        with self._lock:
            if key in self._records:
                self._records.move_to_end(key)
                return False
            while self._records and self._used + record.nbytes > self.capacity_bytes:
                _, evicted = self._records.popitem(last=False)
                self._used -= evicted.nbytes
                self._evictions += 1
                self._tags[evicted.tag] -= 1
                if not self._tags[evicted.tag]:
                    del self._tags[evicted.tag]
            self._records[key] = record
            self._used += record.nbytes
            self._tags[record.tag] += 1
            return True

    def held(self, tag: Tag) -> int:
        """How many records are stored under the (model, kind) registration ``tag``."""
        with self._lock:
            return self._tags[tag]

    def get(self, key: bytes) -> Record | None:
        """The record stored under ``key`` (now most recently used), or None."""
        with self._lock:
            record = self._records.get(key)
            if record is not None:
                self._records.move_to_end(key)
            return record

    def snapshot(self) -> dict[str, int]:
        """Counters for ``/status``."""
        with self._lock:
            return {
                "windows": len(self._records),
                "window_bytes": self._used,
                "window_capacity_bytes": self.capacity_bytes,
                "window_evictions": self._evictions,
            }


def parse_put(
    header: dict[str, Any], frames: list[Any], layout: CacheLayout, tag: Tag
) -> tuple[bytes, Record]:
    """Validate a ``put_window`` request against the query ``layout`` of registration ``tag``;
    return the token bytes and the record (copies of the frames). ``ProtocolError`` says what
    was wrong."""
    if record_kind(header) == "scores":
        return _parse_scores(header, frames, layout, tag)
    has_lse = header.get("lse", False)
    if not isinstance(has_lse, bool):
        raise ProtocolError("bad_field", f"field 'lse' must be a bool, got {has_lse!r}")
    if len(frames) != 3 + has_lse:
        raise ProtocolError(
            "bad_frames",
            f"put_window takes {3 + has_lse} frames (tokens, positions, rows"
            f"{', lse' if has_lse else ''}), got {len(frames)}",
        )
    tokens, positions, data = (bytes(f.buffer) for f in frames[:3])
    lse = bytes(frames[3].buffer) if has_lse else None
    num_tokens = _token_count(tokens)
    rows = header.get("rows")
    if not is_int(rows) or not 0 < rows <= MAX_WINDOW_ROWS:
        raise ProtocolError(
            "bad_field", f"field 'rows' must be an int in [1, {MAX_WINDOW_ROWS}], got {rows!r}"
        )
    if header.get("dtype") != dtype_name(layout.dtype):
        raise ProtocolError(
            "dtype_mismatch",
            f"window dtype {header.get('dtype')!r} but the query layout is "
            f"{dtype_name(layout.dtype)!r}",
        )
    if len(positions) != rows * TOKEN_BYTES:
        raise ProtocolError(
            "bad_data",
            f"{rows} rows need {rows * TOKEN_BYTES} position bytes, got {len(positions)}",
        )
    pos = decode_tokens(positions)
    if any(b <= a for a, b in itertools.pairwise(pos)) or pos[0] < 0 or pos[-1] >= num_tokens:
        raise ProtocolError(
            "bad_data",
            f"window positions must increase strictly within [0, {num_tokens}) (one row per "
            "computed token of the call)",
        )
    expected = rows * layout.num_layers * layout.width * layout.itemsize
    if len(data) != expected:
        raise ProtocolError(
            "bad_data",
            f"window of {rows} rows in layout {layout.to_json()} is {expected} bytes, got "
            f"{len(data)}",
        )
    if lse is not None and len(lse) != 4 * rows * layout.num_layers * layout.num_heads:
        raise ProtocolError(
            "bad_data",
            f"lse of {rows} rows is float32 [1, {layout.num_layers}, {rows}, {layout.num_heads}], "
            f"got {len(lse)} bytes",
        )
    return tokens, WindowRecord(rows, dtype_name(layout.dtype), positions, data, lse, tag)


def _parse_scores(
    header: dict[str, Any], frames: list[Any], layout: CacheLayout, tag: Tag
) -> tuple[bytes, ScoresRecord]:
    """A scores record: frames ``[tokens, float32 [L, heads, rows]]``, ``rows`` at most the
    call's tokens, ``heads`` dividing the query layout's."""
    if len(frames) != 2:
        raise ProtocolError(
            "bad_frames", f"put_window of scores takes 2 frames (tokens, scores), got {len(frames)}"
        )
    tokens, data = (bytes(f.buffer) for f in frames)
    num_tokens = _token_count(tokens)
    rows, heads = header.get("rows"), header.get("heads")
    if not is_int(rows) or not 0 < rows <= num_tokens:
        raise ProtocolError(
            "bad_field",
            f"field 'rows' must be an int in [1, {num_tokens}] (the call's tokens), got {rows!r}",
        )
    if not is_int(heads) or heads <= 0 or layout.num_heads % heads:
        raise ProtocolError(
            "bad_field",
            f"field 'heads' must be a positive int dividing the layout's {layout.num_heads} "
            f"heads, got {heads!r}",
        )
    expected = 4 * layout.num_layers * heads * rows
    if len(data) != expected:
        raise ProtocolError(
            "bad_data",
            f"scores are float32 [{layout.num_layers}, {heads}, {rows}] = {expected} bytes, got "
            f"{len(data)}",
        )
    with warnings.catch_warnings():  # read-only bytes: only read here
        warnings.simplefilter("ignore", UserWarning)
        values = torch.frombuffer(data, dtype=torch.float32)
    bad = int((~torch.isfinite(values)).sum())
    if bad:
        raise ProtocolError(
            "bad_data", f"scores must be finite; {bad} of {values.numel()} are NaN or inf"
        )
    return tokens, ScoresRecord(rows, heads, layout.num_layers, data, tag)


def reply_get(record: Record | None, kind: str = "query") -> tuple[dict[str, Any], list[bytes]]:
    """The ``get_window`` reply for ``record`` (``found: false`` without frames on a miss, or
    when the record is not of ``kind``)."""
    if isinstance(record, ScoresRecord) and kind == "scores":
        reply = {"found": True, "record": "scores", "rows": record.rows, "heads": record.heads}
        return reply, [record.data]
    if not isinstance(record, WindowRecord) or kind != "query":
        return {"found": False}, []
    header = {
        "found": True,
        "rows": record.rows,
        "dtype": record.dtype,
        "lse": record.lse is not None,
    }
    frames = [record.positions, record.data]
    if record.lse is not None:
        frames.append(record.lse)
    return header, frames


def _token_count(raw: bytes) -> int:
    if not raw or len(raw) % TOKEN_BYTES:
        raise ProtocolError(
            "bad_tokens", f"token frame must be a non-empty multiple of {TOKEN_BYTES} bytes"
        )
    return len(raw) // TOKEN_BYTES
