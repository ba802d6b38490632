"""The policy registry: plain names -> factories, from entry points (group ``kvdrop.policies``)
and :func:`register`.

Entry points are listed once, lazily, on first use; each is imported only when its policy is
needed (:func:`factory`) or when everything is listed. Built-in policies come through the same
entry points as third-party ones. A plugin that fails to import is reported with a warning naming
its distribution and error, and every other policy keeps working. Every loaded object is held as
a :class:`~kvdrop.policy.PolicyFactory` (a plain callable is adapted by
:class:`~kvdrop.policy.FunctionFactory`). Spec strings (``"streaming+snapkv"``) are the business
of :mod:`kvdrop.spec`, one layer up; ``kvdrop.get`` and ``kvdrop.describe`` live there.
"""

from __future__ import annotations

import difflib
import inspect
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from importlib_metadata import EntryPoint, entry_points

from kvdrop.errors import PolicyConflictError, PolicyNotFoundError
from kvdrop.factories import PolicyFactory, PolicyInfo, as_factory

__all__ = [
    "ENTRY_POINT_GROUP",
    "PluginWarning",
    "available",
    "describe",
    "factory",
    "is_builtin",
    "register",
    "source",
]

ENTRY_POINT_GROUP = "kvdrop.policies"
#: What may be registered: a PolicyFactory, or any callable ``factory(**params) -> edit fn``.
Factory = Callable[..., Any]
#: Characters a policy name cannot hold (they make it a spec string).
SPEC_CHARS = "+()"


class PluginWarning(UserWarning):
    """A policy plugin could not be loaded; the other policies are unaffected."""


@dataclass
class _Entry:
    name: str
    source: str  # "distribution <name> (<module:attr>)" or "register() in <file>:<line>"
    factory: PolicyFactory | None = None
    entry_point: EntryPoint | None = None
    conflicts: list[str] = field(default_factory=list)
    failed: str | None = None


_lock = threading.RLock()
_entries: dict[str, _Entry] | None = None


def _discover() -> dict[str, _Entry]:
    global _entries
    with _lock:
        if _entries is not None:
            return _entries
        found: dict[str, _Entry] = {}
        seen: set[tuple[str, str]] = set()
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if (ep.name, ep.value) in seen:  # the same dist seen twice on sys.path
                continue
            seen.add((ep.name, ep.value))
            dist = ep.dist.name if ep.dist is not None else "<unknown distribution>"
            source = f"distribution {dist!r} ({ep.value})"
            if ep.name in found:
                found[ep.name].conflicts.append(source)
            else:
                found[ep.name] = _Entry(ep.name, source, entry_point=ep)
        _entries = found
        return found


def _reset() -> None:
    """Forget discovered entry points and run-time registrations (for tests)."""
    global _entries
    with _lock:
        _entries = None


def _load(entry: _Entry) -> PolicyFactory | None:
    """Import an entry's factory once; on failure warn (naming the distribution) and return None."""
    if entry.conflicts:
        sources = " and ".join([entry.source, *entry.conflicts])
        raise PolicyConflictError(
            f"policy name {entry.name!r} is claimed by {sources}; uninstall one of them or "
            "rename its entry point"
        )
    if entry.factory is not None or entry.failed is not None:
        return entry.factory
    assert entry.entry_point is not None
    try:
        obj = entry.entry_point.load()
        if not callable(obj):
            raise TypeError(f"{entry.entry_point.value} is a {type(obj).__name__}, not a factory")
        entry.factory = as_factory(entry.name, obj)
    except Exception as exc:  # a broken plugin must not break the others
        entry.failed = f"{type(exc).__name__}: {exc}"
        warnings.warn(
            f"kvdrop: could not load policy {entry.name!r} from {entry.source}: {entry.failed}",
            PluginWarning,
            stacklevel=3,
        )
    return entry.factory


def register(name: str, factory: Factory, *, replace: bool = False) -> None:
    """Register ``factory`` (``factory(**params) -> ModifyFnType``) under ``name`` at run time.

    Registering a name that exists raises :class:`PolicyConflictError` naming both sources, unless
    ``replace=True``.
    """
    if not isinstance(name, str) or not name or any(c in name for c in SPEC_CHARS):
        raise ValueError(
            f"policy name must be a non-empty string without {', '.join(SPEC_CHARS)}; got {name!r}"
        )
    if not callable(factory):
        raise TypeError(f"factory for {name!r} must be callable; got {type(factory).__name__}")
    wrapped = as_factory(name, factory)
    frame = inspect.stack()[1]
    source = f"register() in {frame.filename}:{frame.lineno}"
    entries = _discover()
    with _lock:
        old = entries.get(name)
        if old is not None and not replace:
            raise PolicyConflictError(
                f"policy name {name!r} is already registered by {old.source}; cannot register it "
                f"again from {source} (pass replace=True to override)"
            )
        entries[name] = _Entry(name, source, factory=wrapped)


def is_builtin(name: str) -> bool:
    """Whether ``name`` is one of kvdrop's own policies (an entry point of the ``kvdrop``
    distribution), not a plugin's or a ``register()`` call's."""
    entry = _discover().get(name)
    ep = None if entry is None or entry.conflicts else entry.entry_point
    return ep is not None and ep.dist is not None and ep.dist.name == "kvdrop"


def available() -> list[str]:
    """Sorted names of every policy whose plugin loads (broken plugins warn and are left out)."""
    entries = _discover()
    names = []
    for name, entry in sorted(entries.items()):
        try:
            if _load(entry) is not None:
                names.append(name)
        except PolicyConflictError as exc:
            warnings.warn(str(exc), PluginWarning, stacklevel=2)
    return names


def factory(name: str) -> PolicyFactory:
    """The factory registered under ``name``; PolicyNotFoundError (with close matches) if none."""
    entries = _discover()
    entry = entries.get(name)
    if entry is None:
        close = difflib.get_close_matches(name, list(entries), n=3, cutoff=0.5)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        raise PolicyNotFoundError(
            f"no drop policy named {name!r}.{hint} Available: {', '.join(sorted(entries))} "
            "(`kvdrop list` shows them)."
        )
    loaded = _load(entry)
    if loaded is None:
        raise PolicyNotFoundError(
            f"policy {name!r} from {entry.source} failed to load: {entry.failed}"
        )
    return loaded


def describe(name: str) -> PolicyInfo:
    """What ``kvdrop describe NAME`` shows for a registered name."""
    return factory(name).info


def source(name: str) -> str:
    """Where policy ``name`` comes from (distribution and object, or register() call site)."""
    factory(name)
    return _discover()[name].source
