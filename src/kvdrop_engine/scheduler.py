"""Admission and step planning: who runs, what a prompt loads and stores, what one step computes.

On admission :func:`plan_prefix` decides what a request loads from the cache server and what it
stores after prefill (:func:`plan_recompute` when the server cannot be asked), for the engine's
query capture; :func:`follow` applies that decision to the request. (Which query rows a request
keeps was decided at submission: :mod:`kvdrop_engine.plan`.)

Admission takes the blocks of a request's prompt; each decode step grows it by the block its
next token needs (:meth:`Scheduler.grow`), and when the budget runs out a running request is
preempted and later recomputed (vLLM's recompute), so one request whose ``max_tokens`` is the
whole budget does not make every other wait until it ends. The KV budget is shared per client
(:func:`kv_client_of`: one ``cache_salt``, with the SDK's edit salts of its streams; the unsalted
requests together are one) by one rule,
:meth:`Scheduler.kv_excess`, that both ask: the victim is the newest request of the client that
holds the most blocks above its fair share, a waiting request that keeps its client within its
share is admitted before those that do not, and reclaims its blocks from clients over theirs
when they are not free. With one client (every request unsalted, or one salt) that is vLLM's
rule: the newest request is the victim, first come, first served. A request that waits for
blocks keeps its place at the head of the line (a preempted one goes first); a later request may
pass it only when its blocks are free now and its peak, with the peaks of the others that passed
this head, leaves the head its blocks once the requests running before it end (so a short
request does not wait behind a 3,000-token one that waits for others, and the head is never
starved). :func:`plan_step` puts every admitted request in one
step: decodes first (one token each), then prompt chunks, ``max_prefill_tokens`` in all, in
:func:`prefill_shares`' order (first come, first served, short prompts passing long ones, a
per-client cap).

The :class:`Scheduler` is not thread-safe by itself: the engine calls it under its condition.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import Tensor

from kvdrop_engine.connectors.base import KVConnector
from kvdrop_engine.errors import EngineError, RequestTooLargeError
from kvdrop_engine.paged import BlockAllocator, SeqStep, blocks_needed
from kvdrop_engine.sampling import finish_reason
from kvdrop_engine.sequence import LoadState, Request
from kvdrop_sdk.protocol import tenant_salt
from kvdrop_sdk.query_capture import QueryCapture
from kvdrop_sdk.validate import positive_int

if TYPE_CHECKING:
    from kvdrop_engine.decode_cut import KVSwap

__all__ = [
    "CLIENT_PREFILL_SHARE",
    "DEFAULT_BUDGET_TOKENS",
    "SCORE_ROWS_PER_STEP",
    "PrefixPlan",
    "Scheduler",
    "StepPlan",
    "budget_blocks",
    "client_of",
    "client_prefill_cap",
    "decoded_store_upto",
    "follow",
    "keys_before",
    "kv_client_of",
    "plan_prefix",
    "plan_recompute",
    "plan_step",
    "prefill_cost",
    "prefill_shares",
    "prefill_within",
]

#: Rows of log-probabilities (each ``[V]`` floats) scoring requests compute per step, all
#: together: prompt scoring's memory is this slice times the vocabulary, whatever the prompt
#: (a 3,001-token ``prompt_logprobs`` request grew the server by 2.4 GB when scored whole).
SCORE_ROWS_PER_STEP = 256
#: The engine's KV budget when it is given neither ``num_blocks`` nor ``kv_budget_tokens``.
DEFAULT_BUDGET_TOKENS = 65536
#: By default one client may have ``max_prefill_tokens // CLIENT_PREFILL_SHARE`` prompt tokens
#: in a step that carries another client's work (the engine's ``max_client_prefill_tokens``,
#: ``--max-client-prefill-tokens``).
CLIENT_PREFILL_SHARE = 4


def client_prefill_cap(max_prefill_tokens: int, max_client: int | None) -> int | None:
    """The per-client cap a step plan uses: ``max_client`` (None: a
    :data:`CLIENT_PREFILL_SHARE`-th of ``max_prefill_tokens``, at least 1; 0: no cap)."""
    if max_client is None:
        return max(1, max_prefill_tokens // CLIENT_PREFILL_SHARE)
    return max_client or None


#: Waiting requests looked at for one that may pass a head waiting for blocks.
_MAX_PASS_SCAN = 256


def budget_blocks(num_blocks: int | None, kv_budget_tokens: int | None, block_size: int) -> int:
    """The budget in blocks, from ``num_blocks`` or ``kv_budget_tokens`` (rounded down to whole
    blocks; default ``DEFAULT_BUDGET_TOKENS``); ``ValueError`` says what was wrong."""
    if num_blocks is not None and kv_budget_tokens is not None:
        raise ValueError("give num_blocks or kv_budget_tokens, not both")
    positive_int(block_size, "block_size")
    if num_blocks is None:
        budget = DEFAULT_BUDGET_TOKENS if kv_budget_tokens is None else kv_budget_tokens
        positive_int(budget, "kv_budget_tokens (one block at least)", minimum=block_size)
        num_blocks = budget // block_size
    positive_int(num_blocks, "num_blocks")
    return num_blocks


@dataclass(frozen=True)
class PrefixPlan:
    """What admission does with a prompt: copy ``kv`` (its first ``num_loaded`` tokens, or None)
    into the request's blocks; after prefill store the first ``store_upto`` prompt tokens (0 =
    nothing new to store), with chunk queries captured from token ``query_offset`` on when
    ``capture_queries`` (full mode)."""

    kv: Tensor | None
    num_loaded: int
    store_upto: int = 0
    capture_queries: bool = False
    query_offset: int = 0


def plan_prefix(
    conn: KVConnector,
    capture: QueryCapture,
    prompt: list[int],
    cache_salt: str,
    limit: int | None = None,
) -> PrefixPlan:
    """Look up ``prompt``'s cached prefix and decide what to load (at most ``limit`` tokens)
    and store, for the engine's query ``capture``; ``EngineError`` when the server cannot be
    asked."""
    try:
        kv = conn.load(prompt, cache_salt)
    except Exception as exc:
        raise EngineError(f"loading the cached prefix from the server failed: {exc}") from exc
    cached = 0 if kv is None else int(kv.shape[2])
    # At least the last prompt token is computed: its logits pick the first output token.
    n = min(cached, len(prompt) - 1)
    if limit is not None:
        n = min(n, limit)
    loaded = kv[:, :, :n] if kv is not None and n > 0 else None
    aligned = len(prompt) // conn.chunk_size * conn.chunk_size
    if aligned <= cached:
        return PrefixPlan(loaded, n)
    # Chunk queries (full mode) are captured for the computed tokens; a loaded prefix (shared
    # with an earlier prompt) must have its queries cached too, or the query cache would hold a
    # hole. After a modify the kept tokens have none: their prompt stores KV only.
    if not conn.transfer_query or not capture.full:
        return PrefixPlan(loaded, n, store_upto=aligned)
    try:
        q_cached = conn.lookup_queries(prompt, cache_salt) if n else 0
    except Exception as exc:
        raise EngineError(f"query lookup in the server failed: {exc}") from exc
    capture = n == 0 or q_cached >= n
    return PrefixPlan(
        loaded,
        n,
        store_upto=aligned,
        capture_queries=capture,
        query_offset=n,
    )


def plan_recompute(conn: KVConnector, capture: QueryCapture, prompt: list[int]) -> PrefixPlan:
    """Admission's plan when the server cannot be asked (down, slow, failing): compute the whole
    prompt, then store its whole chunks (with queries when the connector stores them)."""
    aligned = len(prompt) // conn.chunk_size * conn.chunk_size
    return PrefixPlan(
        None,
        0,
        store_upto=aligned,
        capture_queries=bool(conn.transfer_query) and capture.full and aligned > 0,
    )


def follow(req: Request, plan: PrefixPlan) -> None:
    """Make ``req`` take admission's decision: ``plan.num_loaded`` tokens are in its blocks
    already (its first admission's count is kept: ``Request.loaded_first``). A scoring request
    only loads: it stores and captures nothing. A preempted request captures no more than its
    preemption left it (``Request.preempt`` decides what it captures again)."""
    req.num_computed = plan.num_loaded
    if req.loaded_first is None:
        req.loaded_first = plan.num_loaded
    if req.scoring:
        return
    req.store_upto = plan.store_upto
    req.capture_queries = plan.capture_queries and (req.capture_queries or not req.preempted)
    req.query_offset = plan.query_offset


def decoded_store_upto(req: Request, chunk_size: int, store_decoded: bool) -> int:
    """The tokens of a finished request's sequence to store again (``store_decoded``: the whole
    chunks its generated tokens completed beyond the stored prompt); 0 for none."""
    if not store_decoded or not chunk_size:
        return 0
    computed = len(req.prompt) + len(req.output) - 1  # the last token was never fed back
    aligned = computed // chunk_size * chunk_size
    return (
        aligned if aligned > max(req.store_upto, len(req.prompt) // chunk_size * chunk_size) else 0
    )


@dataclass
class StepPlan:
    """One engine step: the flat token batch, its attention layout, and which rows are sampled.

    ``stepped`` pairs each request with the tokens it computes in this step; ``sampled`` lists the
    requests whose next token comes from ``sample_rows`` (in order); ``scored`` pairs each scoring
    request with how many of ``score_rows`` (in order) are its own; ``pieces`` pairs each
    request in kvzip's reconstruction pass with the rows of it this step computes.
    """

    seqs: list[SeqStep] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    sampled: list[Request] = field(default_factory=list)
    stepped: list[tuple[Request, int]] = field(default_factory=list)
    score_rows: list[int] = field(default_factory=list)
    scored: list[tuple[Request, int]] = field(default_factory=list)
    pieces: list[tuple[Request, int]] = field(default_factory=list)
    num_prefill: int = 0
    num_decode: int = 0


def plan_step(
    batch: Sequence[Request],
    max_prefill_tokens: int,
    max_client_prefill_tokens: int | None = None,
    keys_per_token: float | None = None,
) -> StepPlan:
    """Decodes first (one token each, so they never wait behind prefill chunks), then prompt
    chunks and pieces of reconstruction passes, ``max_prefill_tokens`` tokens in all, handed
    out by :func:`prefill_shares` in arrival order (request id): the oldest prompt first, then
    prompts that end within their client's share (a short prompt beside a 3,000-token one, or
    sixteen, is prefilled in this step), then the rest first come, first served, so a request
    admitted later never thins the share of one already prefilling, and a long kvzip pass never
    holds the decodes up.

    A client is :func:`client_of` (one ``cache_salt``, or one unsalted request); while the step
    carries another client's work a client gets at most ``max_client_prefill_tokens`` in all
    (:func:`client_prefill_cap`: a quarter of the budget by default, so about four long prompts
    are prefilled at once), so one client's prompts cannot make every step of the others long.
    That cap counts each row's attention too (:func:`prefill_cost`, ``keys_per_token`` keys a
    token: the model's :attr:`~kvdrop_engine.model.ModelConfig.attention_keys_per_token`).
    Alone, a client gets the whole budget."""
    plan = StepPlan()
    for req in batch:
        if req.prefilling or req.reconstruction is not None:
            continue
        plan.seqs.append(SeqStep(req.rid, req.blocks, req.num_computed, 1, req.dropped))
        plan.tokens.append(req.output[-1])
        plan.positions.append(req.num_computed + req.dropped)
        plan.sample_rows.append(len(plan.tokens) - 1)
        plan.sampled.append(req)
        plan.stepped.append((req, 1))
        plan.num_decode += 1
    wants: list[tuple[Request, int]] = []
    score_budget = SCORE_ROWS_PER_STEP
    for req in sorted(batch, key=lambda r: r.rid):  # arrival order: prefill_shares' turns
        if req.reconstruction is not None:  # a piece of kvzip's pass, under the same budget
            wants.append((req, req.reconstruction.next_rows()))
            continue
        if not req.prefilling:
            continue
        start = req.num_computed
        n = len(req.prefill_tokens) - start
        if req.recut:  # the whole prompt first: it is cut again before the rest is computed
            n = min(n, len(req.prompt) - start)
        if req.scoring:  # its scored rows are [rows, V] floats: a bounded slice per step
            first = max(start, req.score_from)
            n = min(n, first - start + score_budget)
            score_budget -= max(0, start + n - first)
        if n > 0:
            wants.append((req, n))
    shares = prefill_shares(
        [(client_of(req), n) for req, n in wants],
        {client_of(req) for req in batch},
        max_prefill_tokens,
        client_prefill_cap(max_prefill_tokens, max_client_prefill_tokens),
        [keys_before(req) for req, _ in wants],
        keys_per_token,
    )
    for (req, _), n in zip(wants, shares, strict=True):
        if n <= 0:
            continue
        if req.reconstruction is not None:
            plan.pieces.append((req, n))
            continue
        start, known = req.num_computed, req.prefill_tokens
        plan.seqs.append(SeqStep(req.rid, req.blocks, start, n))
        plan.tokens.extend(known[start : start + n])
        plan.positions.extend(range(start, start + n))
        if req.scoring:
            first = max(start, req.score_from)  # rows of positions first..start+n-1
            if first < start + n:
                end = len(plan.tokens)
                plan.score_rows.extend(range(end - (start + n - first), end))
                plan.scored.append((req, start + n - first))
        elif start + n == len(req.prompt) and not req.output:
            plan.sample_rows.append(len(plan.tokens) - 1)
            plan.sampled.append(req)
        plan.stepped.append((req, n))
        plan.num_prefill += n
    return plan


def keys_before(req: Request) -> int:
    """The cached keys a request's next prompt row (or piece of its kvzip pass) attends to."""
    if req.reconstruction is not None:
        return req.reconstruction.keys_before
    return req.num_computed


def client_of(req: Request) -> object:
    """The client whose share a request's prompt tokens count against: its tenant
    (:func:`kv_client_of`), or the request itself when it has none."""
    tenant = kv_client_of(req)
    return ("salt", tenant) if tenant else ("rid", req.rid)


def kv_client_of(req: Request) -> str:
    """The client whose KV share a request's blocks count against: the tenant of its
    ``cache_salt`` (:func:`~kvdrop_sdk.protocol.tenant_salt`: a stream's edited KV, under a salt
    of its own, counts with its tenant's other requests); the unsalted requests together are
    one client (``""``), so a server whose requests carry no salt (or one) keeps vLLM's
    preemption and admission order."""
    return tenant_salt(req.cache_salt)


def prefill_cost(keys_before: int, tokens: int, keys_per_token: float | None) -> float:
    """The work of ``tokens`` prompt rows after ``keys_before`` cached keys, in tokens: each row
    is one token of the model's matrix work plus its attention over the keys before it (the
    cached ones and the rows before it in the chunk), ``keys_per_token`` keys
    (:attr:`~kvdrop_engine.model.ModelConfig.attention_keys_per_token`) costing one token. So
    the 32 rows at the end of a 3,000-token prompt cost what 32 rows at its start do only when
    attention is free (``keys_per_token`` None: tokens alone)."""
    if not keys_per_token:
        return float(tokens)
    pairs = tokens * keys_before + tokens * (tokens + 1) / 2
    return tokens + pairs / keys_per_token


def prefill_within(
    keys_before: int, want: int, allowance: float, keys_per_token: float | None
) -> int:
    """The most rows, at most ``want``, whose :func:`prefill_cost` fits ``allowance``."""
    lo, hi = 0, max(0, want)
    while lo < hi:  # the cost grows with the rows: the last count that fits
        mid = (lo + hi + 1) // 2
        if prefill_cost(keys_before, mid, keys_per_token) <= allowance:
            lo = mid
        else:
            hi = mid - 1
    return lo


def prefill_shares(
    wants: Sequence[tuple[object, int]],
    clients: Collection[object],
    budget: int,
    cap: int | None,
    keys_before: Sequence[int] | None = None,
    keys_per_token: float | None = None,
) -> list[int]:
    """The one prefill order: ``budget`` prompt tokens handed out over ``wants`` (``(client,
    tokens)`` pairs in arrival order). With more than one client in ``clients`` (the step's
    requests, decoding ones too) a client gets at most ``cap`` in all, so at most
    ``budget // cap`` long prompts are prefilled at once; alone, it may take the whole budget.
    The cap counts work (:func:`prefill_cost` of each want's rows after its ``keys_before``
    cached keys), not rows: rows deep in a long prompt attend to more keys, so a client gets
    fewer of them and the other clients' steps stay short; ``budget`` counts rows.

    Turns, each taking what it wants or what its client's limit and the budget leave: the
    oldest want first (nothing starves), then every want that ends within its client's limit
    (a short prompt passes long ones: it is prefilled in this step), then the rest in arrival
    order (first come, first served). So a later request never delays an earlier one's first
    token by more than its own short prompt, and requests admitted later (into memory a cut
    freed, say) do not dilute the shares of those already prefilling."""
    capped = cap is not None and len(clients) > 1
    limit = cap if capped else budget
    kpt = keys_per_token if capped else None  # alone, a client's rows are counted, not costed
    before = list(keys_before) if keys_before is not None else [0] * len(wants)

    def cost(i: int, rows: int) -> float:
        return prefill_cost(before[i], rows, kpt)

    later = range(1, len(wants))
    fits = {i for i in later if cost(i, wants[i][1]) <= limit}
    order = [i for i in later if i in fits] + [i for i in later if i not in fits]
    shares = [0] * len(wants)
    used: dict[object, float] = {}
    left = budget
    for i in [0, *order] if wants else []:
        client, want = wants[i]
        n = prefill_within(before[i], min(want, left), limit - used.get(client, 0), kpt)
        if n == 0 and client not in used and want > 0 and left > 0:
            n = 1  # a client's first row always fits: a row costlier than the cap never starves
        shares[i] = n
        used[client] = used.get(client, 0) + cost(i, n)
        left -= n
    return shares


class Scheduler:
    """The waiting line and the running set over one block allocator (see the module docstring).

    ``load_lock`` is the engine's lock over :attr:`Request.load_state` (shared with the loads).
    ``swap`` (a :class:`~kvdrop_engine.decode_cut.KVSwap`) preempts the requests it holds by
    moving their cache to host memory and back instead of recomputing them.
    """

    def __init__(
        self,
        allocator: BlockAllocator,
        block_size: int,
        max_batch_size: int,
        load_lock: threading.Lock,
        eos_token_ids: Collection[int] = (),
        swap: KVSwap | None = None,
    ) -> None:
        self.allocator = allocator
        self.swap = swap
        self.eos_token_ids = frozenset(eos_token_ids)
        self.block_size = block_size
        self.max_batch_size = max_batch_size
        self.load_lock = load_lock
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}
        #: The waiting head that requests were admitted ahead of, and those requests' ids.
        self._passed_head: int | None = None
        self._passers: set[int] = set()

    def blocks_for(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """The most blocks a request holds: its prompt and every generated token but the last."""
        return blocks_needed(num_prompt_tokens + max_tokens - 1, self.block_size)

    def blocks_of(self, req: Request) -> int:
        """Blocks ``req`` reserves on admission (:attr:`Request.peak_tokens`)."""
        return blocks_needed(req.peak_tokens, self.block_size)

    def check_fits(self, req: Request) -> None:
        """``RequestTooLargeError`` when ``req`` needs more blocks than the whole budget."""
        need = self.blocks_of(req)
        total = self.allocator.num_blocks
        if need > total:
            raise RequestTooLargeError(
                f"request needs {len(req.prompt)} prompt + {req.params.max_tokens} max_tokens = "
                f"{need} blocks of {self.block_size} tokens, but the engine's KV budget is "
                f"{total} blocks ({total * self.block_size} tokens); "
                "shorten the prompt, lower max_tokens, or give the engine a larger budget"
            )

    def _admission_blocks(self, req: Request) -> int:
        """Blocks a request takes on admission (:attr:`Request.admission_tokens`); decodes grow
        it later."""
        return blocks_needed(req.admission_tokens, self.block_size)

    def kv_excess(self) -> dict[str, float]:
        """The one KV-share rule that preemption and admission ask: for each client
        (:func:`kv_client_of`) with running work or waiting work (in the part of the line that
        admission looks at), the blocks its running requests hold minus its fair share, the
        budget over the number of such clients (> 0: over its share). One client alone holds at
        most the budget: never over."""
        held: dict[str, int] = {}
        for req in self.running.values():
            client = kv_client_of(req)
            held[client] = held.get(client, 0) + len(req.blocks)
        for req in itertools.islice(self.waiting, _MAX_PASS_SCAN):
            if not req.cancelled:
                held.setdefault(kv_client_of(req), 0)
        share = self.allocator.num_blocks / max(1, len(held))
        return {client: n - share for client, n in held.items()}

    def _admission_order(self, excess: Mapping[str, float] | None = None) -> list[int]:
        """Positions in the waiting line, in the order admission considers them: the requests
        that keep their client within its KV share (:meth:`_within_share`; ``excess``:
        :meth:`kv_excess`, computed when not given), then the others, each in line order (one
        client: the line's order)."""
        line = range(min(len(self.waiting), _MAX_PASS_SCAN))
        excess = self.kv_excess() if excess is None else excess
        if len(excess) <= 1:
            return list(line)
        late = [not self._within_share(self.waiting[i], excess) for i in line]
        return [i for i in line if not late[i]] + [i for i in line if late[i]]

    def _within_share(self, req: Request, excess: Mapping[str, float]) -> bool:
        """Whether admitting ``req`` keeps its client within its KV share (``excess``:
        :meth:`kv_excess`)."""
        return excess[kv_client_of(req)] + self._admission_blocks(req) <= 0

    def _next_admissible(self) -> tuple[int, bool] | None:
        """Where in the waiting line the next request to admit is, and whether it passes the
        head (the first of :meth:`_admission_order`): the head when its blocks are free; else
        the first later request of another client (:func:`kv_client_of`) whose blocks are free
        and whose peak, with the peaks of the others admitted ahead of this head, leaves the head
        its blocks once the requests running before it have ended (so passing never starves the
        head); None: none now. A client's own requests never pass each other: within a client
        admission is first come, first served, as vLLM's, since a passer takes the blocks the
        running requests grow into and so preempts one of them (one client, 30 long prompts:
        1.45x the recomputed prompt tokens when they passed)."""
        if not self.waiting:
            return None
        first, *rest = self._admission_order()
        head = self.waiting[first]
        if self._admission_blocks(head) <= self.allocator.num_free:
            return first, False
        if self._passed_head != head.rid:
            self._passed_head, self._passers = head.rid, set()
        self._passers &= self.running.keys()  # ended or preempted passers hold nothing
        held = sum(self.blocks_of(self.running[rid]) for rid in self._passers)
        reserve = self.allocator.num_blocks - self._admission_blocks(head) - held
        free, own = self.allocator.num_free, kv_client_of(head)
        for i in rest:
            req = self.waiting[i]
            if kv_client_of(req) == own:
                continue
            if not req.cancelled and self._admission_blocks(req) <= free:
                if self.blocks_of(req) <= reserve:
                    return i, True
        return None

    def admit(self) -> list[Request]:
        """Move waiting requests to running while blocks are free, in :meth:`_admission_order`:
        its head first; a head that waits for blocks is passed only by requests that cannot
        delay it (:meth:`_next_admissible`), so a short request does not wait behind a long one
        that waits for others to end."""
        admitted = []
        while self.waiting and len(self.running) < self.max_batch_size:
            found = self._next_admissible()
            if found is None:
                break
            i, passes = found
            req = self.waiting[i]
            del self.waiting[i]
            if passes:
                self._passers.add(req.rid)
            req.blocks = self.allocator.allocate(self._admission_blocks(req))
            if req.swapped is not None:
                assert self.swap is not None
                self.swap.into(req)
            self.running[req.rid] = req
            admitted.append(req)
        return admitted

    def grow(self) -> list[tuple[Request, int]]:
        """Give each decoding request (oldest first) the block its next token needs; when none
        is free, preempt :meth:`_victim` (vLLM's recompute: its blocks come back, it goes first
        in the waiting line, and is recomputed when admitted again). Returns the
        preempted requests with the tokens each had computed. A request whose load or
        reconstruction pass runs is not preempted (its blocks are being read or written)."""
        preempted: list[tuple[Request, int]] = []
        for req in list(self.running.values()):
            if req.rid not in self.running or not self._decoding(req):
                continue
            need = blocks_needed(req.num_computed + 1, self.block_size) - len(req.blocks)
            while need > self.allocator.num_free:
                victim = self._victim()
                preempted.append(self._preempt(victim))
                if victim is req:
                    break
            else:
                if need > 0:
                    req.blocks = req.blocks + self.allocator.allocate(need)
        return preempted

    @staticmethod
    def _decoding(req: Request) -> bool:
        return (
            not req.cancelled
            and req.cutting is None
            and req.loading is None
            and req.reconstruction is None
            and not req.prefilling
            and bool(req.output)
        )

    def reclaim(self) -> list[tuple[Request, int]]:
        """When the head of :meth:`_admission_order` keeps its client within its KV share and
        its blocks are not free, preempt requests of clients over their share for it, chosen as
        :meth:`grow` chooses (:meth:`_victim_of`, never the oldest running request), only as long
        as their client stays over its share and only when that frees its blocks: a client over
        its share cannot keep another waiting for the memory it holds beyond it. Returns the
        preempted requests with the tokens each had computed (as :meth:`grow`). One client is
        never over: nothing."""
        if not self.waiting or len(self.running) >= self.max_batch_size:
            return []
        excess = self.kv_excess()
        if len(excess) <= 1:
            return []
        head = self.waiting[self._admission_order(excess)[0]]
        need, free = self._admission_blocks(head), self.allocator.num_free
        if head.cancelled or need <= free or not self._within_share(head, excess):
            return []
        oldest = next(iter(self.running.values()), None)
        able = [r for r in self._preemptible() if r is not oldest]  # it always goes on
        chosen: list[Request] = []
        while free < need and able:
            victim = self._victim_of(able, excess)
            if excess[kv_client_of(victim)] <= 0:
                break
            able.remove(victim)
            chosen.append(victim)
            excess[kv_client_of(victim)] -= len(victim.blocks)
            free += len(victim.blocks)
        if free < need:
            return []
        return [self._preempt(victim) for victim in chosen]

    def _preemptible(self) -> list[Request]:
        """The running requests that may be preempted (a decoding one always may), oldest
        first."""
        return [
            r
            for r in self.running.values()
            if r.loading is None
            and r.reconstruction is None
            and r.cutting is None
            and not r.cancelled
        ]

    def _victim(self) -> Request:
        """The request preempted when blocks run out: of those that may be, the newest of the
        client holding the most blocks above its fair share (:meth:`kv_excess`), never the
        oldest running request while another may go (so it always ends, and then the next
        oldest: no request starves). One client: the newest."""
        able = self._preemptible()
        if not able:
            raise AssertionError("a decoding request is always preemptible")
        if len(able) > 1 and able[0] is next(iter(self.running.values())):
            able = able[1:]
        if len({kv_client_of(r) for r in able}) == 1:
            return able[-1]
        return self._victim_of(able, self.kv_excess())

    @staticmethod
    def _victim_of(able: Sequence[Request], excess: Mapping[str, float]) -> Request:
        """The newest of ``able`` (oldest first) of the client most over its share."""
        return max(reversed(able), key=lambda r: excess[kv_client_of(r)])

    def _preempt(self, req: Request) -> tuple[Request, int]:
        """Preempt ``req`` (swapped out when the swap holds it, else recomputed later): back
        to the head of the line, its blocks freed. Returns it with the tokens it will recompute
        (0 when swapped)."""
        swapped = self.swap is not None and self.swap.holds(req)
        computed = 0 if swapped else req.num_computed  # before preempt() resets it
        self.running.pop(req.rid)
        if swapped:
            self.swap.out(req)
        self.free(req)
        req.preempt()
        self.waiting.appendleft(req)
        return req, computed

    def drop_cancelled(self) -> None:
        """Free cancelled requests -- except one whose prefix a load thread is copying into its
        blocks (freed on a later call, once the copy is done)."""
        for rid in [rid for rid, r in self.running.items() if r.cancelled]:
            req = self.running[rid]
            if req.loading is not None and not req.loading.done():
                with self.load_lock:
                    if req.load_state in (LoadState.COPY, LoadState.COPIED):
                        continue
                    req.load_state = LoadState.ABANDONED
                req.loading.cancel()  # a load still queued never asks the server
            self.free(self.running.pop(rid))
        if any(r.cancelled for r in self.waiting):
            self.waiting = deque(r for r in self.waiting if not r.cancelled)

    def has_work(self, io_ok: bool) -> bool:
        """Something to step, admit or drop, or a load to finish (not just loads in flight)."""
        now = time.monotonic()
        for req in self.running.values():
            if req.cutting is not None:
                if req.cutting.ready(now):
                    return True
                continue  # its policy runs: nothing to step for it yet
            if req.loading is None or req.loading.done():
                return True
            if req.load_state is LoadState.QUEUED and (req.cancelled or not io_ok):
                return True
            if req.load_state is LoadState.IO and (req.cancelled or now >= req.load_deadline):
                return True
        if self.waiting and len(self.running) < self.max_batch_size:
            return self.waiting[0].cancelled or self._next_admissible() is not None
        return False

    def wait_s(self) -> float | None:
        """How long the loop may sleep: until the first load or cut deadline (loads and cuts
        notify when done)."""
        deadlines = [
            r.load_deadline
            for r in self.running.values()
            if r.loading is not None
            and r.load_state is LoadState.IO
            and r.load_deadline < float("inf")
        ] + [r.cutting.deadline for r in self.running.values() if r.cutting is not None]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def runnable(self) -> list[Request]:
        """The running requests this step computes (not cancelled, prefix loaded, no cut
        running)."""
        return [
            r
            for r in self.running.values()
            if not r.cancelled and r.loading is None and r.cutting is None
        ]

    def cuts_ready(self, now: float) -> list[Request]:
        """The running requests whose cut ended (or ran past its deadline) by ``now``."""
        return [r for r in self.running.values() if r.cutting is not None and r.cutting.ready(now)]

    def loading(self) -> list[Request]:
        """The running requests whose prefix load is in flight."""
        return [r for r in self.running.values() if r.loading is not None]

    def postprocess(
        self, plan: StepPlan, tokens: Mapping[int, int]
    ) -> list[tuple[Request, int | None, str | None]]:
        """After a step: each sampled request takes its token (``tokens`` by request id; one
        that failed has none), and this decides who ends. Returns ``(request, token, finish
        reason)`` per sampled request, and ``(request, None, "scored")`` for each scoring
        request whose rows are all computed (it ends without a token)."""
        done: list[tuple[Request, int | None, str | None]] = []
        for req in plan.sampled:
            tok = tokens.get(req.rid)
            if tok is None or req.cancelled or req.rid not in self.running:
                continue
            req.output.append(tok)
            reason = finish_reason(tok, len(req.output), req.params, self.eos_token_ids)
            done.append((req, tok, reason))
        for req, _ in plan.scored:
            if not req.prefilling and not req.cancelled and req.rid in self.running:
                done.append((req, None, "scored"))
        return done

    def finish(self, req: Request) -> bool:
        """Take ``req`` out of the running set and free its blocks; whether it was running."""
        was_running = self.running.pop(req.rid, None) is not None
        self.free(req)
        return was_running

    def drain(self) -> list[Request]:
        """Every waiting and running request, taken out (the engine stops)."""
        pending = list(self.waiting) + list(self.running.values())
        self.waiting.clear()
        self.running.clear()
        return pending

    def free(self, req: Request) -> None:
        """Give ``req``'s blocks back (idempotent)."""
        if req.blocks:
            self.allocator.free(req.blocks)
            req.blocks = ()
