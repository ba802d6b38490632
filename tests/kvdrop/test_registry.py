"""Registry: entry-point discovery, plugins (good, broken, conflicting), run-time registration."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from importlib_metadata import EntryPoint, entry_points

import kvdrop
from kvdrop import registry
from kvdrop_sdk import CacheKind

BUILTINS = {"chunk-halving", "random", "streaming", "knorm", "keydiff"}


def installed_entry_points() -> list[EntryPoint]:
    """Every entry point of the group, as the registry lists them (a distribution seen twice on
    sys.path once)."""
    seen: set[tuple[str, str]] = set()
    out = []
    for ep in entry_points(group=registry.ENTRY_POINT_GROUP):
        if (ep.name, ep.value) not in seen:
            seen.add((ep.name, ep.value))
            out.append(ep)
    return out


ENTRY_POINTS = installed_entry_points()


@pytest.mark.parametrize("ep", ENTRY_POINTS, ids=[f"{ep.name}={ep.value}" for ep in ENTRY_POINTS])
def test_every_installed_policy_loads_and_owns_its_name(ep: EntryPoint) -> None:
    """One test per entry point: a plugin that fails to import, or two claiming one name, fails
    the run here instead of dropping out of the property tests with a warning."""
    claims = [
        f"{o.dist.name if o.dist else '?'} ({o.value})" for o in ENTRY_POINTS if o.name == ep.name
    ]
    assert len(claims) == 1, f"policy name {ep.name!r} is claimed by {' and '.join(claims)}"
    assert callable(ep.load())  # an import error fails here, with its traceback
    assert ep.name in kvdrop.available()


def test_a_broken_plugin_fails_the_test_run(tmp_path: Path) -> None:
    fake_distribution(tmp_path, "kvdrop-broken-plugin", {"broken": "kvdrop_no_such_module:x"})
    fake_distribution(tmp_path, "kvdrop-impostor", {"knorm": "kvdrop.policies.random:random"})
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "owns"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert run.returncode == 1, run.stdout[-2000:]
    assert "ModuleNotFoundError" in run.stdout and "kvdrop-impostor" in run.stdout
    assert "3 failed" in run.stdout  # the broken plugin and both claims on knorm


@pytest.fixture
def fresh_registry() -> Iterator[None]:
    registry._reset()
    yield
    registry._reset()


def fake_distribution(root: Path, name: str, entry_points: dict[str, str]) -> None:
    """A minimal installed distribution (dist-info with entry_points.txt) under ``root``."""
    info = root / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    lines = "\n".join(f"{k} = {v}" for k, v in entry_points.items())
    (info / "entry_points.txt").write_text(f"[kvdrop.policies]\n{lines}\n")


@pytest.fixture
def plugin_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_registry: None) -> Path:
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_builtins_come_from_entry_points() -> None:
    assert BUILTINS <= set(kvdrop.available())
    for name in BUILTINS:
        assert registry.source(name).startswith("distribution 'kvdrop'")


def test_installed_third_party_plugin_is_discovered() -> None:
    assert "value-norm" in kvdrop.available(), "pip install ./tests/plugins/kvdrop-example-plugin"
    assert "kvdrop-example-plugin" in registry.source("value-norm")
    kv = torch.randn(2, 2, 64, 8)
    kv[1, :, 7] *= 50
    _, kept = kvdrop.get("value-norm", keep_tokens=4, chunk_size=4)({CacheKind.KV: kv}, range(64))
    assert 7 in kept


def test_broken_plugin_warns_and_the_others_keep_working(plugin_path: Path) -> None:
    fake_distribution(plugin_path, "kvdrop-broken-plugin", {"broken": "kvdrop_no_such_module:x"})
    with pytest.warns(kvdrop.PluginWarning, match="kvdrop-broken-plugin.*ModuleNotFoundError"):
        names = kvdrop.available()
    assert "broken" not in names and BUILTINS <= set(names)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kvdrop.get("knorm", keep_ratio=0.5)  # other policies load without any warning
    with pytest.raises(kvdrop.PolicyNotFoundError, match="failed to load"):
        kvdrop.get("broken")


def test_two_distributions_claiming_one_name_is_an_error_naming_both(plugin_path: Path) -> None:
    fake_distribution(plugin_path, "kvdrop-impostor", {"knorm": "kvdrop.policies.random:random"})
    with pytest.raises(kvdrop.PolicyConflictError) as err:
        kvdrop.get("knorm")
    assert "kvdrop-impostor" in str(err.value) and "'kvdrop'" in str(err.value)
    kvdrop.get("keydiff")  # unaffected


def test_unknown_name_lists_close_matches() -> None:
    with pytest.raises(kvdrop.PolicyNotFoundError, match="Did you mean 'knorm'"):
        kvdrop.get("knrm")


def test_register_at_run_time(fresh_registry: None) -> None:
    def keep_first(keep_tokens: int = 2, chunk_size: int = 1) -> kvdrop.ScorerPolicy:
        """Keep the first tokens (an example plain factory)."""
        return kvdrop.get("streaming", keep_tokens=keep_tokens, chunk_size=chunk_size)

    kvdrop.register("keep-first", keep_first)
    assert "keep-first" in kvdrop.available()
    info = kvdrop.describe("keep-first")
    assert info.summary == "Keep the first tokens (an example plain factory)."
    assert [p.name for p in info.params] == ["keep_tokens", "chunk_size"]
    with pytest.raises(kvdrop.PolicyConflictError, match="already registered"):
        kvdrop.register("keep-first", keep_first)
    with pytest.raises(kvdrop.PolicyConflictError, match="already registered by distribution"):
        kvdrop.register("knorm", keep_first)
    kvdrop.register("knorm", keep_first, replace=True)
    assert kvdrop.describe("knorm").summary.startswith("Keep the first tokens")


def test_names_that_read_as_specs_cannot_be_registered(fresh_registry: None) -> None:
    for bad in ["a+b", "f(x)", ""]:
        with pytest.raises(ValueError, match="non-empty string without"):
            kvdrop.register(bad, lambda: None)


def test_describe_documents_every_parameter() -> None:
    info = kvdrop.describe("knorm")
    names = [p.name for p in info.params]
    assert names[:3] == ["keep_ratio", "keep_tokens", "chunk_size"]
    for p in info.params:
        assert p.help, f"{p.name} has no help"
    assert info.needs.reads_queries is False
    assert "n_sink" not in [p.name for p in kvdrop.describe("chunk-halving").params]


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvdrop", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_cli_list_table_and_json() -> None:
    table = run_cli("list")
    assert table.returncode == 0, table.stderr
    header = table.stdout.splitlines()[0].split()
    assert header == ["name", "queries", "summary"]  # none, window or full
    assert "value-norm" in table.stdout
    rows = json.loads(run_cli("list", "--json").stdout)
    assert BUILTINS | {"value-norm"} <= {r["name"] for r in rows}
    assert all(set(r) >= {"name", "queries", "summary"} for r in rows)
    assert {r["name"]: r["queries"] for r in rows}["snapkv"] == "window"


def test_cli_list_with_a_broken_plugin_warns_and_lists_the_rest(tmp_path: Path) -> None:
    fake_distribution(tmp_path, "kvdrop-broken-plugin", {"broken": "kvdrop_no_such_module:x"})
    out = run_cli("list", env={"PYTHONPATH": str(tmp_path)})
    assert out.returncode == 0
    assert "kvdrop-broken-plugin" in out.stderr and "ModuleNotFoundError" in out.stderr
    assert "knorm" in out.stdout and "broken" not in out.stdout


def test_cli_describe() -> None:
    out = run_cli("describe", "streaming")
    assert (
        out.returncode == 0 and "n_sink" in out.stdout and "needs query tensors: no" in out.stdout
    )
    bad = run_cli("describe", "streamin")
    assert bad.returncode == 2 and "Did you mean 'streaming'" in bad.stderr
    data = json.loads(run_cli("describe", "knorm", "--json").stdout)
    assert data["name"] == "knorm" and {p["name"] for p in data["params"]} >= {"keep_ratio"}
