"""Edits that move only the bytes they read: the server keeps the rows an edit chose.

Most policies read little of the KV they drop from (:class:`~kvdrop_sdk.query_capture.KVNeed`,
from :func:`~kvdrop_sdk.query_capture.needs_of`): chunk-halving, streaming, random and kvzip
(engine scores) read no byte of it, knorm and the query scorers only the keys. Such an edit,
when it implements :class:`KeepsRows` (every kvdrop policy does), runs as:

1. fetch what it reads: nothing (``EditPath.INDEX``) or the keys (``EditPath.KEYS``, a
   ``[1, L, T, D]`` fetch); the function gets ``{KV: [2, L, T, D]}`` as always, the bytes it does
   not read standing in (keys for values; a broadcast zero for keys);
2. ask it which rows to keep (:meth:`KeepsRows.keep_plan`: sorted indices and the RoPE
   parameters kept keys are re-rotated with);
3. send the indices: the server gathers the kept rows of the cached prefix itself, re-rotates
   their keys to ``0..k-1`` with :func:`kvdrop_rope.rerotate_rows` (the policies' own rule) and
   stores them under the kept tokens and the stream's edit salt (the ``keep`` op). No KV byte
   crosses the link on the way back.

An edit on a GPU (``EditPath.CLIENT``) re-rotates on the GPU instead of the server's CPU: it
fetches the keys it reads (an index-only edit: only the kept chunks' keys), re-rotates the kept
ones there with the same :func:`kvdrop_rope.rerotate_rows`, writes them by DMA into the new
slots, and the values are gathered by index from the cached slots into the new ones in shared
memory (a memcpy; :meth:`kvdrop_sdk.context.Context.keep_rows`). For chunk-halving at keep 0.5
that moves a quarter of the KV each way instead of the whole KV out and half back.

Everything else (a function reading values, rewriting bytes, a plain function, another SDK's
context, ``kv_path="full"``) takes upstream's path: fetch the whole KV, store what ``fn``
returns. :func:`edit_path` is the one rule choosing between them.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from kvdrop_sdk.capabilities import KeepsOnServer
from kvdrop_sdk.hashing import decode_tokens, encode_tokens
from kvdrop_sdk.query_capture import KVNeed, needs_of

if TYPE_CHECKING:
    from kvdrop_sdk.edit import EditContext

__all__ = [
    "INDEX_BYTES",
    "KV_PATH_CHOICES",
    "EditPath",
    "KeepPlan",
    "KeepsRows",
    "decode_index",
    "edit_path",
    "encode_index",
]

#: Bytes per kept index on the wire (little-endian int64).
INDEX_BYTES = 8
#: What ``modify_kv(kv_path=...)`` accepts (the rule: :func:`edit_path`): ``auto`` (the
#: default: the fastest measured), ``least`` (move only what the policy reads, the
#: kept keys re-rotated where the edit runs: by the server's CPU on a host edit, on the GPU on a
#: GPU edit), ``client`` (re-rotated in this process on any device), ``server`` (by the server
#: on any device) or ``full`` (the whole KV, upstream's path).
KV_PATH_CHOICES = ("auto", "least", "client", "server", "full")


class EditPath(str, enum.Enum):
    """How one edit's KV travels (see the module docstring)."""

    #: Fetch the whole KV, store the bytes the function returns (upstream's path).
    FULL = "full"
    #: Fetch the keys only; the server keeps the chosen rows.
    KEYS = "keys"
    #: Fetch nothing; the server keeps the chosen rows.
    INDEX = "index"
    #: Fetch the keys the edit reads (all of them; or, for an index-only edit, the kept
    #: chunks'), re-rotate the kept keys where the edit runs (a GPU) and store them; the values
    #: are gathered by index in the server's shared memory (:meth:`Context.keep_rows`).
    CLIENT = "client"


@dataclass(frozen=True)
class KeepPlan:
    """Which rows of the cached prefix an edit keeps: ``index`` (sorted int64, CPU) and the
    RoPE parameters (``RopeConfig.to_json()``) their keys are re-rotated to ``0..k-1`` with
    (None: not re-rotated)."""

    index: torch.Tensor
    rope: Mapping[str, Any] | None = None


@runtime_checkable
class KeepsRows(Protocol):
    """An edit function whose result is "these rows of the input, keys re-rotated" (every
    kvdrop policy): it can say which without the bytes it does not read."""

    def keep_plan(
        self,
        tensors: Mapping[Any, torch.Tensor],
        tokens: Sequence[int],
        *,
        context: EditContext | None = None,
    ) -> KeepPlan: ...


def edit_path(
    fn: object,
    kv_ctx: object,
    kv_path: str = "auto",
    device: torch.device | str | None = None,
) -> EditPath:
    """The one rule for how an edit's KV travels.

    ``FULL`` when ``kv_path`` is ``full``, ``fn`` reads the values (:func:`needs_of`), does not
    say which rows it keeps (:class:`KeepsRows`) or the context's server cannot keep rows
    (:class:`KeepsOnServer`: another SDK's). Otherwise the server keeps the rows (``INDEX`` or
    ``KEYS`` by what ``fn`` reads), and the kept keys are re-rotated:

    - ``server``: by the server, on its CPU;
    - ``client``: in this process, on the edit's device (``CLIENT``), where the context maps
      the server's shared memory (else as ``server``);
    - ``least``: ``server`` on a host edit (``device`` None or a CPU), ``client`` on a GPU
      edit;
    - ``auto`` (the default): ``least``, except a keys-reading edit on a GPU, which takes
      ``FULL``. Measured on an H200 (``benchmarks/edit_path.py``, 8 edits of
      ``[2, 36, 8192, 1024]`` bf16 on the GPU, docs/sdk/transport.md): chunk-halving ran
      0.74 s full, 3.48 s server, 0.39 s client; knorm 0.49 s full, 5.27 s server, 0.72 s
      client (its scattered values were then gathered chunk by chunk; the row gather that
      replaced it is not measured there yet).
    """
    if kv_path not in KV_PATH_CHOICES:
        raise ValueError(f"kv_path must be one of {KV_PATH_CHOICES}, got {kv_path!r}")
    reads = needs_of(fn).kv
    if (
        kv_path == "full"
        or reads is KVNeed.ALL
        or not isinstance(fn, KeepsRows)
        or not isinstance(kv_ctx, KeepsOnServer)
    ):
        return EditPath.FULL
    on_server = EditPath.KEYS if reads is KVNeed.KEYS else EditPath.INDEX
    on_gpu = device is not None and torch.device(device).type == "cuda"
    if kv_path == "auto" and on_gpu and reads is KVNeed.KEYS:
        return EditPath.FULL
    client = kv_path == "client" or (kv_path in ("least", "auto") and on_gpu)
    return EditPath.CLIENT if client and kv_ctx.client_keep else on_server


def encode_index(index: torch.Tensor) -> bytes:
    """Kept indices as the ``keep`` op's frame (little-endian int64)."""
    return encode_tokens(index.to(device="cpu", dtype=torch.int64).tolist())


def decode_index(raw: bytes | memoryview, num_tokens: int, chunk: int) -> torch.Tensor:
    """The kept indices of a ``keep`` frame, checked: strictly increasing, in
    ``[0, num_tokens)``, a non-zero multiple of ``chunk`` of them; ValueError saying what is
    wrong otherwise (nothing is stored then)."""
    if len(raw) % INDEX_BYTES:
        raise ValueError(f"the index frame must be int64 values, got {len(raw)} bytes")
    count = len(raw) // INDEX_BYTES
    if count == 0 or count % chunk or count > num_tokens:
        raise ValueError(
            f"{count} kept indices: expected a non-zero multiple of the chunk size {chunk}, "
            f"at most the {num_tokens} cached tokens"
        )
    index = torch.tensor(decode_tokens(raw), dtype=torch.int64)
    if int(index.min()) < 0 or int(index.max()) >= num_tokens:
        raise ValueError(f"kept indices must lie in [0, {num_tokens})")
    if count > 1 and bool((index[1:] <= index[:-1]).any()):
        raise ValueError("kept indices must be strictly increasing (each row kept once)")
    return index
