"""The connector factory: the one list of kinds, which every command line's choices read."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable

import pytest

from kvdrop_engine.connectors.factory import CONNECTOR_KINDS, make_connector


def _cache_server_choices(add_arguments: Callable[[argparse.ArgumentParser], None]) -> object:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    (action,) = [a for a in parser._actions if a.dest == "cache_server"]
    return action.choices


def test_the_kinds_are_kvdrop_then_lmcache() -> None:
    assert CONNECTOR_KINDS == ("kvdrop", "lmcache")


def test_every_command_line_offers_the_factory_kinds() -> None:
    from kvdrop.commands import demo_cmd, engine_cmd

    for command in (engine_cmd, demo_cmd):
        choices = _cache_server_choices(command.add_arguments)
        assert choices is CONNECTOR_KINDS, (command.__name__, choices)


def test_an_unknown_kind_is_refused_naming_the_kinds() -> None:
    with pytest.raises(ValueError, match=r"one of \('kvdrop', 'lmcache'\), got 'redis'"):
        make_connector("redis", "tcp://127.0.0.1:1", "http://127.0.0.1:1", "m")


def test_reading_the_kinds_loads_no_connector() -> None:
    """LMCache stays optional and a command line light: the factory imports a connector only to
    build one."""
    code = (
        "import sys; import kvdrop_engine.connectors.factory as f; "
        "print(f.CONNECTOR_KINDS, sorted(m for m in sys.modules if m.startswith('kvdrop_engine')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert out.strip() == (
        "('kvdrop', 'lmcache') "
        "['kvdrop_engine', 'kvdrop_engine.connectors', 'kvdrop_engine.connectors.factory']"
    )


def test_the_package_names_resolve_lazily() -> None:
    import kvdrop_engine.connectors as connectors
    from kvdrop_engine.connectors.base import KVConnector
    from kvdrop_engine.connectors.kvdrop import ServerConnector

    assert connectors.KVConnector is KVConnector
    assert connectors.ServerConnector is ServerConnector
    assert connectors.make_connector is make_connector
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = connectors.Nope
