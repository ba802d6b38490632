"""``kvdrop engine``: the reference engine behind an OpenAI-compatible HTTP server.

The flags, the model loading and the serve loop live in :mod:`kvdrop_engine.cli`, beside the
engine; this front-end gives it the experiment harness's connector
(:func:`kvdrop.experiments.harness.connect`, the one place connectors are built for the demo,
eval and the engine).
"""

from __future__ import annotations

import argparse
from typing import Any

from kvdrop_engine.cli import add_arguments, query_capture_of
from kvdrop_engine.cli import run as serve

__all__ = ["add_arguments", "run"]


def _connect(args: argparse.Namespace, name: str) -> Any:
    """The connector of ``--cache-server`` at ``--url``, or None without ``--url``."""
    from kvdrop.experiments.harness import connect

    if args.kvdrop_url is None:
        return None
    options = {"store_decoded": args.store_decoded_kv} if args.cache_server == "kvdrop" else {}
    capture = query_capture_of(args)
    return connect(
        args.cache_server, args.kvdrop_url, args.kvdrop_http_url, name, capture, **options
    )


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM (see :func:`kvdrop_engine.cli.run`)."""
    return serve(args, _connect)
