"""One base for wrappers (``PolicyWrapper``) and inputs read through to the edit context: what a
policy declares and reads is answered in one place, for built-in and user wrappers alike."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import kvdrop
from kvdrop import Scorer, ScorerFactory, Selection
from kvdrop.inputs import EditInputs, edit_inputs
from kvdrop_rope import RopeConfig
from kvdrop_sdk import CacheKind
from kvdrop_sdk.edit import EditContext
from kvdrop_sdk.query_capture import KVNeed, Needs, QueryCapture, QueryNeed


class Logged(kvdrop.PolicyWrapper):
    """A user's wrapper: logs each edit, keeps what the inner policy keeps."""

    def __init__(self, policy: kvdrop.Policy) -> None:
        super().__init__(policy)
        self.calls = 0

    def select_indices(
        self,
        tensors: Mapping[Any, torch.Tensor],
        tokens: Sequence[int],
        *,
        context: EditContext | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1
        return super().select_indices(tensors, tokens, context=context)


def test_a_users_wrapper_declares_what_its_policy_reads() -> None:
    kvzip, snapkv = Logged(kvdrop.get("kvzip")), Logged(kvdrop.get("snapkv", keep_ratio=0.5))
    assert kvdrop.needs_of(kvzip) == Needs(QueryNeed.NONE, True, KVNeed.NONE)
    assert kvdrop.needs_of(snapkv) == Needs(QueryNeed.WINDOW, False, KVNeed.KEYS, False)
    assert snapkv.name == "snapkv" and snapkv.rerotate
    capture = QueryCapture.for_policies([kvzip, snapkv])
    assert capture.mode is QueryNeed.WINDOW and capture.scores
    kv = torch.randn(2, 1, 64, 4)
    knorm = Logged(kvdrop.get("knorm", keep_tokens=16, chunk_size=16, rerotate=False))
    _, kept = knorm({CacheKind.KV: kv}, list(range(64)))
    assert knorm.calls == 1 and len(kept) == 16 and not knorm.rerotate


def test_wrappers_forward_rerotate_and_rope_unless_set_on_them() -> None:
    inner = kvdrop.get("knorm", keep_tokens=16, chunk_size=16)
    inner.rerotate = False
    budget = kvdrop.Budget(inner)
    assert budget.rerotate is False and budget.name == "budget(knorm)"
    budget.rerotate = True
    assert budget.rerotate and inner.rerotate is False
    rope = RopeConfig(head_dim=4)
    moved = kvdrop.Rerotate(inner, rope)
    assert moved.rope == rope and moved.rerotate and moved.name == "knorm"
    assert kvdrop.Budget(kvdrop.get("kvzip", keep_tokens=16, chunk_size=16)).token_scores


@dataclass(frozen=True)
class Recording(Scorer):
    """Records the Selection it was handed."""

    needs_selection = True
    queries = QueryNeed.WINDOW

    def score(self, kv: torch.Tensor, query: Any, selection: Selection) -> torch.Tensor:
        SEEN.append(selection)
        return torch.arange(kv.shape[2], dtype=torch.float32)


SEEN: list[Selection] = []


def test_inputs_and_selection_read_through_to_the_context() -> None:
    kv, query = torch.randn(2, 1, 32, 8), torch.randn(1, 1, 3, 8)
    context = EditContext.of(
        32,
        query_positions=torch.tensor([4, 31, 40]),
        query_lse=torch.zeros(1, 1, 3, 2),
        prompt_tokens=41,
        protected=3,
        head_dim=8,
        request_id="r1",
    )
    tensors = {CacheKind.KV: kv, CacheKind.QUERY: query}
    inputs = edit_inputs(
        tensors, list(range(32)), policy="p", queries=QueryNeed.WINDOW, context=context
    )
    assert inputs.context is context and inputs.protected == 3 and inputs.prompt_tokens == 41
    assert (
        inputs.query_positions is context.query_positions and inputs.query_lse is context.query_lse
    )
    plain = EditInputs(kv)
    assert plain.prompt_tokens == 32 and plain.query_positions is None and plain.protected == 0
    fn = ScorerFactory("rec", Recording, "test")(keep_tokens=16, chunk_size=8)
    fn.rerotate = False
    fn(tensors, list(range(32)), context=context)
    got = SEEN[-1]
    assert got.inputs.context is context  # nothing copied on the way
    assert (got.budget, got.chunk_size, got.protected, got.tail) == (16, 8, 3, 9)
    assert got.query_positions.tolist() == [4, 31, 40] and got.query_lse is not None


def test_edit_inputs_take_only_kv_query_and_a_context() -> None:
    """The pre-context form (context fields as arguments) is gone: it says what to use."""
    kv = torch.randn(2, 1, 8, 4)
    with pytest.raises(TypeError, match="with_context"):
        EditInputs(kv, None, torch.arange(8))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        EditInputs(kv, None, None, 8)  # type: ignore[call-arg]
    moved = EditInputs(kv).with_context(protected=2, prompt_tokens=12)
    assert moved.protected == 2 and moved.prompt_tokens == 12
