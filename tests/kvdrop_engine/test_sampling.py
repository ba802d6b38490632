"""Sampling: parameter validation, the per-row sampler and the finish rule, without a model."""

from __future__ import annotations

import pytest
import torch

from kvdrop_engine.errors import InvalidRequestError
from kvdrop_engine.sampling import (
    SamplingParams,
    finish_reason,
    make_generator,
    sample,
    token_logprobs,
)


def test_from_dict_validates_and_tolerates_openai_fields() -> None:
    p = SamplingParams.from_dict({"max_tokens": 3, "temperature": 0, "stream": True, "n": 1})
    assert (p.max_tokens, p.temperature) == (3, 0)
    assert SamplingParams.from_dict({"stop_token_ids": [4, 5]}).stop_token_ids == (4, 5)
    for bad, match in [
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": True}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 2}, "n=1"),
        ({"beam_width": 2}, "unsupported sampling parameter"),
        ({"logprobs": 21}, "logprobs"),
    ]:
        with pytest.raises(InvalidRequestError, match=match):
            SamplingParams.from_dict(bad)


def test_greedy_rows_are_argmax_and_sampled_rows_follow_their_generator() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    greedy = SamplingParams(temperature=0)
    hot = SamplingParams(temperature=1.0, seed=7)
    assert make_generator(greedy) is None
    first = sample(logits, [greedy, hot, greedy], [None, make_generator(hot), None])
    again = sample(logits, [greedy, hot, greedy], [None, make_generator(hot), None])
    assert first == again  # same seed, same draw
    assert first[0] == int(logits[0].argmax()) and first[2] == int(logits[2].argmax())
    # top_k=1 and a tiny top_p leave only the best token, whatever the generator draws
    for p in (SamplingParams(top_k=1), SamplingParams(top_p=1e-6)):
        picks = {sample(logits[1:2], [p], [torch.Generator().manual_seed(s)])[0] for s in range(5)}
        assert picks == {int(logits[1].argmax())}


def test_finish_reason() -> None:
    p = SamplingParams(max_tokens=3, stop_token_ids=(9,))
    assert finish_reason(9, 1, p, {2}) == "stop"
    assert finish_reason(2, 1, p, {2}) == "stop"
    assert finish_reason(2, 1, SamplingParams(max_tokens=3, ignore_eos=True), {2}) is None
    assert finish_reason(5, 2, p, {2}) is None
    assert finish_reason(5, 3, p, {2}) == "length"


def test_token_logprobs_are_log_softmax_of_the_raw_logits() -> None:
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(0))
    out = token_logprobs(logits, [5, 6, 7], [None, 0, 3])
    assert out[0] is None
    logp = torch.log_softmax(logits, dim=-1)
    lp, top = out[1]
    assert lp == pytest.approx(float(logp[1, 6])) and top == ()
    lp, top = out[2]
    assert lp == pytest.approx(float(logp[2, 7]))
    best = torch.topk(logp[2], 3)
    assert [t for t, _ in top] == best.indices.tolist()
    assert [v for _, v in top] == pytest.approx(best.values.tolist())


def test_every_sampling_value_is_checked_by_the_one_table() -> None:
    from kvdrop_engine.sampling import BOUNDS, SamplingParamError

    bad = {
        "max_tokens": 0, "min_tokens": -1, "temperature": float("nan"), "top_p": 0,
        "top_k": -2, "min_p": 1.5, "presence_penalty": 2.5, "frequency_penalty": -3,
        "repetition_penalty": 0, "logit_bias": {"x": 1}, "seed": 2**64, "ignore_eos": 1,
        "stop_token_ids": [-1], "logprobs": 21,
    }  # fmt: skip
    assert set(bad) == set(BOUNDS)  # a new field needs a row here and in the table
    for name, value in bad.items():
        with pytest.raises(SamplingParamError, match=f"'{name}' must be") as info:
            SamplingParams.from_dict({name: value})
        assert info.value.field == name
    p = SamplingParams.from_dict({"logit_bias": {"5": -100, "2": 1.5}, "min_p": 0.0})
    assert p.logit_bias == ((2, 1.5), (5, -100)) and p.edits_logits
    assert not SamplingParams.from_dict({"repetition_penalty": 1.0}).edits_logits


def test_min_p_keeps_only_tokens_near_the_top() -> None:
    from kvdrop_engine.sampling import sample_row

    row = torch.tensor([0.0, 5.0, 4.9, -3.0])
    p = SamplingParams(min_p=0.5, seed=0)
    picks = {sample_row(row, p, torch.Generator().manual_seed(s)) for s in range(40)}
    assert picks == {1, 2}
