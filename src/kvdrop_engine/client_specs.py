"""What a request's ``"kvdrop"`` override may name: the one rule, for the prompt cut
(:mod:`kvdrop_engine.drop`) and the decode cut (:mod:`kvdrop_engine.decode_cut`).

``--client-policies`` says which policies a client may pick: ``builtin`` (the default: the
server's own policies and kvdrop's built-ins), ``all`` (plugins too) or a comma-separated list;
the server's own ``--policy``/``--decode-policy`` are always allowed. Whatever is picked stays
within :func:`kvdrop.limits.check_client_spec`'s bounds (spec length and terms, each parameter's
declared ``serve_max``), checked before anything is built.
"""

from __future__ import annotations

from kvdrop_engine.errors import EngineSetupError, InvalidRequestError

__all__ = ["DEFAULT_CLIENT_POLICIES", "ClientSpecs"]

#: ``--client-policies`` when it is not given: the server's own policies and kvdrop's built-ins.
DEFAULT_CLIENT_POLICIES = "builtin"


class ClientSpecs:
    """Which specs a client may ask for (``which``: ``builtin``, ``all`` or a comma-separated
    list of names); ``own`` are the server's own specs (always allowed, unbounded)."""

    def __init__(self, which: str = DEFAULT_CLIENT_POLICIES, own: tuple[str, ...] = ()) -> None:
        if not isinstance(which, str) or not which.strip():
            raise EngineSetupError(
                "--client-policies must be 'builtin', 'all' or a comma-separated list of "
                f"policy names, got {which!r}"
            )
        self.which: str | frozenset[str] = which
        if which not in ("builtin", "all"):
            self.which = frozenset(name.strip() for name in which.split(",") if name.strip())
        self.own = frozenset(own)
        self.own_names: frozenset[str] = frozenset()
        if own:
            from kvdrop.spec import spec_terms  # the policy library, once there is a spec

            self.own_names = frozenset(name for spec in own for name, _ in spec_terms(spec))

    def may_pick(self, name: str) -> bool:
        """Whether a client may name policy ``name``."""
        from kvdrop.registry import is_builtin

        if name in self.own_names or self.which == "all":
            return True
        return is_builtin(name) if self.which == "builtin" else name in self.which

    def check(self, spec: str, field: str = "'kvdrop.policy'") -> None:
        """``InvalidRequestError`` naming ``field`` when a client may not ask for ``spec``."""
        if spec in self.own:
            return
        from kvdrop.errors import PolicyNotFoundError
        from kvdrop.limits import SpecLimits, check_client_spec

        try:
            check_client_spec(spec, SpecLimits(allowed=self.may_pick))
        except PolicyNotFoundError:
            return  # an unknown name: building it says so, in the builder's words
        except ValueError as exc:
            shown = spec if len(spec) <= 80 else f"{spec[:77]}..."
            raise InvalidRequestError(f"{field} {shown!r}: {exc}") from None
