"""Start a REAL kvdrop server as a subprocess on free 127.0.0.1 ports (for tests and benchmarks).

The server is started with ``--parent-pid`` set to this process: if this process dies without
cleaning up (SIGKILL, the OOM killer), the server notices within a quarter second, stops and
unlinks its shared-memory segment, so no orphan server or segment is left behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import requests

from kvdrop_sdk.server.pool import shm_path, unique_shm_name

__all__ = ["ServerHandle", "spawn_server", "spawn_server_in_child", "stop_process"]


def wait_until(cond: Callable[[], object], timeout: float, step: float = 0.02) -> bool:
    """Poll ``cond`` every ``step`` s until it is true or ``timeout`` s pass; returns its last
    answer as a bool (tests wait for a state, never a fixed time)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return bool(cond())


def stop_process(proc: subprocess.Popen[Any], sig: int, timeout: float) -> int:
    """Send ``sig`` to a running ``proc`` and wait for its exit code; after ``timeout`` seconds
    kill it and raise ``TimeoutError`` (a process that ignores SIGTERM is a bug under test)."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise TimeoutError(f"process {proc.pid} ignored {sig!r} for {timeout} s") from None
    return int(proc.returncode)


@dataclass
class ServerHandle:
    """A running server subprocess: its addresses, its /config and the process."""

    url: str
    http_url: str
    shm_name: str | None
    config: dict[str, Any]
    proc: subprocess.Popen[bytes]
    log_path: str
    args: list[str] = field(default_factory=list)

    @property
    def port(self) -> int:
        """ZMQ port."""
        return int(self.config["port"])

    @property
    def http_port(self) -> int:
        """HTTP port."""
        return int(self.config["http_port"])

    def status(self) -> dict[str, Any]:
        """``GET /status``."""
        with requests.Session() as session:
            session.trust_env = False
            return session.get(f"{self.http_url}/status", timeout=10).json()

    def log(self) -> str:
        """Everything the server printed so far."""
        with open(self.log_path, encoding="utf-8", errors="replace") as fh:
            return fh.read()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        """Send ``sig`` and wait for the exit; returns the exit code (kills after ``timeout``)."""
        try:
            return stop_process(self.proc, sig, timeout)
        except TimeoutError:
            raise RuntimeError(f"server did not exit within {timeout} s of {sig}") from None


def _flag_args(flags: dict[str, Any]) -> list[str]:
    args: list[str] = []
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            args.append(flag)
        elif isinstance(value, (list, tuple)):
            for item in value:
                args += [flag, str(item)]
        else:
            args += [flag, str(value)]
    return args


@contextlib.contextmanager
def spawn_server(
    *,
    shm_name: str | bool | None = True,
    startup_timeout: float = 60.0,
    check_exit: bool = True,
    **flags: Any,
) -> Iterator[ServerHandle]:
    """Run ``python -m kvdrop_sdk.server`` with ``flags`` on free ports; yield a ServerHandle.

    ``flags`` map to CLI flags (``l1_size_gb=0.01`` -> ``--l1-size-gb 0.01``, ``True`` -> bare flag,
    lists repeat the flag, e.g. ``enable=["transfer_query"]``). ``shm_name=True`` picks a unique
    name, ``None``/``False`` serves without shared memory. On exit the server gets SIGTERM; with
    ``check_exit`` it must exit 0 and leave nothing in /dev/shm. The server exits on its own when
    this process dies (``--parent-pid``; pass ``parent_pid=None`` to keep it running).
    """
    name = unique_shm_name("kvdrop_test") if shm_name is True else (shm_name or None)
    flags = {"l1_size_gb": 0.25, "log_level": "WARNING", "parent_pid": os.getpid(), **flags}
    with tempfile.TemporaryDirectory(prefix="kvdrop-server-") as tmp:
        ready = os.path.join(tmp, "ready.json")
        log_path = os.path.join(tmp, "server.log")
        args = [sys.executable, "-m", "kvdrop_sdk.server", "--host", "127.0.0.1"]
        args += _flag_args({"port": 0, "http_port": 0, "shm_name": name, **flags})
        args += ["--ready-file", ready]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(log_path, "wb") as log_fh:
            proc = subprocess.Popen(args, stdout=log_fh, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + startup_timeout
            while not os.path.exists(ready):
                if proc.poll() is not None:
                    with open(log_path, encoding="utf-8", errors="replace") as fh:
                        raise RuntimeError(f"server exited with {proc.returncode}: {fh.read()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server not ready within {startup_timeout} s")
                time.sleep(0.05)
            with open(ready, encoding="utf-8") as fh:
                info = json.load(fh)
            http_url = f"http://127.0.0.1:{info['http_port']}"
            with requests.Session() as session:
                session.trust_env = False  # never through HTTP(S)_PROXY
                config = session.get(f"{http_url}/config", timeout=10).json()
                health = session.get(f"{http_url}/health", timeout=10).json()
            if health.get("status") != "ok":
                raise RuntimeError(f"server unhealthy: {health}")
            handle = ServerHandle(
                url=f"tcp://127.0.0.1:{info['port']}",
                http_url=http_url,
                shm_name=name,
                config=config,
                proc=proc,
                log_path=log_path,
                args=args,
            )
            yield handle
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            leaked = name is not None and os.path.exists(shm_path(name))
            if leaked:
                os.unlink(shm_path(name))
        if check_exit and proc.returncode not in (0, -signal.SIGKILL):
            raise RuntimeError(f"server exited with {proc.returncode}")
        if check_exit and leaked:
            raise RuntimeError(f"server left /dev/shm/{name} behind")


_CHILD_SCRIPT = """
import sys
from kvdrop_sdk.testing.server import spawn_server
with spawn_server(l1_size_gb=0.01) as srv:
    print(srv.proc.pid, srv.shm_name, flush=True)
    sys.stdin.read()
"""


def spawn_server_in_child() -> tuple[subprocess.Popen[str], int, str]:
    """A child Python process that runs :func:`spawn_server` and waits: ``(child, server pid,
    shm name)``. Killing the child tests that a server does not outlive the process that started
    it (the parent watchdog)."""
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD_SCRIPT],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    pid_text, name = child.stdout.readline().split()
    return child, int(pid_text), name
