"""One edit's inputs as a policy sees them, validated once at the policy boundary.

:func:`edit_inputs` turns an edit function's ``(tensors, tokens, context)`` into
:class:`EditInputs` or raises a :class:`~kvdrop.PolicyInputError` that says what was wrong;
:func:`check_finite` is the matching check on what a policy produces (scores, re-rotated keys).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvdrop.errors import MissingQueryError, PolicyInputError
from kvdrop_sdk.cache_kind import CacheKind
from kvdrop_sdk.edit import EditContext, get_tensor
from kvdrop_sdk.query_capture import QueryNeed

__all__ = ["EditInputs", "check_finite", "edit_inputs"]


@dataclass(frozen=True)
class EditInputs:
    """One edit's validated inputs as a policy sees them (see :func:`edit_inputs`).

    ``query`` ``[1, L, R, Dq]`` with ``query_positions`` ``[R]`` (None when not needed) and
    ``query_lse`` ``[1, L, R, Hq]`` (the rows' attention log-normalisers, or None);
    ``prompt_tokens`` is ``N >= T``; ``positions`` the RoPE position of each KV row.
    """

    kv: torch.Tensor
    query: torch.Tensor | None
    query_positions: torch.Tensor | None
    prompt_tokens: int
    positions: torch.Tensor
    protected: int = 0
    query_lse: torch.Tensor | None = None
    head_dim: int | None = None
    device: str | None = None
    rope: Mapping[str, Any] | None = None
    token_scores: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.kv.shape[2])


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
    num_tokens = kv.shape[2]
    total = num_tokens if context is None else int(context.prompt_tokens or num_tokens)
    query = qpos = lse = None
    if queries is not QueryNeed.NONE:
        query, qpos, lse = _query_of(tensors, kv, policy, context)
        total = max(total, int(qpos[-1]) + 1)
    return EditInputs(
        kv=kv,
        query=query,
        query_positions=qpos,
        prompt_tokens=total,
        positions=torch.arange(num_tokens) if context is None else context.positions,
        protected=0 if context is None else context.protected,
        query_lse=lse,
        head_dim=None if context is None else context.head_dim,
        device=None if context is None else context.device,
        rope=None if context is None else context.rope,
        token_scores=None if context is None else context.token_scores,
    )


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The query rows, their positions and log-normalisers (None when unknown)."""
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
    lse = None
    if context is None or context.query_positions is None:
        if context is None:
            if rows < num_tokens:
                raise PolicyInputError(
                    f"{policy}: query covers {rows} tokens but the KV has {num_tokens}"
                )
            query, rows = query[:, :, :num_tokens], num_tokens
        qpos = torch.arange(rows)
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
    return query, qpos, lse


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
