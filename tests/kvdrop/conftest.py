"""Policy unit tests call policies bare, without an ``EditContext``: no RoPE parameters are known
there, so every policy that re-rotates (the default) warns that the kept keys stay where they
were. That warning is the expected one in these tests (its own tests check it with
``pytest.warns``, which records it regardless), so it is filtered here, for the policy unit
tests only (not for ``experiments/``, where the engine registers its RoPE and the warning would
be a bug)."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent
BARE_CALL = pytest.mark.filterwarnings(
    "ignore:.*kept keys stay at their old RoPE positions:kvdrop.errors.PolicyWarning"
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(str(item.path))
        if HERE in path.parents and HERE / "experiments" not in path.parents:
            item.add_marker(BARE_CALL)
