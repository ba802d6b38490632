"""What the engine does not trust a drop policy with (reliability round 4): the rows a policy
(or a plugin) returns are checked before any block changes, and a policy that fails at serve
time fails its own request with the policy named, while the engine keeps serving."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch

import kvdrop
from kvdrop.registry import _reset
from kvdrop_engine.drop import PromptDropper
from kvdrop_engine.engine import Engine
from kvdrop_engine.errors import PolicyFailedError
from kvdrop_engine.loading import preset_config
from kvdrop_engine.model import Transformer
from kvdrop_sdk import CacheKind
from kvdrop_sdk.query_capture import QueryNeed

pytestmark = pytest.mark.timeout(120)

GREEDY = {"temperature": 0, "ignore_eos": True}
#: Tokens of the prompt the dropper's start check runs a policy on (a plugin that misbehaves
#: only on other prompts passes it).
CHECK_TOKENS = 160


@pytest.fixture(scope="module")
def model() -> Transformer:
    return Transformer.random(preset_config("tiny"), seed=0)


def prompt_of(n: int, seed: int = 1) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 200, (n,), generator=gen).tolist()


Edit = Callable[[torch.Tensor, Sequence[int]], tuple[torch.Tensor, list[int]]]


def plugin(bad: Edit) -> Callable[..., Any]:
    """A plugin factory whose edit keeps the first half, except off the start check's prompt
    length, where ``bad`` answers."""

    def factory(keep_ratio: float = 0.5) -> Any:
        def edit(tensors: Any, tokens: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
            kv = tensors[CacheKind.KV]
            if len(tokens) != CHECK_TOKENS:
                return bad(kv, tokens)
            k = len(tokens) // 2
            return kv[:, :, :k], list(tokens[:k])

        return edit

    factory.queries = QueryNeed.NONE  # type: ignore[attr-defined]
    return factory


def doubled(kv: torch.Tensor, tokens: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
    return torch.cat([kv, kv], dim=2), list(tokens) * 2


def duplicates(kv: torch.Tensor, tokens: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
    index = torch.tensor([0, 1, 1, 2])
    return kv.index_select(2, index), [tokens[i] for i in index.tolist()]


def raises(kv: torch.Tensor, tokens: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
    raise RuntimeError("plugin bug")


@pytest.fixture
def plugins() -> Iterator[None]:
    for name, bad in (("doubled", doubled), ("dupes", duplicates), ("raises", raises)):
        kvdrop.register(f"guard-{name}", plugin(bad), replace=True)
    yield
    _reset()


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("doubled", "returned 600 rows for a 300-token input"),
        ("dupes", "repeats or precedes an earlier kept row"),
        ("raises", "RuntimeError: plugin bug"),
    ],
)
def test_a_bad_policy_fails_its_request_only_and_is_named(
    model: Transformer, plugins: None, name: str, fragment: str
) -> None:
    """The bad request fails naming the policy; the blocks are all back, and the next request's
    tokens equal those of a fresh engine (no stale rows of the failed one are read)."""
    prompt, other = prompt_of(300), prompt_of(300, seed=2)
    dropper = PromptDropper(model.config, "knorm", keep_ratio=0.5)
    params = {"max_tokens": 6, **GREEDY}
    with Engine(model, num_blocks=64, dropper=PromptDropper(model.config, "knorm")) as fresh:
        expected = fresh.generate(other, params)
    with Engine(model, num_blocks=64, dropper=dropper) as engine:
        bad = {**params, "kvdrop": {"policy": f"guard-{name}"}}
        with pytest.raises(PolicyFailedError) as err:
            list(engine.post_completion(prompt, bad))
        assert f"policy 'guard-{name}' failed on this request's 300-token prompt" in str(err.value)
        assert fragment in str(err.value)
        assert engine.generate(other, params) == expected
        assert engine.num_free_blocks == 64
