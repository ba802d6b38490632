"""docs/policies.md's plugin code is what tests/plugins/kvdrop-example-plugin installs.

Every example of the docs runs (and its shown output is compared) through the docs-as-tests
collection of conftest.py; this checks one thing more: the documented plugins keep exactly what
the installed example plugin keeps.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from pathlib import Path
from typing import Any

import torch
from sybil import Sybil
from sybil.parsers.markdown import PythonCodeBlockParser

import kvdrop
from kvdrop import registry
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


def test_the_readme_tour_warns_about_nothing_it_does_not_show() -> None:
    """A reader who pastes the README's python blocks sees only what the page shows: no
    ``PolicyWarning`` (or any other warning) on stderr."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        page_namespace(ROOT / "README.md")
    assert [str(w.message) for w in caught] == []


def test_the_builtin_list_holds_with_other_plugins_installed() -> None:
    """docs/policies.md prints the built-ins: a third-party plugin registered at run time (as an
    installed distribution would be) must not change what it prints."""
    registry._reset()
    kvdrop.register("zz-docs-extra", registry.factory("random"))
    try:
        with contextlib.redirect_stdout(io.StringIO()) as out:
            page_namespace(ROOT / "docs" / "policies.md")
    finally:
        registry._reset()
    assert "zz-docs-extra" not in out.getvalue()
    assert "'snapkv'" in out.getvalue()
