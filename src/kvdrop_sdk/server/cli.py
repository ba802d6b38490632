"""``kvdrop server``: flags (same names and meanings as the upstream ``lmcache server``) and run."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvdrop_sdk.server.config import ServerConfig

__all__ = ["add_arguments", "config_from_args", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the server's flags to ``parser`` (no heavy imports here), in ``--help`` order."""
    _add_addresses(parser)
    _add_pool(parser)
    _add_service(parser)
    _add_http_limits(parser)
    _add_lifetime(parser)


def _add_addresses(parser: argparse.ArgumentParser) -> None:
    """The addresses served: the host and the ZMQ and HTTP ports."""
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument(
        "--port", type=int, default=6555, help="ZMQ request port (default 6555; 0 = any free)"
    )
    parser.add_argument(
        "--http-port", type=int, default=8080, help="HTTP JSON port (default 8080; 0 = any free)"
    )


def _add_pool(parser: argparse.ArgumentParser) -> None:
    """The L1 chunk pool: its size, eviction, chunk size, shared memory and lazy allocation."""
    parser.add_argument(
        "--l1-size-gb",
        type=float,
        default=1.0,
        help="size of the L1 chunk pool in GiB (float, e.g. 0.01; default 1)",
    )
    parser.add_argument(
        "--eviction-policy",
        default="LRU",
        choices=["LRU"],
        help="what to evict when the pool is full (only LRU)",
    )
    parser.add_argument(
        "--chunk-size", type=int, default=256, help="tokens per stored chunk (default 256)"
    )
    parser.add_argument(
        "--shm-name",
        default=None,
        help="serve the pool from POSIX shared memory /dev/shm/NAME so local clients copy "
        "directly into it (default: no shared memory, socket transfers only)",
    )
    lazy = parser.add_mutually_exclusive_group()
    lazy.add_argument(
        "--no-l1-use-lazy",
        dest="l1_use_lazy",
        action="store_false",
        help="allocate and touch the whole pool at start instead of on demand",
    )
    lazy.add_argument(
        "--l1-use-lazy",
        dest="l1_use_lazy",
        action="store_true",
        help="allocate pool pages on first use (default)",
    )
    parser.set_defaults(l1_use_lazy=True)


def _add_service(parser: argparse.ArgumentParser) -> None:
    """Optional features, worker threads, the longest lease, the ready file for launchers."""
    parser.add_argument(
        "--enable",
        action="append",
        default=[],
        metavar="FEATURE",
        help="enable an optional feature: transfer_query (accept query tensors); repeatable or "
        "comma-separated",
    )
    parser.add_argument("--workers", type=int, default=4, help="request worker threads (default 4)")
    parser.add_argument(
        "--max-lease-s",
        type=float,
        default=600.0,
        help="longest a client may hold pinned/reserved chunks before they are reclaimed",
    )
    parser.add_argument(
        "--ready-file",
        default=None,
        help="write the bound ports as JSON to this file once serving (for launchers)",
    )


def _add_http_limits(parser: argparse.ArgumentParser) -> None:
    """What one HTTP client may cost: the request deadline, body size and connections."""
    parser.add_argument(
        "--http-timeout-s",
        type=float,
        default=30.0,
        help="an HTTP request (line, headers and body) must arrive within this many seconds of "
        "its first byte, and an idle connection is closed after this long (default 30)",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=1 << 20,
        help="largest HTTP request body; larger is answered 413 before it is read "
        "(default 1 MiB: the endpoint takes no bodies)",
    )
    parser.add_argument(
        "--http-max-connections",
        type=int,
        default=64,
        help="HTTP connections served at once; more are answered 503 (default 64)",
    )


def _add_lifetime(parser: argparse.ArgumentParser) -> None:
    """The launcher's pid, expired reservations and per-client leases, the log level."""
    parser.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help="stop cleanly (unlinking the segment) when process PID exits; launchers such as "
        "spawn_server pass their own pid so no server outlives them",
    )
    parser.add_argument(
        "--quarantine-s",
        type=float,
        default=600.0,
        help="keep the slots of an expired shared-memory reservation out of use this long "
        "(>= 1), unless its writer ends the reservation or disconnects first; after it, they are "
        "reused with a checksum on every chunk stored there, checked on every read (a stalled "
        "writer may still be copying; default 600)",
    )
    parser.add_argument(
        "--max-client-leases",
        type=int,
        default=1024,
        help="most pins, reservations and quarantined reservations one client may hold at once "
        "(default 1024; more is refused with too_many_leases)",
    )
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """Build a ``ServerConfig`` from parsed flags."""
    from kvdrop_sdk.server.config import ServerConfig

    features = [f.strip() for item in args.enable for f in item.split(",") if f.strip()]
    return ServerConfig(
        host=args.host,
        port=args.port,
        http_port=args.http_port,
        l1_size_gb=args.l1_size_gb,
        eviction_policy=args.eviction_policy,
        chunk_size=args.chunk_size,
        shm_name=args.shm_name,
        l1_use_lazy=args.l1_use_lazy,
        enable=tuple(features),
        workers=args.workers,
        max_lease_s=args.max_lease_s,
        ready_file=args.ready_file,
        http_timeout_s=args.http_timeout_s,
        parent_pid=args.parent_pid,
        quarantine_s=args.quarantine_s,
        max_request_bytes=args.max_request_bytes,
        http_max_connections=args.http_max_connections,
        max_client_leases=args.max_client_leases,
    )


def _pid_alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def watch_parent(parent_pid: int, on_exit: Callable[[], None], interval: float = 0.25) -> None:
    """Call ``on_exit`` (from a daemon thread) within ``interval`` s of process ``parent_pid``
    exiting; at once if it is already gone.

    Polling, not ``PR_SET_PDEATHSIG``: the kernel sends that signal when the parent *thread*
    that started us exits, which would stop a server that a short-lived worker thread launched.
    A parent that dies is noticed as our reparenting or as its pid vanishing.
    """
    import os
    import threading

    direct = os.getppid() == parent_pid

    def gone() -> bool:
        return (direct and os.getppid() != parent_pid) or not _pid_alive(parent_pid)

    def poll() -> None:
        while not gone():
            time.sleep(interval)
        on_exit()

    if gone():
        on_exit()
        return
    threading.Thread(target=poll, name="kvdrop-parent-watch", daemon=True).start()


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM, then stop cleanly (the shm segment is unlinked)."""
    import logging
    import signal
    import sys
    import threading

    from kvdrop_sdk.server.app import Server, ServerStartError
    from kvdrop_sdk.transport.buffers import tune_malloc

    tune_malloc()  # our own process: keep freed frame buffers for reuse
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"kvdrop server: error: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if config.parent_pid is not None:
        watch_parent(config.parent_pid, stop.set)
        if stop.is_set():
            print(f"kvdrop server: parent process {config.parent_pid} is gone", file=sys.stderr)
            return 1
    server = Server(config)
    try:
        server.start()
    except (ServerStartError, OSError) as exc:
        print(f"kvdrop server: error: cannot start: {exc}", file=sys.stderr)
        return 1
    try:
        print(
            f"kvdrop server: zmq {server.url}  http {server.http_url}  "
            f"shm {config.shm_name or '-'}  pool {config.l1_size_gb:g} GiB",
            flush=True,
        )
        while not stop.wait(0.5):
            pass
    finally:
        server.stop()
    return 0
