"""Server settings; one field per ``kvdrop server`` flag."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from kvdrop_sdk.http_limits import HTTPLimits
from kvdrop_sdk.validate import check_fields, is_int

__all__ = ["FEATURES", "GIB", "ServerConfig"]

#: Optional features accepted by ``--enable``.
FEATURES = ("transfer_query",)
#: ``--l1-size-gb`` counts binary gigabytes.
GIB = 1024**3
_SHM_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
#: (field, lowest, highest) of the float settings. A pool needs one page; timeouts beyond a day
#: overflow some OS calls (socket timeouts, condition waits) and mean "never" anyway.
_NUMBERS = (
    ("l1_size_gb", 4096 / GIB, float(1 << 20)),
    ("max_lease_s", 0.001, 86400.0),
    ("http_timeout_s", 0.001, 86400.0),
    ("quarantine_s", 1.0, 86400.0 * 7),
)


#: Why a bound is what it is, appended to its error.
_WHY = {
    "quarantine_s": "; it is how long a stalled shared-memory writer's slots stay out of use "
    "before they are reused under checksums (0 would hand them on while it may still copy)",
}


def _flag(name: str) -> str:
    """The server flag a setting comes from (``max_client_leases`` -> ``--max-client-leases``)."""
    return "--" + name.replace("_", "-")


@dataclass
class ServerConfig:
    """What the server binds, how big its pool is and which features it offers."""

    host: str = "127.0.0.1"
    port: int = 6555
    http_port: int = 8080
    l1_size_gb: float = 1.0
    eviction_policy: str = "LRU"
    chunk_size: int = 256
    shm_name: str | None = None
    l1_use_lazy: bool = True
    enable: tuple[str, ...] = ()
    workers: int = 4
    max_lease_s: float = 600.0
    ready_file: str | None = None
    http_timeout_s: float = 30.0
    parent_pid: int | None = None
    quarantine_s: float = 600.0
    max_request_bytes: int = 1 << 20
    http_max_connections: int = 64
    max_client_leases: int = 1024

    def __post_init__(self) -> None:
        self.enable = tuple(dict.fromkeys(self.enable))
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad setting and what is expected."""
        self._check_numbers()
        for name in ("port", "http_port"):
            value = getattr(self, name)
            if not is_int(value) or not 0 <= value <= 65535:
                raise ValueError(f"{_flag(name)} must be 0..65535 (0 = any free)")
        if self.eviction_policy.upper() != "LRU":
            raise ValueError(f"--eviction-policy {self.eviction_policy!r}: only LRU is supported")
        check_fields(self, ints={"chunk_size": 1}, label=_flag)
        if self.shm_name is not None and not _SHM_NAME.match(self.shm_name):
            raise ValueError(
                f"--shm-name {self.shm_name!r}: use 1-200 characters from [A-Za-z0-9_.-]"
            )
        unknown = [f for f in self.enable if f not in FEATURES]
        if unknown:
            raise ValueError(
                f"--enable {unknown[0]!r}: unknown feature; expected one of {FEATURES}"
            )
        limits = {
            "workers": (1, 256),
            "max_request_bytes": (1, 1 << 30),
            "http_max_connections": (1, 4096),
            "max_client_leases": (1, 1 << 20),
        }
        check_fields(self, int_ranges=limits, label=_flag)
        if self.parent_pid is not None and (not is_int(self.parent_pid) or self.parent_pid < 1):
            raise ValueError(f"--parent-pid must be a process id, got {self.parent_pid}")

    def _check_numbers(self) -> None:
        """The float settings: finite, positive and within what the OS can take."""
        for name, low, high in _NUMBERS:
            value = getattr(self, name)
            flag = _flag(name)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not (ok and math.isfinite(value) and low <= value <= high):
                bound = "> 0" if 0 < low < 1 else f">= {low:g}"
                raise ValueError(
                    f"{flag} must be {bound} and finite (from {low:g} to {high:g}), got {value!r}"
                    + _WHY.get(name, "")
                )

    @property
    def pool_bytes(self) -> int:
        """Size of the L1 pool in bytes."""
        return int(self.l1_size_gb * GIB)

    @property
    def max_message_bytes(self) -> int:
        """Largest request accepted, all frames together (and so the largest single frame): the
        pool or 64 MiB, whichever is larger, plus 16 MiB for token ids and headers."""
        return max(self.pool_bytes, 64 << 20) + (16 << 20)

    @property
    def http_limits(self) -> HTTPLimits:
        """What one HTTP client may cost: ``--max-request-bytes`` bodies, ``--http-timeout-s``
        for a whole request and for an idle connection, ``--http-max-connections`` at once."""
        return HTTPLimits(
            max_body_bytes=self.max_request_bytes,
            request_timeout_s=self.http_timeout_s,
            idle_timeout_s=self.http_timeout_s,
            max_connections=self.http_max_connections,
        )

    @property
    def transfer_query(self) -> bool:
        """Whether query tensors are accepted."""
        return "transfer_query" in self.enable
