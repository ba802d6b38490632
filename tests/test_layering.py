"""Package layering: which package may import which (function-level imports count).

kvdrop_sdk (transport) imports neither kvdrop (policies) nor kvdrop_engine, and its client
transport (``kvdrop_sdk.transport``) nothing of its server; kvdrop's policy core (everything but
``experiments``, ``commands`` and ``integrations``) does not import kvdrop_engine; kvdrop_rope
imports only torch and the standard library; the engine's model.py imports only torch.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"


#: kvdrop's subpackages that wire policies to the engine (the rest is the policy core).
KVDROP_WIRING = ("experiments", "commands", "integrations")


def _imports(path: Path, depth: int = 1) -> set[str]:
    """Module names ``path`` imports, cut to their first ``depth`` parts (absolute imports;
    relative ones are local)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(".".join(a.name.split(".")[:depth]) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(".".join(node.module.split(".")[:depth]))
    return names


def _package_imports(package: str, depth: int = 1) -> dict[str, set[str]]:
    root = SRC / package
    return {str(p.relative_to(SRC)): _imports(p, depth) for p in sorted(root.rglob("*.py"))}


@pytest.mark.parametrize("forbidden", ["kvdrop", "kvdrop_engine"])
def test_sdk_imports_neither_policies_nor_engine(forbidden: str) -> None:
    bad = {f: names for f, names in _package_imports("kvdrop_sdk").items() if forbidden in names}
    assert not bad, bad


def test_policy_core_does_not_import_the_engine() -> None:
    """Policies, combinators, the registry and the testing kit work without an engine."""
    core = {
        f: names
        for f, names in _package_imports("kvdrop").items()
        if Path(f).parts[1] not in KVDROP_WIRING
    }
    assert len(core) > 20  # the policies and the combinators are in it
    bad = {f: names for f, names in core.items() if "kvdrop_engine" in names}
    assert not bad, bad


def test_transport_does_not_import_the_server() -> None:
    """The client transport owns what client and server share (the shm segment format)."""
    files = _package_imports("kvdrop_sdk/transport", depth=2)
    bad = {f: names for f, names in files.items() if "kvdrop_sdk.server" in names}
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


#: The engine's imports of the policy library, by file: all inside functions (or for type
#: checking), so ``import kvdrop_engine`` loads no policy. The prompt cut and the cut while
#: decoding build policies from spec strings (kvdrop.spec), name their errors (kvdrop.errors)
#: and check the kept indices (kvdrop.policy); a client's spec is bounded before it is built
#: (client_specs.py: kvdrop.spec, kvdrop.registry, kvdrop.limits). A new one is added here,
#: on purpose.
ENGINE_USES_POLICIES = {
    "kvdrop_engine/drop.py": {"kvdrop.errors", "kvdrop.policy", "kvdrop.spec"},
    # the decode cut re-rotates the prompt's captured query rows with the library's RoPE rule
    "kvdrop_engine/decode_cut.py": {"kvdrop.errors", "kvdrop.policy", "kvdrop.rope", "kvdrop.spec"},
    # the decode cut's batched ranking recognises the built-in scorers it batches (and uses
    # the library's key similarity and its fused row-max kernel), so their scores stay the
    # library's own
    "kvdrop_engine/decode_batch.py": {
        "kvdrop.attention",
        "kvdrop.kernels",
        "kvdrop.policies._common",
        "kvdrop.policies.knorm",
        "kvdrop.policies.rkv",
        "kvdrop.policies.snapkv",
        "kvdrop.policies.streaming",
        "kvdrop.policies.tova",
        "kvdrop.policy",
    },
    "kvdrop_engine/client_specs.py": {
        "kvdrop.errors",
        "kvdrop.limits",
        "kvdrop.registry",
        "kvdrop.spec",
    },
}


def _policy_modules(node: ast.AST) -> list[str]:
    """The ``kvdrop`` (policy library) modules an import node imports."""
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        mods = [node.module]
    elif isinstance(node, ast.Import):
        mods = [a.name for a in node.names]
    else:
        return []
    return [m for m in mods if m == "kvdrop" or m.startswith("kvdrop.")]


def test_the_engine_imports_the_policy_library_only_where_named() -> None:
    """``kvdrop_engine -> kvdrop``: only the files and modules of ``ENGINE_USES_POLICIES``,
    never at module level (``if TYPE_CHECKING:`` blocks are not module level)."""
    found: dict[str, set[str]] = {}
    top_level: list[str] = []
    for path in sorted((SRC / "kvdrop_engine").rglob("*.py")):
        name = str(path.relative_to(SRC))
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            found.setdefault(name, set()).update(_policy_modules(node))
        top_level += [name for node in tree.body if _policy_modules(node)]
    assert {f: m for f, m in found.items() if m} == ENGINE_USES_POLICIES
    assert not top_level, top_level
