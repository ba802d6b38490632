"""Fixtures of the LMCache integration tests: one real ``lmcache server`` for the whole session.

Without ``lmcache`` installed the tests that need it skip with the install recipe as the reason;
with ``KVDROP_REQUIRE_LMCACHE=1`` (set by ``.ci/run``) they fail instead, so CI never skips them.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from typing import Any

import pytest

REQUIRED = os.environ.get("KVDROP_REQUIRE_LMCACHE") == "1"
HAVE_LMCACHE = importlib.util.find_spec("lmcache") is not None
REASON = (
    "lmcache is not installed (CPU recipe: pip install -e '.[lmcache]' && pip install --no-deps "
    "lmcache==0.5.6; see docs/lmcache.md)"
)


def pytest_configure(config: pytest.Config) -> None:
    # LMCache's loggers attach opentelemetry's deprecated LoggingHandler on import.
    config.addinivalue_line(
        "filterwarnings", "ignore:`LoggingHandler` in `opentelemetry-sdk` is deprecated"
    )


def need_lmcache() -> None:
    """Skip the calling test without lmcache (fail instead under KVDROP_REQUIRE_LMCACHE=1)."""
    if HAVE_LMCACHE:
        return
    if REQUIRED:
        pytest.fail(f"KVDROP_REQUIRE_LMCACHE=1 but {REASON}")
    pytest.skip(REASON)


@pytest.fixture
def require_lmcache() -> None:
    """Skip (or fail, see the module docstring) when lmcache is not installed."""
    need_lmcache()


@pytest.fixture(scope="session")
def lmcache_server() -> Iterator[Any]:
    """A real LMCache server (shared memory, ``--enable transfer_query``, chunk 256) on free
    ports, started once per session (~20 s on two cores)."""
    need_lmcache()
    from kvdrop_engine.testing import spawn_lmcache_server

    with spawn_lmcache_server(l1_size_gb=0.5) as server:
        yield server
