"""Dropping while serving: each request's prompt cache cut right after its prefill.

``kvdrop engine --policy snapkv --keep-ratio 0.5`` builds one :class:`PromptDropper`; the engine
asks it three things and owns nothing else about dropping:

1. at submission, :meth:`PromptDropper.choose`: which cut a request gets (the engine's default,
   the request's ``"kvdrop"`` override, or none for prompts under ``min_prompt_tokens``); its
   ``capture`` (the policy's needs at ``--query-window``/``--query-stride``) is joined with the
   connector's window store into the request's one capture (:mod:`kvdrop_engine.plan`);
2. for admission, :meth:`PromptCut.peak_tokens`: the most KV the request ever holds, the whole
   prompt while it prefills or the kept part plus its generated tokens, whichever is larger, so
   a dropped request reserves fewer blocks and more requests share the same KV budget;
3. after the prefill (as the first token, from the prefill's logits, is handed out; the request
   decodes on once the cut is applied), :meth:`PromptDropper.cut`: the
   prompt's K/V are gathered from the request's blocks on their device, the policy picks the
   tokens to keep (with the captured queries), the kept keys are
   re-rotated to positions ``0..k-1`` (as every kvdrop edit does, so decoding continues at
   position ``k``), the kept rows are written back to the request's first blocks and the blocks
   it no longer needs are freed. No cache server is involved; with one attached, the whole prompt
   was stored before the cut.

A request's override is ``{"policy": SPEC, "keep_ratio": R}`` (either key may be left out: the
engine's default fills it; a spec's own ``keep_ratio`` wins over the engine's, and a different
``keep_ratio`` beside it is refused: :func:`kvdrop.spec.keep_budget`, the one rule) or ``None``
for no cut; :func:`parse_override` is its one validator.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvdrop_engine.client_specs import DEFAULT_CLIENT_POLICIES, ClientSpecs
from kvdrop_engine.errors import EngineSetupError, InvalidRequestError, PolicyFailedError
from kvdrop_engine.model import ModelConfig
from kvdrop_engine.paged import BlockAllocator, PagedKVCache, blocks_needed
from kvdrop_sdk import CacheKind
from kvdrop_sdk.dry_run import dry_run_inputs
from kvdrop_sdk.edit import EditContext
from kvdrop_sdk.query_capture import (
    DEFAULT_QUERY_STRIDE,
    DEFAULT_QUERY_WINDOW,
    QueryCapture,
    QueryNeed,
)
from kvdrop_sdk.validate import keep_ratio as checked_ratio

if TYPE_CHECKING:
    from kvdrop.policy import Policy
    from kvdrop.spec import KeepBudget
    from kvdrop_engine.sequence import Request

__all__ = [
    "DEFAULT_CLIENT_POLICIES",
    "DEFAULT_CUT_TIMEOUT_S",
    "DEFAULT_MIN_PROMPT_TOKENS",
    "UNSET",
    "CutJob",
    "CutPrompt",
    "CutResult",
    "Override",
    "PendingCut",
    "PromptCut",
    "PromptDropper",
    "parse_override",
    "prepare_cut",
    "serving_policy",
]

#: Prompts shorter than this are left whole: a short cache is cheap, and a policy's observation
#: window (SnapKV's 64 queries) would cover most of it.
DEFAULT_MIN_PROMPT_TOKENS = 128
#: Tokens of the random prompt :meth:`PromptDropper.check` runs a new policy on.
_CHECK_TOKENS = 160
#: Built (spec, keep ratio) pairs kept for reuse.
_MAX_BUILT = 64


#: ``--cut-timeout-s`` when it is not given: a cut still running after this fails its request.
DEFAULT_CUT_TIMEOUT_S = 30.0


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


#: A request that said nothing about dropping (the engine's default applies).
UNSET: Any = _Unset()


@dataclass(frozen=True)
class Override:
    """A request's ``"kvdrop"`` field: ``policy`` and ``keep_ratio`` of its prompt cut (None:
    the engine's), and ``decode``, its cut while decoding (``UNSET``: not sent; None: none; a
    :class:`~kvdrop_engine.decode_cut.DecodeOverride`). ``prompt`` says whether it spoke of the
    prompt cut at all (a value with only ``"decode"`` leaves the engine's default in place)."""

    policy: str | None = None
    keep_ratio: float | None = None
    decode: Any = UNSET
    prompt: bool = True
    #: Prompts shorter than this are left whole (None: the engine's ``--min-drop-tokens``).
    min_drop_tokens: int | None = None

    @property
    def prompt_cut(self) -> Override | Any:
        """The prompt cut's part (``UNSET`` when the field gave only ``"decode"``)."""
        return self if self.prompt else UNSET


#: The keys of a request's ``"kvdrop"`` object.
OVERRIDE_KEYS = ("policy", "keep_ratio", "min_drop_tokens", "decode")


def parse_override(value: Any) -> Override | None:
    """``None`` (no cut) or ``{"policy": str, "keep_ratio": number in (0, 1],
    "min_drop_tokens": int >= 1, "decode": {...}}``, each key optional; ``ValueError`` says
    what was wrong."""
    if value is None or isinstance(value, Override):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(
            "'kvdrop' must be null (no dropping) or an object like "
            f'{{"policy": "snapkv", "keep_ratio": 0.5}}, got {type(value).__name__}'
        )
    unknown = sorted(set(value) - set(OVERRIDE_KEYS))
    if unknown:
        raise ValueError(
            f"'kvdrop' has unknown key(s) {unknown}; expected {', '.join(OVERRIDE_KEYS)}"
        )
    decode: Any = UNSET
    if "decode" in value:  # the cut while decoding: its own validator
        from kvdrop_engine.decode_cut import parse_decode

        decode = parse_decode(value["decode"])
    policy, ratio = value.get("policy"), value.get("keep_ratio")
    if policy is not None and (not isinstance(policy, str) or not policy.strip()):
        raise ValueError(f"'kvdrop.policy' must be a policy name or spec string, got {policy!r}")
    if ratio is not None:
        ratio = checked_ratio(ratio, "'kvdrop.keep_ratio'")
    least = value.get("min_drop_tokens")
    if least is not None and (not isinstance(least, int) or isinstance(least, bool) or least < 1):
        raise ValueError(f"'kvdrop.min_drop_tokens' must be an int >= 1, got {least!r}")
    return Override(policy, ratio, decode, set(value) != {"decode"}, least)


@dataclass(frozen=True)
class PromptCut:
    """One request's cut: the built policy, its spec, its ``budget`` (``keep_ratio``, or the
    spec's own ``keep_tokens``: :func:`kvdrop.spec.keep_budget`) and the query rows it reads
    (``capture``, from :meth:`QueryCapture.for_policies`: its policy's needs at the engine's
    window sizes)."""

    spec: str
    budget: KeepBudget
    policy: Policy
    capture: QueryCapture

    @property
    def keep_ratio(self) -> float | None:
        """The fraction kept (None when the spec keeps a token count)."""
        return self.budget.keep_ratio

    def kept_bound(self, num_prompt: int) -> int:
        """Most prompt tokens the cut keeps (the selector floors ``keep_ratio * T``)."""
        if self.budget.keep_tokens is not None:
            return min(num_prompt, self.budget.keep_tokens)
        assert self.keep_ratio is not None
        return min(num_prompt, max(1, math.ceil(self.keep_ratio * num_prompt)))

    def peak_tokens(self, num_prompt: int, max_tokens: int) -> int:
        """KV tokens the request ever holds: its prompt while it prefills, then the kept part
        plus every generated token but the last."""
        return max(num_prompt, self.kept_bound(num_prompt) + max_tokens - 1)


@dataclass(frozen=True)
class CutResult:
    """What one cut did: prompt tokens before and after, its wall time and the kept indices."""

    num_prompt: int
    num_kept: int
    seconds: float
    index: torch.Tensor | None = None


def serving_policy(
    spec: str, keep_ratio: float | None, default: float | None = None
) -> tuple[KeepBudget, Policy]:
    """``spec`` built as the engine serves it: its budget (:func:`kvdrop.spec.keep_budget`),
    ``chunk_size=1`` where it takes one (the paged cache has no chunk constraint), and not one
    that reads KVzip's reconstruction scores. Needs no model, so ``kvdrop engine`` checks its
    ``--policy`` with it before loading one; ``InvalidRequestError`` saying what is wrong."""
    from kvdrop.errors import PolicyNotFoundError  # the policy library, on first use
    from kvdrop.spec import describe, get, keep_budget

    try:
        budget = keep_budget(spec, keep_ratio, default=default)
        names = {p.name for p in describe(spec).params}
        params: dict[str, Any] = budget.params
        if "chunk_size" in names:
            params["chunk_size"] = 1
        policy = get(spec, **params)
    except (PolicyNotFoundError, ValueError, TypeError) as exc:
        raise InvalidRequestError(f"policy {spec!r}: {_message(exc)}") from None
    if policy.token_scores:
        raise InvalidRequestError(
            f"policy {spec!r} reads the engine's reconstruction scores (KVzip), which the "
            "engine does not compute while serving; pick another policy"
        )
    return budget, policy


class PromptDropper:
    """The engine's drop policies: the ``--policy`` default and per-request overrides.

    ``spec`` is a registered name or spec string (plugins included), built with the budget
    :func:`kvdrop.spec.keep_budget` decides (the spec's own ``keep_ratio`` over ``keep_ratio``'s
    default of 0.5; ``keep_ratio`` given beside a different one of the spec is an error) and
    the paged cache's lack of a chunk constraint (``chunk_size=1`` where the policy takes one),
    and checked once on a random prompt of the model's layout (:meth:`check`), so a policy
    that cannot run on the model fails at start, or a request's override with a clear
    ``InvalidRequestError`` before its prefill. ``spec=None`` serves without a default cut;
    requests may still ask for one. ``query_window`` / ``query_stride`` size the query rows a
    window-reading policy gets (``--query-window`` / ``--query-stride``).
    """

    def __init__(
        self,
        config: ModelConfig,
        spec: str | None = None,
        *,
        keep_ratio: float | None = None,
        min_prompt_tokens: int = DEFAULT_MIN_PROMPT_TOKENS,
        query_window: int = DEFAULT_QUERY_WINDOW,
        query_stride: int = DEFAULT_QUERY_STRIDE,
        client_policies: str = DEFAULT_CLIENT_POLICIES,
        cut_timeout_s: float = DEFAULT_CUT_TIMEOUT_S,
    ) -> None:
        try:
            if keep_ratio is not None:
                keep_ratio = checked_ratio(keep_ratio, "--keep-ratio")
            self.sizes = QueryCapture(QueryNeed.WINDOW, query_window, query_stride)
        except ValueError as exc:
            raise EngineSetupError(str(exc)) from None
        if min_prompt_tokens < 1:
            raise EngineSetupError(f"--min-drop-tokens must be >= 1, got {min_prompt_tokens}")
        ok = isinstance(cut_timeout_s, (int, float)) and not isinstance(cut_timeout_s, bool)
        if not ok or not math.isfinite(cut_timeout_s) or not 0 < cut_timeout_s <= 3600:
            raise EngineSetupError(f"--cut-timeout-s must be in (0, 3600], got {cut_timeout_s!r}")
        #: How long one request's cut may run (off the loop) before the request fails.
        self.cut_timeout_s = float(cut_timeout_s)
        self.config = config
        self.rope_json = config.rope.to_json()
        #: The explicit ``--keep-ratio`` (None: the spec's own, else 0.5).
        self.keep_ratio = keep_ratio
        self.min_prompt_tokens = int(min_prompt_tokens)
        self._built: dict[tuple[str, float | None, float | None], PromptCut] = {}
        self.default: PromptCut | None = None
        if spec is not None:
            try:
                self.default = self._build(spec, self.keep_ratio)
            except InvalidRequestError as exc:
                raise EngineSetupError(f"--policy {spec}: {exc}") from None
        #: What a request's override may name (the server's own policy always).
        self.clients = ClientSpecs(client_policies, () if spec is None else (spec,))

    def may_pick(self, name: str) -> bool:
        """Whether a request's override may name policy ``name`` (``--client-policies``:
        :class:`~kvdrop_engine.client_specs.ClientSpecs`)."""
        return self.clients.may_pick(name)

    def check_client(self, spec: str) -> None:
        """``InvalidRequestError`` when a request may not ask for ``spec``
        (:meth:`ClientSpecs.check <kvdrop_engine.client_specs.ClientSpecs.check>`)."""
        self.clients.check(spec)

    def _build(
        self, spec: str, keep_ratio: float | None, default: float | None = None
    ) -> PromptCut:
        """The cut of ``spec`` with an explicit ``keep_ratio`` (or None) over ``default``."""
        key = (spec, keep_ratio, default)
        if key not in self._built:
            budget, policy = serving_policy(spec, keep_ratio, default)
            try:
                capture = QueryCapture.for_policies(
                    [policy], window=self.sizes.window, stride=self.sizes.stride
                )
            except ValueError as exc:
                raise InvalidRequestError(f"policy {spec!r}: {_message(exc)}") from None
            cut = PromptCut(spec, budget, policy, capture)
            self.check(cut)
            if len(self._built) >= _MAX_BUILT:  # requests choose the keys: keep the cache small
                self._built.pop(next(iter(self._built)))
            self._built[key] = cut
        return self._built[key]

    def check(self, cut: PromptCut) -> None:
        """Run ``cut`` once on a random prompt of the model's layout, so a policy that cannot
        run on this model fails at start (``InvalidRequestError``), not on the first request."""
        cfg = self.config
        run = dry_run_inputs(cfg, _CHECK_TOKENS, cut.policy.needs, cut.capture, rope=self.rope_json)
        kv, tokens = run.tensors[CacheKind.KV], run.tokens
        try:
            _kept(cut, kv, tokens, _chosen(cut, run.tensors, tokens, run.context), run.context)
        except PolicyFailedError as exc:
            raise InvalidRequestError(
                f"cannot run on this model ({cfg.num_layers} layers, {cfg.num_kv_heads} KV heads "
                f"x {cfg.head_dim}): {_message(exc.__cause__ or exc)}"
            ) from None

    def choose(self, num_prompt: int, override: Override | Any | None = UNSET) -> PromptCut | None:
        """The cut of a request with ``num_prompt`` tokens: its parsed ``"kvdrop"`` override
        (``UNSET``: none was sent; None: no cut) over the engine's default; None under the
        threshold."""
        least = self.min_prompt_tokens
        if override is UNSET:
            cut = self.default
        else:
            parsed: Override | None = override  # parsed once: RequestOptions
            if parsed is None:
                return None
            spec = parsed.policy or (None if self.default is None else self.default.spec)
            if spec is None:
                raise InvalidRequestError(
                    "'kvdrop' gives no policy and the engine has no --policy; send "
                    '{"policy": "snapkv", "keep_ratio": 0.5}'
                )
            self.check_client(spec)
            cut = self._build(spec, parsed.keep_ratio, self.keep_ratio)
            if parsed.min_drop_tokens is not None:
                least = parsed.min_drop_tokens
        if cut is None or num_prompt < least:
            return None
        return cut

    def _context(
        self, n: int, qpos: torch.Tensor | None, lse: torch.Tensor | None, device: str
    ) -> EditContext:
        return EditContext(
            positions=torch.arange(n),
            query_positions=qpos,
            query_lse=lse,
            rope=self.rope_json,
            prompt_tokens=n,
            head_dim=self.config.head_dim,
            device=device,
        )

    def cut(self, cache: PagedKVCache, req: Request, cut: PromptCut) -> CutResult:
        """Cut ``req``'s prefilled prompt in place, on the calling thread: :meth:`start`, the
        policy, :meth:`apply` (see the module docstring for what each does)."""
        started = time.perf_counter()
        job = self.start(cache, req, cut)
        return self.apply(cache, req, job, job.choose(), started)

    def start(self, cache: PagedKVCache, req: Request, cut: PromptCut) -> CutJob:
        """(on the loop) ``req``'s prefilled prompt K/V gathered from its blocks (a copy, so the
        policy may run on another thread while the loop steps other requests) and the query
        rows its policy reads, as a :class:`CutJob`."""
        n = req.num_computed
        with torch.inference_mode():
            kv = cache.read(req.blocks, n)  # [2, L, n, Hkv*d] on the cache's device
        tensors: dict[Any, torch.Tensor] = {CacheKind.KV: kv}
        qpos = None
        rows = None if req.window is None else req.window.rows()
        if cut.capture.enabled and rows is not None:
            qpos, queries = rows
            layers, r = queries.shape[0], queries.shape[1]
            tensors[CacheKind.QUERY] = queries.reshape(1, layers, r, -1)
        # No log-normalisers: every key a captured row attended to is in ``kv`` (the whole
        # prompt, no uncached tail), so a softmax over the cached keys is the true one.
        context = self._context(n, qpos, None, str(kv.device))
        return CutJob(cut, tensors, req.prompt[:n], context, _LoopStream.after_gather(kv))

    def apply(
        self,
        cache: PagedKVCache,
        req: Request,
        job: CutJob,
        chosen: tuple[torch.Tensor, torch.Tensor, list[int]],
        started: float,
    ) -> CutResult:
        """(on the loop) Write the kept rows back: afterwards ``req``'s blocks hold them at
        positions ``0..k-1``, ``req.prompt`` is the kept token ids, ``req.num_computed`` is
        ``k`` and ``req.kept_index`` the kept indices; blocks past the next token's are freed
        (decoding grows the request again, block by block: ``Scheduler.grow``), or with a decode
        cut past what it may grow to before that cut (:meth:`Request.hold_tokens`)."""
        index, kept_kv, kept_tokens = chosen
        n, k = len(job.tokens), len(kept_tokens)
        if k < n:
            with torch.inference_mode():
                cache.load(req.blocks, kept_kv.to(cache.dtype), 0)
        _resize(cache.allocator, req, blocks_needed(req.hold_tokens(k), cache.block_size))
        req.uncut_prompt = req.prompt[:n]
        req.kept_index = index
        req.prompt = kept_tokens + req.prompt[n:]
        req.num_computed = k
        req.store_upto = 0  # stored (with a connector) before the cut
        return CutResult(n, k, time.perf_counter() - started, index)

    def recut(self, cache: PagedKVCache, req: Request) -> None:
        """(a preempted cut request, its whole prompt prefilled again) Keep ``req.kept_index``
        of it, as :meth:`apply` did the first time (the policy is not asked again: the same
        rows, re-rotated the same way), and give back the blocks the kept rows and its
        generated tokens do not need."""
        assert req.kept_index is not None and req.cut is not None
        n = len(req.prompt)
        with torch.inference_mode():
            kv = cache.read(req.blocks, n)
            context = self._context(n, None, None, str(kv.device))
            kept_kv, kept_tokens = _kept(req.cut, kv, req.prompt, req.kept_index, context)
            cache.load(req.blocks, kept_kv.to(cache.dtype), 0)
        k = len(kept_tokens)
        req.prompt, req.num_computed, req.recut = kept_tokens, k, False
        _resize(cache.allocator, req, blocks_needed(max(req.recut_tokens, 1), cache.block_size))


@dataclass(frozen=True)
class CutJob:
    """A cut's inputs, gathered on the loop; :meth:`choose` runs the policy on them (any
    thread: it touches no block)."""

    cut: PromptCut
    tensors: Mapping[Any, torch.Tensor]
    tokens: list[int]
    context: EditContext
    stream: _LoopStream | None = None

    def choose(self) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """The checked kept indices, the kept rows (keys re-rotated) and their token ids;
        ``PolicyFailedError`` naming the policy when it fails or chooses badly."""
        kv = self.tensors[CacheKind.KV]
        with torch.inference_mode(), _on_side(self.stream):
            index = _chosen(self.cut, self.tensors, self.tokens, self.context)
            kept_kv, kept_tokens = _kept(self.cut, kv, self.tokens, index, self.context)
            if self.stream is not None:
                self.stream.hand_back(index, kept_kv)
        return index, kept_kv, kept_tokens


@dataclass(frozen=True)
class _LoopStream:
    """(CUDA) The loop's stream at a cut's gather and an event after it. A cut's policy runs on
    a high-priority stream of its own: on the loop's stream each of its host syncs (a top-k's
    indices read back, say) would wait behind every prefill the loop enqueued meanwhile, and a
    snapkv cut of an 8-14K prompt took 1.3 s on an H200 that way, all of it in the request's
    time to first token."""

    stream: torch.cuda.Stream
    gathered: torch.cuda.Event

    @staticmethod
    def after_gather(kv: torch.Tensor) -> _LoopStream | None:
        if kv.device.type != "cuda":
            return None
        stream = torch.cuda.current_stream(kv.device)
        return _LoopStream(stream, stream.record_event())

    def hand_back(self, *tensors: torch.Tensor) -> None:
        """Mark what the policy made on the side stream as used by the loop's stream, so the
        allocator reuses none of it before the loop's reads end."""
        for t in tensors:
            if t.is_cuda:
                t.record_stream(self.stream)


@contextmanager
def _on_side(loop: _LoopStream | None) -> Iterator[None]:
    """Run the body on a fresh high-priority stream that starts after the gather (CUDA), or
    as it is (CPU)."""
    if loop is None:
        yield
        return
    side = torch.cuda.Stream(loop.stream.device, priority=-1)
    side.wait_event(loop.gathered)
    try:
        with torch.cuda.stream(side):
            yield
    finally:
        side.synchronize()  # the gathered K/V stay read until here, also when the policy fails


class PendingCut:
    """A cut running on a thread of its own (:meth:`PromptDropper.start` then
    :meth:`CutJob.choose`), with its deadline: the loop steps every other request meanwhile,
    and applies it (or fails its request) once :meth:`ready`. A policy still running at the
    deadline is abandoned (Python cannot stop a thread; its late result is dropped)."""

    def __init__(self, job: CutJob, timeout_s: float, wake: Callable[[], None]) -> None:
        self.job = job
        self.started = time.perf_counter()
        self.deadline = time.monotonic() + timeout_s
        self.timeout_s = timeout_s
        self._box: list[tuple[bool, Any]] = []
        self._wake = wake

        def run() -> None:
            try:
                self._box.append((True, job.choose()))
            except BaseException as exc:  # handed to the loop by result()
                self._box.append((False, exc))
            wake()

        name = f"kvdrop-cut-{job.cut.spec[:16]}"
        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    def ready(self, now: float) -> bool:
        """Whether the loop should take it now: the policy ended, or its deadline passed."""
        return bool(self._box) or now >= self.deadline

    def result(self) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """The policy's choice; ``PolicyFailedError`` when it failed or ran past its deadline."""
        if not self._box:
            raise PolicyFailedError(
                f"policy {self.job.cut.spec!r} did not finish its cut of this request's "
                f"{len(self.job.tokens)}-token prompt within {self.timeout_s:g} s "
                "(kvdrop engine --cut-timeout-s); the request is failed, the others go on"
            )
        ok, value = self._box[0]
        if not ok:
            raise value
        return value


def prepare_cut(
    dropper: PromptDropper | None, req: Request, override: Any = UNSET
) -> PromptCut | None:
    """(at submission, for :func:`kvdrop_engine.plan.plan_request`) ``req``'s prompt cut for its
    parsed ``"kvdrop"`` ``override`` (``UNSET``: none sent); asking for a cut from an engine
    without a dropper is an ``InvalidRequestError``. A request that may be cut reports its kept
    prompt tokens once (:class:`~kvdrop_sdk.events.TokenEvent`)."""
    if dropper is None:
        if override is not UNSET and override is not None:
            raise InvalidRequestError(
                "'kvdrop' asks for dropping, but this engine was built without a dropper "
                "(kvdrop engine --policy, or Engine(dropper=PromptDropper(...)))"
            )
        return None
    cut = dropper.choose(len(req.prompt), override)
    if override is not UNSET or dropper.default is not None:
        req.kept_prompt = len(req.prompt)  # reported as kept; the cut lowers it
    if req.params.max_tokens == 1:
        return None  # one token: nothing would decode from the cut cache
    return cut


@dataclass(frozen=True)
class CutPrompt:
    """(after prefill) Cut the prompt's cache by the request's policy, off the loop: the first
    token (from the prefill's logits) is handed over at once, and the request decodes on once
    the cut is applied (``Engine._finish_cut``). An action of a
    :class:`~kvdrop_engine.plan.RequestPlan`; a request that ends with its first token, or
    whose cut was applied already (a preempted one recomputing), is not cut."""

    def run(self, host: Any, req: Request, step: Any) -> bool:
        if req.kept_index is not None or step.reason is not None:
            return False
        host.start_cut(req)
        return False  # the first event goes out now: its token does not depend on the cut


def _resize(allocator: BlockAllocator, req: Request, need: int) -> None:
    """Give ``req`` exactly ``need`` blocks: free the tail, or take more when a policy kept
    more than its keep ratio promised (``OutOfBlocksError`` when none are free)."""
    if need < len(req.blocks):
        allocator.free(req.blocks[need:])
        req.blocks = req.blocks[:need]
    elif need > len(req.blocks):
        req.blocks = req.blocks + allocator.allocate(need - len(req.blocks))


def _chosen(
    cut: PromptCut, tensors: Mapping[Any, torch.Tensor], tokens: list[int], context: EditContext
) -> torch.Tensor:
    """The indices ``cut``'s policy keeps of ``tokens``, checked (sorted, unique, in range, at
    least one) before any block is touched; ``PolicyFailedError`` naming the policy otherwise."""
    from kvdrop.policy import checked_index

    try:
        _, index = cut.policy.select_indices(tensors, tokens, context=context)
        return checked_index(cut.spec, index, len(tokens))
    except Exception as exc:  # a policy's (or plugin's) failure is this request's alone
        raise _failed(cut, len(tokens), exc) from exc


def _kept(
    cut: PromptCut,
    kv: torch.Tensor,
    tokens: list[int],
    index: torch.Tensor,
    context: EditContext,
) -> tuple[torch.Tensor, list[int]]:
    """The rows at ``index`` with their keys re-rotated to ``0..k-1`` (the policy's ``keep``)."""
    try:
        return cut.policy.keep(kv, tokens, index, context=context)
    except Exception as exc:
        raise _failed(cut, len(tokens), exc) from exc


def _failed(cut: PromptCut, num_prompt: int, exc: BaseException) -> PolicyFailedError:
    return PolicyFailedError(
        f"policy {cut.spec!r} failed on this request's {num_prompt}-token prompt: "
        f"{type(exc).__name__}: {_message(exc)}"
    )


def _message(exc: BaseException) -> str:
    """The first line of an error (KeyError quotes its message)."""
    text = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
    return str(text).splitlines()[0] if str(text) else type(exc).__name__
