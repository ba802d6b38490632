"""A script of ``benchmarks/`` as a module, for its tests (the folder is not a package)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

BENCHMARKS = pathlib.Path(__file__).parents[2] / "benchmarks"


def load_benchmark(script: str, module_name: str | None = None) -> ModuleType:
    """``benchmarks/<script>.py`` loaded as ``module_name`` (default: ``script``) and registered
    in ``sys.modules`` under it, since dataclasses look their module up while it loads."""
    name = module_name or script
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{script}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
