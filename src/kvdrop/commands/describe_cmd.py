"""``kvdrop describe NAME``: a policy's summary, query needs and parameters."""

from __future__ import annotations

import argparse
import json
import sys


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
    print(f"{info.name}: {info.summary}")
    print(f"needs query tensors: {'yes' if info.needs.reads_queries else 'no'}")
    print(f"source: {source(args.name)}")
    if info.details:
        print(f"\n{info.details}")
    print()
    rows = [p.describe() for p in info.params]
    print(format_table(rows, ["name", "type", "default", "allowed", "help"], title="parameters"))
    return 0
