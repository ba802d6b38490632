"""Compression while decoding (``kvdrop_engine.decode_cut``): the cache stays within budget +
every, freed blocks serve other requests, preempted cut requests keep their tokens, and the
engine's cuts decode exactly what a dense reference with the same policy decodes."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import requests
import torch

from kvdrop.cli import main
from kvdrop_engine.decode_cut import DecodeCompressor, parse_decode
from kvdrop_engine.decode_reference import DenseDecode
from kvdrop_engine.drop import PromptDropper
from kvdrop_engine.engine import Engine
from kvdrop_engine.errors import EngineSetupError, InvalidRequestError, RequestTooLargeError
from kvdrop_engine.loading import preset_config
from kvdrop_engine.model import Transformer
from kvdrop_sdk.events import kept_prompt_tokens

pytestmark = pytest.mark.timeout(300)

GREEDY = {"temperature": 0, "ignore_eos": True}
POLICIES = ["rkv", "snapkv", "tova", "knorm"]


@pytest.fixture(scope="module")
def model() -> Transformer:
    return Transformer.random(preset_config("tiny"), seed=0)


def prompt_of(n: int, seed: int = 1) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 200, (n,), generator=gen).tolist()


def dense_decode_cut(
    model: Transformer, prompt: list[int], spec: str, budget: int, every: int, steps: int
) -> tuple[list[int], torch.Tensor]:
    """Greedy decoding on a dense cache cut by the same policy at the same points
    (:class:`~kvdrop_engine.decode_reference.DenseDecode`); the tokens and the true positions
    of the rows held at the end."""
    compressor = DecodeCompressor(model.config, spec, budget=budget, every=every)
    dense = DenseDecode(model, compressor.default, compressor)
    out = [int(dense.prefill(prompt).argmax())]
    while len(out) < steps:
        out.append(int(dense.feed(out[-1]).argmax()))
    return out, dense.positions


@pytest.mark.parametrize("spec", ["rkv", "knorm"])
def test_decode_cuts_equal_the_policy_on_a_dense_cache(model: Transformer, spec: str) -> None:
    """The engine's cuts (gather from blocks, policy, scatter to the first slots, free; next
    tokens at their true positions) decode the same tokens as the policy cutting a dense cache,
    and hold the same rows at the end."""
    prompt = prompt_of(40)
    budget, every, steps = 48, 16, 120
    compressor = DecodeCompressor(model.config, spec, budget=budget, every=every)
    engine = Engine(model, num_blocks=64, compressor=compressor)
    held: list[torch.Tensor] = []
    original = compressor.cut

    def spy(cache, reqs):  # type: ignore[no-untyped-def]
        done = original(cache, reqs)
        held[:] = [reqs[0].slot_positions(reqs[0].num_computed)]
        return done

    compressor.cut = spy  # type: ignore[method-assign]
    with engine:
        got = engine.generate(prompt, {"max_tokens": steps, **GREEDY})
        stats = engine.stats()
    want, positions = dense_decode_cut(model, prompt, spec, budget, every, steps)
    assert got == want
    assert stats.decode_cuts >= 5
    # The engine's last cut kept the rows the reference holds (before its later tokens).
    assert torch.equal(held[0], positions[: held[0].numel()])


def test_a_cut_moves_the_kept_rows_exactly(model: Transformer) -> None:
    """After a cut the request's first slots hold exactly the rows the policy picked from the
    cache read just before it, bit for bit, and its blocks past the next token's are free."""
    compressor = DecodeCompressor(model.config, "rkv", budget=32, every=16)
    engine = Engine(model, num_blocks=32, compressor=compressor)
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = []
    cut = compressor.cut

    def spy_cut(cache, reqs):  # type: ignore[no-untyped-def]
        req = reqs[0]
        kv = cache.read(req.blocks, req.num_computed)
        positions = req.slot_positions(req.num_computed)
        before = engine.num_free_blocks
        done = cut(cache, reqs)
        index = torch.searchsorted(positions, req.slot_positions(req.num_computed))
        after = cache.read(req.blocks, req.num_computed)
        seen.append((kv, index, after, engine.num_free_blocks - before))
        return done

    compressor.cut = spy_cut  # type: ignore[method-assign]
    with engine:
        engine.generate(prompt_of(60), {"max_tokens": 60, **GREEDY})
    assert len(seen) >= 3
    for kv, index, after, _ in seen:
        assert torch.equal(after, kv[:, :, index]) and index.numel() == 32
    assert seen[0][3] == 1  # 60 prompt tokens in 4 blocks, 33 in 3


@pytest.mark.parametrize("spec", POLICIES)
@pytest.mark.parametrize("prompt_len", [20, 150])
def test_the_cache_never_exceeds_budget_plus_every(
    model: Transformer, spec: str, prompt_len: int
) -> None:
    budget, every = 40, 12
    compressor = DecodeCompressor(model.config, spec, budget=budget, every=every)
    engine = Engine(model, num_blocks=64, compressor=compressor)
    largest = 0
    forward = engine.runner.forward

    def spy(plan):  # type: ignore[no-untyped-def]
        nonlocal largest
        for s in plan.seqs:
            if s.num_new == 1:  # a decode step reads start + 1 cached tokens
                largest = max(largest, s.start + 1)
        return forward(plan)

    engine.runner.forward = spy  # type: ignore[method-assign]
    with engine:
        out = engine.generate(prompt_of(prompt_len), {"max_tokens": 100, **GREEDY})
        stats = engine.stats()
    assert len(out) == 100
    assert largest <= budget + every and stats.peak_decode_kv_tokens == largest
    assert stats.decode_cuts >= 3
    assert engine.num_free_blocks == engine.num_blocks


def test_freed_blocks_serve_other_requests(model: Transformer) -> None:
    """16 blocks (256 tokens): two 30 + 200-token generations need 460 tokens and cannot run
    together uncut (one is preempted); cut to 48 + 16 they run side by side, no preemption."""
    prompts = [prompt_of(30, seed) for seed in (1, 2)]

    def run(compressor: DecodeCompressor | None) -> tuple[int, int, int]:
        with Engine(model, num_blocks=16, compressor=compressor) as engine:
            streams = [engine.post_completion(p, {"max_tokens": 200, **GREEDY}) for p in prompts]
            counts = [0, 0]
            readers = [
                threading.Thread(target=lambda i=i: counts.__setitem__(i, len(list(streams[i]))))
                for i in range(2)
            ]
            for r in readers:
                r.start()
            for r in readers:
                r.join(240)
            st = engine.stats()
            assert counts == [200, 200] and engine.num_free_blocks == engine.num_blocks
            return st.preemptions, st.peak_running, st.peak_blocks_used

    preempted, _, _ = run(None)
    assert preempted >= 1
    compressor = DecodeCompressor(model.config, "rkv", budget=48, every=16)
    preempted, running, blocks = run(compressor)
    assert (preempted, running) == (0, 2)
    assert blocks <= 2 * 4  # 64 tokens each: 4 blocks


def test_preempted_cut_requests_keep_their_tokens(model: Transformer) -> None:
    """Three cut requests in a budget too small for all three at their peaks: those preempted
    after a cut are swapped to host memory and back (not recomputed), and every request decodes
    what it decodes alone."""
    prompts = [prompt_of(n, 10 + i) for i, n in enumerate((20, 70, 50, 30))]
    base = {"max_tokens": 150, **GREEDY}
    # The first is not cut: it grows to 169 tokens and preempts the (newer) cut requests,
    # which reserve what they hold at most and so never preempt by themselves.
    params = [{**base, "kvdrop": {"decode": None}}, base, base, base]

    def compressor() -> DecodeCompressor:
        return DecodeCompressor(model.config, "rkv", budget=40, every=16)

    with Engine(model, num_blocks=64, compressor=compressor()) as solo:
        want = [solo.generate(p, q) for p, q in zip(prompts, params)]
    # 12 blocks of 16: a cut request holds 4-5 blocks (56-70 tokens); not all fit at once.
    with Engine(model, num_blocks=12, compressor=compressor()) as engine:
        got = _run_together(engine, prompts, params)
        st = engine.stats()
    assert got == want
    assert st.swaps >= 1 and st.preemptions >= st.swaps
    assert engine.num_free_blocks == engine.num_blocks


def _largest_decode(engine: Engine) -> list[int]:
    """Spy on ``engine``'s forward: the list's one item becomes the most cached tokens a
    decode step of any request read (its ``start + 1``; prefill chunks are not decodes)."""
    largest = [0]
    forward = engine.runner.forward

    def spy(plan):  # type: ignore[no-untyped-def]
        for s in plan.seqs[: plan.num_decode]:
            largest[0] = max(largest[0], s.start + 1)
        return forward(plan)

    engine.runner.forward = spy  # type: ignore[method-assign]
    return largest


@pytest.mark.parametrize("prompt_cut", ["knorm", "snapkv"])
def test_it_composes_with_the_prompt_cut(model: Transformer, prompt_cut: str) -> None:
    """A 200-token prompt cut to half (100 kept, past budget + every = 50), then cuts while
    decoding: the first event reports the kept prompt, and the decode cut runs as the prompt
    cut is applied (on the prompt's last query rows), so no decode step reads more than 50."""
    dropper = PromptDropper(model.config, prompt_cut, keep_ratio=0.5)
    compressor = DecodeCompressor(model.config, "rkv", budget=40, every=10)
    with Engine(model, num_blocks=64, dropper=dropper, compressor=compressor) as engine:
        largest = _largest_decode(engine)
        events = list(engine.post_completion(prompt_of(200), {"max_tokens": 80, **GREEDY}))
        st = engine.stats()
    assert len(events) == 80 and kept_prompt_tokens(events) == 100
    assert st.prompt_cuts == 1 and st.decode_cuts >= 7
    assert 0 < largest[0] <= 50 and st.peak_decode_kv_tokens == largest[0]
    assert engine.num_free_blocks == engine.num_blocks


def test_a_one_token_prefill_chunk_is_not_a_decode(model: Transformer) -> None:
    """Peak KV per request counts decode steps only: a 100-token prompt prefilled as 99 + 1
    tokens (``max_prefill_tokens=99``) is cut to budget + every = 52 after its prefill, and
    no decode reads more (the 1-token chunk at 100 is a prefill; counted, it read 100)."""
    compressor = DecodeCompressor(model.config, "rkv", budget=40, every=12)
    engine = Engine(model, num_blocks=64, max_prefill_tokens=99, compressor=compressor)
    with engine:
        largest = _largest_decode(engine)
        assert len(engine.generate(prompt_of(100), {"max_tokens": 60, **GREEDY})) == 60
        st = engine.stats()
    assert st.decode_cuts >= 5
    assert 0 < largest[0] <= 52 and st.peak_decode_kv_tokens == largest[0]


def test_per_request_overrides(model: Transformer) -> None:
    compressor = DecodeCompressor(model.config, "knorm", budget=40, every=10)
    prompt = prompt_of(30)
    with Engine(model, num_blocks=64, compressor=compressor) as engine:

        def cuts(extra: dict) -> tuple[int, int]:
            engine.reset_stats()
            engine.generate(prompt, {"max_tokens": 60, **GREEDY, **extra})
            st = engine.stats()
            return st.decode_cuts, st.peak_decode_kv_tokens

        assert cuts({}) == (4, 50)
        assert cuts({"kvdrop": {"decode": None}})[0] == 0
        assert cuts({"kvdrop": None})[0] == 0
        assert cuts({"kvdrop": {"decode": {"budget": 60, "every": 5}}}) == (5, 65)
        assert cuts({"kvdrop": {"decode": {"policy": "tova"}}}) == (4, 50)


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ({"decode": {"budget": 0}}, "'kvdrop.decode.budget' must be an int >= 1"),
        ({"decode": {"every": "x"}}, "'kvdrop.decode.every' must be an int >= 1"),
        ({"decode": {"window": 3}}, "unknown key(s) ['window']"),
        ({"decode": 5}, "'kvdrop.decode' must be null"),
        ({"decode": {"policy": "nope"}}, "decode policy 'nope'"),
    ],
)
def test_bad_overrides_are_refused(model: Transformer, value: object, fragment: str) -> None:
    compressor = DecodeCompressor(model.config, "knorm", budget=40)
    with Engine(model, num_blocks=16, compressor=compressor) as engine:
        with pytest.raises(InvalidRequestError) as info:
            engine.post_completion([5, 6, 7], {"max_tokens": 4, "kvdrop": value})
    assert fragment in str(info.value)


def test_an_override_needs_a_compressor_and_a_budget(model: Transformer) -> None:
    with Engine(model, num_blocks=16) as engine:
        with pytest.raises(InvalidRequestError, match="without one"):
            engine.post_completion([5, 6], {"max_tokens": 4, "kvdrop": {"decode": {}}})
    with Engine(model, num_blocks=16, compressor=DecodeCompressor(model.config)) as engine:
        with pytest.raises(InvalidRequestError, match="needs a policy and a budget"):
            engine.post_completion([5, 6], {"max_tokens": 4, "kvdrop": {"decode": {}}})
        out = engine.generate(
            [5, 6],
            {
                "max_tokens": 40,
                **GREEDY,
                "kvdrop": {"decode": {"policy": "rkv", "budget": 16, "every": 8}},
            },
        )
        assert len(out) == 40 and engine.stats().peak_decode_kv_tokens <= 24


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"spec": "rkv"}, "--decode-policy needs --decode-budget"),
        ({"spec": "rkv", "budget": 0}, "--decode-budget must be an int >= 1"),
        ({"spec": "rkv", "budget": 8, "every": 0}, "--decode-every must be an int >= 1"),
        ({"spec": "kvzip", "budget": 8}, "reconstruction"),
        ({"spec": "nope", "budget": 8}, "--decode-policy nope"),
    ],
)
def test_setup_errors_are_one_line(model: Transformer, kwargs: dict, fragment: str) -> None:
    with pytest.raises(EngineSetupError) as info:
        DecodeCompressor(model.config, **kwargs)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_parse_decode_shapes() -> None:
    assert parse_decode(None) is None
    parsed = parse_decode({"policy": "rkv", "budget": 8})
    assert parsed is not None and (parsed.policy, parsed.budget, parsed.every) == ("rkv", 8, None)
    with pytest.raises(ValueError, match="budget"):
        parse_decode({"budget": True})


def test_engine_cli_cuts_while_decoding(tmp_path: Path) -> None:
    """``kvdrop engine --decode-policy rkv --decode-budget 32 --decode-every 8`` as a
    subprocess: a long completion is served within 40 KV tokens (``/stats``), a request's
    ``"kvdrop": {"decode": null}`` is not cut, and a bad override is a 400 naming the field."""
    from test_cli import EngineProcess

    flags = ["--random-preset", "tiny", "--kv-budget-tokens", "1024"]
    flags += ["--decode-policy", "rkv", "--decode-budget", "32", "--decode-every", "8"]
    proc = EngineProcess(tmp_path, *flags)
    try:
        proc.wait_healthy(timeout=120)
        body = {"prompt": prompt_of(50), "max_tokens": 120, "temperature": 0, "ignore_eos": True}
        reply = requests.post(proc.url + "/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 120
        stats = requests.get(proc.url + "/stats", timeout=10).json()
        assert stats["decode_cuts"] >= 10 and stats["peak_decode_kv_tokens"] <= 40, stats
        whole = {**body, "kvdrop": {"decode": None}}
        assert requests.post(proc.url + "/v1/completions", json=whole, timeout=120).ok
        after = requests.get(proc.url + "/stats", timeout=10).json()
        assert after["decode_cuts"] == stats["decode_cuts"]
        assert after["peak_decode_kv_tokens"] == 50 + 120 - 1
        bad = {**body, "kvdrop": {"decode": {"budget": -1}}}
        refused = requests.post(proc.url + "/v1/completions", json=bad, timeout=30)
        assert refused.status_code == 400 and "kvdrop.decode.budget" in refused.text
        assert proc.stop() == 0
    finally:
        if proc.proc.poll() is None:
            proc.proc.kill()
            proc.proc.wait()
    assert "cut by rkv to 32 tokens every 8" in proc.log()


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--decode-policy", "rkv"], "--decode-policy needs --decode-budget TOKENS"),
        (["--decode-budget", "0"], "--decode-budget must be a positive integer"),
        (["--decode-policy", "nope", "--decode-budget", "8"], "--decode-policy nope"),
    ],
)
def test_engine_cli_refuses_bad_decode_flags(
    flags: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["engine", "--random-preset", "tiny", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("kvdrop engine: error: ") and fragment in err, err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("spec", ["rkv", "knorm"])
def test_decode_graphs_cut_like_the_eager_forward(spec: str) -> None:
    """On a GPU, decode steps replayed from CUDA graphs keep the same query rows and positions
    as eager steps: both engines cut and decode the same tokens."""
    gpu = Transformer.random(preset_config("tiny"), seed=0, device="cuda")
    prompts = [prompt_of(n, 20 + n) for n in (30, 70, 110)]
    params = {"max_tokens": 160, **GREEDY}
    outs = []
    for graphs in (True, False):
        compressor = DecodeCompressor(gpu.config, spec, budget=48, every=16)
        with Engine(gpu, num_blocks=64, compressor=compressor, cuda_graphs=graphs) as engine:
            assert (engine.graphs is not None) is graphs
            streams = [engine.post_completion(p, params) for p in prompts]
            outs.append([[e.token_id for e in s] for s in streams])
            assert engine.stats().decode_cuts >= 3 * 6
    assert outs[0] == outs[1]


def test_a_generation_longer_than_the_budget_fits_when_cut(model: Transformer) -> None:
    """100 + 1000 tokens do not fit a 256-token KV budget whole (RequestTooLargeError), but do
    with a cut while decoding: the request holds at most 64 + 16."""
    compressor = DecodeCompressor(model.config, "knorm", budget=64, every=16)
    params = {"max_tokens": 1000, **GREEDY}
    with Engine(model, kv_budget_tokens=256, compressor=compressor) as engine:
        assert len(engine.generate(prompt_of(100), params)) == 1000
        assert engine.stats().peak_decode_kv_tokens == 80
        with pytest.raises(RequestTooLargeError):
            engine.post_completion(prompt_of(100), {**params, "kvdrop": {"decode": None}})


def test_cut_requests_are_admitted_by_what_they_hold_at_most(model: Transformer) -> None:
    """The long-generation job at tiny shape: eight 20-60-token prompts, 200 tokens each, cut
    to 32 + 16, in 16 blocks of 16. Admitted by their prompts, they outgrow the budget and
    preempt each other (each recompute re-prefills); admitted by what they hold at most
    (``max(prompt, budget + every)``), none is preempted, none holds more than budget + every
    while it decodes, and each decodes what it decodes alone."""
    prompts = [prompt_of(20 + 5 * i, 30 + i) for i in range(8)]
    params = {"max_tokens": 200, **GREEDY}

    def compressor() -> DecodeCompressor:
        return DecodeCompressor(model.config, "knorm", budget=32, every=16)

    with Engine(model, num_blocks=64, compressor=compressor()) as solo:
        want = [solo.generate(p, params) for p in prompts]
    with Engine(model, num_blocks=16, compressor=compressor()) as engine:
        got = _run_together(engine, prompts, [params] * len(prompts))
        st = engine.stats()
    assert got == want
    assert st.preemptions == 0 and st.swaps == 0
    assert st.peak_decode_kv_tokens <= 32 + 16
    assert st.peak_running >= 4  # 3-4 blocks each: four or five run side by side
    assert engine.num_free_blocks == engine.num_blocks


def _run_together(engine: Engine, prompts: list[list[int]], params: list[dict]) -> list[list[int]]:
    """Each prompt's generated token ids, all submitted before the loop's first step (one
    schedule) and read on threads of their own."""
    with engine._cv:
        streams = [engine.post_completion(p, q) for p, q in zip(prompts, params, strict=True)]
    got: list[list[int]] = [[] for _ in prompts]
    readers = [
        threading.Thread(target=lambda i=i: got[i].extend(e.token_id for e in streams[i]))
        for i in range(len(prompts))
    ]
    for r in readers:
        r.start()
    for r in readers:
        r.join(240)
    return got
