"""``kvdrop describe NAME``: a policy's summary, query needs and parameters, wrapped to the
terminal's width (``$COLUMNS``)."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import textwrap
from typing import Any

#: A Sphinx cross-reference, ``:class:`~kvdrop.Policy``` or ``:func:`kvdrop.get```.
_ROLE = re.compile(r":[a-z]+:`(~?)([^`<]*?)(?:\s*<[^>]*>)?`")
#: reST inline literals ````text````.
_LITERAL = re.compile(r"``(.+?)``")


def plain_text(text: str) -> str:
    """Docstring reST as a terminal shows it: roles become their target (``~`` keeps the last
    name, as Sphinx does), double-backquoted literals single-quoted like Markdown code."""
    text = _ROLE.sub(lambda m: m[2].rsplit(".", 1)[-1] if m[1] else m[2], text)
    return _LITERAL.sub(r"`\1`", text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="policy name (see `kvdrop list`)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def run(args: argparse.Namespace) -> int:
    import kvdrop
    from kvdrop.spec import source
    from kvdrop_sdk.table import format_table

    try:
        info = kvdrop.describe(args.name)
    except (kvdrop.PolicyNotFoundError, kvdrop.PolicyConflictError, kvdrop.PolicyParamError) as exc:
        print(f"kvdrop describe: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**info.to_dict(), "source": source(args.name)}, indent=2))
        return 0
    width = shutil.get_terminal_size().columns  # $COLUMNS, else the terminal, else 80
    head = [
        f"{info.name}: {plain_text(info.summary)}",
        f"needs query tensors: {'yes' if info.needs.reads_queries else 'no'}",
        f"source: {source(args.name)}",
    ]
    for line in head:
        print(textwrap.fill(line, width, subsequent_indent="  ", break_on_hyphens=False))
    if info.details:
        paragraphs = plain_text(info.details).split("\n\n")
        print("\n" + "\n\n".join(_wrap(p, width) for p in paragraphs))
    print()
    rows = [_plain_row(p.describe()) for p in info.params]
    columns = ["name", "type", "default", "allowed", "help"]
    print(format_table(rows, columns, title="parameters", width=width))
    return 0


def _wrap(paragraph: str, width: int) -> str:
    """A docstring paragraph refilled to ``width``: its prose joined, each indented line (an
    item of a list) its own line, continued two spaces further in."""
    groups: list[list[str]] = []
    for line in paragraph.split("\n"):
        if not groups or line[:1].isspace():
            groups.append([])
        groups[-1].append(line)
    out = []
    for group in groups:
        indent = group[0][: len(group[0]) - len(group[0].lstrip())]
        text = " ".join(" ".join(group).split())
        out.append(
            textwrap.fill(
                text, width, initial_indent=indent, subsequent_indent=indent and indent + "  ",
                break_on_hyphens=False,
            )
        )  # fmt: skip
    return "\n".join(out)


def _plain_row(row: dict[str, Any]) -> dict[str, Any]:
    return {k: plain_text(v) if isinstance(v, str) else v for k, v in row.items()}
