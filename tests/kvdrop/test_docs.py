"""The runnable examples of the policy docs and README's policy tour run and show what they say."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import kvdrop
from kvdrop_sdk import CacheKind

ROOT = Path(__file__).parents[2]


def run_blocks(path: Path) -> dict[str, Any]:
    """Run every ```python block of ``path`` in order, in one module (as a reader would)."""
    blocks = re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), re.S)
    assert blocks, f"{path} lost its python examples"
    module = types.ModuleType(f"docs_{path.stem.replace('-', '_')}")
    sys.modules[module.__name__] = module  # dataclasses and typing look their module up
    try:
        for block in blocks:
            exec(compile(block, str(path), "exec", dont_inherit=True), module.__dict__)
    finally:
        del sys.modules[module.__name__]
    return module.__dict__


@pytest.mark.parametrize(
    "page", ["policies.md", "policies-kv.md", "policies-query.md", "combinators.md"]
)
def test_policy_docs_examples_run(page: str, capsys: pytest.CaptureFixture[str]) -> None:
    run_blocks(ROOT / "docs" / page)
    out = capsys.readouterr().out
    if page == "policies.md":
        assert out.startswith("['budget', 'chunk', 'chunk-halving', 'compose', 'h2o', 'keydiff'")
        assert "--enable transfer_query" in out
    if page == "policies-kv.md":
        assert out.splitlines() == [
            f"{n} 512 512" for n in ("chunk-halving", "streaming", "knorm", "keydiff")
        ]
    if page == "combinators.md":
        assert "leaves knorm without tokens" in out


def test_the_documented_plugins_are_the_installed_ones() -> None:
    """docs/policies.md's plugin code keeps what tests/plugins/kvdrop-example-plugin keeps."""
    docs = run_blocks(ROOT / "docs" / "policies.md")
    gen = torch.Generator().manual_seed(1)
    kv, query = torch.randn(2, 2, 96, 16, generator=gen), torch.randn(1, 2, 96, 32, generator=gen)
    tensors, tokens = {CacheKind.KV: kv, CacheKind.QUERY: query}, list(range(96))
    for name, params in [
        ("value-norm", {"layer_agg": "max"}),
        ("last-queries", {"head_dim": 8, "window": 5}),
    ]:
        factory = docs[name.replace("-", "_")]
        assert [(p.name, p.default) for p in factory.params] == [
            (p.name, p.default) for p in kvdrop.describe(name).params
        ]
        documented = factory(keep_tokens=32, chunk_size=8, **params)
        installed = kvdrop.get(name, keep_tokens=32, chunk_size=8, **params)
        assert documented(tensors, tokens)[1] == installed(tensors, tokens)[1]


def test_readme_policy_tour_prints_what_it_shows(capsys: pytest.CaptureFixture[str]) -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    tour = readme[readme.index("**Policies**") :]
    block = re.search(r"```python\n(.*?)```", tour, re.S)
    assert block is not None
    exec(compile(block.group(1), "README.md", "exec", dont_inherit=True), {"__name__": "readme"})
    printed = capsys.readouterr().out.strip()
    shown = re.search(r"print\(.*\)\s+# (.*)", block.group(1))
    assert shown is not None and printed == shown.group(1).strip()
