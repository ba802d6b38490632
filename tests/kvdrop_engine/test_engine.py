"""Engine: continuous batching over a KV budget gives each request the output of a lone run."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from collections.abc import Sequence

import pytest
import torch

from kvdrop_engine.engine import Engine, _stop_running_engines
from kvdrop_engine.errors import EngineError, InvalidRequestError, RequestTooLargeError
from kvdrop_engine.loading import preset_config
from kvdrop_engine.model import Transformer, generate
from kvdrop_engine.sampling import SamplingParams

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model() -> Transformer:
    return Transformer.random(preset_config("tiny"), seed=0)


def prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=gen).tolist()
    return [torch.randint(3, 512, (k,), generator=gen).tolist() for k in lens]


def run_threads(engine: Engine, ps: Sequence[list[int]], params: dict) -> list[list[int]]:
    """Submit every prompt from its own thread, all released at once."""
    outs: list[list[int]] = [[] for _ in ps]
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(ps))

    def worker(i: int) -> None:
        try:
            barrier.wait()
            outs[i] = engine.generate(ps[i], params)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(ps))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return outs


def test_greedy_equals_generate_alone(model: Transformer) -> None:
    (p,) = prompts(1, 40, 40)
    with Engine(model, num_blocks=16, block_size=16, max_prefill_tokens=16) as eng:
        events = list(eng.post_completion(p, {**GREEDY, "max_tokens": 12}))
    assert [e.token_id for e in events] == generate(model, p, 12, stop_at_eos=False)
    assert [e.finish_reason for e in events] == [None] * 11 + ["length"]
    assert all(e.text == "" for e in events)


def test_eight_threads_tight_budget_match_alone(model: Transformer) -> None:
    ps = prompts(8, 20, 120, seed=1)
    refs = [generate(model, p, 16, stop_at_eos=False) for p in ps]
    # 12 blocks of 16 tokens: room for two or three of these requests at a time.
    with Engine(model, num_blocks=12, block_size=16, max_prefill_tokens=64) as eng:
        outs = run_threads(eng, ps, {**GREEDY, "max_tokens": 16})
        st = eng.stats()
        assert eng.num_free_blocks == 12  # every block came back
    assert outs == refs  # also the preempted ones, recomputed
    assert 2 <= st.peak_running < 8  # requests waited for admission...
    assert st.peak_waiting >= 4  # ...in line
    assert st.requests_finished == 8
    assert st.prefill_tokens_computed == sum(map(len, ps)) + st.recomputed_tokens
    assert st.decode_tokens_computed == 8 * 15


def test_eight_threads_roomy_budget_run_together(model: Transformer) -> None:
    ps = prompts(8, 30, 60, seed=2)
    refs = [generate(model, p, 10, stop_at_eos=False) for p in ps]
    with Engine(model, num_blocks=64, block_size=16) as eng:
        outs = run_threads(eng, ps, {**GREEDY, "max_tokens": 10})
    assert outs == refs


def test_budget_fitting_half_halves_concurrency(model: Transformer) -> None:
    ps = prompts(8, 48, 48, seed=3)  # each needs (48 + 17 - 1) / 16 = 4 blocks
    with Engine(model, num_blocks=16, block_size=16) as eng:
        assert eng.blocks_for(48, 17) == 4
        run_threads(eng, ps, {**GREEDY, "max_tokens": 17})
        half = eng.stats()
    with Engine(model, num_blocks=32, block_size=16) as eng:
        run_threads(eng, ps, {**GREEDY, "max_tokens": 17})
        full = eng.stats()
    # Admission takes a prompt's 3 blocks (five fit 16); decodes grow to 4 blocks each, so four
    # run at a time and a fifth admitted one is preempted (and recomputed).
    assert 4 <= half.peak_running <= 5 and half.peak_blocks_used == 16
    assert full.peak_running == 8 and full.preemptions == 0
    assert half.steps > full.steps  # two waves of decodes instead of one


def test_request_too_big_is_rejected_at_submit(model: Transformer) -> None:
    with Engine(model, kv_budget_tokens=64, block_size=16) as eng:
        with pytest.raises(RequestTooLargeError, match=r"needs .* 5 blocks .* budget is 4 blocks"):
            eng.post_completion(list(range(3, 63)), {**GREEDY, "max_tokens": 10})
        # the engine keeps serving requests that fit
        assert len(eng.generate(list(range(3, 40)), {**GREEDY, "max_tokens": 5})) == 5


def test_freed_blocks_are_reused(model: Transformer) -> None:
    """Twenty requests pass through a budget that holds one at a time."""
    ps = prompts(20, 30, 30, seed=4)
    with Engine(model, num_blocks=3, block_size=16) as eng:
        for p in ps:
            assert eng.generate(p, {**GREEDY, "max_tokens": 8}) == generate(
                model, p, 8, stop_at_eos=False
            )
            assert eng.num_free_blocks == 3
        st = eng.stats()
    assert st.requests_finished == 20 and st.peak_running == 1


def test_sampling_seed_top_k_and_stops(model: Transformer) -> None:
    (p,) = prompts(1, 20, 20, seed=5)
    sampled = {"temperature": 1.5, "top_p": 0.95, "ignore_eos": True, "max_tokens": 20}
    with Engine(model, num_blocks=16) as eng:
        a = eng.generate(p, {**sampled, "seed": 7})
        b = eng.generate(p, {**sampled, "seed": 7})
        c = eng.generate(p, {**sampled, "seed": 8})
        greedy = eng.generate(p, {**GREEDY, "max_tokens": 20})
        top1 = eng.generate(
            p, {"temperature": 1.0, "top_k": 1, "ignore_eos": True, "max_tokens": 20}
        )
        assert a == b and a != c
        assert top1 == greedy
        stop_at = greedy[5]
        first = greedy.index(stop_at)
        ev = list(eng.post_completion(p, {**GREEDY, "max_tokens": 20, "stop_token_ids": [stop_at]}))
        assert [e.token_id for e in ev] == greedy[: first + 1]
        assert ev[-1].finish_reason == "stop"


def test_eos_stops_unless_ignored() -> None:
    cfg = preset_config("tiny")
    m = Transformer.random(cfg, seed=0)
    (p,) = prompts(1, 10, 10, seed=6)
    ref = generate(m, p, 10, stop_at_eos=False)
    cfg.eos_token_ids = (ref[3],)  # make the 4th greedy token an EOS
    with Engine(m, num_blocks=8) as eng:
        stopped = eng.generate(p, {"temperature": 0, "max_tokens": 10})
        ignored = eng.generate(p, {"temperature": 0, "max_tokens": 10, "ignore_eos": True})
    assert stopped == ref[: ref.index(ref[3]) + 1]
    assert ignored == ref


def test_text_from_tokenizer(model: Transformer) -> None:
    class Tok:
        def decode(self, ids: Sequence[int]) -> str:
            return "".join(f"<{i}>" for i in ids)

    (p,) = prompts(1, 8, 8, seed=7)
    with Engine(model, tokenizer=Tok(), num_blocks=8) as eng:
        ev = list(eng.post_completion(p, {**GREEDY, "max_tokens": 6}))
    assert "".join(e.text for e in ev) == Tok().decode([e.token_id for e in ev])


def test_text_of_multibyte_characters_split_over_tokens(model: Transformer) -> None:
    """Byte-level tokens: a character split over several tokens is emitted once complete."""

    class ByteTok:
        def decode(self, ids: Sequence[int]) -> str:
            return bytes(i % 256 for i in ids).decode("utf-8", errors="replace")

    (p,) = prompts(1, 8, 8, seed=7)
    with Engine(model, tokenizer=ByteTok(), num_blocks=8) as eng:
        ev = list(eng.post_completion(p, {**GREEDY, "max_tokens": 24}))
    ids = [e.token_id for e in ev]
    assert "".join(e.text for e in ev) == ByteTok().decode(ids)
    assert not any(e.text.endswith("\ufffd") for e in ev[:-1] if e.text)


def test_bad_requests_raise_typed_errors(model: Transformer) -> None:
    with Engine(model, num_blocks=8) as eng:
        for bad, match in [
            ({"max_tokens": 0}, "max_tokens"),
            ({"temperature": -1}, "temperature"),
            ({"top_p": 0}, "top_p"),
            ({"best_of": 2}, "unsupported sampling parameter"),
            ({"stop_token_ids": ["x"]}, "stop_token_ids"),
        ]:
            with pytest.raises(InvalidRequestError, match=match):
                eng.post_completion([5, 6], bad)
        with pytest.raises(InvalidRequestError, match="empty"):
            eng.post_completion([], {})
        with pytest.raises(InvalidRequestError, match=r"prompt_token_ids\[1\] = 600 is outside"):
            eng.post_completion([5, 600], {})
        with pytest.raises(InvalidRequestError, match="list of ints"):
            eng.post_completion("hello", {})  # type: ignore[arg-type]
        assert eng.stats().requests_admitted == 0
    with pytest.raises(InvalidRequestError, match="num_blocks or kv_budget_tokens"):
        Engine(model, num_blocks=4, kv_budget_tokens=64)
    assert SamplingParams.from_dict({"max_tokens": 3, "stream": True}).max_tokens == 3


def test_closing_the_iterator_cancels_and_frees(model: Transformer) -> None:
    (p,) = prompts(1, 20, 20, seed=8)
    with Engine(model, num_blocks=8) as eng:
        it = eng.post_completion(p, {**GREEDY, "max_tokens": 50})
        next(it)
        it.close()
        # the next request still runs, and the cancelled one's blocks come back
        assert len(eng.generate(p, {**GREEDY, "max_tokens": 3})) == 3
        assert eng.num_free_blocks == 8


def test_stop_fails_running_and_waiting_requests(model: Transformer) -> None:
    (p,) = prompts(1, 20, 20, seed=9)
    eng = Engine(model, num_blocks=64, block_size=16)
    eng.start()
    first = eng.post_completion(p, {**GREEDY, "max_tokens": 1000})  # reserves 64 blocks
    second = eng.post_completion(p, {**GREEDY, "max_tokens": 12})  # waits for first's blocks
    next(first)
    eng.stop()
    with pytest.raises(EngineError, match="stopped"):
        list(first)
    with pytest.raises(EngineError, match="stopped"):
        list(second)
    assert eng.num_free_blocks == 64


def test_engines_never_stopped_are_stopped_at_exit(model: Transformer) -> None:
    engine = Engine(model)
    first = engine.generate([5, 6, 7], {"max_tokens": 2, **GREEDY})
    thread = engine._thread
    assert thread is not None and thread.is_alive()
    _stop_running_engines()  # what atexit runs
    assert not thread.is_alive()
    # as after stop(): a new request starts the loop again
    assert engine.generate([5, 6, 7], {"max_tokens": 2, **GREEDY}) == first
    engine.stop()


def test_a_program_that_never_stops_its_engine_exits_cleanly() -> None:
    """Without stop() the loop thread died at interpreter teardown inside a torch call: exit code
    134 every time the program ended while a request was running, about half the time when
    idle. Both programs must exit 0."""
    program = textwrap.dedent(
        """
        from kvdrop_engine.engine import Engine
        from kvdrop_engine.loading import preset_config
        from kvdrop_engine.model import Transformer

        engine = Engine(Transformer.random(preset_config("tiny"), seed=0))
        print(engine.generate([1, 2, 3], {"max_tokens": 4, "temperature": 0}))
        if BUSY:  # leave with a long request still decoding
            events = engine.post_completion([1, 2, 3], {"max_tokens": 4000, "ignore_eos": True})
            print(next(iter(events)).token_id)
        """
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", f"BUSY = {busy}\n{program}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for busy in (True, False)
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err.decode()[-2000:]
        assert out.decode().startswith("[")


def test_stats_count_decode_only_steps_and_the_tokens_they_read(model: Transformer) -> None:
    with Engine(model, kv_budget_tokens=256, block_size=16) as engine:
        engine.reset_stats()
        out = engine.generate(list(range(3, 13)), {**GREEDY, "max_tokens": 5})
        st = engine.stats()
    assert len(out) == 5
    # One prefill step (10 prompt tokens, first token), then 4 decode-only steps reading the
    # 11th, 12th, 13th and 14th token's cache.
    assert st.steps == 5 and st.decode_only_steps == 4
    assert st.decode_kv_tokens == 11 + 12 + 13 + 14
    assert st.decode_step_seconds > 0 and st.graph_capture_seconds == 0  # no CUDA graphs on CPU
    assert engine.graphs is None


def test_gpu_options_need_a_gpu(model: Transformer) -> None:
    with pytest.raises(InvalidRequestError, match="cuda_graphs=True"):
        Engine(model, cuda_graphs=True)
    with pytest.raises(InvalidRequestError, match="fused_ops=True"):
        Engine(model, fused_ops=True)
