"""``kvdrop describe NAME``: a policy's summary, query needs and parameters."""

from __future__ import annotations

import argparse
import json
import re
import sys
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
    print(f"{info.name}: {plain_text(info.summary)}")
    print(f"needs query tensors: {'yes' if info.needs.reads_queries else 'no'}")
    print(f"source: {source(args.name)}")
    if info.details:
        print(f"\n{plain_text(info.details)}")
    print()
    rows = [_plain_row(p.describe()) for p in info.params]
    print(format_table(rows, ["name", "type", "default", "allowed", "help"], title="parameters"))
    return 0


def _plain_row(row: dict[str, Any]) -> dict[str, Any]:
    return {k: plain_text(v) if isinstance(v, str) else v for k, v in row.items()}
