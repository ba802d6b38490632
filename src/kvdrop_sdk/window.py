"""Query windows: the few query rows of one engine call, stored and read through a query context.

An engine in the lean query mode does not store every prompt token's query (that costs more than
the KV it helps to shrink: Qwen3-8B has 32 query heads for 8 KV heads). Per call it keeps the
rows a policy can use -- the last ``W`` tokens of the call's whole sequence (the uncached tail and
the generated tokens included) and a strided sample -- and stores them as one
:class:`QueryWindow` keyed by the call's model, cache salt and every token id (prompt + generated),
i.e. exactly the token list a request stream holds after that call. ``RequestStream.modify_kv``
reads it and hands the rows to the edit function with their positions
(``EditContext.query_positions``). The server side is :mod:`kvdrop_sdk.server.windows`.
Window calls go through the context's restart path (``Context.record_call``): after a server restart
the query layout is registered again and the call retried, as for chunks; the first stored copy
of a window wins.

Each row may carry its attention log-normalisers ``lse`` (per query head, the log-sum-exp of its
scaled logits over every key it attended to, the uncached tail's keys included): with them
``exp(q.k / sqrt(d) - lse)`` is the row's true attention probability on a cached key, although
the tail's keys are not in the cache (``EditContext.query_lse``).

:class:`TokenScores` is the store's second record kind: per-token importance ``[L, H, N]`` of a
call's first ``N`` tokens that the engine computed with the model (KVzip's reconstruction pass,
``kvdrop_engine.reconstruct``), read by policies that score without the model
(``EditContext.token_scores``). Small where the queries behind them would be large.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvdrop_sdk.cache_kind import CacheKind
from kvdrop_sdk.capabilities import StoresRecords
from kvdrop_sdk.context import check_tensor
from kvdrop_sdk.errors import SDKError
from kvdrop_sdk.hashing import decode_tokens, encode_tokens
from kvdrop_sdk.layout import dtype_name
from kvdrop_sdk.protocol import RpcError
from kvdrop_sdk.transport.buffers import tensor_buffer

__all__ = [
    "QueryWindow",
    "TokenScores",
    "retrieve_scores",
    "retrieve_window",
    "scores_for",
    "store_scores",
    "store_window",
]


@dataclass(frozen=True)
class QueryWindow:
    """Query rows ``[1, L, R, Dq]`` (CPU), their positions ``[R]`` (int64, increasing) and
    optionally their attention log-normalisers ``lse`` ``[1, L, R, Hq]`` (float32)."""

    queries: torch.Tensor
    positions: torch.Tensor
    lse: torch.Tensor | None = None

    def __post_init__(self) -> None:
        q, pos = self.queries, self.positions
        check_tensor(q, "window queries")
        check_tensor(pos, "window positions")
        if self.lse is not None:
            check_tensor(self.lse, "window lse")
        if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[0] != 1:
            shape = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
            raise SDKError(f"window queries must be a [1, L, R, Dq] tensor, got {shape}")
        if not isinstance(pos, torch.Tensor) or pos.dim() != 1 or pos.dtype != torch.int64:
            raise SDKError("window positions must be a 1-D int64 tensor")
        if pos.numel() != q.shape[2] or pos.numel() == 0:
            raise SDKError(
                f"window has {q.shape[2]} query rows but {pos.numel()} positions; expected one "
                "position per row and at least one row"
            )
        if bool((pos[1:] <= pos[:-1]).any()) or int(pos[0]) < 0:
            raise SDKError("window positions must be non-negative and strictly increasing")
        lse = self.lse
        if lse is not None and (
            not isinstance(lse, torch.Tensor)
            or lse.dim() != 4
            or tuple(lse.shape[:3]) != tuple(q.shape[:3])
            or lse.dtype != torch.float32
        ):
            shape = tuple(lse.shape) if isinstance(lse, torch.Tensor) else type(lse).__name__
            raise SDKError(
                f"window lse must be a float32 [1, L, R, Hq] tensor matching the queries "
                f"{tuple(q.shape)}, got {shape}"
            )

    @property
    def num_rows(self) -> int:
        return int(self.positions.numel())


def _query_ctx(ctx: Any) -> StoresRecords:
    """``ctx`` if it is a query context that stores records (a kvdrop one), else SDKError."""
    if not isinstance(ctx, StoresRecords) or ctx.kind is not CacheKind.QUERY:
        records = isinstance(ctx, StoresRecords)
        what = f"a {ctx.kind.value!r} context" if records else type(ctx).__name__
        raise SDKError(f"query windows go through a query context, got {what}")
    return ctx


def _call(
    ctx: StoresRecords,
    op: str,
    raw: bytes,
    cache_salt: str,
    fields: dict[str, Any],
    frames: Sequence[Any],
    what: str,
) -> tuple[dict[str, Any], list[Any]]:
    """``ctx``'s record call of ``op``; a refusal says ``what`` failed."""
    try:
        return ctx.record_call(op, raw, cache_salt, fields, frames)
    except RpcError as exc:
        raise RpcError(exc.code, f"{what} failed: {exc}") from None


def store_window(
    ctx: StoresRecords,
    tokens: Sequence[int],
    window: QueryWindow,
    cache_salt: str = "",
) -> bool:
    """Store ``window`` for the call over ``tokens`` (prompt + generated); False when the server
    kept a record with at least as many rows (or the window exceeds its window budget)."""
    _query_ctx(ctx)
    layout = ctx.layout
    q = window.queries
    expected = (1, layout.num_layers, window.num_rows, layout.width)
    if tuple(q.shape) != expected or q.dtype != layout.dtype:
        raise SDKError(
            f"window queries have shape {tuple(q.shape)} dtype {q.dtype}; expected {expected} "
            f"{layout.dtype} (query layout of {ctx.server_model_name!r})"
        )
    raw = ctx.encode(tokens)
    if int(window.positions[-1]) >= len(raw) // 8:
        raise SDKError(
            f"window position {int(window.positions[-1])} is past the call's {len(raw) // 8} tokens"
        )
    data = q.detach().to("cpu").contiguous()
    fields: dict[str, Any] = {"rows": window.num_rows, "dtype": dtype_name(q.dtype)}
    positions = encode_tokens(window.positions.tolist())
    frames = [positions, tensor_buffer(data)]
    if window.lse is not None:
        if window.lse.shape[3] != layout.num_heads:
            raise SDKError(
                f"window lse has {window.lse.shape[3]} heads; the query layout has "
                f"{layout.num_heads}"
            )
        frames.append(tensor_buffer(window.lse.detach().to("cpu").contiguous()))
        fields["lse"] = True
    reply, _ = _call(ctx, "put_window", raw, cache_salt, fields, frames, "storing the query window")
    return bool(reply.get("stored"))


def retrieve_window(
    ctx: StoresRecords, tokens: Sequence[int], cache_salt: str = ""
) -> QueryWindow | None:
    """The window stored for exactly ``tokens`` under ``cache_salt``, or None."""
    _query_ctx(ctx)
    layout = ctx.layout
    raw = ctx.encode(tokens)
    if not raw:
        return None
    reply, frames = _call(ctx, "get_window", raw, cache_salt, {}, [], "reading the query window")
    if not reply.get("found"):
        return None
    rows = reply.get("rows")
    has_lse = reply.get("lse") is True
    if (
        len(frames) != 2 + has_lse
        or reply.get("dtype") != dtype_name(layout.dtype)
        or not isinstance(rows, int)
    ):
        raise SDKError(f"server sent a malformed window reply {reply!r} with {len(frames)} frames")
    positions = torch.tensor(decode_tokens(frames[0].buffer), dtype=torch.int64)
    shape = (1, layout.num_layers, rows, layout.width)
    buf = bytearray(frames[1].buffer)
    if len(buf) != rows * layout.num_layers * layout.width * layout.itemsize:
        raise SDKError(f"server sent {len(buf)} window bytes for {rows} rows of {shape}")
    queries = torch.frombuffer(buf, dtype=layout.dtype).view(shape)
    lse = None
    if has_lse:
        lse_shape = (1, layout.num_layers, rows, layout.num_heads)
        lse_buf = bytearray(frames[2].buffer)
        if len(lse_buf) != 4 * rows * layout.num_layers * layout.num_heads:
            raise SDKError(f"server sent {len(lse_buf)} lse bytes for {lse_shape}")
        lse = torch.frombuffer(lse_buf, dtype=torch.float32).view(lse_shape)
    return QueryWindow(queries, positions, lse)


@dataclass(frozen=True)
class TokenScores:
    """Per-token scores ``[L, H, N]`` (float32, CPU) of the first ``N`` tokens of one call, per
    layer and head (``H`` divides the query layout's heads: KV heads for KVzip)."""

    scores: torch.Tensor

    def __post_init__(self) -> None:
        s = self.scores
        if (
            not isinstance(s, torch.Tensor)
            or s.dim() != 3
            or s.dtype != torch.float32
            or s.shape[2] == 0
        ):
            shape = tuple(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__
            raise SDKError(
                f"token scores must be a float32 [L, H, N] tensor with N >= 1, got {shape}"
            )

    @property
    def num_tokens(self) -> int:
        return int(self.scores.shape[2])


def store_scores(
    ctx: StoresRecords, tokens: Sequence[int], scores: TokenScores, cache_salt: str = ""
) -> bool:
    """Store ``scores`` for the call over ``tokens`` (prompt + generated; the scores cover its
    first ``N``); False when the server kept a record at least as long or has no room."""
    _query_ctx(ctx)
    layout = ctx.layout
    s = scores.scores
    bad = int((~torch.isfinite(s)).sum())
    if bad:
        raise SDKError(f"token scores must be finite; {bad} of {s.numel()} are NaN or inf")
    if s.shape[0] != layout.num_layers or layout.num_heads % s.shape[1]:
        raise SDKError(
            f"token scores {tuple(s.shape)} do not fit the query layout of "
            f"{ctx.server_model_name!r}: expected {layout.num_layers} layers and heads dividing "
            f"{layout.num_heads}"
        )
    raw = ctx.encode(tokens)
    if scores.num_tokens > len(raw) // 8:
        raise SDKError(f"{scores.num_tokens} scored tokens but the call has {len(raw) // 8}")
    fields = {
        "record": "scores",
        "rows": scores.num_tokens,
        "heads": int(s.shape[1]),
    }
    data = tensor_buffer(s.detach().to("cpu").contiguous())
    reply, _ = _call(ctx, "put_window", raw, cache_salt, fields, [data], "storing the token scores")
    return bool(reply.get("stored"))


def retrieve_scores(
    ctx: StoresRecords, tokens: Sequence[int], cache_salt: str = ""
) -> TokenScores | None:
    """The scores stored for exactly ``tokens`` under ``cache_salt``, or None."""
    _query_ctx(ctx)
    layout = ctx.layout
    raw = ctx.encode(tokens)
    if not raw:
        return None
    fields = {"record": "scores"}
    reply, frames = _call(
        ctx, "get_window", raw, cache_salt, fields, [], "reading the token scores"
    )
    if not reply.get("found"):
        return None
    rows, heads = reply.get("rows"), reply.get("heads")
    if len(frames) != 1 or not isinstance(rows, int) or not isinstance(heads, int):
        raise SDKError(f"server sent a malformed scores reply {reply!r} with {len(frames)} frames")
    buf = bytearray(frames[0].buffer)
    shape = (layout.num_layers, heads, rows)
    if len(buf) != 4 * layout.num_layers * heads * rows:
        raise SDKError(f"server sent {len(buf)} score bytes for float32 {shape}")
    return TokenScores(torch.frombuffer(buf, dtype=torch.float32).view(shape))


def scores_for(q_ctx: object, tokens: Sequence[int], cache_salt: str) -> torch.Tensor | None:
    """The engine's scores ``[L, H, N]`` of the call over ``tokens`` (read through a kvdrop query
    context), else None. Callers ask only for edit functions whose needs include them."""
    if not isinstance(q_ctx, StoresRecords):
        return None  # no query context, or an LMCache one: the policy says what is missing
    found = retrieve_scores(q_ctx, tokens, cache_salt)
    return None if found is None else found.scores
