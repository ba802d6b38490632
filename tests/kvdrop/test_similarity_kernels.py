"""kvdrop's Triton kernels: checked on the CPU in Triton's interpreter (CI has no GPU), against
float64 references (``similarity_kernel_checks.py``, in a child process because Triton reads
``TRITON_INTERPRET`` when first imported)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvdrop import kernels

CHECKS = Path(__file__).with_name("similarity_kernel_checks.py")


@pytest.mark.skipif(kernels.triton is None, reason="Triton is not installed")
def test_kernels_match_references_in_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(CHECKS)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(": ok") == 2, proc.stdout


def test_kernel_takes_only_what_it_can_run() -> None:
    cpu16 = torch.zeros(1, 4, 64, dtype=torch.float16)
    assert kernels.available(cpu16) == kernels.interpreted()
    assert not kernels.available(cpu16.float())
    with pytest.raises(ValueError, match="float16"):
        kernels.similarity_row_max(cpu16.float(), 0, 4)
