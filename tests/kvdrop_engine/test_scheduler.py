"""Scheduler: admission in FIFO order over the block budget, and one step's plan."""

from __future__ import annotations

import queue
import random
import threading
from concurrent.futures import Future

import pytest

from kvdrop_engine.paged import BlockAllocator
from kvdrop_engine.sampling import SamplingParams
from kvdrop_engine.scheduler import (
    Scheduler,
    budget_blocks,
    client_of,
    kv_client_of,
    plan_step,
    prefill_cost,
    prefill_shares,
)
from kvdrop_engine.sequence import LoadState, Request
from kvdrop_sdk.edit import edit_salt


def req(rid: int, prompt_len: int, computed: int = 0, output: list[int] | None = None) -> Request:
    r = Request(rid, list(range(1, prompt_len + 1)), SamplingParams(), "", queue.Queue(),
                None, None)  # fmt: skip
    r.num_computed, r.output = computed, list(output or [])
    return r


def test_plan_step_puts_decodes_first_and_caps_prefill_tokens() -> None:
    a = req(0, 10, 0, [])  # prefilling, 10 tokens
    b = req(1, 4, 5, [7])  # decoding: prompt + 1 generated token computed
    c = req(2, 6, 2, [])  # prefilling, 4 tokens left
    plan = plan_step([c, a, b], max_prefill_tokens=12, max_client_prefill_tokens=0)
    assert [s.seq_id for s in plan.seqs] == [1, 0, 2]
    assert plan.tokens[:1] == [7] and plan.positions[:1] == [5]
    assert (plan.num_decode, plan.num_prefill) == (1, 12)
    # no cap: first come, first served (by request id, not batch order): a's whole prompt, then c
    assert plan.stepped == [(b, 1), (a, 10), (c, 2)]
    assert plan.sampled == [b, a]  # a's prompt ends in this step, c's does not
    assert plan.sample_rows == [0, 10]


def test_prefill_shares_serve_the_oldest_then_short_prompts_then_first_come() -> None:
    clients = {"a", "b", "c", "d", "e"}
    # the oldest, then those that end within the cap (short ones pass), then arrival order
    assert prefill_shares([("a", 3000), ("b", 16), ("c", 3000), ("d", 16)], clients, 128, 32) == [
        32, 16, 32, 16,
    ]  # fmt: skip
    assert prefill_shares([("a", 50), ("b", 50), ("c", 50)], clients, 128, 64) == [50, 50, 28]
    assert prefill_shares([("a", 50), ("b", 50), ("c", 50)], clients, 128, 32) == [32, 32, 32]
    # a client's wants share its cap: the tenant's first request takes it, the second waits
    assert prefill_shares([("a", 500), ("a", 500), ("b", 30)], clients, 128, 64) == [64, 0, 30]
    # alone (or no cap) the oldest may take the whole budget: vLLM's first-come chunked prefill
    assert prefill_shares([("a", 500), ("a", 16)], {"a"}, 128, 32) == [128, 0]
    assert prefill_shares([("a", 500), ("b", 16)], clients, 128, None) == [128, 0]
    assert prefill_shares([("a", 100), ("b", 16)], clients, 128, None) == [100, 16]
    assert prefill_shares([], clients, 5, 2) == []


def test_the_client_cap_counts_attention_work_not_rows() -> None:
    kpt = 288.0  # the tiny preset's ModelConfig.attention_keys_per_token
    assert prefill_cost(2900, 32, None) == 32  # without a model's ratio: rows
    assert prefill_cost(0, 32, kpt) == 32 + 32 * 33 / 2 / kpt
    assert prefill_cost(2900, 32, kpt) == pytest.approx(32 + (32 * 2900 + 32 * 33 / 2) / kpt)
    clients = {"hostile", "good"}
    # the same 32-token cap: rows at a long prompt's start nearly all fit, rows deep in it few,
    # and what they cost stays within the cap; the good client's short prompt is not touched
    start, deep = (
        prefill_shares([("hostile", 3000), ("good", 16)], clients, 128, 32, [k, 0], kpt)
        for k in (0, 2900)
    )
    assert start == [30, 16] and deep == [2, 16]
    assert prefill_cost(2900, deep[0], kpt) <= 32 < prefill_cost(2900, deep[0] + 1, kpt)
    # alone, the budget counts rows: a client's own long prompt is not slowed
    assert prefill_shares([("hostile", 3000)], {"hostile"}, 128, 32, [2900], kpt) == [128]
    # a row costlier than the whole cap still gets one row a step: nothing starves
    assert prefill_shares([("a", 500), ("b", 16)], clients, 128, 32, [50_000, 0], kpt) == [1, 16]
    # the order asks the cost too: a short prompt deep in its cache no longer passes as short
    order = prefill_shares([("a", 3000), ("b", 8), ("c", 20)], {"a", "b", "c"}, 64, 32,
                           [0, 20_000, 0], kpt)  # fmt: skip
    assert order == [30, 1, 20]  # c's whole prompt before b's first row


def test_plan_step_costs_each_row_by_the_keys_it_attends() -> None:
    deep = req(0, 3000, 2900)  # a tenant's scoring-sized prompt, 100 rows left
    deep.cache_salt = "hostile"
    good = req(1, 16)
    plan = plan_step([deep, good], max_prefill_tokens=128, max_client_prefill_tokens=32,
                     keys_per_token=288.0)  # fmt: skip
    assert plan.stepped == [(deep, 2), (good, 16)]
    rows = plan_step([deep, good], max_prefill_tokens=128, max_client_prefill_tokens=32)
    assert rows.stepped == [(deep, 32), (good, 16)]  # counted in rows: 16 times the work


def _prefill_until_done(
    reqs: list[Request], budget: int, admit: dict[int, list[Request]] | None = None
) -> dict[int, int]:
    """Steps ``reqs`` (prompts prefilled, then one decode a step, as the engine does; ``admit``:
    requests joining the batch at a step) until every prompt is prefilled; the step each one
    got its first token in, by request id."""
    batch, first, step = list(reqs), {}, 0
    while any(r.prefilling for r in batch):
        step += 1
        batch += (admit or {}).get(step, [])
        plan = plan_step(batch, max_prefill_tokens=budget)
        for r, n in plan.stepped:
            r.num_computed += n
        for r in plan.sampled:
            r.output.append(7)
            first.setdefault(r.rid, step)
    return first


def test_first_come_first_served_and_later_admissions_do_not_delay_earlier_prompts() -> None:
    """Issue 34 (H200 burst, snapkv's median TTFT 1.017x the baseline's): with the prompt
    tokens shared max-min fairly, every long prompt of a burst got its first token at about
    the same late step, and requests admitted into the memory a cut freed thinned the shares
    of those still prefilling. Now the prompts end in arrival order, about four at once (the
    cap is a quarter of the step), and requests admitted later do not move an earlier one's
    first token."""
    alone = _prefill_until_done([req(k, 1000) for k in range(8)], 128)
    # four at once, 32 tokens (the cap) each a step: the first four in step 32, not all in 63
    assert [alone[k] for k in range(8)] == [32, 32, 32, 32, 63, 63, 63, 64]
    late = {10: [req(100 + k, 1000) for k in range(4)], 30: [req(200 + k, 1000) for k in range(4)]}
    joined = _prefill_until_done([req(k, 1000) for k in range(8)], 128, late)
    assert {k: joined[k] for k in range(8)} == alone
    assert min(joined[r.rid] for rs in late.values() for r in rs) > alone[7]


def test_a_short_prompt_is_not_prefilled_after_a_long_ones_whole_prompt() -> None:
    """Issue 33: 16 requests of 1,000 prompt tokens ahead of a 16-token one (prompt_logprobs
    clients): the short one was prefilled after all of theirs (in step 126, at 128 tokens a
    step); with max-min fair shares in step 3; now in step 1: a prompt that ends within its
    client's cap passes the long ones, which are served first come, first served, 32 tokens
    (the cap) each."""
    longs = [req(k, 1000) for k in range(16)]
    short = req(16, 16)
    plan = plan_step([*longs, short], max_prefill_tokens=128)
    assert plan.num_prefill == 128 and short in plan.sampled
    assert [(r.rid, n) for r, n in plan.stepped] == [(0, 32), (1, 32), (2, 32), (3, 16), (16, 16)]


def test_one_clients_prompts_get_at_most_its_cap_in_a_step_beside_another_clients_work() -> None:
    """Issue 33 (soak p99): one client's prompt tokens are work on the one loop. Sixteen
    1,000-token prompts under one ``cache_salt`` beside another client's decode took the whole
    2,048-token step (each its own fair share); now that client gets the cap (a quarter of the
    step by default), its requests served first come, first served, and alone it still gets
    the whole budget."""
    hostile = [req(k, 1000) for k in range(16)]
    for r in hostile:
        r.cache_salt = "tenant-h"
    good = req(16, 4, 5, [7])  # decoding
    plan = plan_step([*hostile, good], max_prefill_tokens=2048)
    assert plan.num_decode == 1
    assert plan.num_prefill == 2048 // 4
    assert [(r.rid, n) for r, n in plan.stepped if r is not good] == [(0, 512)]
    # an unsalted request is a client of its own: capped beside others too
    long, short = req(17, 3000), req(18, 16)
    plan = plan_step([long, short, good], max_prefill_tokens=2048)
    assert dict((r.rid, n) for r, n in plan.stepped) == {16: 1, 17: 512, 18: 16}
    # alone, or with the cap off, the budget is not held back
    assert plan_step(hostile, max_prefill_tokens=2048).num_prefill == 2048
    assert plan_step([*hostile, good], 2048, max_client_prefill_tokens=0).num_prefill == 2048


def test_a_tenants_edited_streams_are_its_own_client_not_each_another() -> None:
    """Issue 31 (the pipelined job): an SDK stream decodes its edited KV under a salt of its own
    (``edit_salt``: ``"job.edit.<id>"``). Each such stream counted as a client apart, so while
    any decoded, the tenant's other prompts (and kvzip passes) got the per-client cap, a
    quarter of the step, and its memory share was the budget over the number of streams. They
    are one tenant: its prompts get the whole budget and its blocks one share."""
    prefilling = [_salted(k, 1000, "job") for k in range(4)]
    decoding = [_salted(4 + k, 64, edit_salt("job", f"stream{k}"), 65) for k in range(3)]
    plan = plan_step([*prefilling, *decoding], max_prefill_tokens=2048)
    assert plan.num_decode == 3
    assert plan.num_prefill == 2048  # on main: 512, the cap of the client "job"
    assert {kv_client_of(r) for r in [*prefilling, *decoding]} == {"job"}
    # another tenant is still a client apart, and capped beside the job
    other = _salted(7, 1000, "other")
    plan = plan_step([*prefilling, *decoding, other], max_prefill_tokens=2048)
    assert dict((r.rid, n) for r, n in plan.stepped if n > 1) == {0: 512, 7: 512}
    # an unsalted stream's edit salt is unsalted: one request, one client
    lone = _salted(8, 1000, edit_salt("", "s"))
    assert kv_client_of(lone) == "" and client_of(lone) == ("rid", 8)
    sched = Scheduler(BlockAllocator(64), 16, 16, threading.Lock())
    sched.running.update({r.rid: r for r in [*prefilling, *decoding]})
    for r in sched.running.values():
        r.blocks = sched.allocator.allocate(2)
    sched.waiting.append(other)
    assert sched.kv_excess() == {"job": 14 - 32.0, "other": -32.0}


def test_admission_is_fifo_and_the_head_waits_for_its_blocks() -> None:
    sched = Scheduler(BlockAllocator(3), 16, 8, threading.Lock())
    big, small, tiny = req(0, 30), req(1, 20), req(2, 4)  # prompts of 2, 2 and 1 blocks
    sched.waiting.extend([big, small, tiny])
    assert sched.admit() == [big] and len(big.blocks) == 2  # its prompt, not its max_tokens
    assert sched.admit() == []  # small needs 2 blocks, 1 is free: it waits, tiny does not pass
    assert sched.has_work(io_ok=True)  # big is runnable
    sched.finish(big)
    assert sched.admit() == [small, tiny] and sched.allocator.num_free == 0


def test_a_short_request_passes_a_head_that_waits_but_never_starves_it() -> None:
    """Issue 33: a 3,000-token request waiting for the blocks of running ones held every short
    request behind it (good clients' p99 4x). A later request of another client passes it when
    its blocks are free and the peaks of those that passed leave the head its blocks once the
    requests running before it end; the head's own client does not pass it (first come, first
    served within a client, so passers do not preempt a one-client job's running requests)."""
    sched = Scheduler(BlockAllocator(20), 16, 64, threading.Lock())
    running = req(0, 160)  # 10 blocks
    head = req(1, 150)  # 10 blocks of prompt (peak 11: 150 + 16 - 1 tokens)
    head.cache_salt = "tenant"
    same = req(10, 8)  # the head's client: it waits behind the head
    same.cache_salt = "tenant"
    shorts = [req(2 + k, 8) for k in range(8)]  # 1 block each, peak 2 (8 + 16 - 1 tokens)
    sched.waiting.append(running)
    assert sched.admit() == [running]
    running.num_computed = 160
    sched.allocator.allocate(1)  # one block taken (by growth, say): the head does not fit
    sched.waiting.extend([head, same])
    assert sched.admit() == []
    sched.waiting.remove(same)
    sched.waiting.extend(shorts)
    admitted = sched.admit()
    # 20 - 10 (the head's admission) = 10 blocks of passers' peaks: five shorts (2 each).
    assert admitted == shorts[:5] and list(sched.waiting) == [head, *shorts[5:]]
    sched.finish(shorts[0])  # one ends: its peak no longer counts, one more passes
    assert sched.admit() == [shorts[5]]
    sched.finish(running)  # the request that ran before the head ends: the head fits
    assert sched.admit()[0] is head


def test_decodes_grow_and_the_newest_request_is_preempted_when_blocks_run_out() -> None:
    sched = Scheduler(BlockAllocator(4), 16, 8, threading.Lock())
    old, new = req(0, 16), req(1, 16)
    sched.waiting.extend([old, new])
    assert sched.admit() == [old, new]  # one block each
    for r in (old, new):  # both prefilled, one token out: the next decode writes token 16
        r.num_computed, r.output = 16, [7]
    assert sched.grow() == [] and (len(old.blocks), len(new.blocks)) == (2, 2)
    for r in (old, new):  # 16 tokens later both need a third block; 0 are free
        r.num_computed, r.output = 32, [7] * 17
    assert sched.grow() == [(new, 32)]  # the newest gives its blocks back ...
    assert len(old.blocks) == 3 and list(sched.running) == [0]
    assert list(sched.waiting) == [new] and new.preempted and new.num_computed == 0
    assert new.prefilling and new.prefill_tokens == new.prompt + [7] * 16  # ... recomputed
    assert sched.admit() == []  # it needs 3 blocks for its 32 tokens; 1 is free


def _serve(salt: str, steps: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """A random single-client workload (every request with ``cache_salt`` ``salt``) over 24
    blocks of 4 tokens, stepped as the engine does (admit, grow and reclaim, one planned step,
    finish);
    the preempted and the admitted request ids, in order."""
    rng = random.Random(seed)
    sched = Scheduler(BlockAllocator(24), 4, 8, threading.Lock())
    victims: list[int] = []
    admitted: list[int] = []
    rid = 0
    for _ in range(steps):
        for _ in range(rng.choice([0, 0, 1, 2])):
            n, m = rng.randint(1, 30), rng.randint(1, 40)
            r = Request(rid, [1] * n, SamplingParams(max_tokens=m), salt, queue.Queue(),
                        None, None)  # fmt: skip
            sched.waiting.append(r)
            rid += 1
        line = [r.rid for r in sched.waiting]
        got = [r.rid for r in sched.admit()]
        assert got == line[: len(got)], "one client: admitted in the waiting line's order"
        admitted += got
        victims += [r.rid for r, _ in sched.grow() + sched.reclaim()]
        plan = plan_step(sched.runnable(), 16)
        for r, n in plan.stepped:
            r.num_computed += n
        for r in plan.sampled:
            r.output.append(7)
            if len(r.output) == r.params.max_tokens:
                sched.finish(r)
    return victims, admitted


def test_one_client_keeps_the_newest_victim_and_first_come_admission() -> None:
    """The KV share changes nothing for one client, and within a client admission is first come,
    first served (``_serve`` checks each step that the admitted requests are the waiting line's
    first): every request unsalted (together one client) or under one salt, the victims and the
    admission order are pinned (the newest running request preempted). Recorded on main after
    f7d9cff, when requests stopped passing a waiting head of their own client: 7 preemptions in
    50 steps where passing made 22."""
    victims, admitted = _serve("", 50)
    assert victims == [4, 3, 3, 3, 8, 7, 9]
    assert admitted == [0, 1, 2, 3, 4, 3, 3, 3, 4, 5, 6, 7, 8, 7, 8, 9]
    # one salt: the prefill shares differ from unsalted requests' (one client, not many)
    victims, admitted = _serve("tenant", 50)
    assert victims == [4, 4, 3, 3, 8, 7, 7, 7, 9, 8]
    assert admitted == [0, 1, 2, 3, 4, 4, 3, 3, 4, 5, 6, 7, 8, 7, 7, 7, 8, 9]


def _salted(rid: int, prompt_len: int, salt: str, computed: int = 0) -> Request:
    r = req(rid, prompt_len, computed, [7] if computed else [])
    r.cache_salt = salt
    return r


def test_kv_memory_is_shared_per_client_in_preemption_and_admission() -> None:
    """Issue 33 (soak p99 3.3-5.0x): the newest running request was the victim, in the hostile
    phase most often a good client's short one, and a hostile client's preempted request went
    first in line. Now the victim is the newest request of the client holding the most blocks
    above its fair share (the budget over the clients with work), and a client under its share
    is admitted first."""
    sched = Scheduler(BlockAllocator(8), 4, 8, threading.Lock())
    h0, h1 = _salted(0, 12, "heavy"), _salted(1, 12, "heavy")  # 3 blocks each
    light = _salted(2, 3, "light")  # 1 block, the newest; its next token fits
    sched.waiting.extend([h0, h1])
    assert sched.admit() == [h0, h1]
    sched.waiting.append(light)
    assert sched.admit() == [light]
    for r in (h0, h1, light):  # prefilled, one token out; the heavy ones need a 4th block
        r.num_computed, r.output = len(r.prompt), [7]
    assert sched.kv_excess() == {"heavy": 2.0, "light": -3.0}  # 6 and 1 of 8 blocks, share 4
    # h0 takes the last free block, h1 needs one: the heavy client's newest goes
    assert sched.grow() == [(h1, 12)]  # on main: [(light, 3)], and h1 grew into its block
    assert list(sched.running) == [0, 2] and list(sched.waiting) == [h1]

    # admission: the heavy client holds 6 of 8 blocks; its request heads the line, 2 are free
    sched = Scheduler(BlockAllocator(8), 4, 8, threading.Lock())
    sched.waiting.append(_salted(0, 24, "heavy"))
    assert len(sched.admit()[0].blocks) == 6
    h1, light = _salted(1, 8, "heavy"), _salted(2, 8, "light")  # 2 blocks each
    sched.waiting.extend([h1, light])
    assert sched.admit() == [light]  # on main: [h1]
    assert list(sched.waiting) == [h1]
    # the unsalted requests are one client too: beside the heavy one, under its share
    sched.finish(light)
    anonymous = req(3, 8)
    sched.waiting.append(anonymous)
    assert sched.reclaim() == [] and sched.admit() == [anonymous]

    # the heavy client holds every block: a light request reclaims what it needs from the
    # heavy client's newest (on main it waits until a heavy request ends)
    sched = Scheduler(BlockAllocator(8), 4, 8, threading.Lock())
    h0, h1 = _salted(0, 16, "heavy"), _salted(1, 16, "heavy")  # 4 blocks each
    sched.waiting.extend([h0, h1])
    assert sched.admit() == [h0, h1] and sched.allocator.num_free == 0
    light = _salted(2, 8, "light")
    sched.waiting.append(light)
    assert sched.reclaim() == [(h1, 0)] and sched.admit() == [light]
    assert list(sched.waiting) == [h1]  # it would take the heavy client over its share (4)
    # a request that would take its client over its share reclaims nothing
    later = _salted(3, 12, "light")  # 3 blocks; 2 are free; light holds 2 of its 4
    sched.waiting.append(later)
    assert sched.reclaim() == [] and sched.admit() == []


def test_the_oldest_running_request_is_never_the_victim_while_another_may_go() -> None:
    """A client over its share whose only request is the oldest running one keeps it (so it
    ends, and every request after it: none starves); the newest of the next client goes."""
    sched = Scheduler(BlockAllocator(6), 4, 8, threading.Lock())
    big = _salted(0, 16, "heavy")  # 4 blocks, the oldest
    a, b = _salted(1, 3, "light"), _salted(2, 3, "light")  # their next token fits
    sched.waiting.append(big)
    assert sched.admit() == [big]
    sched.waiting.extend([a, b])
    assert sched.admit() == [a, b]
    for r in (big, a, b):
        r.num_computed, r.output = len(r.prompt), [7]
    assert sched.kv_excess()["heavy"] > 0
    assert sched.grow() == [(b, 3)]  # big needs a 5th block: the light client's newest goes
    assert list(sched.running) == [0, 1] and len(big.blocks) == 5


def test_cancelled_requests_are_dropped_unless_their_prefix_is_being_copied() -> None:
    sched = Scheduler(BlockAllocator(8), 16, 8, threading.Lock())
    copying, queued = req(0, 4), req(1, 4)
    sched.waiting.extend([copying, queued])
    sched.admit()
    for r, state in ((copying, LoadState.COPY), (queued, LoadState.QUEUED)):
        r.loading, r.load_state, r.cancelled = Future(), state, True
    sched.drop_cancelled()
    assert list(sched.running) == [0]  # the copy is still writing into its blocks
    assert queued.load_state is LoadState.ABANDONED and queued.blocks == ()


def test_budget_blocks_rounds_down_and_refuses_both_or_too_small() -> None:
    assert budget_blocks(None, 100, 16) == 6
    assert budget_blocks(5, None, 16) == 5
    with pytest.raises(ValueError, match="not both"):
        budget_blocks(5, 100, 16)
    with pytest.raises(ValueError, match="kv_budget_tokens"):
        budget_blocks(None, 8, 16)
