"""Every docs block runs alone: a reader may copy any one block, not the page.

conftest.py runs a page's blocks in order in one namespace, so a block that uses a name only an
earlier block defines passes there and fails (``NameError``) for a reader who pastes that block
into a fresh interpreter. This checks every ```` ```python ```` block of README.md and
docs/**/*.md (skipped ones too: a reader runs them elsewhere) statically: each name the block
reads at its top level, or as a global inside its functions, classes and comprehensions, is
bound in the block itself (assigned, imported, defined) or is a builtin. "Alone" means with the
services the page starts running (a server started by a bash block is the block's stated
prerequisite, as for a reader with it running in another terminal), not with its variables.

A block that cannot sensibly repeat what it continues says so, with the reason, right before it:
``<!-- continues: "why" -->``. Every skip directive names its reason too (``"why"`` or
``requires("module")``), so each block is run by the docs test or says why not.
"""

from __future__ import annotations

import builtins
import re
import symtable
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

_FENCE = re.compile(r"^```(?P<info>[^\n]*)\n(?P<source>.*?)^```", re.S | re.M)
_COMMENTS = re.compile(r"(?:<!--(?:(?!-->).)*-->\s*)+\Z", re.S)
_CONTINUES = re.compile(r'<!--\s*continues:\s*"(?P<why>[^"]+)"\s*-->')
_SKIP = re.compile(r"<!--\s*skip:(?P<rest>(?:(?!-->).)*)-->", re.S)
_SKIP_WITH_REASON = re.compile(r'\s*next\s+(?:"[^"]+"|requires\("[\w.]+"\))\s*')
#: Names a page's namespace has before any block runs (conftest.py's ``requires``; a module's).
_GIVEN = {"requires", "__name__", "__file__"} | set(dir(builtins))


def unbound_names(source: str) -> list[str]:
    """Names ``source`` reads at module level (or as globals in its inner scopes) without
    binding them itself, builtins left out; sorted."""
    table = symtable.symtable(source, "<docs block>", "exec")
    bound = {
        s.get_name()
        for s in table.get_symbols()
        if s.is_assigned() or s.is_imported() or s.is_namespace()
    }
    read: set[str] = set()

    def walk(scope: symtable.SymbolTable, top: bool) -> None:
        for s in scope.get_symbols():
            if not s.is_referenced():
                continue
            if (top and not (s.is_assigned() or s.is_imported())) or (not top and s.is_global()):
                read.add(s.get_name())
        for child in scope.get_children():
            walk(child, False)

    walk(table, True)
    return sorted(read - bound - _GIVEN)


def python_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """Each python block of a page: its line, its source, and its ``continues`` reason."""
    blocks = []
    for m in _FENCE.finditer(text):
        info = m["info"].strip()
        if not info or info.split()[0].lower() not in ("python", "py"):
            continue
        before = _COMMENTS.search(text[: m.start()].rstrip() + "\n")
        marker = _CONTINUES.search(before.group(0)) if before else None
        line = text.count("\n", 0, m.start()) + 1
        blocks.append((line, m["source"], marker["why"] if marker else None))
    return blocks


def test_the_check_finds_a_name_from_an_earlier_block() -> None:
    page = (
        "```python\nimport torch\nx = torch.ones(2)\n```\n\n"
        "```python\ndef f():\n    return [v * 2 for v in x]\nprint(f(), len(torch.ones(1)))\n```\n"
        '\n<!-- continues: "reuses the server object above" -->\n```python\nprint(x)\n```\n'
    )
    blocks = python_blocks(page)
    assert [unbound_names(source) for _, source, _ in blocks] == [[], ["torch", "x"], ["x"]]
    assert [why for _, _, why in blocks] == [None, None, "reuses the server object above"]
    assert unbound_names("class A:\n    n = 1\n    m = n + len([])\nA()\n") == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_block_defines_what_it_uses(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    missing = {
        line: names
        for line, source, why in python_blocks(text)
        if why is None and (names := unbound_names(source))
    }
    assert not missing, (
        f"{page.name}: blocks that use names an earlier block defines (line: names): {missing}. "
        "Repeat the setup in the block so it runs alone, or put "
        '<!-- continues: "why" --> before it.'
    )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_skip_says_why(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    bare = [m.group(0) for m in _SKIP.finditer(text) if not _SKIP_WITH_REASON.fullmatch(m["rest"])]
    assert not bare, f"{page.name}: skip directives without a reason: {bare}"
