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
from collections.abc import Iterable, Iterator
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


#: Head shapes ``(query heads, KV heads, head_dim)`` of the random-weight layers: GQA, MHA, MQA.
SHAPES: tuple[tuple[int, int, int], ...] = ((4, 2, 32), (4, 4, 16), (8, 1, 16))


def build(num_tokens: int, seed: int, shape: tuple[int, int, int] = SHAPES[0]) -> Setup:
    """One attention layer of a random-weight Llama with ``shape`` = (query heads, KV heads,
    head_dim), fed ``num_tokens`` random hidden states drawn from ``seed``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    heads, kv_heads, head_dim = shape
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=10000.0,
        initializer_range=0.1,
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(config).eval()
    hidden = torch.randn(1, num_tokens, config.hidden_size)
    return layer_setup(model, 0, hidden)


def layer_setup(model: Any, layer: int, hidden: torch.Tensor) -> Setup:
    """The :class:`Setup` of ``model``'s attention layer ``layer`` (an HF Llama) given the
    hidden states ``[1, T, hidden]`` that enter it (after its input norm)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

    config = model.config
    module = model.model.layers[layer].self_attn
    module.rotary_emb = model.model.rotary_emb  # CapPress reads it from the module
    t = hidden.shape[1]
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    d = config.head_dim
    cos, sin = model.model.rotary_emb(hidden, torch.arange(t)[None])
    with torch.no_grad():
        q = module.q_proj(hidden).view(1, t, heads, d).transpose(1, 2)
        k = module.k_proj(hidden).view(1, t, kv_heads, d).transpose(1, 2)
        v = module.v_proj(hidden).view(1, t, kv_heads, d).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    logits = q @ repeat_kv(k, heads // kv_heads).transpose(2, 3) / math.sqrt(d)
    mask = torch.ones(t, t, dtype=torch.bool).triu(1)
    attentions = torch.softmax(logits.masked_fill(mask, -math.inf), dim=-1)
    rope = RopeConfig.from_hf_config(config.to_dict())
    kwargs = {"position_embeddings": (cos, sin)}
    return Setup(module, hidden, k, v, q, attentions, kwargs, rope)


def real_setups(model: Any, input_ids: list[int], layers: Iterable[int]) -> Iterator[Setup]:
    """:func:`layer_setup` of a real HF model's ``layers`` on a real prompt: each layer's input
    (its normed hidden states) is captured by a forward pre-hook during one forward pass."""
    captured: dict[int, torch.Tensor] = {}
    handles = []
    for i in layers:

        def keep(module: Any, args: Any, kwargs: Any, i: int = i) -> None:
            captured[i] = kwargs.get("hidden_states", args[0] if args else None).detach()

        attn = model.model.layers[i].self_attn
        handles.append(attn.register_forward_pre_hook(keep, with_kwargs=True))
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([input_ids]))
    finally:
        for h in handles:
            h.remove()
    for i in sorted(captured):
        yield layer_setup(model, i, captured[i].float())


@dataclass(frozen=True)
class Row:
    pair: str
    press: str
    diff: float | None  # largest |score difference| over ``region``
    region: str
    jaccard: float | None
    note: str = ""
    deliberate: bool = False  # a stated, deliberate difference (the note says why)
    tolerance: float | None = None  # the row's own bound on ``diff`` (default MAX_DIFF)
    tied: bool = False  # the kept sets differ only among tokens of equal score


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
    """``max |a - b|`` relative to ``max(1, max |b|)`` (position-weighted scores such as
    FINCH's run into the hundreds, where float32 rounding is absolute 1e-5 and more)."""
    return float((a.float() - b.float()).abs().max() / max(1.0, float(b.float().abs().max())))


def _zscore(x: torch.Tensor) -> torch.Tensor:
    return (x - x.mean()) / x.std().clamp_min(1e-6)


def leverage_rounding(pre_rope: torch.Tensor, sketch_dimension: int = 48) -> float:
    """How far kvpress's own float32 leverage ``[1, H, T, d]`` (z-scored, sketch from seed 0)
    is from the same formula in float64 with the same sketch: the float32 rounding error of the
    computation itself, large where the keys' Gram matrix is ill-conditioned (repeated tokens
    give near-duplicate pre-RoPE keys)."""
    from kvpress import LeverageScorePress

    torch.manual_seed(0)
    f32 = _zscore(LeverageScorePress.compute_leverage_scores(pre_rope, sketch_dimension)[0])
    torch.manual_seed(0)
    heads, _, d = pre_rope.shape[1:]
    sketch = (torch.randn(1, heads, d, sketch_dimension) / math.sqrt(sketch_dimension)).double()
    keys = pre_rope[0].double()
    x = (keys - keys.mean(dim=1, keepdim=True)) @ sketch[0]
    gram = x.transpose(1, 2) @ x + 1e-2 * torch.eye(sketch_dimension, dtype=torch.float64)
    f64 = (x * torch.linalg.solve(gram, x.transpose(1, 2)).transpose(1, 2)).sum(-1)
    return float((f32.double() - _zscore(f64.clamp_min(0))).abs().max())


def leverage_tolerance(rounding: float) -> float:
    """The bound kvdrop's leverage is held to: twice kvpress's own float32 rounding error
    (:func:`leverage_rounding`) plus 1e-5; kvdrop rebuilds the pre-RoPE keys from the cached
    post-RoPE ones (relative error ~2e-7) and runs the same float32 steps in another batch
    layout, so its result differs from kvpress's by about as much as either differs from
    float64."""
    return 2.0 * rounding + 1e-5


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
        _diff(tova.expand(theirs.shape[0], -1), theirs),
        "all T",
        None,
        "mean over all query heads; the last token scores the maximum + 1, as kvpress",
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
    ours = _per_head(setup, "random", seed=0)[0]
    theirs = _press_scores(setup, _press("RandomPress", seed=0))[0]
    yield Row(
        "random (seed 0)",
        "RandomPress",
        _diff(ours, theirs),
        "head 0, all T",
        None,
        "same generator: kvpress's draws for its first KV head",
    )
    yield from new_score_pairs(setup)


def new_score_pairs(setup: Setup) -> Iterator[Row]:
    """Issue 26's policies (before aggregation: their ``head_scores``)."""
    t, d = setup.num_tokens, setup.head_dim
    positions = torch.arange(t)
    ours = NonCausalAttnScorer(head_dim=d).head_scores(setup.kv(), setup.query())[0]
    theirs = _press_scores(setup, _press("NonCausalAttnPress", chunk_size=256))
    note = (
        f"a partial last chunk of {t % 256} tokens, padded as kvpress pads it (partial='kvpress')"
        if t % 256
        else "T a multiple of chunk_length 256"
    )
    yield Row("non-causal-attn", "NonCausalAttnPress", _diff(ours, theirs), "all T", None, note)
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
    theirs = _zscore(theirs)
    rounding = leverage_rounding(pre_rope)
    yield Row(
        "leverage",
        "LeverageScorePress",
        _diff(ours, theirs),
        "all T",
        None,
        f"sketch from seed 0 both; kvpress's own float32 error (vs float64) {rounding:.1e}, "
        "the bound is twice it + 1e-5",
        tolerance=leverage_tolerance(rounding),
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
    note = (
        f"the {t - 12} tokens between the sinks and the last 4 end in a partial chunk, padded "
        "as kvpress pads it; blending = 1 - keep_ratio"
    )
    region = "T - sinks - last 4, mean over KV heads"
    diff = _diff(ours[8 : t - 4], theirs[8 : t - 4])
    with torch.no_grad():
        inner = setup.module.k_proj(setup.hidden[:, 8 : t - 4])
    rounding = leverage_rounding(inner.view(1, t - 12, -1, d).transpose(1, 2))
    bound = (1.0 - ratio) * leverage_tolerance(rounding) + MAX_DIFF  # blending * leverage's
    return Row("compactor", "CompactorPress", diff, region, None, note, tolerance=bound)


def _kept_rows(original: torch.Tensor, kept: torch.Tensor) -> set[int]:
    """Indices of ``kept`` rows ``[n, d]`` in ``original`` ``[T, d]`` (exact matches)."""
    return set(torch.cdist(kept.float(), original.float()).argmin(dim=1).tolist())


def _jaccard(a: set[int], b: set[int]) -> float:
    return len(a & b) / max(len(a | b), 1)


def _select_pair(
    setup: Setup, press: Any, spec: str, ratio: float, inner: Any = None, **params: Any
) -> tuple[float, bool]:
    """Mean over KV heads of the Jaccard of kvpress's and kvdrop's kept sets on that head, and
    whether every difference is a tie: with the ``inner`` press (a ChunkKV's or Block's scorer)
    given, the two kept sets' sorted scores agree to 1e-5 relative on every head (repeated
    tokens give equal scores, and the two break ties in different orders)."""
    out, tied = [], inner is not None
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
        ours = set(kept.tolist())
        out.append(_jaccard(theirs, ours))
        if inner is not None and ours != theirs:
            with torch.no_grad():
                args = (setup.module, setup.hidden, keys, values, None, setup.kwargs)
                token = inner.score(*args)[0, 0].float()
            a, b = (token[sorted(x)].sort().values for x in (theirs, ours))
            scale = max(1.0, float(token.abs().max()))
            tied = tied and len(a) == len(b) and float((a - b).abs().max()) <= 1e-5 * scale
    return sum(out) / len(out), tied


def _tie_note(jaccard: float, tied: bool, note: str = "") -> tuple[str, bool]:
    if tied and jaccard < MIN_JACCARD:
        return (
            note + "; " if note else ""
        ) + "the sets differ only among equal scores (ties)", True
    return note, False


def select_pairs(setup: Setup, ratio: float) -> Iterator[Row]:
    """The pairs compared by their kept sets (one KV head at a time)."""
    press = _press("StreamingLLMPress", n_sink=4)
    jac, _ = _select_pair(setup, press, "streaming", ratio, n_sink=4)
    yield Row("streaming", "StreamingLLMPress", None, "kept set", jac)
    jac, _ = _select_pair(setup, _press("RandomPress", seed=0), "random", ratio, seed=0)
    yield Row("random (seed 0)", "RandomPress", None, "kept set", jac)
    for name, cls in (("knorm", "KnormPress"), ("keydiff", "KeyDiffPress")):
        press = _press("ChunkKVPress", press=_press(cls), chunk_length=20)
        spec = f"chunkkv(policy={name}, chunk_length=20)"
        jac, tied = _select_pair(setup, press, spec, ratio, inner=press.press, n_sink=0)
        note, tie = _tie_note(jac, tied, "budget = kvpress's whole chunks")
        yield Row(
            f"chunkkv(policy={name})",
            f"ChunkKVPress({cls})",
            None,
            "kept set",
            jac,
            note,
            tied=tie,
        )
        press = _press("BlockPress", press=_press(cls), block_size=128)
        spec = f"block(policy={name}, block_size=128)"
        jac, tied = _select_pair(setup, press, spec, ratio, inner=press.press, n_sink=0)
        note, tie = _tie_note(jac, tied)
        yield Row(
            f"block(policy={name})", f"BlockPress({cls})", None, "kept set", jac, note, tied=tie
        )


def byte_tokenizer(folder: str) -> Any:
    """A byte-level Hugging Face tokenizer (256 ids, no merges, no chat template) saved in
    ``folder``: KVzipPress loads its model's tokenizer by ``name_or_path``, and without a chat
    template both sides build the same reconstruction input (no prefix, suffix ``\\n``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core)
    tokenizer.save_pretrained(folder)
    return tokenizer


def kvzip_pair(
    num_tokens: int,
    seed: int,
    shape: tuple[int, int, int] = SHAPES[0],
    chunk_tokens: int = 512,
    num_layers: int = 2,
) -> Row:
    """kvdrop's KVzip reconstruction scores (:class:`~kvdrop.integrations.transformers.KVDropPress`,
    the engine's chunking and scoring rule) against ``KVzipPress``'s own ``score_val`` (its
    ``with press(model):`` passes) on a random-weight Llama of ``num_layers`` layers with
    ``shape`` heads, ``num_tokens`` random token ids of a byte tokenizer, context chunks of
    ``chunk_tokens``. Compared per layer and KV head, after the ``n_sink`` first tokens (kvdrop
    scores them 1, kvpress gives them its maximum + 1 when it selects)."""
    import tempfile

    import kvpress
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    from kvdrop.integrations.transformers import KVDropPress, hf_reconstruction_prompt

    heads, kv_heads, head_dim = shape
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=10000.0,
        initializer_range=0.1,
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 256, (1, num_tokens + 1))  # the last: kvdrop's uncached tail
    with tempfile.TemporaryDirectory() as folder:
        tokenizer = byte_tokenizer(folder)
        model.config.name_or_path = folder
        press = kvpress.KVzipPress(compression_ratio=0.5, chunk_size=chunk_tokens)
        seen: list[torch.Tensor] = []
        press.compress_post = lambda _model: seen.append(press.score_val[:, 0].clone())
        with torch.no_grad(), press(model):
            model(input_ids=ids[:, :num_tokens], past_key_values=DynamicCache())
        prompt = hf_reconstruction_prompt(tokenizer, chunk_tokens=chunk_tokens)
        ours = KVDropPress("kvzip", tokenizer=tokenizer, reconstruction=prompt).prefill(model, ids)
    theirs = seen[0].float()  # [L, Hkv, T]
    mine = ours.token_scores
    assert mine is not None and mine.shape == theirs.shape, (mine, theirs.shape)
    sinks = press.n_sink
    return Row(
        "kvzip",
        "KVzipPress",
        _diff(mine[..., sinks:], theirs[..., sinks:]),
        "T - sinks, per layer and KV head",
        None,
        f"reconstruction scores of a {num_layers}-layer random model, chunks of {chunk_tokens} "
        "(byte tokenizer, no chat template: the same input both sides); selection differs "
        "(kvpress: a budget per head, ranked over heads and layers; kvdrop: one list)",
    )


#: Pairs not compared on tensors, and why.
EXCEPTIONS = (
    Row(
        "kvzip",
        "KVzipPress",
        None,
        "-",
        None,
        "scores come from the reconstruction pass with the whole model, not from one "
        "layer's tensors: kvzip_pair compares them on a random-weight model (the random "
        "--heads case), and the side-by-side by answers",
    ),
)


def rows(
    num_tokens: int, seed: int, ratio: float, shape: tuple[int, int, int] = SHAPES[0]
) -> list[Row]:
    """Every pair on one random-weight layer (:func:`build`)."""
    return setup_rows(build(num_tokens, seed, shape), ratio)


def setup_rows(setup: Setup, ratio: float) -> list[Row]:
    """Every pair on the tensors of ``setup``."""
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
    """``yes`` when the pair meets the target, ``ties`` when its kept sets differ only among
    tokens of equal score, ``exception`` when it is not compared or differs deliberately (the
    note says why), else ``NO``."""
    if r.diff is None and r.jaccard is None:
        return "exception"
    if r.tied:
        return "ties"
    bound = MAX_DIFF if r.tolerance is None else r.tolerance
    ok = (r.diff is not None and r.diff <= bound) or (
        r.jaccard is not None and r.jaccard >= MIN_JACCARD
    )
    return "yes" if ok else "exception" if r.deliberate else "NO"


def table(found: list[Row]) -> Iterator[str]:
    yield (
        "| kvdrop | kvpress | max score diff | bound | compared | kept-set Jaccard | target "
        "| note |"
    )
    yield "|---|---|---|---|---|---|---|---|"
    for r in found:
        diff = "-" if r.diff is None else f"{r.diff:.1e}"
        bound = "-" if r.diff is None else f"{MAX_DIFF if r.tolerance is None else r.tolerance:.1e}"
        jac = "-" if r.jaccard is None else f"{r.jaccard:.3f}"
        yield (
            f"| {r.pair} | {r.press} | {diff} | {bound} | {r.region} | {jac} | {verdict(r)} "
            f"| {r.note} |"
        )
