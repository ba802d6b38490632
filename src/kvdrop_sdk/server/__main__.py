"""``python -m kvdrop_sdk.server [flags]``: same as ``kvdrop server``."""

from __future__ import annotations

import argparse
import sys

from kvdrop_sdk.server.cli import add_arguments, run


def main(argv: list[str] | None = None) -> int:
    """Parse the server flags and run it."""
    parser = argparse.ArgumentParser(prog="python -m kvdrop_sdk.server", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
