"""Generated hostile wire messages for the server, and a driver that sends them (tests, soak).

``fuzz_messages(seed, count, target)`` yields deterministic messages built three ways: mutations
of valid requests of every op (a field dropped, retyped, or set to an odd value; frames dropped,
repeated, truncated or filled with noise; the protocol version or op changed), headers that are
not a JSON object (garbage bytes, invalid UTF-8, arrays, numbers, truncated or deeply nested
JSON), and random frames; one in ten is sent by a ``zmq.REQ`` peer. (A DEALER message whose first
frame is empty looks exactly like a REQ envelope and is answered like one.) ``send_fuzz`` sends
them one by one and checks that each gets exactly one well-formed reply: ``ok`` true for the
(rare) mutations that stay valid, else ``ok`` false with a non-empty ``code`` and ``error``.

The target model must not be one whose stored bytes a test checks: a valid mutation may store or
pin chunks of it (and so may evict others once the pool is full).
"""

from __future__ import annotations

import json
import random
import struct
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import zmq

from kvdrop_sdk.cache_kind import CacheKind
from kvdrop_sdk.layout import CacheLayout, dtype_name
from kvdrop_sdk.protocol import MAX_HEADER_BYTES, PROTOCOL_VERSION
from kvdrop_sdk.server.ops import OPS

__all__ = ["FuzzMessage", "FuzzReport", "FuzzTarget", "fuzz_messages", "send_fuzz"]


@dataclass(frozen=True)
class FuzzTarget:
    """What valid requests look like on the server under test."""

    model: str
    layout: CacheLayout
    chunk_size: int


@dataclass(frozen=True)
class FuzzMessage:
    """One message: its frames, whether a ``zmq.REQ`` peer sends it, and how it was made."""

    frames: list[bytes]
    req: bool
    kind: str


@dataclass
class FuzzReport:
    """What ``send_fuzz`` saw."""

    sent: int = 0
    ok: int = 0
    errors: int = 0
    no_reply: int = 0
    malformed_replies: int = 0
    codes: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0


def _noise(rng: random.Random, n: int) -> bytes:
    return rng.getrandbits(8 * n).to_bytes(n, "little") if n else b""


def _odd_value(rng: random.Random, depth: int = 0) -> Any:
    """A JSON value of a random type, often one a field does not expect."""
    pick = rng.randrange(14 if depth < 3 else 10)
    if pick == 0:
        return None
    if pick == 1:
        return rng.random() < 0.5
    if pick == 2:
        return rng.choice([0, -1, 1, 7, 2**31, 2**63, -(2**63), 2**70, 10**30])
    if pick == 3:
        return rng.choice([0.0, -0.5, 1e-300, 1e300, float("nan"), float("inf"), -float("inf")])
    if pick == 4:
        return ""
    if pick == 5:
        return "".join(chr(rng.randrange(1, 0x2FFF)) for _ in range(rng.randrange(1, 40)))
    if pick == 6:
        return "x" * rng.choice([1, 255, 256, 4096])
    if pick == 7:
        return rng.choice(["kv", "query", "value", "KV", "model##query", "../x", "\x00"])
    if pick == 8:
        return rng.getrandbits(128).to_bytes(16, "little").hex()
    if pick == 9:
        return rng.randrange(-5, 5)
    if pick in (10, 11):
        return [_odd_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    return {str(_odd_value(rng, 3)): _odd_value(rng, depth + 1) for _ in range(rng.randrange(3))}


def _tokens(rng: random.Random, target: FuzzTarget) -> bytes:
    c = target.chunk_size
    n = rng.choice([0, 1, c - 1, c, 2 * c, 3 * c, rng.randrange(1, 4 * c)])
    ids = [rng.randrange(0, 50_000) for _ in range(n)]
    raw = struct.pack(f"<{n}q", *ids)
    roll = rng.random()
    if roll < 0.05:
        return raw[: max(0, len(raw) - rng.randrange(1, 8))]  # not a multiple of 8
    if roll < 0.08:
        return struct.pack("<q", -1) + raw  # a negative id
    return raw


def _valid(rng: random.Random, op: str, target: FuzzTarget) -> tuple[dict[str, Any], list[bytes]]:
    """A request that the server would accept (as far as its frames allow)."""
    base = {"model": target.model, "kind": "kv", "salt": rng.choice(["", "s", "salt-2"])}
    layout = target.layout
    if op == "ping":
        return {}, []
    if op == "register":
        return {"model": target.model, "kind": "kv", "layout": layout.to_json()}, []
    if op == "layout":
        return {"model": target.model, "kind": "kv"}, []
    if op in ("commit", "abort", "release"):
        return {"lease": rng.getrandbits(128).to_bytes(16, "little").hex()}, []
    toks = _tokens(rng, target)
    if op in ("lookup", "get"):
        return base, [toks]
    if op in ("pin", "reserve"):
        return {**base, "lease_s": rng.choice([0.5, 1, 30])}, [toks]
    # put: the right number of row frames for whole chunks, sometimes.
    c = target.chunk_size
    n = (len(toks) // 8) // c
    rows = 2 * layout.num_layers
    span = c * layout.width * layout.itemsize
    header = {
        **base,
        "dtype": dtype_name(layout.dtype),
        "shape": list(layout.shape(CacheKind.KV, max(n, 1) * c)),
        "first_chunk": 0,
    }
    data = [_noise(rng, min(span, 64)) * (span // min(span, 64)) for _ in range(n * rows)]
    return header, [toks, *data]


def _mutate(
    rng: random.Random, header: dict[str, Any], frames: list[bytes]
) -> tuple[dict[str, Any], list[bytes]]:
    header = dict(header)
    frames = list(frames)
    for _ in range(rng.randrange(1, 4)):
        roll = rng.randrange(9)
        keys = [k for k in header if k not in ("v", "rid")]
        if roll == 0 and keys:
            header.pop(rng.choice(keys))
        elif roll in (1, 2) and keys:
            header[rng.choice(keys)] = _odd_value(rng)
        elif roll == 3:
            header[str(_odd_value(rng, 3))[:20]] = _odd_value(rng)
        elif roll == 4:
            header["v"] = rng.choice([0, 2, "1", None, 1.0, [1]])
        elif roll == 5:
            header["op"] = rng.choice([*OPS, "", "PING", "shutdown", None, 5, ["ping"]])
        elif roll == 6 and frames:
            i = rng.randrange(len(frames))
            frames[i] = frames[i][: rng.randrange(len(frames[i]) + 1)]
        elif roll == 7:
            frames.insert(rng.randrange(len(frames) + 1), _noise(rng, rng.randrange(0, 300)))
        elif frames:
            frames.pop(rng.randrange(len(frames)))
    return header, frames


def _bad_header(rng: random.Random) -> bytes:
    pick = rng.randrange(9)
    if pick == 0:
        return _noise(rng, rng.randrange(1, 200))
    if pick == 1:
        return b"\xff\xfe" + _noise(rng, 20)
    if pick == 2:
        return json.dumps(_odd_value(rng)).encode()  # valid JSON, rarely an object
    if pick == 3:
        return b'{"v": 1, "op": "ping", "rid": ' + b"[" * rng.randrange(100, 20_000)
    if pick == 4:
        depth = rng.randrange(500, 20_000)
        return b'{"a":' * depth + b"1" + b"}" * depth
    if pick == 5:
        return b""
    if pick == 6:
        return b" " * rng.randrange(1, 100)
    if pick == 7:
        return b'{"v": 1, "op": "ping", "pad": "' + b"p" * (MAX_HEADER_BYTES + 10) + b'"}'
    return b'{"v": 1, "op": "ping"'  # truncated


def fuzz_messages(seed: int, count: int, target: FuzzTarget) -> Iterator[FuzzMessage]:
    """``count`` deterministic hostile messages for a server holding ``target``'s layout."""
    rng = random.Random(seed)
    for i in range(count):
        roll = rng.random()
        req = rng.random() < 0.1
        if roll < 0.12:
            frames = [_bad_header(rng), *(_noise(rng, 16) for _ in range(rng.randrange(3)))]
            yield FuzzMessage(frames, req, "bad_header")
            continue
        if roll < 0.17:
            frames = [_noise(rng, rng.randrange(0, 100)) for _ in range(rng.randrange(1, 5))]
            yield FuzzMessage(frames, req, "noise")
            continue
        op = rng.choice(OPS)
        header, frames = _valid(rng, op, target)
        header = {"v": PROTOCOL_VERSION, "op": op, "rid": i, **header}
        kind = "valid"
        if roll < 0.95:
            header, frames = _mutate(rng, header, frames)
            kind = "mutated"
        raw = json.dumps(header, separators=(",", ":")).encode()
        yield FuzzMessage([raw, *frames], req, kind)


def _reply_ok(raw: bytes, report: FuzzReport) -> None:
    try:
        reply = json.loads(raw)
    except ValueError:
        report.malformed_replies += 1
        return
    if not isinstance(reply, dict) or not isinstance(reply.get("ok"), bool):
        report.malformed_replies += 1
    elif reply["ok"]:
        report.ok += 1
    elif not reply.get("code") or not reply.get("error"):
        report.malformed_replies += 1
    else:
        report.errors += 1
        report.codes[str(reply["code"])] += 1


def send_fuzz(url: str, messages: Iterator[FuzzMessage], timeout: float = 10.0) -> FuzzReport:
    """Send each message and read its reply (DEALER, or REQ for ``req`` messages)."""
    zctx = zmq.Context.instance()
    report = FuzzReport()
    socks: dict[int, zmq.Socket] = {}
    start = time.perf_counter()
    try:
        for msg in messages:
            kind = zmq.REQ if msg.req else zmq.DEALER
            sock = socks.get(kind)
            if sock is None:
                sock = socks[kind] = zctx.socket(kind)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(url)
            sock.send_multipart(msg.frames)
            report.sent += 1
            if not sock.poll(int(timeout * 1000)):
                report.no_reply += 1
                sock.close(0)
                del socks[kind]  # a REQ socket without its reply cannot send again
                continue
            parts = sock.recv_multipart()
            if not msg.req and len(msg.frames) >= 2 and msg.frames[0] == b"":
                parts = parts[1:]  # a DEALER that leads with an empty frame is answered as REQ
            _reply_ok(parts[0] if parts else b"", report)
    finally:
        for sock in socks.values():
            sock.close(0)
    report.seconds = time.perf_counter() - start
    return report
