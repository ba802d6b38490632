"""``kvdrop list``: every registered policy as a table (or JSON)."""

from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    import kvdrop
    from kvdrop.spec import source
    from kvdrop_sdk.table import format_table

    rows = []
    for name in kvdrop.available():
        info = kvdrop.describe(name)
        rows.append(
            {
                "name": name,
                "queries": info.queries.value,
                "summary": info.summary,
                "source": source(name),
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(format_table(rows, ["name", "queries", "summary"]))
    return 0
