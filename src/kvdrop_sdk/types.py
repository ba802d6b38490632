"""The edit-function contract shared by the SDK and every kvdrop policy.

An edit function is ``fn(tensors, tokens) -> (kv, kept_tokens)`` (:data:`ModifyFnType`, as
upstream). A function that wants to know more about the request -- where its rows sit (RoPE
positions), which positions its query rows belong to, how long the whole prompt is, the model's
RoPE parameters -- declares it once with :func:`accepts_edit_context` (or a true
``accepts_edit_context`` attribute, as every kvdrop policy has); the SDK then calls
``fn(tensors, tokens, context=EditContext(...))``. Plain functions keep getting
``fn(tensors, tokens)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from kvdrop_sdk.cache_kind import CacheKind, kind_value
from kvdrop_sdk.validate import is_int

__all__ = [
    "EDIT_CONTEXT_ATTR",
    "EditContext",
    "ModifyFnType",
    "accepts_edit_context",
    "get_tensor",
    "takes_edit_context",
]

#: An edit function: given the retrieved tensors of one request (``{KV: [2, L, T, D]}`` and
#: optionally ``{QUERY: [1, L, W, Dq]}``) and its T chunk-aligned token ids, return the edited KV
#: ``[2, L, T', D]`` and the T' token ids it is stored under.
ModifyFnType = Callable[
    [Mapping[CacheKind, torch.Tensor], Sequence[int]], tuple[torch.Tensor, Sequence[int]]
]

#: The marker attribute: an edit function whose ``accepts_edit_context`` is True is called with
#: ``context=EditContext(...)``.
EDIT_CONTEXT_ATTR = "accepts_edit_context"

_F = TypeVar("_F", bound=Callable[..., Any])


def accepts_edit_context(fn: _F) -> _F:
    """Mark ``fn`` (a function or callable object) as taking ``context=EditContext``; returns it."""
    setattr(fn, EDIT_CONTEXT_ATTR, True)
    return fn


def takes_edit_context(fn: Any) -> bool:
    """Whether ``fn`` declared that it takes ``context=`` (see :func:`accepts_edit_context`)."""
    return getattr(fn, EDIT_CONTEXT_ATTR, False) is True


def _int_vector(value: Any, name: str) -> torch.Tensor:
    t = torch.as_tensor(value)
    if t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
        raise ValueError(f"EditContext.{name} must be a 1-D integer tensor, got {value!r}")
    t = t.to(device="cpu", dtype=torch.int64)
    if t.numel() and int(t.min()) < 0:
        raise ValueError(f"EditContext.{name} must be non-negative")
    return t


@dataclass(frozen=True)
class EditContext:
    """What the SDK knows about one edit beyond ``(tensors, tokens)``.

    - ``positions`` ``[T]``: the RoPE position of each KV row. The engine reads a cached prefix as
      positions ``0..T-1``, so this is ``arange(T)`` for a fresh prompt and after a re-rotated
      edit (the SDK does not track the angles of keys an earlier edit left un-rotated).
    - ``query_positions`` ``[W]``: the position of each row of ``tensors[QUERY]``, strictly
      increasing; rows may lie past ``T`` (the uncached tail and tokens generated so far). None
      when no query tensor is passed.
    - ``query_lse`` ``[1, L, W, Hq]`` float32: per query row, layer and head, the log-sum-exp of
      the row's scaled attention logits over every key it attended to when the engine computed
      it, the uncached tail's keys included; ``exp(q.k / sqrt(d) - lse)`` is then its true
      attention probability on a cached key. NaN where unknown (e.g. chunk-stored queries).
    - ``rope``: the RoPE parameters the engine registered with the layout (a JSON dict, see
      ``CacheLayout.rope``), or None when unknown.
    - ``prompt_tokens``: length of the whole sequence the next call sends (cached prefix +
      uncached tail + generated tokens), so budgets can be of the whole prompt.
    - ``protected``: the first tokens that must never be dropped (e.g. a system prompt).
    - ``device``: where the caller wants scoring to run (None: the function decides).
    - ``head_dim`` and ``chunk_size``: from the layout and the server, when known.
    - ``request_id``: the request stream's id (for logs).
    - ``token_scores`` ``[L, H, S]`` float32: per-token importance the engine computed with the
      model for the call's first ``S`` tokens (KVzip's reconstruction pass; see
      ``kvdrop_sdk.window.TokenScores``), for policies that declare ``token_scores``; ``S`` may
      be more or fewer than the ``T`` KV rows (tokens decoded after the pass have none).
    """

    positions: torch.Tensor
    query_positions: torch.Tensor | None = None
    query_lse: torch.Tensor | None = None
    rope: Mapping[str, Any] | None = None
    prompt_tokens: int | None = None
    protected: int = 0
    device: str | None = None
    head_dim: int | None = None
    chunk_size: int | None = None
    request_id: str = ""
    token_scores: torch.Tensor | None = None

    def __post_init__(self) -> None:
        pos = _int_vector(self.positions, "positions")
        object.__setattr__(self, "positions", pos)
        num_tokens = pos.numel()
        if self.query_positions is not None:
            qpos = _int_vector(self.query_positions, "query_positions")
            if qpos.numel() > 1 and bool((qpos[1:] <= qpos[:-1]).any()):
                raise ValueError("EditContext.query_positions must be strictly increasing")
            object.__setattr__(self, "query_positions", qpos)
        lse = self.query_lse
        if lse is not None:
            rows = None if self.query_positions is None else self.query_positions.numel()
            if (
                not isinstance(lse, torch.Tensor)
                or lse.dim() != 4
                or lse.shape[0] != 1
                or not lse.is_floating_point()
                or (rows is not None and lse.shape[2] != rows)
            ):
                raise ValueError(
                    "EditContext.query_lse must be a float [1, L, W, Hq] tensor with one row per "
                    f"query position, got {getattr(lse, 'shape', lse)!r}"
                )
        if self.prompt_tokens is None:
            object.__setattr__(self, "prompt_tokens", num_tokens)
        if not is_int(self.prompt_tokens) or self.prompt_tokens < num_tokens:
            raise ValueError(
                f"EditContext.prompt_tokens must be an int >= the {num_tokens} KV rows, got "
                f"{self.prompt_tokens!r}"
            )
        if not is_int(self.protected) or self.protected < 0:
            raise ValueError(f"EditContext.protected must be an int >= 0, got {self.protected!r}")
        if self.rope is not None and not isinstance(self.rope, Mapping):
            raise ValueError(f"EditContext.rope must be a mapping or None, got {self.rope!r}")
        for name in ("head_dim", "chunk_size"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value <= 0):
                raise ValueError(
                    f"EditContext.{name} must be a positive int or None, got {value!r}"
                )
        ts = self.token_scores
        if ts is not None and (
            not isinstance(ts, torch.Tensor) or ts.dim() != 3 or not ts.is_floating_point()
        ):
            raise ValueError(
                "EditContext.token_scores must be a float [L, H, S] tensor, got "
                f"{getattr(ts, 'shape', ts)!r}"
            )
        if self.device is not None and not isinstance(self.device, str):
            object.__setattr__(self, "device", str(self.device))

    @classmethod
    def of(cls, num_tokens: int, **fields: Any) -> EditContext:
        """A context for a fresh ``num_tokens``-row prefix (positions ``0..T-1``)."""
        return cls(positions=torch.arange(num_tokens), **fields)

    @property
    def num_tokens(self) -> int:
        """KV rows handed to the function (``T``)."""
        return int(self.positions.numel())

    @property
    def tail_tokens(self) -> int:
        """Tokens after the cached prefix (recomputed by the engine, never dropped)."""
        assert self.prompt_tokens is not None
        return self.prompt_tokens - self.num_tokens


def get_tensor(tensors: Mapping[Any, torch.Tensor], kind: CacheKind) -> torch.Tensor | None:
    """Look up ``kind`` in a mapping keyed by any enum (or string) whose value matches."""
    for key, value in tensors.items():
        if kind_value(key) == kind.value:
            return value
    return None
