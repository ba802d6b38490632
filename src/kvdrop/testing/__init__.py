"""Test and measurement tooling of kvdrop, kept out of the policies: :func:`check_policy` runs the
policy contract (:mod:`kvdrop.testing.policy_contract`) in a plugin's own CI, no source checkout
needed; ``profiling.PeakRSS`` measures peak memory."""

from __future__ import annotations

from kvdrop.testing.policy_contract import (
    check_describes_itself,
    check_invalid_parameters,
    check_invariants,
    check_parameter_values,
    check_policy,
    check_query_sample,
    check_window_path,
    check_wrong_shapes,
    explicit_cases,
    policy_names,
)

__all__ = [
    "check_describes_itself",
    "check_invalid_parameters",
    "check_invariants",
    "check_parameter_values",
    "check_policy",
    "check_query_sample",
    "check_window_path",
    "check_wrong_shapes",
    "explicit_cases",
    "policy_names",
]
