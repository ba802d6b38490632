"""Invariants every registered policy must keep (including plugins), through the public test kit
``kvdrop.testing`` (what a plugin's own CI runs; its module docstring states the input domain).

One list drives the matrix: ``kvdrop.available()``. The runs are deterministic (hypothesis with
``derandomize=True``). A plugin whose import fails, or two claiming one name, fails
test_registry.py (one test per entry point), so no plugin drops out of this matrix silently.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

import kvdrop
from kvdrop import testing
from kvdrop.factories import ScorerFactory

POLICIES = kvdrop.available()


@pytest.mark.parametrize("name", POLICIES)
def test_policy_invariants(name: str) -> None:
    testing.check_invariants(name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", POLICIES)
def test_policy_invariants_hold_for_cuda_tensors(name: str) -> None:
    """An edit run with ``device="cuda"`` hands the policy CUDA tensors: it must give CUDA
    tensors back whose rows are the input's, bit for bit (the SDK stores them by DMA)."""
    testing.check_invariants(name, max_examples=8, device="cuda")


@pytest.mark.parametrize("name", POLICIES)
def test_invalid_parameters_name_the_parameter(name: str) -> None:
    testing.check_invalid_parameters(name)


@pytest.mark.parametrize("name", POLICIES)
def test_wrongly_shaped_inputs_raise(name: str) -> None:
    testing.check_wrong_shapes(name)


@pytest.mark.parametrize("name", POLICIES)
def test_policy_objects_say_what_describe_says(name: str) -> None:
    testing.check_describes_itself(name)


def test_policy_names_filter_by_distribution() -> None:
    assert "snapkv" in testing.policy_names("kvdrop")
    assert "value-norm" not in testing.policy_names("kvdrop")
    assert set(testing.policy_names()) == set(POLICIES)


@dataclass(frozen=True)
class ReversingScorer(kvdrop.Scorer):
    """Breaks the contract on purpose: keeps the right tokens but hands them back reversed."""

    def score(self, kv: torch.Tensor, query: torch.Tensor | None) -> torch.Tensor:
        return torch.zeros(kv.shape[2])


class Reversed(ScorerFactory):
    def __call__(self, **params: Any) -> Any:
        inner = super().__call__(**params)

        class Wrapper(type(inner)):  # type: ignore[misc]
            def __call__(self, tensors: Any, tokens: Any, **kw: Any) -> Any:
                kv, kept = inner(tensors, tokens, **kw)
                return kv.flip(2), list(reversed(kept))

        wrapper = object.__new__(Wrapper)
        wrapper.__dict__.update(inner.__dict__)
        return wrapper


def test_the_kit_fails_a_policy_that_breaks_the_contract() -> None:
    broken = Reversed("reversing", ReversingScorer, "keeps tokens in reverse order")
    testing.check_describes_itself(broken)
    with pytest.raises(AssertionError, match="keep order"):
        testing.check_invariants(broken, max_examples=20)
