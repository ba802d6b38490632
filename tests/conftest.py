"""Shared fixtures: real kvdrop servers started as subprocesses on free 127.0.0.1 ports.

``kv_server`` (session): shared memory + ``--enable transfer_query``, chunk size 256, 0.25 GiB.
``socket_server`` (session): no shared memory, no query kind (socket transport only).
``spawn_kv_server``: the ``spawn_server`` context manager, for tests that need their own flags.
``model_name``: a model name unique to the test, so tests sharing a server never collide.
"""

from __future__ import annotations

import os

# Tests run engines, servers and clients side by side on two cores: spinning OpenMP workers steal
# the cores from each other (decode steps measured up to 100x slower). Set before torch loads;
# subprocesses inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvdrop_sdk.testing.server import ServerHandle, spawn_server


@pytest.fixture(scope="session")
def kv_server() -> Iterator[ServerHandle]:
    """A server with shared memory and the query kind enabled, shared by the whole session."""
    with spawn_server(enable=["transfer_query"], chunk_size=256, l1_size_gb=0.25) as handle:
        yield handle


@pytest.fixture(scope="session")
def socket_server() -> Iterator[ServerHandle]:
    """A server without shared memory and without ``transfer_query``."""
    with spawn_server(shm_name=None, chunk_size=256, l1_size_gb=0.1) as handle:
        yield handle


@pytest.fixture
def spawn_kv_server() -> Callable[..., Any]:
    """``spawn_server`` itself: ``with spawn_kv_server(l1_size_gb=0.01) as srv: ...``."""
    return spawn_server


@pytest.fixture
def model_name(request: pytest.FixtureRequest) -> str:
    """A model name unique to this test (and its parameters)."""
    return "test/" + re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.nodeid)[-120:]
