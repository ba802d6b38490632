"""``kvdrop server``: the KV cache server's command.

Its argument table and ``run`` live in :mod:`kvdrop_sdk.server.cli`, beside the server: the SDK
never imports ``kvdrop`` (the layering rule), and ``python -m kvdrop_sdk.server`` must run the same
server without the policy package. This front-end only puts it under ``kvdrop``.
"""

from __future__ import annotations

from kvdrop_sdk.server.cli import add_arguments, run

__all__ = ["add_arguments", "run"]
