"""``kvdrop describe`` prints plain text: the docstrings' Sphinx roles and literals are resolved
for a terminal, for every registered policy."""

from __future__ import annotations

import re

import pytest

import kvdrop
from kvdrop.cli import main
from kvdrop.commands.describe_cmd import plain_text

MARKUP = re.compile(r":[a-z]+:`|``")


def test_roles_become_their_target_and_literals_single_backquotes() -> None:
    text = "see :class:`~kvdrop.MissingTokenScoresError`, :func:`kvdrop.get` and ``[L, H, S]``"
    assert plain_text(text) == "see MissingTokenScoresError, kvdrop.get and `[L, H, S]`"


@pytest.mark.parametrize("name", kvdrop.available())
def test_describe_prints_no_sphinx_markup(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["describe", name]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{name}: ") and "parameters" in out
    assert not MARKUP.search(out), out


def test_kvzip_details_read_as_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["describe", "kvzip"]) == 0
    out = capsys.readouterr().out
    assert "see MissingTokenScoresError for where they come from" in " ".join(out.split())


@pytest.mark.parametrize("name", kvdrop.available())
def test_describe_wraps_to_the_terminal_width(
    name: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``COLUMNS=80``: no line is wider (issue 34: 268 columns), and no word of a help text is
    lost to the wrapping."""
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["describe", name]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80, out
    table = out.split("\nparameters\n", 1)[1].splitlines()
    at = table[0].index("help")
    column = "".join(line[at:] for line in table[2:])
    helps = "".join(plain_text(p.help) for p in kvdrop.describe(name).params)
    assert "".join(column.split()) == "".join(helps.split())
