"""The contract every kvdrop policy keeps, as checks a plugin's own CI can run (no source
checkout needed): ``kvdrop.testing.check_policy("my-policy")``.

:func:`check_policy` runs four checks on one policy, given by its registered name or by its
factory (a :class:`kvdrop.PolicyFactory`, registered or not):

- :func:`check_invariants`: first :func:`check_parameter_values` (explicit examples: every
  dtype, the budget's extremes, and every value of every declared parameter's domain, bounds
  included), then hypothesis draws inputs from the documented domain (below) and parameters
  from their declared domains, with ``derandomize=True`` (the same examples on every run and
  machine); the policy must not raise on these finite inputs (non-finite scores are refused by
  the selector), the output must have the input's L, D, dtype and device, keep
  ``expected_count`` tokens in order, be the input's rows bit for bit, leave the inputs (KV,
  queries and token scores) bit for bit unchanged, be deterministic, and accept another SDK's
  cache-kind enum by value. Every failure names the example's parameters and shape. A query
  policy that takes a query window (``QueryNeed.WINDOW``) is also called the way the engine
  calls it: the last rows of a longer prompt with their positions (:func:`check_window_path`);
  one that says it reads no strided sample (``reads_query_sample = False``) keeps the same
  tokens without it (:func:`check_query_sample`).
- :func:`check_invalid_parameters`: bad ``keep_ratio``/``chunk_size``/unknown parameters raise
  ``PolicyParamError`` naming the parameter.
- :func:`check_wrong_shapes`: wrongly shaped inputs raise ``PolicyInputError`` (and
  ``MissingQueryError`` for a query policy without queries).
- :func:`check_describes_itself`: a built policy is a ``kvdrop.Policy`` and says what ``describe``
  says.

The input domain: T = 1..160 tokens (1..8 always tried, :data:`SHORT_PROMPTS`); chunk sizes 1, 4,
16, 32; float32, bfloat16, float16; 1-3 layers; 1-3 KV heads of ``head_dim`` 2, 4 or 8 and GQA
groups of 1 or 2; ``keep_ratio`` in [0.01, 1] or ``keep_tokens`` 1..200. Other parameters: each of
their ``choices``, bools, ints 0..40, floats in [-1, 1] and None where the type allows, kept where
the parameter's own ``check`` accepts them; parameters of other types keep ``PolicyInfo.example``'s
value or their default.
The tensors come from the one dry run the engine and the experiment harness use
(:func:`kvdrop_sdk.dry_run.dry_run_inputs`), so all three hand a policy the same inputs.
:func:`policy_names` lists what to parametrize a pytest test over. Needs ``hypothesis``.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import itertools
import types
import typing
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvdrop.errors import (
    MissingQueryError,
    MissingTokenScoresError,
    PolicyInputError,
    PolicyParamError,
    PolicyWarning,
)
from kvdrop.factories import PolicyFactory, PolicyInfo
from kvdrop.params import Param
from kvdrop.policy import Policy
from kvdrop.registry import available, factory, source
from kvdrop_sdk import CacheKind
from kvdrop_sdk.dry_run import dry_run_inputs
from kvdrop_sdk.edit import EditContext
from kvdrop_sdk.query_capture import Needs, QueryCapture, QueryNeed, needs_of

__all__ = [
    "DTYPES",
    "Case",
    "ForeignKind",
    "check_describes_itself",
    "check_invalid_parameters",
    "check_invariants",
    "check_parameter_values",
    "check_policy",
    "check_query_sample",
    "check_window_path",
    "check_wrong_shapes",
    "describe_case",
    "expected_count",
    "explicit_cases",
    "parameter_domain",
    "policy_names",
]

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Parameters drawn with the tensors (budget, chunk size and head_dim must fit them).
SHAPED = frozenset({"keep_ratio", "keep_tokens", "chunk_size", "head_dim"})
INTS = tuple(range(41))
FLOATS = (-1.0, -0.5, 0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)

PolicyRef = str | PolicyFactory


class ForeignKind(enum.Enum):
    """Another SDK's cache-kind enum (e.g. LMCache's): policies must accept it by value."""

    KV = "kv"
    QUERY = "query"


@dataclass(frozen=True)
class Case:
    """One drawn input: parameters, ``kv [2, L, T, D]``, ``query [1, L, T, Dq]``, distinct token
    ids (so each kept token maps back to one index), the per-head size, and per-token scores
    ``[L, Hkv, T]`` of the engine's reconstruction pass (for policies declaring
    ``token_scores``, e.g. ``kvzip``; they get them in the edit context)."""

    params: dict[str, Any]
    kv: torch.Tensor
    query: torch.Tensor
    tokens: list[int]
    head_dim: int
    scores: torch.Tensor | None = None

    def context(self, policy: Any) -> EditContext | None:
        """The edit context a policy that reads token scores gets (None for the others)."""
        if not policy.token_scores or self.scores is None:
            return None
        return EditContext.of(self.kv.shape[2], token_scores=self.scores)


def policy_names(distribution: str | None = None) -> list[str]:
    """Registered policy names, or only those of ``distribution`` (your plugin's dist name):
    ``@pytest.mark.parametrize("name", policy_names("my-plugin"))``."""
    names = available()
    if distribution is None:
        return names
    return [n for n in names if source(n).startswith(f"distribution {distribution!r} ")]


def _factory(ref: PolicyRef) -> PolicyFactory:
    return factory(ref) if isinstance(ref, str) else ref


def _type_args(tp: Any) -> tuple[Any, ...]:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return typing.get_args(tp)
    return (tp,)


def parameter_domain(name: str, p: Param) -> list[Any]:
    """Values of parameter ``p`` to draw from: its choices, or candidates of its type that its
    own validation accepts; empty when none can be inferred."""
    if p.choices is not None:
        return list(p.choices)
    kinds = _type_args(p.type)
    candidates: list[Any] = []
    if bool in kinds:
        candidates += [False, True]
    if int in kinds:
        candidates += INTS
    if float in kinds:
        candidates += FLOATS
    if candidates and type(None) in kinds:
        candidates.append(None)
    ok = []
    for value in candidates:
        try:
            p.validate(name, value)
        except PolicyParamError:
            continue
        ok.append(value)
    return ok


def _draw_case(draw: Callable[[Any], Any], info: PolicyInfo) -> Case:
    import hypothesis.strategies as st

    head_dim = draw(st.sampled_from([2, 4, 8]))
    kv_heads, group = draw(st.integers(1, 3)), draw(st.sampled_from([1, 2]))
    num_tokens, chunk = draw(st.integers(1, 160)), draw(st.sampled_from([1, 4, 16, 32]))
    params: dict[str, Any] = {}
    for p in info.params:
        if p.name in SHAPED:
            continue
        values = parameter_domain(info.name, p)
        if values:
            params[p.name] = draw(st.sampled_from(values))
        elif p.name in info.example:
            params[p.name] = info.example[p.name]
    params["chunk_size"] = chunk
    if draw(st.booleans()):
        params["keep_ratio"] = draw(st.floats(0.01, 1.0))
    else:
        params["keep_tokens"] = draw(st.integers(1, 200))
    if "head_dim" in {p.name for p in info.params}:
        params["head_dim"] = head_dim
    dtype, layers = draw(st.sampled_from(DTYPES)), draw(st.integers(1, 3))
    layout = _Layout(layers, kv_heads, kv_heads * group, head_dim)
    return _case(params, layout, num_tokens, dtype, draw(st.integers(0, 2**16)))


@dataclass(frozen=True)
class _Layout:
    """The model layout one example's tensors have (what :func:`dry_run_inputs` reads)."""

    num_layers: int
    num_kv_heads: int
    num_heads: int
    head_dim: int


#: What every example carries: every query row and per-token scores (a policy reads what it
#: declares; the kit hands every input over, as the engine's fullest capture does).
_EVERYTHING = Needs(QueryNeed.FULL, token_scores=True)
_FULL_CAPTURE = QueryCapture(QueryNeed.FULL, scores=True)


def _case(
    params: dict[str, Any], layout: _Layout, num_tokens: int, dtype: torch.dtype, seed: int
) -> Case:
    """One example's inputs from the one dry run the engine and the harness use
    (:func:`kvdrop_sdk.dry_run.dry_run_inputs`: KV, every query row, token scores), in
    ``dtype``, with distinct token ids drawn apart from the positions (so a policy that returns
    indices for tokens fails)."""
    run = dry_run_inputs(layout, num_tokens, _EVERYTHING, _FULL_CAPTURE, seed=seed)
    kv = run.tensors[CacheKind.KV].to(dtype)
    query = run.tensors[CacheKind.QUERY].to(dtype)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randperm(10 * num_tokens + 10, generator=gen)[:num_tokens].tolist()
    return Case(params, kv, query, tokens, layout.head_dim, run.context.token_scores)


def expected_count(params: dict[str, Any], num_tokens: int) -> int:
    """The contract's budget: aligned down to chunk_size, at least one chunk, at most T."""
    chunk = params["chunk_size"]
    raw = params.get("keep_tokens")
    if raw is None:
        raw = int(params["keep_ratio"] * num_tokens + 1e-9)
    return min(max(chunk, raw - raw % chunk), num_tokens)


def _check_kept(case: Case, out: torch.Tensor, kept: list[Any], count: int | None) -> None:
    """Shape, dtype, order and bit-identical rows of one result."""
    kv, tokens = case.kv, case.tokens
    assert out.dim() == 4 and out.shape[:2] == kv.shape[:2] and out.shape[3] == kv.shape[3], (
        f"output shape {tuple(out.shape)} does not match the input {tuple(kv.shape)} but in T"
    )
    assert out.dtype == kv.dtype and out.device == kv.device, "output dtype/device changed"
    assert out.shape[2] == len(kept), "output rows and kept tokens differ in number"
    if count is not None:
        assert len(kept) == count, f"kept {len(kept)} tokens; the budget is {count}"
        if count < kv.shape[2]:
            assert count % case.params["chunk_size"] == 0, "the budget is not chunk-aligned"
    index = {t: i for i, t in enumerate(tokens)}
    assert all(t in index for t in kept), "kept tokens must be input tokens"
    positions = [index[t] for t in kept]
    twice = sorted(p for p, n in collections.Counter(positions).items() if n > 1)
    assert not twice, f"kept positions {twice[:8]} more than once (a duplicate index)"
    assert all(a < b for a, b in itertools.pairwise(positions)), "kept tokens must keep order"
    assert torch.equal(out, kv[:, :, positions]), "kept rows must be the input rows, bit-identical"


def describe_case(name: str, case: Case) -> str:
    """What one example was, for failure messages: the parameters and the tensors' shape."""
    params = ", ".join(f"{k}={v!r}" for k, v in sorted(case.params.items()))
    _, layers, tokens, width = case.kv.shape
    return f"{name}({params}) on T={tokens}, L={layers}, D={width}, {case.kv.dtype}"


def _inputs_of(case: Case) -> dict[str, torch.Tensor]:
    named = {"KV": case.kv, "queries": case.query}
    if case.scores is not None:
        named["token scores"] = case.scores
    return named


def _check_unchanged(before: dict[str, torch.Tensor], case: Case, label: str) -> None:
    """Every input (KV, queries, token scores) is bit for bit what it was before the call."""
    for what, now in _inputs_of(case).items():
        if not torch.equal(now, before[what]):
            diff = (now.float() - before[what].float()).abs().nan_to_num(nan=float("inf"))
            raise AssertionError(
                f"{label}: the policy changed its input {what} in place (max change "
                f"{float(diff.max()):.3g}); score() must not edit kv, query or token scores: "
                "clone before editing (note that .float() of a float32 tensor is the same tensor)"
            )


def _call(label: str, policy: Any, tensors: Any, case: Case, context: Any) -> Any:
    """The policy's result; a policy that raises on these finite, in-domain inputs fails with
    the example named (non-finite scores land here: the selector refuses them)."""
    try:
        return policy(tensors, case.tokens, context=context)
    except Exception as exc:
        raise AssertionError(
            f"{label}: raised {type(exc).__name__} on finite inputs inside the documented "
            f"domain: {exc}"
        ) from exc


def _invariants(ref: PolicyRef, case: Case) -> None:
    make = _factory(ref)
    label = describe_case(make.info.name, case)
    before = {what: t.clone() for what, t in _inputs_of(case).items()}
    tensors = {CacheKind.KV: case.kv, CacheKind.QUERY: case.query}
    policy = make(**case.params)
    context = case.context(policy)
    out, kept = _call(label, policy, tensors, case, context)
    _check_unchanged(before, case, label)
    count = expected_count(case.params, case.kv.shape[2])
    try:
        _check_kept(case, out, list(kept), count)
    except AssertionError as exc:
        raise AssertionError(f"{label}: {exc}") from exc
    if count == case.kv.shape[2]:
        assert list(kept) == case.tokens and torch.equal(out, case.kv), f"{label}: all kept, but "
        "the input did not come back"
    foreign = {ForeignKind.KV: case.kv, ForeignKind.QUERY: case.query}
    out2, kept2 = _call(label, make(**case.params), foreign, case, context)
    assert list(kept2) == list(kept) and torch.equal(out2, out), f"{label}: not deterministic"


def _base_case(info: PolicyInfo, dtype: torch.dtype, num_tokens: int = 48, **shape: Any) -> Case:
    """One fixed input of the domain: T=48 (or ``num_tokens``), 2 layers, 2 KV heads of
    head_dim 4, GQA 2, the example's parameters, keep half in chunks of 1 (``shape`` overrides
    the budget)."""
    layout = _Layout(num_layers=2, num_kv_heads=2, num_heads=4, head_dim=4)
    params: dict[str, Any] = {**dict(info.example), "chunk_size": 1, "keep_ratio": 0.5}
    if "head_dim" in {p.name for p in info.params}:
        params["head_dim"] = layout.head_dim
    params.update(shape)
    if "keep_tokens" in shape:
        params.pop("keep_ratio")
    return _case(params, layout, num_tokens, dtype, seed=7)


#: The budget's bounds and extremes, drawn explicitly: the smallest and largest ratio, a budget
#: of one token, of all and of more than T, a chunk longer than T.
BUDGET_EXTREMES: tuple[dict[str, Any], ...] = (
    {"keep_ratio": 0.01},
    {"keep_ratio": 1.0},
    {"keep_tokens": 1},
    {"keep_tokens": 48},
    {"keep_tokens": 200},
    {"keep_ratio": 0.5, "chunk_size": 32},
    {"keep_ratio": 0.5, "chunk_size": 64},
)


#: Prompt lengths every policy is tried on explicitly: the shortest prompts are where sink
#: counts, windows and chunk sizes cover the whole prompt (``cap`` raised on 2-4 tokens).
SHORT_PROMPTS = tuple(range(1, 9))


def explicit_cases(ref: PolicyRef) -> Iterator[Case]:
    """The examples every check runs besides the drawn ones: each dtype at the example's
    parameters, prompts of 1-8 tokens, the budget's extremes, and every value of every declared
    parameter's domain (its bounds included) with the others at their defaults."""
    info = _factory(ref).info
    for dtype in DTYPES:
        yield _base_case(info, dtype)
    for n in SHORT_PROMPTS:
        yield _base_case(info, torch.float32, num_tokens=n)
    for shape in BUDGET_EXTREMES:
        yield _base_case(info, torch.float32, **shape)
    for p in info.params:
        if p.name in SHAPED:
            continue
        for value in parameter_domain(info.name, p):
            case = _base_case(info, torch.float32)
            yield Case({**case.params, p.name: value}, *dataclasses.astuple(case)[1:])


def check_parameter_values(ref: PolicyRef) -> None:
    """:func:`explicit_cases` through the invariants (and the window path for a window policy):
    a bug at one parameter value fails here whatever hypothesis draws."""
    make = _factory(ref)
    window = make(**dict(make.info.example)).queries is QueryNeed.WINDOW
    with _quiet():
        for case in explicit_cases(ref):
            _invariants(ref, case)
            if window:
                check_window_path(ref, case, 8, 16)
        if window:
            check_query_sample(ref)


#: check_query_sample's prompt and capture: a window wider than any example's observation
#: window (64), and a sample of every 5th row before it.
_SAMPLE_TOKENS, _SAMPLE_WINDOW, _SAMPLE_STRIDE = 240, 80, 5


def check_query_sample(ref: PolicyRef) -> None:
    """A window policy that declares it reads no strided sample (``Needs.query_sample``
    False: the engine then stores none for it) keeps the same tokens when the query rows hold
    the last ``_SAMPLE_WINDOW`` rows alone as when they hold a strided sample too, at its
    example's parameters. A policy that reads the sample is not checked (it may use it)."""
    make = _factory(ref)
    policy = make(**dict(make.info.example))
    if policy.queries is not QueryNeed.WINDOW or needs_of(policy).query_sample:
        return
    case = _base_case(make.info, torch.float32, num_tokens=_SAMPLE_TOKENS)
    d = case.head_dim
    layout = _Layout(case.kv.shape[1], case.kv.shape[3] // d, case.query.shape[3] // d, d)
    capture = QueryCapture(QueryNeed.WINDOW, window=_SAMPLE_WINDOW, stride=_SAMPLE_STRIDE)
    run = dry_run_inputs(layout, _SAMPLE_TOKENS, Needs(QueryNeed.WINDOW), capture, seed=3)
    positions = run.context.query_positions
    assert positions is not None
    last = positions >= _SAMPLE_TOKENS - _SAMPLE_WINDOW
    kept = []
    for rows in (torch.ones_like(last), last):
        query = run.tensors[CacheKind.QUERY][:, :, rows]
        context = EditContext(
            positions=torch.arange(_SAMPLE_TOKENS),
            query_positions=positions[rows],
            prompt_tokens=_SAMPLE_TOKENS,
            head_dim=d,
        )
        tensors = {CacheKind.KV: case.kv, CacheKind.QUERY: query}
        label = f"{describe_case(make.info.name, case)}, {int(rows.sum())} query rows"
        with _quiet():
            kept.append(list(_call(label, make(**case.params), tensors, case, context)[1]))
    assert kept[0] == kept[1], (
        f"{make.info.name} declares reads_query_sample = False, but the strided sample of "
        f"query rows changes what it keeps ({len(set(kept[0]) ^ set(kept[1]))} tokens differ): "
        "declare reads_query_sample = True, or read only the last rows (last_rows)"
    )


def check_window_path(ref: PolicyRef, case: Case, tail: int, rows: int) -> None:
    """Call the policy as the engine does in window mode: the prompt has ``tail`` more tokens
    than the cache's T, and the query tensor holds only its last ``rows`` rows, with their
    positions (some past T), no log-normalisers and no RoPE parameters (so nothing is
    re-rotated and the kept rows come back bit for bit)."""
    num_tokens = case.kv.shape[2]
    total = num_tokens + tail
    rows = max(1, min(rows, total))
    # The dry run of the whole prompt, as a window capture keeps it: its last ``rows`` queries.
    d = case.head_dim
    layout = _Layout(case.kv.shape[1], case.kv.shape[3] // d, case.query.shape[3] // d, d)
    capture = QueryCapture(QueryNeed.WINDOW, window=rows, stride=0)
    run = dry_run_inputs(layout, total, Needs(QueryNeed.WINDOW), capture, seed=total)
    query = run.tensors[CacheKind.QUERY]
    context = EditContext(
        positions=torch.arange(num_tokens),
        query_positions=run.context.query_positions,
        prompt_tokens=total,
        head_dim=case.head_dim,
    )
    make = _factory(ref)
    label = f"{describe_case(make.info.name, case)}, window path (tail {tail}, {rows} rows)"
    window = Case(case.params, case.kv, query.to(case.kv.dtype), case.tokens, case.head_dim)
    before = {what: t.clone() for what, t in _inputs_of(window).items()}
    tensors = {CacheKind.KV: window.kv, CacheKind.QUERY: window.query}
    out, kept = _call(label, make(**case.params), tensors, case, context)
    _check_unchanged(before, window, label)
    try:
        _check_kept(case, out, list(kept), None)
    except AssertionError as exc:
        raise AssertionError(f"{label}: {exc}") from exc
    again = _call(label, make(**case.params), tensors, case, context)
    assert list(again[1]) == list(kept), f"{label}: not deterministic on the window path"


@contextmanager
def _quiet() -> Iterator[None]:
    """Tiny budgets and short windows warn (PolicyWarning); the checks are about results."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PolicyWarning)
        yield


def check_invariants(
    ref: PolicyRef, *, max_examples: int = 40, device: torch.device | str = "cpu"
) -> None:
    """The explicit examples (:func:`check_parameter_values`), then the drawn-input checks
    (hypothesis, derandomized); raises on the first falsified one, naming its parameters.
    ``device``: where the drawn tensors live (e.g. "cuda": the output must stay there and its
    rows be the input's, bit for bit, as on the host)."""
    try:
        from hypothesis import HealthCheck, given, settings
        from hypothesis import strategies as st
    except ImportError as exc:  # the test kit's one extra dependency
        raise ImportError("kvdrop.testing needs hypothesis: pip install hypothesis") from exc
    make = _factory(ref)
    info = make.info
    policy = make(**dict(info.example))
    window = policy.queries is QueryNeed.WINDOW
    check_parameter_values(ref)

    @settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(data=st.data())
    def run(data: Any) -> None:
        case = _on_device(_draw_case(data.draw, info), torch.device(device))
        with _quiet():
            _invariants(ref, case)
            if window:
                tail, rows = data.draw(st.integers(0, 40)), data.draw(st.integers(1, 72))
                check_window_path(ref, case, tail, rows)

    run()


def _on_device(case: Case, device: torch.device) -> Case:
    if device.type == "cpu":
        return case
    scores = None if case.scores is None else case.scores.to(device)
    return replace(case, kv=case.kv.to(device), query=case.query.to(device), scores=scores)


def _raises(kind: type[Exception], fragment: str, call: Callable[[], Any]) -> None:
    try:
        call()
    except kind as exc:
        assert fragment in str(exc), f"{kind.__name__} does not mention {fragment!r}: {exc}"
        return
    raise AssertionError(f"expected {kind.__name__} mentioning {fragment!r}; nothing raised")


def check_invalid_parameters(ref: PolicyRef) -> None:
    """Bad parameters raise ``PolicyParamError`` naming the parameter."""
    make = _factory(ref)
    example = dict(make.info.example)
    for bad, fragment in [
        ({"keep_ratio": 0.0}, "keep_ratio"),
        ({"keep_ratio": 1.5}, "keep_ratio"),
        ({"keep_ratio": "half"}, "keep_ratio"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"keep_ratio": 0.5, "keep_tokens": 256}, "not both"),
        ({"bogus": 1}, "bogus"),
    ]:
        _raises(PolicyParamError, fragment, lambda bad=bad: make(**{**example, **bad}))


def check_wrong_shapes(ref: PolicyRef) -> None:
    """Wrongly shaped inputs raise ``PolicyInputError`` saying what was expected."""
    make = _factory(ref)
    fn = make(**{**dict(make.info.example), "keep_tokens": 4, "chunk_size": 4})
    kv, query, tokens = torch.randn(2, 2, 16, 8), torch.randn(1, 2, 16, 8), list(range(16))
    _raises(PolicyInputError, "[2, L, T, D]", lambda: fn({CacheKind.KV: kv[0]}, tokens))
    both = {CacheKind.KV: kv, CacheKind.QUERY: query}
    _raises(PolicyInputError, "token ids", lambda: fn(both, tokens[:15]))
    _raises(PolicyInputError, "no KV tensor", lambda: fn({CacheKind.QUERY: query}, tokens))
    if make.info.needs.reads_queries:
        _raises(
            MissingQueryError, "--enable transfer_query", lambda: fn({CacheKind.KV: kv}, tokens)
        )
    if fn.token_scores:
        _raises(MissingTokenScoresError, "reconstruction pass", lambda: fn(both, tokens))


def check_describes_itself(ref: PolicyRef) -> None:
    """A built policy is a ``kvdrop.Policy`` and says what ``describe`` says."""
    make = _factory(ref)
    fn = make(**dict(make.info.example))
    assert isinstance(fn, Policy), f"{make.info.name}: the factory built a {type(fn).__name__}"
    assert fn.queries is make.info.queries, f"queries {fn.queries} differs from describe's"


def check_policy(ref: PolicyRef, *, max_examples: int = 40) -> None:
    """Every contract check on one policy (a registered name or a factory); raises
    ``AssertionError`` (or the policy's own error) on the first broken rule."""
    check_describes_itself(ref)
    check_invalid_parameters(ref)
    check_wrong_shapes(ref)
    check_invariants(ref, max_examples=max_examples)
