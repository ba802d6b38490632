"""Package layering: which package may import which (function-level imports count).

kvdrop_sdk (transport) imports neither kvdrop (policies) nor kvdrop_engine; kvdrop_rope imports
only torch and the standard library; the engine's model.py imports only torch.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"


def _imports(path: Path) -> set[str]:
    """Top-level package names ``path`` imports (absolute imports; relative ones are local)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _package_imports(package: str) -> dict[str, set[str]]:
    return {str(p.relative_to(SRC)): _imports(p) for p in sorted((SRC / package).rglob("*.py"))}


@pytest.mark.parametrize("forbidden", ["kvdrop", "kvdrop_engine"])
def test_sdk_imports_neither_policies_nor_engine(forbidden: str) -> None:
    bad = {f: names for f, names in _package_imports("kvdrop_sdk").items() if forbidden in names}
    assert not bad, bad


def test_rope_and_model_import_only_torch_and_stdlib() -> None:
    allowed = set(sys.stdlib_module_names) | {"torch", "__future__"}
    files = _package_imports("kvdrop_rope")
    files["kvdrop_engine/model.py"] = _imports(SRC / "kvdrop_engine" / "model.py")
    bad = {f: names - allowed for f, names in files.items() if names - allowed}
    assert not bad, bad


def test_only_the_lmcache_backend_imports_lmcache() -> None:
    """LMCache stays optional: one module imports it (lazily), nothing else does."""
    files = {
        **_package_imports("kvdrop"),
        **_package_imports("kvdrop_sdk"),
        **_package_imports("kvdrop_engine"),
        **_package_imports("kvdrop_rope"),
    }
    assert {f for f, names in files.items() if "lmcache" in names} == {
        "kvdrop_engine/connectors/lmcache.py"
    }
