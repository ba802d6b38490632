"""Triton kernels: checked on the CPU in Triton's interpreter (CI has no GPU), against float64
references and the plain PyTorch path (``kernel_checks.py``, in a child process because Triton
reads ``TRITON_INTERPRET`` when first imported)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvdrop_engine import kernels

CHECKS = Path(__file__).with_name("kernel_checks.py")


@pytest.mark.skipif(kernels.triton is None, reason="Triton is not installed")
def test_kernels_match_references_in_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(CHECKS)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(": ok") == 3, proc.stdout


def test_kernels_run_on_cpu_only_when_interpreted() -> None:
    assert kernels.available("cpu") == kernels.interpreted()
    assert not kernels.available(None) or kernels.interpreted()


def test_decode_splits_fill_the_device_within_bounds() -> None:
    assert kernels.decode_splits(1, 8) == 32
    assert kernels.decode_splits(16, 8) == 8
    assert kernels.decode_splits(256, 8) == 8
    assert all(8 <= kernels.decode_splits(b, h) <= 32 for b in range(1, 300, 7) for h in (1, 8))


@pytest.mark.skipif(kernels.triton is None, reason="Triton is not installed")
def test_paged_decode_rejects_shapes_it_cannot_run() -> None:
    import torch

    q = torch.zeros(1, 6, 24)  # head dim not a power of two
    cache = torch.zeros(4, 16, 2, 24)
    table = torch.zeros(1, 1, dtype=torch.int32)
    lens = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="power of two"):
        kernels.paged_decode(q, cache, cache, table, lens)
