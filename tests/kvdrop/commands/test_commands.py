"""The ``kvdrop`` subcommands' front-ends: flags that cannot work fail in one line with exit code
2, ``--help`` says what a default run does."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdrop.cli import main


def _one_error(err: str, prefix: str) -> str:
    """The one error line of a failed command (no traceback)."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, err
    return lines[0]


def test_server_bad_port_says_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["server", "--port", "99999"]) == 2
    line = _one_error(capsys.readouterr().err, "kvdrop server: error:")
    assert "--port" in line and "65535" in line


@pytest.mark.parametrize("value", ["inf", "nan", "-0.5", "1.5", "half"])
def test_keep_ratio_flags_must_be_in_range(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--keep-ratio", value])
    assert exc.value.code == 2
    line = _one_error(capsys.readouterr().err, "kvdrop demo: error:")
    assert "--keep-ratio: expected a number in (0, 1]" in line and value in line


@pytest.mark.parametrize("value", ["inf", "nan", "0", "1.5", "1", "abc"])
def test_keep_ratios_must_be_in_the_range_the_help_says(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The flag asks the eval grid's own rule (1.0 is the full-KV row every grid has), so a
    value the run would refuse is refused while parsing, with the same words as the help."""
    with pytest.raises(SystemExit) as exc:
        main(["eval", "--keep-ratios", "0.5", value])
    assert exc.value.code == 2
    line = _one_error(capsys.readouterr().err, "kvdrop eval: error:")
    assert "--keep-ratios:" in line and "(0, 1)" in line and value in line
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    assert "keep ratios in (0, 1)" in " ".join(capsys.readouterr().out.split())


def test_eval_help_shows_the_default_grid(capsys: pytest.CaptureFixture[str]) -> None:
    from kvdrop.experiments.eval import PRESETS

    with pytest.raises(SystemExit) as exc:
        main(["eval", "--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text
    grid = PRESETS["default"]
    assert "(default: " + " ".join(map(str, grid["keep_ratios"])) + ")" in out
    assert "(default: " + " ".join(map(str, grid["lengths"])) + ")" in out
    assert "(default: " + " ".join(grid["tasks"]) + ")" in out
    assert f"(default: {grid['num_samples']})" in out


def test_plot_styles_stay_distinct_past_ten_policies() -> None:
    from kvdrop.commands.eval_cmd import plot_style

    styles = [plot_style(i) for i in range(80)]
    assert len({s["color"] for s in styles[:20]}) == 20
    assert len({(s["color"], s["marker"], s["linestyle"]) for s in styles}) == 80


def test_eval_plot_draws_a_wilson_band_per_policy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    from matplotlib.axes import Axes

    from kvdrop.commands.eval_cmd import plot_report
    from kvdrop.experiments.eval import EvalReport

    rows = []
    for policy, acc in (("full", 1.0), ("snapkv", 0.5), ("random", 0.25)):
        for ratio in (1.0,) if policy == "full" else (0.5, 0.25):
            rows.append(
                {
                    "setting": "inside",
                    "policy": policy,
                    "keep_ratio": ratio,
                    "accuracy": acc,
                    "ci_low": acc / 2,
                    "ci_high": (1 + acc) / 2,
                }
            )
    report = EvalReport(rows, {"model": "m", "grid": {"policies": ["snapkv", "random"]}})
    report.pooled = lambda by=(): rows  # type: ignore[method-assign]
    bands: list[tuple[tuple[float, ...], tuple[float, ...]]] = []
    original = Axes.fill_between

    def spy(self: Axes, x: object, y1: object, y2: object, **kw: object) -> object:
        bands.append((tuple(y1), tuple(y2)))  # type: ignore[arg-type]
        return original(self, x, y1, y2, **kw)

    monkeypatch.setattr(Axes, "fill_between", spy)
    plot_report(report, tmp_path / "plot.png")
    assert sorted(bands) == [((0.125, 0.125), (0.625, 0.625)), ((0.25, 0.25), (0.75, 0.75))]
    assert (tmp_path / "plot.png").stat().st_size > 0


@pytest.mark.parametrize("key", ["keep_ratio", "keep_tokens"])
def test_demo_policy_arg_cannot_bypass_the_keep_ratio_rule(
    key: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--policy-arg keep_ratio=0.3`` beside the ``--keep-ratio`` default would be a second,
    silent budget rule: refused before anything loads, saying where the budget goes."""
    assert main(["demo", "--policy-arg", f"{key}=3"]) == 2
    line = _one_error(capsys.readouterr().err, "kvdrop demo: error:")
    assert f"--policy-arg {key}=" in line and "--keep-ratio" in line
