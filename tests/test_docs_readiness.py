"""The docs wait for a server the way a user's script would, never by luck.

conftest.py's docs runner waits for every background service before the next command, so a page
whose ``curl`` runs right after ``kvdrop server ... &`` passes here and fails for a reader on a
loaded machine (start-up takes 9-12 s with ``--no-l1-use-lazy``). This checks the pages instead:
the first ``curl`` to a port that a background command of the page started must retry refused
connections (``curl --retry-connrefused --retry N``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

_BASH_BLOCK = re.compile(r"^```(?:bash|sh|console)\n(.*?)^```", re.S | re.M)
_STARTED_PORT = re.compile(r"--(?:http-)?port[ =](\d{2,5})\b")
_CURL_PORT = re.compile(r"(?:localhost|127\.0\.0\.1):(\d{2,5})\b")


def unwaited_curls(text: str) -> list[str]:
    """Commands of ``text`` (markdown) that reach a just-started server without waiting for it."""
    pending: set[str] = set()
    bad: list[str] = []
    for block in _BASH_BLOCK.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            command = line.split(" #")[0].strip()
            if not command or command.startswith("#"):
                continue
            if re.search(r"(?<![&|])&$", command):
                pending |= set(_STARTED_PORT.findall(command))
            elif command.startswith("curl"):
                ports = set(_CURL_PORT.findall(command)) & pending
                if ports and "--retry-connrefused" not in command:
                    bad.append(command)
                pending -= ports
    return bad


def test_the_check_finds_a_curl_that_does_not_wait() -> None:
    page = (
        "```bash\nkvdrop server --port 6555 --http-port 8080 &\n"
        "curl -s localhost:8080/health\n```\n"
    )
    assert unwaited_curls(page) == ["curl -s localhost:8080/health"]
    waited = page.replace("curl -s", "curl -s --retry-connrefused --retry 30 --retry-delay 1")
    assert unwaited_curls(waited) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_curl_after_a_background_start_waits_for_readiness(page: Path) -> None:
    assert unwaited_curls(page.read_text(encoding="utf-8")) == []
