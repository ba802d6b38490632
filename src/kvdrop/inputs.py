"""One edit's inputs as a policy sees them, validated once at the policy boundary.

:func:`edit_inputs` turns an edit function's ``(tensors, tokens, context)`` into
:class:`EditInputs` or raises a :class:`~kvdrop.PolicyInputError` that says what was wrong;
:func:`check_finite` is the matching check on what a policy produces (scores, re-rotated keys).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvdrop.errors import MissingQueryError, PolicyInputError
from kvdrop_sdk.cache_kind import CacheKind
from kvdrop_sdk.edit import EditContext, get_tensor
from kvdrop_sdk.query_capture import QueryNeed

__all__ = ["EditInputs", "check_finite", "edit_inputs"]


@dataclass(frozen=True, eq=False, init=False)
class EditInputs:
    """One edit's validated inputs as a policy sees them (see :func:`edit_inputs`): the KV
    ``[2, L, T, D]``, the query rows ``[1, L, R, Dq]`` (None when not read) and the SDK's edit
    context (None: a plain upstream call). Everything else reads through to the context, so a
    new context field reaches every policy without being copied here (other context fields:
    :meth:`with_context`).
    """

    kv: torch.Tensor
    query: torch.Tensor | None
    context: EditContext | None

    def __init__(
        self,
        kv: torch.Tensor,
        query: torch.Tensor | None = None,
        context: EditContext | None = None,
    ) -> None:
        if context is not None and not isinstance(context, EditContext):
            raise TypeError(
                f"EditInputs takes (kv, query, context: EditContext | None); got a "
                f"{type(context).__name__} for context (other context fields: with_context)"
            )
        object.__setattr__(self, "kv", kv)
        object.__setattr__(self, "query", query)
        object.__setattr__(self, "context", context)

    @property
    def num_tokens(self) -> int:
        return int(self.kv.shape[2])

    def with_context(self, **fields: Any) -> EditInputs:
        """The same tensors under a context with ``fields`` replaced (a plain call's context is
        the upstream one: positions ``0..T-1``)."""
        base = EditContext.of(self.num_tokens) if self.context is None else self.context
        return EditInputs(self.kv, self.query, dataclasses.replace(base, **fields))

    @functools.cached_property
    def positions(self) -> torch.Tensor:
        """The RoPE position of each KV row (``0..T-1`` without a context)."""
        return torch.arange(self.num_tokens) if self.context is None else self.context.positions

    @functools.cached_property
    def query_positions(self) -> torch.Tensor | None:
        """``[R]``: where each query row sits (the context's, else ``0..R-1``; rows past ``T``
        belong to the uncached tail); None without a query."""
        if self.query is None:
            return None
        if self.context is not None and self.context.query_positions is not None:
            return self.context.query_positions
        return torch.arange(self.query.shape[2])

    @property
    def query_lse(self) -> torch.Tensor | None:
        """``[1, L, R, Hq]``: the rows' attention log-normalisers, when the context places the
        rows and knows them."""
        placed = self.context is not None and self.context.query_positions is not None
        return self.context.query_lse if placed and self.query is not None else None  # type: ignore[union-attr]

    @functools.cached_property
    def prompt_tokens(self) -> int:
        """``N >= T``: the whole prompt (the context's, at least up to the last query row;
        ``T`` without a context, the upstream call)."""
        if self.context is None:
            return self.num_tokens
        qpos = self.query_positions
        last = int(qpos[-1]) + 1 if qpos is not None and qpos.numel() else 0
        return max(int(self.context.prompt_tokens or 0), last, self.num_tokens)

    @property
    def protected(self) -> int:
        return 0 if self.context is None else self.context.protected

    @property
    def head_dim(self) -> int | None:
        return None if self.context is None else self.context.head_dim

    @property
    def device(self) -> str | None:
        return None if self.context is None else self.context.device

    @property
    def rope(self) -> Mapping[str, Any] | None:
        return None if self.context is None else self.context.rope

    @property
    def token_scores(self) -> torch.Tensor | None:
        return None if self.context is None else self.context.token_scores


def edit_inputs(
    tensors: Mapping[Any, torch.Tensor],
    tokens: Sequence[int],
    *,
    policy: str,
    queries: QueryNeed,
    context: EditContext | None = None,
) -> EditInputs:
    """Validate an edit function's arguments once; raise a teaching error when they are wrong.

    The query is read unless ``queries`` is ``QueryNeed.NONE``. Without a context it must cover
    the KV's ``T`` tokens and is cut to them (positions ``0..T-1``, the upstream layout). With
    one, its ``query_positions`` place the rows (default ``0..R-1``), which may lie past ``T`` up
    to ``context.prompt_tokens``.
    """
    if context is not None and not isinstance(context, EditContext):
        raise PolicyInputError(
            f"{policy}: context must be a kvdrop_sdk.edit.EditContext, got {type(context).__name__}"
        )
    kv = _kv_of(tensors, tokens, policy, context)
    query = None
    if queries is not QueryNeed.NONE:
        query = _query_of(tensors, kv, policy, context)
    return EditInputs(kv, query, context)


def _kv_of(
    tensors: Mapping[Any, torch.Tensor],
    tokens: Sequence[int],
    policy: str,
    context: EditContext | None,
) -> torch.Tensor:
    """The ``[2, L, T, D]`` floating KV of ``tensors``, checked against ``tokens`` and context."""
    kv = get_tensor(tensors, CacheKind.KV)
    if kv is None:
        keys = ", ".join(repr(k) for k in tensors)
        raise PolicyInputError(
            f"{policy}: no KV tensor in the mapping (keys: {keys}); expected "
            "a key whose value is 'kv' (CacheKind.KV)"
        )
    if not isinstance(kv, torch.Tensor) or kv.dim() != 4 or kv.shape[0] != 2:
        shape = tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__
        raise PolicyInputError(f"{policy}: KV must be a [2, L, T, D] tensor; got {shape}")
    if not kv.is_floating_point():
        raise PolicyInputError(f"{policy}: KV must be a floating-point tensor; got {kv.dtype}")
    num_tokens = kv.shape[2]
    if len(tokens) != num_tokens or num_tokens == 0:
        raise PolicyInputError(
            f"{policy}: got {len(tokens)} token ids for a KV of {num_tokens} tokens; they must "
            "match and be non-empty"
        )
    if context is not None and context.num_tokens != num_tokens:
        raise PolicyInputError(
            f"{policy}: the edit context describes {context.num_tokens} KV rows but the KV has "
            f"{num_tokens}"
        )
    return kv


def _query_of(
    tensors: Mapping[Any, torch.Tensor],
    kv: torch.Tensor,
    policy: str,
    context: EditContext | None,
) -> torch.Tensor:
    """The validated query rows (cut to the KV's ``T`` without a context)."""
    query = get_tensor(tensors, CacheKind.QUERY)
    if query is None:
        raise MissingQueryError(policy)
    if (
        not isinstance(query, torch.Tensor)
        or query.dim() != 4
        or query.shape[0] != 1
        or query.shape[1] != kv.shape[1]
    ):
        shape = tuple(query.shape) if isinstance(query, torch.Tensor) else type(query)
        raise PolicyInputError(
            f"{policy}: query must be [1, L, R, Dq] with L={kv.shape[1]} like the KV; got {shape}"
        )
    num_tokens, rows = kv.shape[2], query.shape[2]
    if context is None or context.query_positions is None:
        if context is None:
            if rows < num_tokens:
                raise PolicyInputError(
                    f"{policy}: query covers {rows} tokens but the KV has {num_tokens}"
                )
            query, rows = query[:, :, :num_tokens], num_tokens
    else:
        qpos = context.query_positions
        if qpos.numel() != rows:
            raise PolicyInputError(
                f"{policy}: the edit context has {qpos.numel()} query positions for {rows} query "
                "rows"
            )
        lse = context.query_lse
        if lse is not None and tuple(lse.shape[1:3]) != (kv.shape[1], rows):
            raise PolicyInputError(
                f"{policy}: the edit context's query_lse {tuple(lse.shape)} does not match the "
                f"{rows} query rows of {kv.shape[1]} layers"
            )
    if rows == 0:
        raise PolicyInputError(f"{policy}: the query tensor has no rows")
    return query


def check_finite(policy: str, values: torch.Tensor, what: str, hint: str) -> None:
    """Raise PolicyInputError naming ``policy`` when ``values`` hold NaN or inf.

    ``what`` says which result it is ("scores", "re-rotated keys"); ``hint`` what to check.
    """
    bad = int((~torch.isfinite(values)).sum())
    if bad:
        raise PolicyInputError(
            f"{policy}: {bad} non-finite value(s) (NaN or inf) in its {what} of "
            f"{values.numel()}; {hint}"
        )
