"""The selector: budget, forced tokens, one ranking order that selection is a prefix of."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from kvdrop.selector import Selector


def random_cases() -> Iterator[tuple[torch.Tensor, Selector]]:
    gen = torch.Generator().manual_seed(11)
    for i in range(60):
        t = int(torch.randint(1, 90, (1,), generator=gen))
        scores = torch.randint(0, 5, (t,), generator=gen).float()  # many ties
        if i % 7 == 0:
            scores[0] = float("nan")
        chunk = [1, 4, 8, 16][i % 4]
        yield (
            scores,
            Selector(
                keep_tokens=int(torch.randint(1, 100, (1,), generator=gen)),
                chunk_size=chunk,
                n_sink=i % 5,
                window=(3 * i) % 11,
                chunked=i % 3 == 0,
            ),
        )


def ref_token_ranking(scores: list[float], n_sink: int, window: int) -> list[int]:
    """The documented order, written out: the last ``window`` tokens (most recent first), the
    first ``n_sink`` not already among them, then by score (NaN lowest; ties: earlier first)."""
    t = len(scores)
    recent = list(range(t - 1, max(t - window, 0) - 1, -1))
    sinks = [i for i in range(min(n_sink, t)) if i not in recent]
    rest = [i for i in range(t) if i not in recent and i not in sinks]
    rest.sort(key=lambda i: (-(-math.inf if math.isnan(scores[i]) else scores[i]), i))
    return recent + sinks + rest


def ref_ranking(scores: torch.Tensor, sel: Selector) -> list[int]:
    values = scores.tolist()
    if not sel.chunked:
        return ref_token_ranking(values, sel.n_sink, sel.window)
    c = sel.chunk_size
    full = len(values) // c * c
    sums = [sum(values[i : i + c]) for i in range(0, full, c)]
    order = ref_token_ranking(sums, -(-min(sel.n_sink, full) // c), -(-min(sel.window, full) // c))
    return [j * c + i for j in order for i in range(c)] + list(range(full, len(values)))


def test_ranking_is_the_documented_order_and_selection_its_prefix() -> None:
    for scores, sel in random_cases():
        k = sel.budget(scores.numel())
        expected = ref_ranking(scores, sel)
        assert sel.ranking(scores).tolist() == expected
        t = scores.numel()
        want = sorted(expected[:k]) if k < t else list(range(t))
        assert sel.select(scores, k).tolist() == want and len(want) == k


def test_selection_reports_what_the_selector_keeps() -> None:
    sel = Selector(keep_ratio=0.5, chunk_size=8, n_sink=2, window=5, chunked=True)
    got = sel.selection(100)
    assert (got.num_tokens, got.budget, got.chunk_size, got.n_sink, got.window, got.chunked) == (
        100,
        48,
        8,
        2,
        5,
        True,
    )
    assert sel.selection(100, budget=16).budget == 16


def test_budget_is_of_the_cached_part_and_what_is_asked_counts_the_tail() -> None:
    sel = Selector(keep_ratio=0.5, chunk_size=256)
    # 1018-token prompt, 768 cached: half of them is 384, aligned down to one chunk; the
    # 250-token tail is kept anyway, so 506 of the 509 asked of the whole prompt are kept.
    assert sel.budget(768) == 256 and sel.requested(768, 1018) == 509
    assert Selector(keep_ratio=0.5, chunk_size=256).budget(1024) == 512
    assert Selector(keep_ratio=0.1, chunk_size=16).budget(64) == 16  # at least one chunk
    assert Selector(keep_tokens=600, chunk_size=16).budget(768) == 592
    assert Selector(keep_tokens=5000).requested(1018) == 1018
    assert Selector(keep_tokens=300).requested(768, 1018) == 550


def test_recent_window_counts_the_tail_and_protected_tokens_come_first() -> None:
    sel = Selector(keep_tokens=16, chunk_size=4, window=10, n_sink=2)
    scores = torch.arange(40, dtype=torch.float32).flip(0)  # earlier = better
    # 6 tail tokens: only the last 4 cached ones are forced recent.
    order = sel.ranking(scores, prompt_tokens=46).tolist()
    assert order[:6] == [39, 38, 37, 36, 0, 1]
    # Protected: the first 9 come before everything, and the budget grows to cover them.
    order = sel.ranking(scores, prompt_tokens=46, protected=9).tolist()
    assert order[:9] == list(range(9)) and order[9:13] == [39, 38, 37, 36]
    assert Selector(keep_tokens=4, chunk_size=4).budget(40, protected=9) == 12
    kept = Selector(keep_tokens=4, chunk_size=4).select(scores.flip(0), protected=9)
    assert kept.tolist()[:9] == list(range(9))


def test_a_bare_count_selection_names_unknown_context_fields() -> None:
    sel = Selector(keep_tokens=4, chunk_size=1)
    with pytest.raises(TypeError, match=r"\['bogus'\]"):
        sel.selection(10, bogus=1)
    given = sel.selection(10, prompt_tokens=14, head_dim=4)
    assert given.inputs.prompt_tokens == 14 and given.inputs.head_dim == 4
