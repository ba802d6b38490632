"""The adapter of a plain edit function ``fn(tensors, tokens) -> (kv, tokens)`` to :class:`Policy`.

Plugins may register plain functions; :func:`as_policy` wraps them so combinators and the SDK
see one protocol. What the function reads comes from its declaration
(:func:`~kvdrop_sdk.query_capture.needs_of`: a function that declares nothing reads the full
queries, as upstream's do), unless its factory declares it.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvdrop.errors import PolicyInputError, PolicyOutputError, PolicyWarning
from kvdrop.inputs import edit_inputs
from kvdrop.policy import NeedsPolicy, Policy, warn_no_rope
from kvdrop_sdk.edit import EditContext, ModifyFnType, takes_edit_context
from kvdrop_sdk.query_capture import KVNeed, Needs, QueryNeed, needs_of

__all__ = ["FunctionPolicy", "as_policy"]


class FunctionPolicy(NeedsPolicy):
    """A plain edit function ``fn(tensors, tokens) -> (kv, tokens)`` seen as a :class:`Policy`.

    ``fn`` gets ``context=`` too when it declares so (``kvdrop_sdk.edit.accepts_edit_context``)
    and then re-rotates on its own. For a plain ``fn``, calling the policy finds the kept rows in
    the input (greedy in order, matching the token id and the layer-0 key row, so repeated ids are
    told apart) and re-rotates their keys when RoPE parameters are known; a ``fn`` whose output
    rows are not input rows (e.g. it changed values) is returned as it is, with a warning.
    """

    def __init__(self, name: str, fn: ModifyFnType, needs: Needs | None = None) -> None:
        self.name = name
        self.fn = fn
        # Its bytes are the function's own (and matched by value): it always reads the whole KV.
        self._needs = dataclasses.replace(needs_of(fn) if needs is None else needs, kv=KVNeed.ALL)
        self._takes_context = takes_edit_context(fn)

    def __repr__(self) -> str:
        return f"FunctionPolicy({self.name!r}, {self.fn!r})"

    @property
    def needs(self) -> Needs:
        return self._needs

    def _call_fn(
        self,
        tensors: Mapping[Any, torch.Tensor],
        tokens: Sequence[int],
        context: EditContext | None,
    ) -> tuple[torch.Tensor, Sequence[int]]:
        if self._takes_context:
            return self.fn(tensors, tokens, context=context)  # type: ignore[call-arg]
        return self.fn(tensors, tokens)

    def _match(
        self, kv: torch.Tensor, tokens: Sequence[int], out: torch.Tensor, kept: Sequence[int]
    ) -> torch.Tensor:
        """The input row of each kept row, in order: greedy on the token id and the value rows
        of every layer (values carry no position, so a function that re-rotated its kept keys
        is matched too). More rows than the input, or rows that are no input row after the
        previous kept one (a duplicate, out of order, changed), are a ``PolicyOutputError``
        (``PolicyInputError`` for changed rows, which ``__call__`` passes on with a warning)."""
        n, k = len(tokens), len(kept)
        rows = out.shape[2] if isinstance(out, torch.Tensor) and out.dim() == 4 else None
        if rows != k:
            shown = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise PolicyOutputError(
                f"policy {self.name!r} returned KV {shown} with {k} token ids; expected "
                "[2, L, k, D] KV with one token id per kept row"
            )
        if k > n:
            raise PolicyOutputError(
                f"policy {self.name!r} returned {k} rows for a {n}-token input; a policy keeps "
                "each input row at most once"
            )
        values, got = kv[1].transpose(0, 1), out[1].transpose(0, 1)  # [T, L, D]
        ids = [int(t) for t in tokens]
        found: list[int] = []
        i = 0
        for j, tok in enumerate(kept):
            tok = int(tok)
            while i < n and not (ids[i] == tok and torch.equal(values[i], got[j])):
                i += 1
            if i == n:
                if any(ids[e] == tok and torch.equal(values[e], got[j]) for e in range(n)):
                    raise PolicyOutputError(
                        f"policy {self.name!r} returned kept row {j} (token {tok}) that repeats "
                        "or precedes an earlier kept row; expected input rows in order, each "
                        "kept at most once"
                    )
                raise PolicyInputError(
                    f"{self.name}: kept row {j} (token {tok}) is not an input row at a later "
                    "index; expected a policy that keeps input rows in order"
                )
            found.append(i)
            i += 1
        return torch.tensor(found, dtype=torch.int64)

    def select_indices(
        self,
        tensors: Mapping[Any, torch.Tensor],
        tokens: Sequence[int],
        *,
        context: EditContext | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Only the KV is read here; the function reads what it declared on its own.
        kv = edit_inputs(
            tensors, tokens, policy=self.name, queries=QueryNeed.NONE, context=context
        ).kv
        out, kept = self._call_fn(tensors, tokens, context)
        return kv, self._match(kv, tokens, out, kept)

    def __call__(
        self,
        tensors: Mapping[Any, torch.Tensor],
        tokens: Sequence[int],
        *,
        context: EditContext | None = None,
        positions: Sequence[int] | torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Sequence[int]]:
        out, kept = self._call_fn(tensors, tokens, context)
        if self._takes_context and self.rope is None:
            return out, kept  # it saw the context: its own choice of positions
        rope = self.rope_for(context)
        moved = len(kept) != len(tokens) or list(kept) != [int(t) for t in tokens]
        if rope is None:
            if self.rerotate and moved:
                warn_no_rope(self.name)
            return out, kept
        kv = edit_inputs(
            tensors, tokens, policy=self.name, queries=QueryNeed.NONE, context=context
        ).kv
        try:
            index = self._match(kv, tokens, out, kept)
        except PolicyInputError:
            warnings.warn(
                f"{self.name}: its output rows are not input rows, so they cannot be re-rotated; "
                "returned as they are",
                PolicyWarning,
                stacklevel=2,
            )
            return out, kept
        return self.keep(kv, tokens, index, context=context, positions=positions)


def as_policy(fn: Policy | ModifyFnType, name: str, needs: Needs | None = None) -> Policy:
    """``fn`` itself if it is a :class:`Policy`, else a :class:`FunctionPolicy` around it
    (reading ``needs``, default the function's own :func:`needs_of`)."""
    if isinstance(fn, Policy):
        return fn
    if not callable(fn):
        raise TypeError(f"{name}: expected an edit function fn(tensors, tokens); got {fn!r}")
    return FunctionPolicy(name, fn, needs)
