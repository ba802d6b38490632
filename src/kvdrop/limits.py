"""What a serving client may ask of a policy spec: a bounded cost.

An engine that lets each request pick its cut (``"kvdrop": {"policy": SPEC}``) runs the client's
choice of code and parameters. :class:`SpecLimits` bounds that choice before anything is built:
the spec's length, the number of policy terms it builds (nested ones included), which policies
may be named, and each parameter's ``serve_max``, declared where the parameter is
(:func:`kvdrop.param`): ``leverage(sketch_dimension=4000)`` asked for 455 MB of one request. A
bounded parameter given None (no bound: ``h2o(num_queries=null)``, every saved query) is over
its ``serve_max`` too.
The operator's own ``--policy`` and library calls are not bounded here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvdrop.errors import PolicyParamError
from kvdrop.spec import factory, spec_terms
from kvdrop_sdk.validate import is_number

__all__ = ["DEFAULT_MAX_SPEC_CHARS", "DEFAULT_MAX_SPEC_TERMS", "SpecLimits", "check_client_spec"]

#: Longest spec string a client may send.
DEFAULT_MAX_SPEC_CHARS = 512
#: Most policy terms one client spec may build (a 3000-term ``knorm+knorm+...`` took 5.2 s).
DEFAULT_MAX_SPEC_TERMS = 16


@dataclass(frozen=True)
class SpecLimits:
    """``max_chars`` and ``max_terms`` of a client's spec; ``allowed(name)`` says whether a
    client may name a policy (None: every registered one)."""

    max_chars: int = DEFAULT_MAX_SPEC_CHARS
    max_terms: int = DEFAULT_MAX_SPEC_TERMS
    allowed: Callable[[str], bool] | None = None


def check_client_spec(spec: str, limits: SpecLimits) -> None:
    """``PolicyParamError`` saying what is over (and the bound) when a client may not run
    ``spec``: too long, too many terms, a policy it may not pick, or a parameter over its
    ``serve_max``. Cheap: the spec is parsed, nothing is built."""
    if len(spec) > limits.max_chars:
        raise PolicyParamError(
            f"the policy spec is {len(spec)} characters; a client may send at most "
            f"{limits.max_chars}"
        )
    terms = spec_terms(spec)
    if len(terms) > limits.max_terms:
        raise PolicyParamError(
            f"the policy spec builds {len(terms)} policy terms; a client may ask for at most "
            f"{limits.max_terms}"
        )
    for name, params in terms:
        declared = {p.name: p for p in factory(name).info.params}  # an unknown name: not found
        if limits.allowed is not None and not limits.allowed(name):
            raise PolicyParamError(
                f"policy {name!r} may not be picked by this server's clients (the operator "
                "allows the server's own policy and the built-ins: kvdrop engine "
                "--client-policies)"
            )
        for key, value in params.items():
            p = declared.get(key)
            cap = None if p is None else p.serve_max
            # None is no bound at all for a bounded parameter (h2o's num_queries=None: every
            # saved query, O(T^2) work): over the cap too.
            if cap is not None and (value is None or (is_number(value) and value > cap)):
                raise PolicyParamError(
                    f"{name}: parameter {key!r} got {value!r}; a serving client may ask for at "
                    f"most {cap:g} (its cost grows with it; the operator's --policy may set more)"
                )
