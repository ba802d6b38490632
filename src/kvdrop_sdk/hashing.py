"""Chunk keys: a sha256 prefix chain over token ids, rooted in model name, kind and cache salt.

``h_0 = sha256(root)``, ``h_{i+1} = sha256(h_i || tokens of chunk i as little-endian int64)``;
chunk ``i`` is stored under ``h_{i+1}``, so a chunk's key depends on every token before it.
Python's ``hash()`` is never used (it is salted per process).
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence

__all__ = ["TOKEN_BYTES", "chunk_keys", "decode_tokens", "encode_tokens", "root_hash"]

#: Bytes per token id on the wire and in the hash (little-endian int64).
TOKEN_BYTES = 8
_VERSION = b"kvdrop-chunk-v1"


def _field(value: str) -> bytes:
    raw = value.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def root_hash(model_name: str, kind: str, cache_salt: str) -> bytes:
    """``h_0``: length-prefixed fields, so ("a", "bc") and ("ab", "c") differ."""
    return hashlib.sha256(
        _VERSION + _field(model_name) + _field(kind) + _field(cache_salt)
    ).digest()


def encode_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian int64 bytes; ValueError for non-int (bools included) or
    negative ids."""
    if not isinstance(tokens, (list, tuple)):
        tokens = list(tokens)
    if any(isinstance(t, bool) for t in tokens):
        raise ValueError("token ids must be ints, got a bool (True would be stored as token 1)")
    try:
        arr = array("q", tokens)
    except (TypeError, OverflowError) as exc:
        raise ValueError(f"token ids must be ints in [0, 2**63): {exc}") from None
    if len(arr) and min(arr) < 0:
        raise ValueError(f"token ids must be non-negative, got {min(arr)}")
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def decode_tokens(raw: bytes | memoryview) -> list[int]:
    """Inverse of ``encode_tokens``; ValueError when the length is not a multiple of 8."""
    if len(raw) % TOKEN_BYTES:
        raise ValueError(f"token frame has {len(raw)} bytes, not a multiple of {TOKEN_BYTES}")
    arr = array("q")
    arr.frombytes(bytes(raw))
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tolist()


def chunk_keys(root: bytes, token_bytes: bytes | memoryview, chunk_size: int) -> list[bytes]:
    """Keys of every whole chunk in ``token_bytes`` (encoded ids); a partial tail has no key."""
    step = chunk_size * TOKEN_BYTES
    view = memoryview(token_bytes)
    keys: list[bytes] = []
    h = root
    for start in range(0, len(view) - step + 1, step):
        h = hashlib.sha256(h + view[start : start + step]).digest()
        keys.append(h)
    return keys
