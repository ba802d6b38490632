"""Argument types and option groups shared by the ``kvdrop`` subcommands (the engine's groups,
``--model``/``--dtype``/... and ``--cache-server``/``--url``/``--query-capture``, are declared
once in :mod:`kvdrop_engine.options`, which ``kvdrop engine`` uses too)."""

from __future__ import annotations

import argparse
import math

from kvdrop_engine.options import (
    add_connector_arguments,
    add_keep_ratio_argument,
    add_model_arguments,
)

__all__ = [
    "add_connector_arguments",
    "add_keep_ratio_argument",
    "add_model_arguments",
    "finite_positive",
]


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def finite_positive(text: str) -> float:
    """An argparse ``type``: a finite float > 0 (``inf`` and ``nan`` are refused in one line)."""
    value = _number(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value
