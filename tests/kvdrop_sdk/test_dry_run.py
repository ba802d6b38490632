"""The one dry run's inputs (``kvdrop_sdk.dry_run``): shaped as the engine hands them over."""

from __future__ import annotations

from types import SimpleNamespace

from kvdrop_sdk import CacheKind
from kvdrop_sdk.dry_run import capture_positions, dry_run_inputs
from kvdrop_sdk.query_capture import Needs, QueryCapture, QueryNeed

LAYOUT = SimpleNamespace(num_layers=2, num_kv_heads=2, num_heads=4, head_dim=8)


def test_rows_follow_the_capture() -> None:
    window = QueryCapture(QueryNeed.WINDOW, window=4, stride=8)
    assert capture_positions(20, window) == [0, 8, 16, 17, 18, 19]
    assert capture_positions(5, QueryCapture(QueryNeed.FULL)) == [0, 1, 2, 3, 4]


def test_inputs_have_the_layouts_shapes_and_only_what_is_read() -> None:
    window = QueryCapture(QueryNeed.WINDOW, window=4, stride=0)
    run = dry_run_inputs(LAYOUT, 16, Needs(QueryNeed.WINDOW, True), window, chunk_size=8)
    assert run.tensors[CacheKind.KV].shape == (2, 2, 16, 16)
    assert run.tensors[CacheKind.QUERY].shape == (1, 2, 4, 32)
    assert run.context.query_positions.tolist() == [12, 13, 14, 15]
    assert run.context.token_scores.shape == (2, 2, 16) and run.tokens == list(range(16))
    kv_only = dry_run_inputs(LAYOUT, 16, Needs(QueryNeed.NONE), window)
    assert set(kv_only.tensors) == {CacheKind.KV} and kv_only.context.token_scores is None
    # A capture that keeps no queries serves none, whatever the function reads.
    none = dry_run_inputs(LAYOUT, 16, Needs(QueryNeed.WINDOW), QueryCapture())
    assert set(none.tensors) == {CacheKind.KV}
