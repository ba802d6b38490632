"""Compression while decoding: each running request's KV kept within a token budget (R-KV style).

``kvdrop engine --decode-policy rkv --decode-budget 1024 --decode-every 128`` builds one
:class:`DecodeCompressor`. A long generation grows its cache by one token a step; once a
request's cache would pass ``budget + every`` tokens, the compressor cuts it back to ``budget``
tokens, on the device, in place: the first ``n_sink`` tokens (attention sinks) and the policy's
recent ``window`` always stay, the rest are ranked by the policy (R-KV's importance minus
redundancy, or snapkv, tova, knorm, ... through the same ``Needs`` the prompt cut reads); the kept
rows are moved to the request's first blocks and its other blocks go back to the pool at once, for
other requests. A request therefore never holds more than ``budget + every`` tokens while it
decodes (its prompt while it prefills). Every request due in a step is cut in that step, with one
gather and one scatter for all of them (the policies rank each request on its own).

RoPE: kept keys stay at their positions (no re-rotation). The request remembers the true
positions of its kept rows and how many tokens were dropped, so the next token is computed at its
true position ``len(prompt) + len(output) - 1`` while it is written to cache slot
``num_computed`` (:attr:`Request.dropped`). Decoding then equals attention over the full
sequence with the dropped tokens masked out (what R-KV and kvpress's decoding presses compute), a
cut costs no rotation work, and the distance between the newest token and the prompt stays the
one the model was trained on. The prompt cut (:mod:`kvdrop_engine.drop`) re-rotates to
``0..k-1`` instead because a prefix cache stores prompts at those positions; both compose: the
decode cut continues from the prompt cut's positions.

The query rows a policy reads are the request's last ``window`` computed tokens (its prompt's
tail before the first cut, then its generated tokens), captured by the eager forward and by the
decode graphs alike; they are reset after each cut (their slots moved).

Preemption: a request that was cut while decoding cannot be recomputed to the same cache (its
later tokens attended to the kept rows only), so it is never recomputed: :class:`KVSwap` copies
its KV (at most ``budget + every`` tokens) to host memory when it is preempted and back when it is
admitted again, so it keeps its tokens exactly. With a connector, the prompt's KV is stored after
its prefill as usual (before any cut); nothing is stored when a decode-cut request ends (neither
decoded chunks nor its query window: its cache no longer matches its token sequence).

A request's ``"kvdrop"`` object may carry ``"decode": {"policy": SPEC, "budget": TOKENS,
"every": N}`` (keys left out: the engine's defaults) or ``"decode": null`` (no cut while
decoding); :func:`parse_decode` is its one validator.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvdrop_engine.client_specs import DEFAULT_CLIENT_POLICIES, ClientSpecs
from kvdrop_engine.decode_batch import BatchedRank, batched
from kvdrop_engine.drop import UNSET
from kvdrop_engine.errors import EngineSetupError, InvalidRequestError
from kvdrop_engine.model import ModelConfig
from kvdrop_engine.paged import PagedKVCache, blocks_needed
from kvdrop_sdk import CacheKind
from kvdrop_sdk.dry_run import dry_run_inputs
from kvdrop_sdk.edit import EditContext
from kvdrop_sdk.query_capture import DEFAULT_QUERY_WINDOW, QueryCapture, QueryNeed

if TYPE_CHECKING:
    from kvdrop.policy import Policy
    from kvdrop_engine.sequence import Request

__all__ = [
    "DEFAULT_DECODE_EVERY",
    "DEFAULT_DECODE_SINK",
    "DecodeCompressor",
    "DecodeCut",
    "DecodeOverride",
    "KVSwap",
    "decode_capture",
    "parse_decode",
    "prepare_decode",
]

#: ``--decode-every`` when it is not given: R-KV's buffer of 128 generated tokens.
DEFAULT_DECODE_EVERY = 128
#: Attention sinks every decode cut keeps (StreamingLLM's four), unless the spec sets ``n_sink``.
DEFAULT_DECODE_SINK = 4
#: Built (spec, budget) pairs kept for reuse.
_MAX_BUILT = 64
#: Tokens of the random cache :meth:`DecodeCompressor.check` runs a new policy on, and the
#: budget it cuts them to (so the policy ranks, not just keeps everything).
_CHECK_TOKENS, _CHECK_BUDGET = 96, 8


@dataclass(frozen=True)
class DecodeOverride:
    """A request's ``"kvdrop": {"decode": ...}``: ``policy``, ``budget``, ``every`` (None: the
    engine's)."""

    policy: str | None = None
    budget: int | None = None
    every: int | None = None


def _count(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"'kvdrop.decode.{name}' must be an int >= 1, got {value!r}")
    return int(value)


def parse_decode(value: Any) -> DecodeOverride | None:
    """``None`` (no cut while decoding) or ``{"policy": str, "budget": int >= 1, "every": int >=
    1}``, each key optional; ``ValueError`` says what was wrong."""
    if value is None or isinstance(value, DecodeOverride):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(
            "'kvdrop.decode' must be null (no cut while decoding) or an object like "
            f'{{"policy": "rkv", "budget": 1024, "every": 128}}, got {type(value).__name__}'
        )
    unknown = sorted(set(value) - {"policy", "budget", "every"})
    if unknown:
        raise ValueError(
            f"'kvdrop.decode' has unknown key(s) {unknown}; expected policy, budget, every"
        )
    policy = value.get("policy")
    if policy is not None and (not isinstance(policy, str) or not policy.strip()):
        raise ValueError(
            f"'kvdrop.decode.policy' must be a policy name or spec string, got {policy!r}"
        )
    budget, every = _count(value.get("budget"), "budget"), _count(value.get("every"), "every")
    return DecodeOverride(policy, budget, every)


@dataclass(frozen=True)
class DecodeCut:
    """One request's cut while decoding: the built policy (``keep_tokens=budget``), its spec,
    the budget, the number of generated tokens between cuts and the query rows its policy reads
    (``capture``: the last ``query_window`` computed tokens, or none); ``fast`` ranks a batch
    of requests in one set of kernels (:mod:`kvdrop_engine.decode_batch`; None: the policy
    ranks each request)."""

    spec: str
    budget: int
    every: int
    policy: Policy
    capture: QueryCapture
    fast: BatchedRank | None = None

    def due(self, num_cached: int) -> bool:
        """Whether a cache of ``num_cached`` tokens is cut before the next decode step (which
        adds one): it would pass ``budget + every``."""
        return num_cached + 1 > self.budget + self.every

    def held_tokens(self, cached: int, entering: int) -> int:
        """KV tokens a request that holds ``cached`` tokens holds at most while ``entering``
        more enter its cache: it is cut before it passes ``budget + every`` (never less than
        ``cached``). The one rule of what admission and the cuts reserve for it."""
        return max(cached, min(cached + entering, self.budget + self.every))

    def peak_tokens(self, num_prompt: int, decode_start: int, max_tokens: int) -> int:
        """KV tokens a request ever holds: its prompt while it prefills, then from
        ``decode_start`` tokens growing by ``max_tokens - 1``, at most ``budget + every``."""
        return max(num_prompt, self.held_tokens(decode_start, max_tokens - 1))


@dataclass(frozen=True)
class DecodeCutResult:
    """What one step's decode cuts did: requests cut, tokens before and after, wall time."""

    num_requests: int
    tokens_before: int
    tokens_kept: int
    seconds: float


class DecodeCompressor:
    """The engine's decode-time cuts: the ``--decode-policy`` default and per-request overrides.

    ``spec`` (a registered name or spec string) is built with ``keep_tokens=budget``,
    ``chunk_size=1`` and ``n_sink`` (unless the spec sets it) and checked once on a random cache
    of the model's layout, so a policy that cannot run fails at start (``EngineSetupError``) or a
    request's override with ``InvalidRequestError``. ``spec=None`` serves without a default
    cut; requests may still ask for one (``budget`` is then their default budget, if given),
    within what ``client_policies`` allows (:mod:`kvdrop_engine.client_specs`).
    ``every`` (None: :data:`DEFAULT_DECODE_EVERY`) is the number of generated tokens between
    cuts; ``query_window`` the query rows kept for policies that read them.
    """

    def __init__(
        self,
        config: ModelConfig,
        spec: str | None = None,
        *,
        budget: int | None = None,
        every: int | None = None,
        n_sink: int = DEFAULT_DECODE_SINK,
        query_window: int = DEFAULT_QUERY_WINDOW,
        client_policies: str = DEFAULT_CLIENT_POLICIES,
    ) -> None:
        every = DEFAULT_DECODE_EVERY if every is None else every
        for name, value in (("--decode-every", every), ("--query-window", query_window)):
            if not isinstance(value, int) or value < 1:
                raise EngineSetupError(f"{name} must be an int >= 1, got {value!r}")
        if budget is not None and (not isinstance(budget, int) or budget < 1):
            raise EngineSetupError(f"--decode-budget must be an int >= 1, got {budget!r}")
        if not isinstance(n_sink, int) or n_sink < 0:
            raise EngineSetupError(f"n_sink must be an int >= 0, got {n_sink!r}")
        if spec is not None and budget is None:
            raise EngineSetupError("--decode-policy needs --decode-budget TOKENS")
        self.config = config
        self.rope_json = config.rope.to_json()
        self.budget, self.every = budget, every
        self.n_sink, self.query_window = n_sink, query_window
        self._built: dict[tuple[str, int, int], DecodeCut] = {}
        self.default: DecodeCut | None = None
        if spec is not None:
            assert budget is not None
            try:
                self.default = self._build(spec, budget, every)
            except InvalidRequestError as exc:
                raise EngineSetupError(f"--decode-policy {spec}: {exc}") from None
        #: What a request's decode override may name (``--client-policies``).
        self.clients = ClientSpecs(client_policies, () if spec is None else (spec,))

    def _build(self, spec: str, budget: int, every: int) -> DecodeCut:
        key = (spec, budget, every)
        if key not in self._built:
            policy = self._policy(spec, budget)
            self.check(spec, self._policy(spec, _CHECK_BUDGET))
            fast = batched(policy, self.config.head_dim)
            # A batched ranking observes its last ``query_count`` rows: only those are kept.
            window = self.query_window
            if fast is not None and fast.reads_queries:
                window = min(window, fast.query_count())
            capture = QueryCapture.for_policies([policy], window=window, stride=0)
            if len(self._built) >= _MAX_BUILT:  # requests choose the keys: keep the cache small
                self._built.pop(next(iter(self._built)))
            self._built[key] = DecodeCut(spec, budget, every, policy, capture, fast)
        return self._built[key]

    def check(self, spec: str, policy: Policy) -> None:
        """Rank a random cache of the model's layout with ``policy`` once (with query rows when
        it reads them), so a policy that cannot run on this model fails at start."""
        cfg = self.config
        sizes = QueryCapture(QueryNeed.WINDOW, self.query_window, 0)
        run = dry_run_inputs(cfg, _CHECK_TOKENS, policy.needs, sizes, rope=self.rope_json)
        try:
            policy.select_indices(run.tensors, run.tokens, context=run.context)
        except Exception as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise InvalidRequestError(
                f"decode policy {spec!r} cannot run on this model ({cfg.num_layers} layers, "
                f"{cfg.num_kv_heads} KV heads x {cfg.head_dim}): {first}"
            ) from None

    def _context(
        self, positions: torch.Tensor, qpos: torch.Tensor | None, device: str
    ) -> EditContext:
        return EditContext(
            positions=positions,
            query_positions=qpos,
            rope=self.rope_json,
            prompt_tokens=positions.numel(),
            head_dim=self.config.head_dim,
            device=device,
        )

    def _policy(self, spec: str, budget: int) -> Policy:
        from kvdrop.errors import PolicyNotFoundError  # the policy library, on first use
        from kvdrop.spec import describe, get

        try:
            names = {p.name for p in describe(spec).params}
            if "keep_tokens" not in names:
                raise ValueError("it takes no keep_tokens budget, which a decode cut sets")
            params: dict[str, Any] = {"keep_tokens": budget}
            if "chunk_size" in names:
                params["chunk_size"] = 1
            if "n_sink" in names and "n_sink" not in spec:
                params["n_sink"] = self.n_sink
            policy = get(spec, rerotate=False, **params)
        except (PolicyNotFoundError, ValueError, TypeError) as exc:
            raise InvalidRequestError(f"decode policy {spec!r}: {exc}") from None
        if policy.token_scores or policy.queries is QueryNeed.FULL:
            raise InvalidRequestError(
                f"decode policy {spec!r} reads every token's query or the reconstruction "
                "scores, which the engine does not keep while decoding; pick rkv, snapkv, tova, "
                "knorm, streaming or another window or KV-only policy"
            )
        return policy

    def choose(self, override: Any = UNSET) -> DecodeCut | None:
        """The decode cut of a request: its ``"kvdrop.decode"`` override (left out: none was
        sent; None: no cut) over the engine's default."""
        if override is UNSET:
            return self.default
        try:
            parsed = parse_decode(override)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        if parsed is None:
            return None
        base = self.default
        spec = parsed.policy or (None if base is None else base.spec)
        budget = parsed.budget or (self.budget if base is None else base.budget)
        if spec is None or budget is None:
            raise InvalidRequestError(
                "'kvdrop.decode' needs a policy and a budget (the engine has no "
                '--decode-policy/--decode-budget); send {"policy": "rkv", "budget": 1024}'
            )
        self.clients.check(spec, "'kvdrop.decode.policy'")  # bounded before it is built
        return self._build(spec, budget, parsed.every or self.every)

    @staticmethod
    def due(req: Request) -> bool:
        """Whether ``req`` is cut after this step: its cache would pass ``budget + every`` with
        the next token, and a policy that reads queries has at least one captured row (it has
        one whenever it is due: the prompt's tail is captured while it prefills, and after a
        prompt cut :meth:`after_prompt_cut` moves those rows to the kept cache)."""
        cut = req.decode_cut
        if cut is None or not cut.due(req.num_computed):
            return False
        reads = cut.policy.queries is not QueryNeed.NONE
        return not reads or (req.window is not None and req.window.num_rows > 0)

    def after_prompt_cut(
        self,
        req: Request,
        rows: tuple[torch.Tensor, torch.Tensor] | None,
        num_prompt: int,
    ) -> None:
        """(after a prompt cut of ``num_prompt`` tokens to the ``req.num_computed`` kept ones,
        their keys re-rotated to ``0..k-1``, and its window restarted) Where the decode cut is
        due at once (``k`` past ``budget + every``) and reads queries, give the fresh window the
        prompt's last query rows ``rows`` ``(slots [r], queries [L, r, Hq, d])`` it captured
        while prefilling, moved back by the tokens the prompt cut dropped (slot and RoPE
        position ``p - (num_prompt - k)``), so the decode cut ranks before the request's first
        decode step and it never decodes past ``budget + every``. The rows are those of the
        kept tokens where the prompt cut kept the prompt's tail (window policies do), else the
        prompt's last queries standing at the kept cache's end."""
        cut, window = req.decode_cut, req.window
        k = req.num_computed
        if cut is None or not cut.due(k) or rows is None or window is None:
            return
        if cut.policy.queries is QueryNeed.NONE or window.num_rows:
            return
        from kvdrop.rope import rerotate_keys, rope_config  # the policy library

        qpos, queries = rows
        shift = num_prompt - k
        take = (qpos >= max(num_prompt - cut.capture.window, shift)).nonzero().squeeze(1)
        if take.numel() == 0:
            return
        old = qpos[take]
        picked = queries.index_select(1, take.to(queries.device))
        layers, r, heads, dim = picked.shape
        flat = picked.reshape(layers, r, heads * dim)
        moved = rerotate_keys(flat, old, old - shift, rope_config(self.rope_json))
        window.add((old - shift).tolist(), moved.view(layers, r, heads, dim))

    def cut(self, cache: PagedKVCache, reqs: Sequence[Request]) -> DecodeCutResult:
        """Cut each of ``reqs`` (all due, see :meth:`DecodeCut.due`) to its budget in place: one
        gather of the keys of every request a batched ranking ranks (the requests of one policy,
        length and query slots together, :class:`~kvdrop_engine.decode_batch.BatchedRank`: they
        read no values) and of the whole cache of any other (ranked by its policy); one move of
        the kept rows' keys and values to each request's first slots, one read of the kept
        indices to the host; the blocks past them are freed."""
        started = time.perf_counter()
        groups: dict[tuple[Any, ...], list[tuple[Request, Any]]] = {}
        alone: list[Request] = []
        for req in reqs:
            cut = req.decode_cut
            assert cut is not None
            observed = self._observed(cut, req.num_computed, req.window)
            if observed is None:
                alone.append(req)
                continue
            qpos = observed[0]
            key = (id(cut), req.num_computed, None if qpos is None else tuple(qpos.tolist()))
            groups.setdefault(key, []).append((req, observed))
        ordered = [req for members in groups.values() for req, _ in members] + alone
        counts = [req.num_computed for req in ordered]
        device = cache.device
        with torch.inference_mode():
            slots = torch.cat([cache.slots(r.blocks, 0, n) for r, n in zip(ordered, counts)])
            ranked = sum(counts[: len(ordered) - len(alone)])
            keys_all = cache.read_keys(slots[:ranked])  # [L, ranked, Hkv*d], a copy
            picks: list[torch.Tensor] = []  # kept row indices per request, on the device
            offset = 0
            for members in groups.values():
                req0, (qpos, _) = members[0]
                fast = req0.decode_cut.fast
                n, t = len(members), req0.num_computed
                keys = keys_all[:, offset : offset + n * t].unflatten(1, (n, t)).transpose(0, 1)
                queries = None
                if qpos is not None:
                    queries = torch.stack([q for _, (_, q) in members]).to(device)
                picks.extend(fast.select(keys, queries, qpos).unbind(0))
                offset += n * t
            del keys_all
            if alone:
                kv = cache.read_slots(slots[ranked:])  # [2, L, rest, Hkv*d], a copy
                for req, part in zip(alone, kv.split(counts[len(picks) :], dim=2)):
                    picks.append(self._select(req, part).to(device))
                del kv
            base = [0, *torch.tensor(counts[:-1], dtype=torch.int64).cumsum(0).tolist()]
            rows = torch.cat([index + b for index, b in zip(picks, base)])
            kept = torch.cat(
                [cache.slots(r.blocks, 0, int(i.numel())) for r, i in zip(ordered, picks)]
            )
            cache.move_slots(slots.index_select(0, rows), kept)
            host = torch.cat(picks).cpu().split([int(i.numel()) for i in picks])  # one sync
        for req, index in zip(ordered, host, strict=True):
            self._shrink(cache, req, index)
        return DecodeCutResult(len(reqs), sum(counts), len(rows), time.perf_counter() - started)

    @staticmethod
    def _observed(cut: DecodeCut, num_tokens: int, window: Any) -> tuple[Any, Any] | None:
        """What ``cut``'s batched ranking reads of a cache of ``num_tokens`` rows whose query
        capture is ``window`` (a ``WindowCapture`` or its ``rows()``): ``(slots [r], queries
        [L, r, Hq*d])`` of the rows it observes, ``(None, None)`` for a KV-only policy, or None
        when the policy itself must rank it (no batched ranking, or the rows the library's
        ``last_rows`` would warn about or stand in for)."""
        fast = cut.fast
        if fast is None:
            return None
        if not fast.reads_queries:
            return None, None
        rows = window.rows() if hasattr(window, "rows") else window
        if rows is None:
            return None
        qpos, queries = rows
        first = max(num_tokens - fast.query_count(), 0)
        take = (qpos >= first).nonzero().squeeze(1)
        expected = max(0, int(qpos[-1]) - first + 1)
        if take.numel() == 0 or take.numel() < expected:
            return None
        picked = queries.index_select(1, take.to(queries.device))
        return qpos[take], picked.reshape(picked.shape[0], picked.shape[1], -1)

    def _select(self, req: Request, kv: torch.Tensor) -> torch.Tensor:
        """Indices of ``req``'s cached rows ``kv`` its policy keeps (:meth:`select`)."""
        assert req.decode_cut is not None
        n = kv.shape[2]
        positions = req.slot_positions(n)
        sequence = req.prompt + req.output
        tokens = [sequence[p] for p in positions.tolist()]
        rows = None if req.window is None else req.window.rows()
        return self.select(req.decode_cut, kv, positions, tokens, rows)

    def select(
        self,
        cut: DecodeCut,
        kv: torch.Tensor,
        positions: torch.Tensor,
        tokens: Sequence[int],
        rows: tuple[torch.Tensor, torch.Tensor] | None,
        *,
        batched: bool = True,
    ) -> torch.Tensor:
        """Indices (sorted, CPU int64) of the rows of ``kv`` ``[2, L, n, Hkv*d]`` (true RoPE
        ``positions``, token ids ``tokens``) that ``cut``'s policy keeps, given the query
        ``rows`` ``(slots [r], queries [L, r, Hq, d])`` captured since the last cut: its
        batched ranking where it has one (as the engine's cuts), else (or with ``batched=False``)
        the policy's own call."""
        from kvdrop.policy import checked_index  # the policy library, loaded by the build

        observed = self._observed(cut, kv.shape[2], rows) if batched else None
        if observed is not None:  # the engine's batched ranking, one request
            assert cut.fast is not None
            qpos, queries = observed
            batch = None if queries is None else queries[None].to(kv.device)
            return cut.fast.select(kv[0][None], batch, qpos)[0].cpu()
        tensors: dict[Any, torch.Tensor] = {CacheKind.KV: kv}
        qpos = None
        if cut.policy.queries is not QueryNeed.NONE and rows is not None:
            qpos, queries = rows
            tensors[CacheKind.QUERY] = queries.reshape(1, queries.shape[0], queries.shape[1], -1)
        # No log-normalisers: the rows were computed after the last cut, so every key they
        # attended to is in ``kv``. Query positions are slots (the policy's order of rows);
        # ``positions`` are the rows' true RoPE positions, for policies that rotate keys back.
        context = self._context(positions, qpos, str(kv.device))
        _, index = cut.policy.select_indices(tensors, list(tokens), context=context)
        return checked_index(cut.spec, index, kv.shape[2])

    def _shrink(self, cache: PagedKVCache, req: Request, index: torch.Tensor) -> None:
        """``req`` after its cut to the rows at ``index``: their true positions, the dropped
        count, a fresh query window, and its blocks past what it may grow to before its next
        cut freed (:meth:`Request.hold_tokens`: the others stay reserved, so growing never
        preempts another request)."""
        n, k = req.num_computed, int(index.numel())
        req.kept_positions = req.slot_positions(n)[index]
        req.dropped += n - k
        req.num_computed = k
        req.decode_cuts += 1
        # The rows moved: capture again, from the rows the next cut observes on (the last
        # ``query_window`` before the cache passes budget + every; none are stored after a cut).
        req.restart_window(max(k, req.decode_cut.budget + req.decode_cut.every))
        need = blocks_needed(req.hold_tokens(k), cache.block_size)
        if need < len(req.blocks):
            cache.allocator.free(req.blocks[need:])
            req.blocks = req.blocks[:need]


def prepare_decode(
    compressor: DecodeCompressor | None, req: Request, override: Any = UNSET
) -> DecodeCut | None:
    """(at submission, for :func:`kvdrop_engine.plan.plan_request`) ``req``'s decode cut (its
    ``capture`` says which query rows the request keeps for it). ``override`` is the request's
    ``"kvdrop.decode"`` value (UNSET: it sent none); asking for a cut from an engine without a
    compressor is an ``InvalidRequestError``."""
    if compressor is None:
        if override is not UNSET and override is not None:
            raise InvalidRequestError(
                "'kvdrop.decode' asks for a cut while decoding, but this engine was built "
                "without one (kvdrop engine --decode-policy, or "
                "Engine(compressor=DecodeCompressor(...)))"
            )
        return None
    cut = compressor.choose(override)
    if cut is None or req.params.max_tokens == 1:
        return None
    if req.options.reconstruct:
        raise InvalidRequestError(
            "reconstruct=true scores the prompt's whole cache when the request ends, which a "
            "cut while decoding no longer holds; send 'kvdrop.decode': null with it"
        )
    return cut


def decode_capture(req: Request) -> QueryCapture | None:
    """The query rows ``req``'s decode cut reads (None: it has none)."""
    return None if req.decode_cut is None else req.decode_cut.capture


class KVSwap:
    """Preemption of decode-cut requests without recomputing: their KV goes to host memory
    when their blocks are taken back and returns when they are admitted again (see the module
    docstring). The scheduler asks :meth:`holds` which requests it swaps."""

    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache

    @staticmethod
    def holds(req: Request) -> bool:
        """Whether ``req`` is swapped rather than recomputed: it was cut while decoding."""
        return req.kept_positions is not None

    def out(self, req: Request) -> None:
        """Copy ``req``'s cache to host memory (before its blocks are freed)."""
        req.swapped = self.cache.read_cpu(req.blocks, req.num_computed)

    def into(self, req: Request) -> None:
        """Put ``req``'s swapped cache back into its (new) blocks."""
        kv, req.swapped = req.swapped, None
        assert kv is not None
        self.cache.load(req.blocks, kv, 0)
        req.num_computed = kv.shape[2]
