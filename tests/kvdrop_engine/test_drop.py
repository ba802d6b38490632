"""Dropping while serving (``kvdrop_engine.drop``): the cut after prefill on the engine's paged
cache, against a dense reference; the blocks it frees let more requests run in the same budget;
per-request overrides, the threshold, and the errors of bad policies and overrides."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

import kvdrop
from kvdrop_engine.connectors.base import KVConnector
from kvdrop_engine.drop import PromptDropper, parse_override
from kvdrop_engine.engine import Engine
from kvdrop_engine.errors import EngineSetupError, InvalidRequestError
from kvdrop_engine.loading import preset_config
from kvdrop_engine.metrics import engine_load
from kvdrop_engine.model import DenseAttention, ModelConfig, Transformer
from kvdrop_sdk import CacheKind
from kvdrop_sdk.edit import EditContext
from kvdrop_sdk.events import kept_prompt_tokens
from kvdrop_sdk.query_capture import QueryCapture

pytestmark = pytest.mark.timeout(120)

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model() -> Transformer:
    return Transformer.random(preset_config("tiny"), seed=0)


def prompt_of(n: int, seed: int = 1) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 200, (n,), generator=gen).tolist()


def dense_cut_reference(model: Transformer, prompt: list[int], spec: str, steps: int) -> list[int]:
    """Prefill densely, cut with the policy itself (re-rotated to 0..k-1), decode greedily."""
    cfg = model.config
    cache = DenseAttention(cfg)
    with torch.inference_mode():
        logits = model(torch.tensor(prompt), torch.arange(len(prompt)), cache)
        n = len(prompt)
        kv = torch.stack(
            [
                torch.stack([cache.keys(i).reshape(n, -1) for i in range(cfg.num_layers)]),
                torch.stack([cache.values(i).reshape(n, -1) for i in range(cfg.num_layers)]),
            ]
        )
        policy = kvdrop.get(spec, keep_ratio=0.5, chunk_size=1)
        context = EditContext(
            positions=torch.arange(n), rope=cfg.rope.to_json(), prompt_tokens=n, head_dim=16
        )
        kept, tokens = policy({CacheKind.KV: kv}, prompt, context=context)
        k = len(tokens)
        small = DenseAttention(cfg)
        shape = (k, cfg.num_kv_heads, cfg.head_dim)
        small._k = [
            kept[0, i].reshape(shape).transpose(0, 1).clone() for i in range(cfg.num_layers)
        ]
        small._v = [
            kept[1, i].reshape(shape).transpose(0, 1).clone() for i in range(cfg.num_layers)
        ]
        small.length, small._capacity = k, k
        out = [int(logits[-1].argmax())]
        for step in range(steps - 1):
            logits = model(torch.tensor(out[-1:]), torch.tensor([k + step]), small)
            out.append(int(logits[-1].argmax()))
    return out


def test_cut_equals_the_policy_on_a_dense_cache(model: Transformer) -> None:
    """The engine's cut (gather from blocks, policy, re-rotation, write back, free) decodes the
    same tokens as the policy applied to a dense cache, decoding at positions k, k+1, ..."""
    prompt = prompt_of(200)
    dropper = PromptDropper(model.config, "knorm", keep_ratio=0.5)
    with Engine(model, num_blocks=64, dropper=dropper) as engine:
        events = list(engine.post_completion(prompt, {"max_tokens": 8, **GREEDY}))
        stats = engine.stats()
    assert [e.token_id for e in events] == dense_cut_reference(model, prompt, "knorm", 8)
    # the first token goes out while the cut runs; the next event reports what it kept
    assert [e.kept_prompt_tokens for e in events[:3]] == [None, 100, None]
    assert (stats.prompt_cuts, stats.prompt_tokens_kept, stats.prompt_tokens_dropped) == (
        1,
        100,
        100,
    )


def test_kept_keys_sit_at_contiguous_positions(model: Transformer) -> None:
    """Layer 0's keys depend only on token and position: after the cut they equal a fresh
    prefill of the kept tokens at 0..k-1 (so the keys were re-rotated, not left in place)."""
    prompt = prompt_of(160)
    dropper = PromptDropper(model.config, "snapkv", keep_ratio=0.5)
    engine = Engine(model, num_blocks=64, dropper=dropper)
    req = None
    original = engine.dropper.apply  # type: ignore[union-attr]

    def spy(cache, r, *args):  # type: ignore[no-untyped-def]
        nonlocal req
        done = original(cache, r, *args)
        req = (list(r.prompt), cache.keys(r.blocks, 0, r.num_computed).clone())
        return done

    engine.dropper.apply = spy  # type: ignore[method-assign,union-attr]
    with engine:
        engine.generate(prompt, {"max_tokens": 2, **GREEDY})
    assert req is not None
    kept, keys = req
    assert len(kept) == 80
    fresh = DenseAttention(model.config)
    with torch.inference_mode():
        model(torch.tensor(kept), torch.arange(len(kept)), fresh)
    torch.testing.assert_close(keys, fresh.keys(0), atol=1e-5, rtol=1e-5)


def test_cut_requests_share_the_budget() -> None:
    """Without a cut one request fits the budget at a time; with it, a second is admitted once
    the first one's cut frees its dropped blocks, and both decode together."""
    model = Transformer.random(preset_config("tiny"), seed=0)
    prompts = [prompt_of(200, seed) for seed in (1, 2)]
    params = {"max_tokens": 40, **GREEDY}
    peaks = []
    for dropper in (None, PromptDropper(model.config, "knorm", keep_ratio=0.5)):
        with Engine(model, num_blocks=24, dropper=dropper) as engine:
            streams = [engine.post_completion(p, params) for p in prompts]
            outputs = [list(s) for s in streams]
            peaks.append(engine.stats().peak_running)
            assert engine.num_free_blocks == 24
        assert [len(o) for o in outputs] == [40, 40]
    assert peaks == [1, 2]


def test_overrides_and_threshold(model: Transformer) -> None:
    prompt = prompt_of(200)
    params = {"max_tokens": 3, **GREEDY}

    def kept(engine: Engine, extra: dict, tokens: list[int] = prompt) -> int | None:
        return kept_prompt_tokens(engine.post_completion(tokens, {**params, **extra}))

    dropper = PromptDropper(
        model.config, "snapkv", keep_ratio=0.5, min_prompt_tokens=150, client_policies="all"
    )
    with Engine(model, num_blocks=64, dropper=dropper) as engine:
        assert kept(engine, {}) == 100
        assert kept(engine, {"kvdrop": None}) == 200  # no cut
        assert kept(engine, {"kvdrop": {"keep_ratio": 0.25}}) == 50  # the default policy
        assert kept(engine, {"kvdrop": {"policy": "knorm", "keep_ratio": 0.75}}) == 150
        assert kept(engine, {"kvdrop": {"policy": "value-norm"}}) == 100  # a plugin's policy
        assert kept(engine, {}, prompt[:120]) == 120  # under the threshold: left whole
        # A request's own threshold (a per-request option: parse_override and choose only).
        assert kept(engine, {"kvdrop": {"min_drop_tokens": 100}}, prompt[:120]) == 60
        assert kept(engine, {"kvdrop": {"min_drop_tokens": 250}}) == 200
        assert engine.stats().prompt_cuts == 5
    with Engine(model, num_blocks=64, dropper=PromptDropper(model.config)) as engine:
        assert kept(engine, {}) is None  # no default policy: nothing to report
        assert kept(engine, {"kvdrop": {"policy": "streaming", "keep_ratio": 0.5}}) == 100


def test_a_spec_keep_ratio_is_the_engines_one_rule(model: Transformer) -> None:
    """``--policy 'knorm(keep_ratio=0.3)'`` keeps 0.3 (not the 0.5 default); an explicit
    different ``--keep-ratio`` beside it fails at start; a request's different keep_ratio
    beside a spec's own is refused, while the engine's ratio is only the requests' default."""
    dropper = PromptDropper(model.config, "knorm(keep_ratio=0.3)")
    assert dropper.default is not None and str(dropper.default.budget) == "0.3 (the spec's)"
    with pytest.raises(EngineSetupError, match=r"sets keep_ratio=0\.3 and keep_ratio 0\.5"):
        PromptDropper(model.config, "knorm(keep_ratio=0.3)", keep_ratio=0.5)
    assert PromptDropper(model.config, "knorm(keep_ratio=0.3)", keep_ratio=0.3).default
    params = {"max_tokens": 2, **GREEDY}
    engine = Engine(
        model, num_blocks=64, dropper=PromptDropper(model.config, "knorm", keep_ratio=0.5)
    )
    with engine:
        assert kept_prompt_tokens(engine.post_completion(prompt_of(200), params)) == 100
        ask = {"policy": "knorm(keep_ratio=0.25)"}  # the engine's 0.5 is only a default
        events = engine.post_completion(prompt_of(200), {**params, "kvdrop": ask})
        assert kept_prompt_tokens(events) == 50
        with pytest.raises(
            InvalidRequestError, match=r"sets keep_ratio=0\.25 and keep_ratio 0\.75"
        ):
            engine.post_completion(
                prompt_of(200), {**params, "kvdrop": {**ask, "keep_ratio": 0.75}}
            )
    with Engine(model, num_blocks=64, dropper=dropper) as engine:
        kept = kept_prompt_tokens(engine.post_completion(prompt_of(200), params))
    assert kept == 60


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("snapkv", "must be null"),
        ({"policy": 3}, "'kvdrop.policy' must be"),
        ({"keep_ratio": 0}, "'kvdrop.keep_ratio' must be a number in (0, 1]"),
        ({"keep_ratio": True}, "'kvdrop.keep_ratio'"),
        ({"ratio": 0.5}, "unknown key(s) ['ratio']"),
        ({"min_drop_tokens": 0}, "'kvdrop.min_drop_tokens' must be an int >= 1, got 0"),
        ({"policy": "no-such-policy"}, "no-such-policy"),
        ({"policy": "snapkv", "keep_ratio": 0.5, "window": 8}, "unknown key(s) ['window']"),
        ({"policy": "snapkv(head_dim=12)"}, "cannot run on this model"),
    ],
)
def test_bad_overrides_are_refused(model: Transformer, value: object, fragment: str) -> None:
    with Engine(model, num_blocks=64, dropper=PromptDropper(model.config, "snapkv")) as engine:
        with pytest.raises(InvalidRequestError) as err:
            engine.post_completion(prompt_of(200), {"max_tokens": 2, "kvdrop": value})
    assert fragment in str(err.value)


def test_override_needs_a_dropper(model: Transformer) -> None:
    with Engine(model, num_blocks=64) as engine:
        with pytest.raises(InvalidRequestError, match="without a dropper"):
            engine.post_completion([5, 6], {"max_tokens": 2, "kvdrop": {"policy": "knorm"}})
        out = engine.generate([5, 6], {"max_tokens": 2, "ignore_eos": True, "kvdrop": None})
        assert len(out) == 2


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("no-such-policy", "--policy no-such-policy: policy 'no-such-policy'"),
        ("kvzip", "reconstruction scores"),
        ("snapkv(head_dim=12)", "cannot run on this model"),
    ],
)
def test_setup_errors_are_one_line(model: Transformer, spec: str, fragment: str) -> None:
    with pytest.raises(EngineSetupError) as err:
        PromptDropper(model.config, spec)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_parse_override_shapes() -> None:
    assert parse_override(None) is None
    assert parse_override({}) == parse_override({"policy": None})
    assert parse_override({"policy": "knorm", "keep_ratio": 1}).keep_ratio == 1.0  # type: ignore[union-attr]


def test_gauges_report_kept_and_dropped(model: Transformer) -> None:
    dropper = PromptDropper(model.config, "knorm", keep_ratio=0.25)
    with Engine(model, num_blocks=64, dropper=dropper) as engine:
        engine.generate(prompt_of(200), {"max_tokens": 2, **GREEDY})
        load = engine_load(engine)
    assert (load.prompt_tokens_kept, load.prompt_tokens_dropped) == (50, 150)


class DictConnector(KVConnector):
    """Whole chunks of 16 in a dict (the connector of docs/engine.md)."""

    def __init__(self) -> None:
        super().__init__(QueryCapture())
        self.chunks: dict[tuple[int, ...], torch.Tensor] = {}

    def bind(
        self, config: ModelConfig, dtype: torch.dtype, *, device: torch.device | None = None
    ) -> None:
        self.chunk_size = 16

    def load(self, tokens: Sequence[int], cache_salt: str = "") -> torch.Tensor | None:
        for n in range(len(tokens) // 16 * 16, 0, -16):
            if (kv := self.chunks.get(tuple(tokens[:n]))) is not None:
                return kv
        return None

    def store(
        self,
        kv: torch.Tensor,
        queries: torch.Tensor | None,
        tokens: Sequence[int],
        cache_salt: str = "",
        *,
        query_offset: int = 0,
    ) -> int:
        n = len(tokens) // 16 * 16
        self.chunks[tuple(tokens[:n])] = kv[:, :, :n].clone()
        return 0


def test_with_a_connector_the_whole_prompt_is_stored_before_the_cut(model: Transformer) -> None:
    """A cache server still gets the whole prompt (its chunks are stored before the cut), and a
    second request for the same prompt loads them and is cut the same way."""
    prompt = prompt_of(200)
    conn = DictConnector()
    dropper = PromptDropper(model.config, "knorm", keep_ratio=0.5)
    with Engine(model, num_blocks=64, connector=conn, dropper=dropper) as engine:
        first = list(engine.post_completion(prompt, {"max_tokens": 6, **GREEDY}))
        again = list(engine.post_completion(prompt, {"max_tokens": 6, **GREEDY}))
        stats = engine.stats()
    assert list(conn.chunks) == [tuple(prompt[:192])]
    assert stats.tokens_loaded == 192 and stats.prompt_cuts == 2
    assert [e.token_id for e in first] == [e.token_id for e in again]
    assert kept_prompt_tokens(first) == kept_prompt_tokens(again) == 100


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("spec", ["knorm", "snapkv"])
def test_cuda_cuts_beside_prefills_equal_their_solo_runs(spec: str) -> None:
    """On CUDA a cut's policy runs on a side stream while the loop prefills other prompts: each
    of eight requests sent together keeps the tokens and decodes the answer it has alone (a
    missed stream ordering would read half-written K/V or reuse freed memory)."""
    gpu = Transformer.random(preset_config("tiny"), seed=0, device="cuda")
    prompts = [prompt_of(300 + 37 * i, seed=i) for i in range(8)]
    params = {"max_tokens": 12, **GREEDY}

    def run(batch: list[list[int]]) -> list[tuple[int | None, list[int]]]:
        dropper = PromptDropper(gpu.config, spec, keep_ratio=0.5)
        with Engine(gpu, num_blocks=256, dropper=dropper, max_prefill_tokens=128) as engine:
            streams = [engine.post_completion(p, params) for p in batch]
            events = [list(s) for s in streams]
        return [(kept_prompt_tokens(e), [x.token_id for x in e]) for e in events]

    together = run(prompts)
    alone = [run([p])[0] for p in prompts]
    assert together == alone
    assert all(kept is not None and kept < len(p) for (kept, _), p in zip(together, prompts))
