"""Score identity: each kvdrop policy against its kvpress press on identical tensors.

One attention layer of a small HF ``LlamaForCausalLM`` with random weights (``--seed``) makes
the inputs both sides read: hidden states, post-RoPE keys, values and queries, and the eager
attention matrix. kvpress's ``press.score(module, hidden_states, keys, values, attentions,
kwargs)`` gives per KV head scores ``[Hkv, T]``; kvdrop's are taken before its shared
aggregation over heads and layers (a new policy's ``head_scores``, or the policy run on one KV
head's slice of the tensors, where that aggregation is the identity). A pair whose press
selects (streaming, random, ChunkKV, Block) is compared by the Jaccard index of the kept sets,
one KV head at a time (kvpress keeps a set per head; kvdrop one list for all of them, so one
head is where both select one list). Used by ``kvpress_compare.py --scores``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

import kvdrop
from kvdrop.policies.cap import CapScorer
from kvdrop.policies.finch import FinchScorer
from kvdrop.policies.leverage import LeverageScorer
from kvdrop.policies.non_causal_attn import NonCausalAttnScorer
from kvdrop.selector import Selector
from kvdrop_rope import RopeConfig
from kvdrop_sdk import CacheKind


@dataclass
class Setup:
    """One layer's inputs, in kvpress's layout and in kvdrop's."""

    module: Any
    hidden: torch.Tensor  # [1, T, hidden]
    keys: torch.Tensor  # [1, Hkv, T, d] post-RoPE
    values: torch.Tensor
    queries: torch.Tensor  # [1, Hq, T, d] post-RoPE
    attentions: torch.Tensor  # [1, Hq, T, T] causal softmax
    kwargs: dict[str, Any]
    rope: RopeConfig

    @property
    def num_tokens(self) -> int:
        return int(self.keys.shape[2])

    @property
    def head_dim(self) -> int:
        return int(self.keys.shape[3])

    def kv(self, head: int | None = None) -> torch.Tensor:
        """kvdrop's ``[2, 1, T, Hkv * d]`` (one KV head's ``[2, 1, T, d]`` with ``head``)."""
        kv = torch.stack([self.keys[0], self.values[0]])  # [2, Hkv, T, d]
        if head is not None:
            kv = kv[:, head : head + 1]
        return kv.transpose(1, 2).reshape(2, 1, self.num_tokens, -1)

    def query(self, head: int | None = None) -> torch.Tensor:
        """kvdrop's ``[1, 1, T, Hq * d]`` (one GQA group's with ``head``)."""
        q = self.queries[0]
        if head is not None:
            group = q.shape[0] // self.keys.shape[1]
            q = q[head * group : (head + 1) * group]
        return q.transpose(0, 1).reshape(1, 1, self.num_tokens, -1)


def build(num_tokens: int, seed: int) -> Setup:
    """A 4-query-head, 2-KV-head, head_dim 32 Llama attention layer with random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rope_theta=10000.0,
        initializer_range=0.1,
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(config).eval()
    module = model.model.layers[0].self_attn
    module.rotary_emb = model.model.rotary_emb  # CapPress reads it from the module
    hidden = torch.randn(1, num_tokens, config.hidden_size)
    cos, sin = model.model.rotary_emb(hidden, torch.arange(num_tokens)[None])
    with torch.no_grad():
        q = module.q_proj(hidden).view(1, num_tokens, 4, 32).transpose(1, 2)
        k = module.k_proj(hidden).view(1, num_tokens, 2, 32).transpose(1, 2)
        v = module.v_proj(hidden).view(1, num_tokens, 2, 32).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    logits = q @ repeat_kv(k, 2).transpose(2, 3) / math.sqrt(32)
    mask = torch.ones(num_tokens, num_tokens, dtype=torch.bool).triu(1)
    attentions = torch.softmax(logits.masked_fill(mask, -math.inf), dim=-1)
    rope = RopeConfig.from_hf_config(config.to_dict())
    kwargs = {"position_embeddings": (cos, sin)}
    return Setup(module, hidden, k, v, q, attentions, kwargs, rope)


@dataclass(frozen=True)
class Row:
    pair: str
    press: str
    diff: float | None  # largest |score difference| over ``region``
    region: str
    jaccard: float | None
    note: str = ""
    deliberate: bool = False  # a stated, deliberate difference (the note says why)


def _press(name: str, **kwargs: Any) -> Any:
    import kvpress

    return getattr(kvpress, name)(**kwargs)


def _press_scores(setup: Setup, press: Any, attentions: bool = False) -> torch.Tensor:
    args = (setup.module, setup.hidden, setup.keys, setup.values)
    attn = setup.attentions if attentions else None
    with torch.no_grad():
        return press.score(*args, attn, setup.kwargs)[0].float()  # [Hkv, T]


def _per_head(setup: Setup, spec: str, **params: Any) -> torch.Tensor:
    """kvdrop's ``[Hkv, T]``: the policy's scores on each KV head's slice alone."""
    if any(p.name == "head_dim" for p in kvdrop.describe(spec).params):
        params = {"head_dim": setup.head_dim, **params}
    fn = kvdrop.get(spec, chunk_size=1, **params)
    rows = []
    for head in range(setup.keys.shape[1]):
        query = None if fn.queries is kvdrop.QueryNeed.NONE else setup.query(head)
        rows.append(fn.scores(setup.kv(head), query))  # type: ignore[attr-defined]
    return torch.stack(rows)


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def score_pairs(setup: Setup) -> Iterator[Row]:
    """The pairs compared by their scores."""
    t, d = setup.num_tokens, setup.head_dim
    yield Row(
        "knorm",
        "KnormPress",
        _diff(_per_head(setup, "knorm"), _press_scores(setup, _press("KnormPress"))),
        "all T",
        None,
    )
    yield Row(
        "keydiff",
        "KeyDiffPress",
        _diff(_per_head(setup, "keydiff"), _press_scores(setup, _press("KeyDiffPress"))),
        "all T",
        None,
    )
    ours = _per_head(setup, "snapkv", window=64, kernel=5)[:, : t - 64] / 64
    theirs = _press_scores(setup, _press("SnapKVPress", window_size=64, kernel_size=5))
    yield Row(
        "snapkv (kernel 5)",
        "SnapKVPress",
        _diff(ours, theirs[:, : t - 64]),
        "T - window",
        None,
        "kvdrop sums the 64 window rows, kvpress averages them: kvdrop's / 64 compared; "
        "kvdrop's default kernel is 15 (docs/quality.md)",
    )
    tova = kvdrop.get("tova", head_dim=d, chunk_size=1).scores(setup.kv(), setup.query())
    theirs = _press_scores(setup, _press("TOVAPress"))
    yield Row(
        "tova",
        "TOVAPress",
        _diff(tova[: t - 1].expand(2, -1), theirs[:, : t - 1]),
        "T - 1",
        None,
        "mean over all query heads, as kvpress",
    )
    ours = _per_head(setup, "h2o", num_queries=None, recent_ratio=0.0)
    theirs = _press_scores(setup, _press("ObservedAttentionPress"), attentions=True)
    yield Row(
        "h2o (all queries, recent_ratio 0)",
        "ObservedAttentionPress",
        _diff(ours, theirs),
        "all T",
        None,
        "kvdrop's default samples 128 queries, half the budget recent",
    )
    ours = _per_head(setup, "random", seed=0)[0, : t - 1]
    theirs = _press_scores(setup, _press("RandomPress", seed=0))[0, : t - 1]
    yield Row(
        "random (seed 0)",
        "RandomPress",
        _diff(ours, theirs),
        "head 0, T - 1",
        None,
        "same generator; kvdrop always keeps the last chunk",
    )
    yield from new_score_pairs(setup)


def new_score_pairs(setup: Setup) -> Iterator[Row]:
    """Issue 26's policies (before aggregation: their ``head_scores``)."""
    t, d = setup.num_tokens, setup.head_dim
    positions = torch.arange(t)
    ours = NonCausalAttnScorer(head_dim=d).head_scores(setup.kv(), setup.query())[0]
    theirs = _press_scores(setup, _press("NonCausalAttnPress", chunk_size=256))
    partial = t % 256 != 0
    note = (
        "the last chunk is partial: kvpress pads it with keys it does not mask (logit -1e-9) "
        "and zero queries that attend to them; kvdrop attends within the real tokens "
        "(server chunks of 256 make T a multiple of 256)"
        if partial
        else "T a multiple of chunk_length 256"
    )
    yield Row(
        "non-causal-attn", "NonCausalAttnPress", _diff(ours, theirs), "all T", None, note, partial
    )
    cap_sel = Selector(keep_ratio=0.5, chunk_size=1, n_sink=4).selection(
        t, query_positions=positions, rope=setup.rope
    )
    ours = CapScorer(head_dim=d).head_scores(setup.kv(), setup.query(), cap_sel)
    theirs = _press_scores(setup, _press("CapPress", n_sink=4))
    yield Row("cap", "CapPress", _diff(ours[0], theirs), "all T", None)
    window = 24
    finch_sel = Selector(keep_ratio=0.5, chunk_size=1, window=window).selection(
        t, query_positions=positions
    )
    ours = FinchScorer(head_dim=d).head_scores(setup.kv(), setup.query(), finch_sel)[0]
    press = _press("FinchPress")
    press.window_size = window
    theirs = _press_scores(setup, press)[:, : t - window]
    yield Row(
        "finch",
        "FinchPress",
        _diff(ours, theirs),
        "T - question",
        None,
        f"question = last {window} tokens (kvdrop: after the delimiter)",
    )


def i26a_score_pairs(setup: Setup) -> Iterator[Row]:
    """The other helper's ports of issue 26 (cur, lagkv, leverage, expected-attention)."""
    t, d = setup.num_tokens, setup.head_dim
    cur = _press("CURPress", num_sinks=4)
    ours = _per_head(setup, "cur", n_sink=4)[:, 4:]
    yield Row("cur", "CURPress", _diff(ours, _press_scores(setup, cur)[:, 4:]), "T - sinks", None)
    ours = _per_head(setup, "lagkv", n_sink=4, lag_size=128)
    theirs = _press_scores(setup, _press("LagKVPress", n_sink=4, lag_size=128))
    yield Row("lagkv", "LagKVPress", _diff(ours, theirs), "all T", None)
    selection = Selector(keep_ratio=0.5, chunk_size=1).selection(
        t, head_dim=d, rope=setup.rope, positions=torch.arange(t)
    )
    ours = LeverageScorer(head_dim=d).head_scores(setup.kv(), selection)[0]
    with torch.no_grad():
        pre_rope = setup.module.k_proj(setup.hidden).view(1, t, -1, d).transpose(1, 2)
        torch.manual_seed(0)  # kvpress draws the sketch from torch's global generator
        theirs = _press("LeverageScorePress").compute_leverage_scores(pre_rope, 48)[0]
    theirs = (theirs - theirs.mean()) / theirs.std().clamp_min(1e-6)
    yield Row(
        "leverage",
        "LeverageScorePress",
        _diff(ours, theirs),
        "all T",
        None,
        "kvpress's global generator seeded as kvdrop's sketch seed",
    )
    fn = kvdrop.get("expected-attention", head_dim=d, chunk_size=1)
    fn.rope = setup.rope  # the model's RoPE, as the engine registers it with the layout
    heads = [fn.scores(setup.kv(h), setup.query(h)) for h in range(setup.keys.shape[1])]
    theirs = _press_scores(setup, _press("ExpectedAttentionPress", epsilon=0.0))
    yield Row(
        "expected-attention",
        "ExpectedAttentionPress",
        _diff(torch.stack(heads)[:, 4:], theirs[:, 4:]),
        "T - sinks",
        None,
        "every prompt query row given (the engine's lean window estimates the statistics)",
    )


def compactor_pair(setup: Setup, ratio: float) -> Row:
    """``compactor`` against ``CompactorPress``, after the mean over KV heads (the scorer gives
    no per-head scores, and both z-normalise over all heads of a layer)."""
    t, d = setup.num_tokens, setup.head_dim
    fn = kvdrop.get("compactor", head_dim=d, chunk_size=1, keep_ratio=ratio)
    fn.rope = setup.rope
    ours = fn.scores(setup.kv(), setup.query())  # type: ignore[attr-defined]
    press = _press("CompactorPress", compression_ratio=1.0 - ratio)
    torch.manual_seed(0)  # its leverage sketch, from torch's global generator (kvdrop: seed 0)
    theirs = _press_scores(setup, press).mean(dim=0)
    partial = (t - 12) % 256 != 0
    note = (
        f"scored on the {t - 12} tokens between the sinks and the last 4: a partial last "
        "chunk, padded unmasked by kvpress (as non-causal-attn; equal to 1e-6 when T - 12 is "
        "a multiple of 256)"
        if partial
        else "T - 12 a multiple of 256; blending = 1 - keep"
    )
    region = "T - sinks - last 4, mean over KV heads"
    diff = _diff(ours[8 : t - 4], theirs[8 : t - 4])
    return Row("compactor", "CompactorPress", diff, region, None, note, partial)


def _kept_rows(original: torch.Tensor, kept: torch.Tensor) -> set[int]:
    """Indices of ``kept`` rows ``[n, d]`` in ``original`` ``[T, d]`` (exact matches)."""
    return set(torch.cdist(kept.float(), original.float()).argmin(dim=1).tolist())


def _jaccard(a: set[int], b: set[int]) -> float:
    return len(a & b) / max(len(a | b), 1)


def _select_pair(setup: Setup, press: Any, spec: str, ratio: float, **params: Any) -> float:
    """Mean over KV heads of the Jaccard of kvpress's and kvdrop's kept sets on that head."""
    out = []
    for head in range(setup.keys.shape[1]):
        keys = setup.keys[:, head : head + 1]
        values = setup.values[:, head : head + 1]
        press.compression_ratio = 1.0 - ratio
        with torch.no_grad():
            kept_keys, _ = press.compress(
                setup.module, setup.hidden, keys, values, None, setup.kwargs
            )
        theirs = _kept_rows(keys[0, 0], kept_keys[0, 0])
        fn = kvdrop.get(spec, keep_tokens=len(theirs), chunk_size=1, rerotate=False, **params)
        _, kept = fn.select_indices({CacheKind.KV: setup.kv(head)}, list(range(setup.num_tokens)))
        out.append(_jaccard(theirs, set(kept.tolist())))
    return sum(out) / len(out)


def select_pairs(setup: Setup, ratio: float) -> Iterator[Row]:
    """The pairs compared by their kept sets (one KV head at a time)."""
    press = _press("StreamingLLMPress", n_sink=4)
    yield Row(
        "streaming",
        "StreamingLLMPress",
        None,
        "kept set",
        _select_pair(setup, press, "streaming", ratio, n_sink=4),
    )
    yield Row(
        "random (seed 0)",
        "RandomPress",
        None,
        "kept set",
        _select_pair(setup, _press("RandomPress", seed=0), "random", ratio, seed=0),
        "kvdrop keeps the last chunk (here: the last token) first",
    )
    for inner, cls in (("knorm", "KnormPress"), ("keydiff", "KeyDiffPress")):
        press = _press("ChunkKVPress", press=_press(cls), chunk_length=20)
        yield Row(
            f"chunkkv(policy={inner})",
            f"ChunkKVPress({cls})",
            None,
            "kept set",
            _select_pair(
                setup, press, f"chunkkv(policy={inner}, chunk_length=20)", ratio, n_sink=0
            ),
            "budget = kvpress's whole chunks",
        )
        press = _press("BlockPress", press=_press(cls), block_size=128)
        yield Row(
            f"block(policy={inner})",
            f"BlockPress({cls})",
            None,
            "kept set",
            _select_pair(setup, press, f"block(policy={inner}, block_size=128)", ratio, n_sink=0),
        )


#: Pairs not compared on tensors, and why.
EXCEPTIONS = (
    Row(
        "kvzip",
        "KVzipPress",
        None,
        "-",
        None,
        "scores come from the engine's reconstruction pass with the model "
        "(kvdrop_engine.reconstruct), not from cached tensors; compared by answers instead "
        "(the section above)",
    ),
)


def rows(num_tokens: int, seed: int, ratio: float) -> list[Row]:
    setup = build(num_tokens, seed)
    return [
        *score_pairs(setup),
        *i26a_score_pairs(setup),
        compactor_pair(setup, ratio),
        *select_pairs(setup, ratio),
        *EXCEPTIONS,
    ]


#: The target: scores within this (float32) or kept sets at least this similar.
MAX_DIFF, MIN_JACCARD = 1e-4, 0.99


def verdict(r: Row) -> str:
    """``yes`` when the pair meets the target, ``exception`` when it is not compared or differs
    deliberately (the note says why), else ``NO``."""
    if r.diff is None and r.jaccard is None:
        return "exception"
    ok = (r.diff is not None and r.diff <= MAX_DIFF) or (
        r.jaccard is not None and r.jaccard >= MIN_JACCARD
    )
    return "yes" if ok else "exception" if r.deliberate else "NO"


def table(found: list[Row]) -> Iterator[str]:
    yield "| kvdrop | kvpress | max abs score diff | compared | kept-set Jaccard | target | note |"
    yield "|---|---|---|---|---|---|---|"
    for r in found:
        diff = "-" if r.diff is None else f"{r.diff:.1e}"
        jac = "-" if r.jaccard is None else f"{r.jaccard:.3f}"
        yield f"| {r.pair} | {r.press} | {diff} | {r.region} | {jac} | {verdict(r)} | {r.note} |"
