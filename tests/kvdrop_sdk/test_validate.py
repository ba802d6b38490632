"""The shared input checks: ints that are not bools, token-id lists with the offending index."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvdrop_sdk.validate import check_fields, is_int, is_number, positive_int, token_ids


def test_bools_are_not_numbers() -> None:
    assert is_int(3) and not is_int(True) and not is_int(3.0)
    assert is_number(2.5) and is_number(2) and not is_number(False) and not is_number("1")
    assert positive_int(4, "n") == 4
    with pytest.raises(ValueError, match="n must be an int >= 2, got 1"):
        positive_int(1, "n", minimum=2)


def test_token_ids() -> None:
    assert token_ids([3, 0, 7], "ids") == [3, 0, 7]
    assert token_ids(torch.tensor([1, 2]), "ids") == [1, 2]
    assert token_ids((), "ids") == []  # emptiness is the caller's rule
    with pytest.raises(TypeError, match="ids must be a list of ints"):
        token_ids("abc", "ids")
    with pytest.raises(TypeError, match=r"ids\[1\] must be an int token id, got bool True"):
        token_ids([1, True], "ids")
    with pytest.raises(ValueError, match=r"ids\[0\] must be a non-negative token id, got -1"):
        token_ids([-1], "ids")
    with pytest.raises(ValueError, match=r"ids\[2\] = 9 is outside the vocabulary \[0, 9\)"):
        token_ids([0, 8, 9], "ids", vocab_size=9)
    with pytest.raises(ValueError, match="1-D integer tensor"):
        token_ids(torch.zeros(2), "ids")


@dataclasses.dataclass
class _Counts:
    max_tokens: int = 1
    every: int = 1


def test_check_fields_names_a_field_by_its_class_or_by_a_label() -> None:
    with pytest.raises(ValueError, match=r"^_Counts\.every must be a positive int, got 0$"):
        check_fields(_Counts(every=0), ints={"max_tokens": 1, "every": 1})
    with pytest.raises(ValueError, match=r"^--max-tokens must be a positive int, got True$"):
        check_fields(
            _Counts(max_tokens=True),  # a bool is not a count
            ints={"max_tokens": 1},
            label=lambda name: "--" + name.replace("_", "-"),
        )
