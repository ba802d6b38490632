"""The ``kvdrop`` command line: one subcommand per module of :mod:`kvdrop.commands`, imported only
when chosen."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

# name -> (module, one-line help). Each module defines ``add_arguments(parser)`` and
# ``run(args) -> int``; modules keep heavy imports (torch, zmq) inside ``run``.
COMMANDS: dict[str, tuple[str, str]] = {
    "list": ("kvdrop.commands.list_cmd", "list the registered drop policies"),
    "describe": ("kvdrop.commands.describe_cmd", "show a policy's summary and parameters"),
    "server": ("kvdrop.commands.server_cmd", "run the KV cache server (ZMQ + HTTP)"),
    "engine": (
        "kvdrop.commands.engine_cmd",
        "run the reference engine (OpenAI-compatible HTTP)",
    ),
    "demo": (
        "kvdrop.commands.demo_cmd",
        "prefill, drop, decode: baseline vs dropped, side by side",
    ),
    "eval": ("kvdrop.commands.eval_cmd", "accuracy and fidelity of policies against full KV"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Build the top-level parser; only ``command``'s module is imported (all for --help)."""
    parser = argparse.ArgumentParser(
        prog="kvdrop",
        description="KV-cache token dropping: policies, cache server, reference engine, demo.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        if command == name:
            importlib.import_module(module).add_arguments(sp)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvdrop`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # output piped into `head` and closed early: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
