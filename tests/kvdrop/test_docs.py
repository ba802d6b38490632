"""docs/policies.md's plugin code is what tests/plugins/kvdrop-example-plugin installs.

Every example of the docs runs (and its shown output is compared) through the docs-as-tests
collection of conftest.py; this checks one thing more: the documented plugins keep exactly what
the installed example plugin keeps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from sybil import Sybil
from sybil.parsers.markdown import PythonCodeBlockParser

import kvdrop
from kvdrop_sdk import CacheKind

ROOT = Path(__file__).parents[2]


def page_namespace(path: Path) -> dict[str, Any]:
    """Run every ```python block of ``path`` in order, in one namespace (as a reader would)."""
    document = Sybil([PythonCodeBlockParser()]).parse(path)
    examples = list(document.examples())
    assert examples, f"{path} lost its python examples"
    for example in examples:
        example.evaluate()
    return document.namespace


def test_the_documented_plugins_are_the_installed_ones() -> None:
    docs = page_namespace(ROOT / "docs" / "policies.md")
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
