"""What the combinator factories share: the parameters they pass on to the policy they wrap,
and the one way they turn a policy's name (or spec) into a built policy -- by asking
:mod:`kvdrop.spec`. Each combinator's module owns its own factory (``compose``, ``chunk``,
``chunkkv``, ``block``, ``budget``, registered by those names); the combinator classes
themselves only ever hold built policies.
"""

from __future__ import annotations

from typing import Any

from kvdrop.errors import PolicyParamError
from kvdrop.factories import PolicyInfo
from kvdrop.params import Param
from kvdrop.policy import Policy, QueryNeed
from kvdrop.selector import SELECTOR_PARAMS

__all__ = [
    "CHUNK_SIZE",
    "DEVICE",
    "HEAD_DIM",
    "KEEP",
    "build",
    "describe",
    "inner_info",
    "inner_params",
    "is_spec",
    "policy_name",
    "policy_terms",
]

KEEP = [p for p in SELECTOR_PARAMS if p.name in ("keep_ratio", "keep_tokens")]
CHUNK_SIZE = next(p for p in SELECTOR_PARAMS if p.name == "chunk_size")
DEVICE = next(p for p in SELECTOR_PARAMS if p.name == "device")
HEAD_DIM = Param(
    "head_dim",
    int | None,
    None,
    "per-head dimension, passed to every inner policy that takes head_dim (unless it sets it)",
    "None or an int >= 1",
    lambda d: d >= 1,
)


def build(name: str, **params: Any) -> Policy:
    """The policy ``name`` (a registered name or a spec) built with ``params``, as
    ``kvdrop.get`` builds it."""
    from kvdrop import spec  # spec imports these factories: asked at build time, not import

    return spec.get(name, **params)


def describe(name: str) -> PolicyInfo:
    """``kvdrop.describe(name)``."""
    from kvdrop import spec

    return spec.describe(name)


def is_spec(name: str) -> bool:
    """Whether ``name`` is a spec string (:func:`kvdrop.spec.is_spec`)."""
    from kvdrop import spec

    return spec.is_spec(name)


def policy_terms(policies: Any) -> list[tuple[str, dict[str, Any]]]:
    """A ``policies`` value as (name, params) terms (:func:`kvdrop.spec.policy_terms`)."""
    from kvdrop import spec

    return spec.policy_terms(policies)


def inner_params(params: dict[str, Any]) -> dict[str, Any]:
    """Parameters for the inner policy (``head_dim=None`` means: the inner policy's default)."""
    return {k: v for k, v in params.items() if not (k == "head_dim" and v is None)}


def policy_name(owner: str, policy: Any, *, spec_ok: bool) -> str:
    if not isinstance(policy, str) or (is_spec(policy) and not spec_ok):
        raise PolicyParamError(
            f"{owner}: parameter 'policy' got {policy!r}; expected a registered policy name"
            + (" or a spec" if spec_ok else "")
        )
    return policy


def inner_info(name: str, summary: str, own: Param, details: str) -> PolicyInfo:
    """PolicyInfo of a combinator over one policy given by name (``policy`` + ``own``)."""
    return PolicyInfo(
        name,
        summary,
        QueryNeed.NONE,  # as its default inner policy (knorm); the inner policy decides
        (
            Param("policy", str, "knorm", "the scorer policy it runs"),
            own,
            *SELECTOR_PARAMS,
            HEAD_DIM,
        ),
        details + " Every other parameter goes to the inner policy and is validated by it.",
        {},
    )
