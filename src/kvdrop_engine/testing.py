"""Test tooling for the LMCache backend: run a real ``lmcache server`` on free local ports.

Tests, benchmarks and the demo start one with :func:`spawn_lmcache_server`; the shipped
connector (:mod:`kvdrop_engine.connectors.lmcache`) does not need it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import requests

from kvdrop_engine.connectors.lmcache import require_lmcache
from kvdrop_sdk.errors import SDKError

__all__ = ["LMCacheServer", "spawn_lmcache_server"]


@dataclass
class LMCacheServer:
    """A running ``lmcache server`` subprocess (see :func:`spawn_lmcache_server`)."""

    url: str
    http_url: str
    shm_name: str | None
    proc: subprocess.Popen[bytes]
    log_path: str

    def status(self) -> dict[str, Any]:
        """``GET /status``."""
        with requests.Session() as session:
            session.trust_env = False
            return dict(session.get(f"{self.http_url}/status", timeout=10).json())

    def log(self) -> str:
        """Everything the server printed so far."""
        with open(self.log_path, encoding="utf-8", errors="replace") as fh:
            return fh.read()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def spawn_lmcache_server(
    *,
    l1_size_gb: float = 0.5,
    chunk_size: int = 256,
    transfer_query: bool = True,
    shared_memory: bool = True,
    startup_timeout: float = 180.0,
) -> Iterator[LMCacheServer]:
    """Run a real ``lmcache server`` on free 127.0.0.1 ports (for tests, benchmarks, the demo).

    The flags are the ones the SDK needs (docs/lmcache.md): ``--supported-transfer-mode auto``,
    ``--no-l1-use-lazy`` and a unique ``--shm-name`` (unless ``shared_memory=False``: the SDK then
    falls back to pickling), ``--enable transfer_query`` when asked. Start-up takes ~20 s on two
    cores. Stopped with SIGTERM on exit; its shared-memory pool is removed.
    """
    require_lmcache()
    port, http_port = _free_port(), _free_port()
    name = f"kvdrop_lmc_{os.getpid()}_{uuid.uuid4().hex[:8]}" if shared_memory else None
    args = [sys.executable, "-c", "from lmcache.cli.main import main; raise SystemExit(main())"]
    args += ["server", "--host", "127.0.0.1", "--port", str(port), "--http-host", "127.0.0.1"]
    args += ["--http-port", str(http_port), "--chunk-size", str(chunk_size)]
    args += ["--l1-size-gb", str(l1_size_gb), "--eviction-policy", "LRU"]
    args += ["--supported-transfer-mode", "auto"]
    if name is not None:
        args += ["--shm-name", name, "--no-l1-use-lazy"]
    if transfer_query:
        args += ["--enable", "transfer_query"]
    env = dict(os.environ, LMCACHE_DISABLE_BANNER="1", PYTHONUNBUFFERED="1")
    env.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    with tempfile.TemporaryDirectory(prefix="kvdrop-lmcache-") as tmp:
        log_path = os.path.join(tmp, "server.log")
        with open(log_path, "wb") as log_fh:
            proc = subprocess.Popen(args, stdout=log_fh, stderr=subprocess.STDOUT, env=env)
        handle = LMCacheServer(
            f"tcp://127.0.0.1:{port}", f"http://127.0.0.1:{http_port}", name, proc, log_path
        )
        try:
            deadline = time.monotonic() + startup_timeout
            while True:
                if proc.poll() is not None:
                    raise SDKError(f"lmcache server exited with {proc.returncode}: {handle.log()}")
                try:
                    if handle.status().get("is_healthy"):
                        break
                except (requests.RequestException, ValueError):
                    pass
                if time.monotonic() > deadline:
                    raise SDKError(f"lmcache server not ready within {startup_timeout:g}s")
                time.sleep(0.25)
            yield handle
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            leftover = f"/dev/shm/lmcache_l1_pool_{name}"
            if name is not None and os.path.exists(leftover):
                os.unlink(leftover)
