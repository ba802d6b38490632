"""WindowCapture: which rows a request keeps (last W computed positions + every S-th), in order."""

from __future__ import annotations

import pytest
import torch

from kvdrop_engine.capture import WindowCapture


def rows(positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Query rows ``[L=2, r, Hq=1, d=2]`` whose values are their positions, and lse alike."""
    p = torch.tensor(positions, dtype=torch.float32)
    q = p.view(1, -1, 1, 1).expand(2, -1, 1, 2).clone()
    return q, p.view(1, -1, 1).expand(2, -1, 1).clone()


def test_wanted_rows_of_prefill_chunks_and_decode_steps() -> None:
    cap = WindowCapture(num_prompt=100, window=8, stride=32)
    assert cap.wanted(0, 40) == [0, 32]
    assert cap.wanted(40, 60) == [24, *range(52, 60)]  # 64 is offset 24; 92..99 the last 8
    assert cap.wanted(100, 1) == [0]  # a decode step: always its one row
    assert WindowCapture(10, 4, 0).wanted(0, 10) == [6, 7, 8, 9]  # stride 0: no sample


def test_record_keeps_the_last_window_over_decode_steps_and_the_strided_sample() -> None:
    cap = WindowCapture(num_prompt=20, window=4, stride=8)
    for start, n in ((0, 12), (12, 8)):
        offsets = cap.wanted(start, n)
        q, lse = rows([start + o for o in offsets])
        cap.add([start + o for o in offsets], q, lse)
    for pos in range(20, 26):  # six decode steps
        q, lse = rows([pos])
        cap.add([pos], q, lse)
    record = cap.record()
    assert record is not None
    positions, queries, norms = record
    # 17..21 left the window and are not multiples of 8; 24 is both, kept once.
    assert positions.tolist() == [0, 8, 16, 22, 23, 24, 25]
    assert queries.shape == (1, 2, 7, 2) and norms.shape == (1, 2, 7, 1)
    assert queries[0, 0, :, 0].tolist() == positions.tolist() == norms[0, 1, :, 0].tolist()
    assert cap.num_rows == 7


def test_rows_must_come_in_order() -> None:
    cap = WindowCapture(num_prompt=10, window=4, stride=0)
    q, lse = rows([7, 8])
    cap.add([7, 8], q, lse)
    with pytest.raises(ValueError, match="position order"):
        cap.add([8], *rows([8]))
    assert WindowCapture(5, 2, 0).record() is None
    with pytest.raises(ValueError, match="window >= 1"):
        WindowCapture(5, 0, 0)
