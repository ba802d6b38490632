"""``kvdrop engine``: the reference engine behind an OpenAI-compatible HTTP server.

The flags, the connector (through the one factory), the model loading and the serve loop live in
:mod:`kvdrop_engine.cli`, beside the engine; this is its front-end in ``kvdrop``'s command line.
"""

from __future__ import annotations

from kvdrop_engine.cli import add_arguments, run

__all__ = ["add_arguments", "run"]
