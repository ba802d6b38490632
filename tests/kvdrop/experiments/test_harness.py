"""The experiment harness: the layout check that runs before any prefill, and the demo failing in
one line on a policy that cannot edit the model (the capture: tests/kvdrop_sdk/
test_query_capture.py)."""

from __future__ import annotations

import pytest

import kvdrop
from kvdrop.experiments.harness import HarnessError, check_policies
from kvdrop_engine.loading import preset_config
from kvdrop_sdk.query_capture import QueryCapture, QueryNeed


def test_check_policies_refuses_a_head_dim_that_does_not_divide_the_layout() -> None:
    cfg = preset_config("tiny")  # 2 KV / 4 query heads x 16
    full = QueryCapture(QueryNeed.FULL)
    bad = kvdrop.get("last-queries", keep_ratio=0.5, head_dim=24)
    with pytest.raises(HarnessError, match=r"'last-queries' cannot edit.*head_dim=24"):
        check_policies({"last-queries": bad}, cfg, full, chunk_size=256)
    # The default head_dim (None) is filled from the layout: it fits.
    check_policies({"last-queries": kvdrop.get("last-queries", keep_ratio=0.5)}, cfg, full, 256)
    window = QueryCapture(QueryNeed.WINDOW)
    for name in ("snapkv", "h2o", "rkv", "knorm"):
        check_policies({name: kvdrop.get(name, keep_ratio=0.5)}, cfg, window, chunk_size=256)


def _demo_error(capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    from kvdrop.cli import main

    args = ["demo", "--random-preset", "tiny", "--num-requests", "2", "--prompt-tokens", "300"]
    assert main([*args, "--max-tokens", "2", *flags]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "prefill" not in err, err  # failed before any prefill
    lines = [line for line in err.splitlines() if line.startswith("kvdrop demo: error:")]
    assert len(lines) == 1, err
    return lines[0]


def test_demo_checks_the_policy_against_the_layout_before_prefill(
    capsys: pytest.CaptureFixture[str],
) -> None:
    line = _demo_error(capsys, "--policy", "last-queries", "--policy-arg", "head_dim=24")
    assert "cannot edit this model's caches" in line and "head_dim=24" in line


# 300-token prompts are one 256-token chunk and a tail: keep 0.5 keeps them whole, and the
# demo says so (PolicyWarning); expected here, the test is about the plugin's head_dim.
@pytest.mark.filterwarnings("ignore:.*chunk alignment keeps:kvdrop.errors.PolicyWarning")
def test_demo_runs_the_example_query_plugin_with_its_default_head_dim(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvdrop.cli import main

    args = ["demo", "--random-preset", "tiny", "--num-requests", "2", "--prompt-tokens", "300"]
    assert main([*args, "--max-tokens", "2", "--policy", "last-queries", "--json"]) == 0
    err = capsys.readouterr().err
    # The model load is announced before it starts, then timed.
    assert err.index("loading ") < err.index("model random-tiny:"), err
