"""The pipeline runner, baseline vs dropped side by side: the measurement behind ``kvdrop demo``,
``kvdrop eval`` and the decode-gain benchmark (the prompts it runs: :mod:`~.prompts`).

One engine (one fixed KV budget) and one kvdrop server serve both runs; each run prefills the
same prompts (max_tokens=1; the engine stores KV and queries in the server), the dropped run then
edits every request's cache with a policy, and both decode the same number of tokens. The runs use
different cache salts so the second never reuses the first one's cache.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvdrop.experiments.prompts import Prompt
from kvdrop.selector import Selector
from kvdrop_sdk.batch import BatchedStream, ProgressCallback
from kvdrop_sdk.context import Context
from kvdrop_sdk.edit import ModifyFnType
from kvdrop_sdk.metrics import Metrics
from kvdrop_sdk.query_capture import needs_of
from kvdrop_sdk.request import RequestStream, create_request

__all__ = [
    "RunResult",
    "engine_budget",
    "kept_count",
    "run_pipeline",
    "summarize_runs",
]


def kept_count(num_tokens: int, keep_ratio: float, chunk_size: int) -> int:
    """Tokens a policy keeps of a prompt's cached (chunk-aligned) prefix, per the selector."""
    cached = num_tokens - num_tokens % chunk_size
    return Selector(keep_ratio=keep_ratio, chunk_size=chunk_size).budget(cached) if cached else 0


def engine_budget(
    prompt_lengths: Sequence[int],
    max_tokens: int,
    keep_ratio: float,
    chunk_size: int,
    block_size: int,
) -> tuple[int, int, int]:
    """An engine KV budget (tokens) that fits every dropped request at once but not the baseline.

    Returns ``(budget, baseline_fit, dropped_fit)``: how many requests fit at once in each run
    (requests reserve blocks for prompt + max_tokens on admission).
    """

    def blocks(tokens: int) -> int:
        return -(-tokens // block_size)

    def need_dropped(n: int) -> int:
        return blocks(kept_count(n, keep_ratio, chunk_size) + n % chunk_size + 1 + max_tokens)

    full = [blocks(n + 1 + max_tokens) for n in prompt_lengths]
    dropped = [need_dropped(n) for n in prompt_lengths]
    budget_blocks = max(sum(dropped), max(full))
    baseline_fit, used = 0, 0
    for b in sorted(full):
        if used + b > budget_blocks:
            break
        used, baseline_fit = used + b, baseline_fit + 1
    return budget_blocks * block_size, baseline_fit, len(prompt_lengths)


@dataclass
class RunResult:
    """One run's metric reports, outputs and engine counters."""

    name: str
    prefill: Metrics
    decode: Metrics
    modify: Metrics | None = None
    outputs: list[list[int]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    correct: int | None = None
    engine: dict[str, int] = field(default_factory=dict)
    decode_prompt_lengths: list[int] = field(default_factory=list)
    decode_prompts: list[list[int]] = field(default_factory=list, repr=False)
    #: Each decode stream's salt (after an edit its own: the edited KV is stored under it).
    decode_salts: list[str] = field(default_factory=list, repr=False)
    #: Engine counters of prefill + modify (``engine`` holds the decode phase's).
    prefill_engine: dict[str, int] = field(default_factory=dict)

    @property
    def prefill_query_bytes(self) -> int:
        """Query bytes the engine stored during prefill (chunk queries and windows)."""
        return int(self.prefill_engine.get("query_bytes_stored", 0))

    @property
    def decode_tput(self) -> float:
        return float(self.decode["output_tput"])

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "prefill": self.prefill.to_dict(),
            "modify": self.modify.to_dict() if self.modify is not None else None,
            "decode": self.decode.to_dict(),
            "correct": self.correct,
            "engine": self.engine,
            "decode_prompt_lengths": self.decode_prompt_lengths,
            "prefill_engine": self.prefill_engine,
            "texts": self.texts,
        }


def run_pipeline(
    name: str,
    engine: Any,
    contexts: Sequence[Context],
    prompts: Sequence[Prompt],
    sampling: dict[str, Any],
    *,
    modify_fn: ModifyFnType | None = None,
    cache_salt: str = "",
    progress: Callable[[str], ProgressCallback | None] = lambda phase: None,
    modify_timeout: float = 600.0,
    modify_concurrency: int | None = None,
    modify_device: str | None = None,
    modify_kv_path: str = "auto",
    fresh_decode: bool = False,
    reconstruct: bool | None = None,
    suffixes: Sequence[Sequence[int]] | None = None,
) -> RunResult:
    """Prefill, optionally modify, then decode ``prompts`` through ``engine``'s post_completion.

    ``modify_concurrency`` bounds the edits running at once (None: the batch's default);
    ``modify_device`` is where they run (``batch.modify(device=)``; None: the host);
    ``modify_kv_path`` how their KV travels (``batch.modify(kv_path=)``: ``auto`` moves only
    what the policy reads, ``full`` the whole KV both ways).

    By default decoding continues each stream after the token its prefill sampled (from the full
    cache, as upstream's batched stream does). ``fresh_decode`` decodes instead from the stream's
    prompt without that token (the kept tokens and the uncached tail after a modify), so every
    output token comes from the edited cache; ``suffixes`` (one token list per prompt, e.g. a
    question asked after compression) are appended to that prompt and imply ``fresh_decode``.
    ``reconstruct`` asks the engine to score each prompt with KVzip's reconstruction pass in the
    prefill; by default it follows ``modify_fn``'s needs (``token_scores``, e.g. ``kvzip``), and
    False skips it where the server holds the scores already.
    """
    if suffixes is not None and len(suffixes) != len(prompts):
        raise ValueError(f"{len(suffixes)} suffixes for {len(prompts)} prompts; give one each")
    batch = BatchedStream(
        max_concurrency=max(1, len(prompts)), modify_concurrency=modify_concurrency
    )
    engine.reset_stats()
    streams = []
    for p in prompts:
        stream = create_request(contexts, engine.post_completion, p.token_ids, cache_salt)
        batch.add(stream)
        streams.append(stream)
    if reconstruct is None:
        reconstruct = modify_fn is not None and needs_of(modify_fn).token_scores
    batch.progress = progress(f"{name}: prefill")
    prefill = batch.prefill({**sampling, "reconstruct": True} if reconstruct else sampling)
    modify = None
    if modify_fn is not None:
        batch.progress = progress(f"{name}: modify")
        modify = batch.modify(
            modify_fn, timeout=modify_timeout, device=modify_device, kv_path=modify_kv_path
        )
    prefill_engine = engine.stats().to_dict()
    engine.reset_stats()
    if fresh_decode or suffixes is not None:
        batch, streams = _fresh_streams(engine, contexts, streams, suffixes or [()] * len(streams))
    decode_prompts = [s.tokens for s in streams]
    decode_lengths = [len(t) for t in decode_prompts]
    batch.progress = progress(f"{name}: decode")
    decode = batch.decode(sampling)
    tokenizer = getattr(engine, "tokenizer", None)
    # Runs decode with ignore_eos (equal work in both runs); what follows the first EOS is not
    # part of the answer, so outputs are compared and shown up to it.
    eos = frozenset(getattr(engine, "eos_token_ids", ()) or ())
    outputs = [_until_eos(s.generated_tokens, eos) for s in streams]
    texts = [_detokenize(tokenizer, o) for o in outputs]
    result = RunResult(
        name,
        prefill,
        decode,
        modify,
        outputs,
        texts,
        engine=engine.stats().to_dict(),
        decode_prompt_lengths=decode_lengths,
        prefill_engine=prefill_engine,
        decode_prompts=decode_prompts,
        decode_salts=[s.active_cache_salt for s in streams],
    )
    if all(p.answer is not None for p in prompts) and tokenizer is not None:
        result.correct = sum(p.answer in t for p, t in zip(prompts, texts))
    return result


def _fresh_streams(
    engine: Any,
    contexts: Sequence[Context],
    streams: Sequence[RequestStream],
    suffixes: Sequence[Sequence[int]],
) -> tuple[BatchedStream, list[RequestStream]]:
    """New streams over each stream's tokens minus the one its prefill sampled, plus a suffix;
    the engine finds the (edited) cache under the same tokens and the stream's active salt."""
    batch = BatchedStream(max_concurrency=max(1, len(streams)))
    fresh = []
    for s, suffix in zip(streams, suffixes):
        if s.decoded_tokens != 1:
            raise RuntimeError(
                f"stream {s.request_stream_id} decoded {s.decoded_tokens} tokens before the "
                "fresh decode; expected exactly the prefill's one"
            )
        tokens = s.tokens[:-1] + list(suffix)
        stream = create_request(contexts, engine.post_completion, tokens, s.active_cache_salt)
        batch.add(stream)
        fresh.append(stream)
    return batch, fresh


def _until_eos(ids: list[int], eos: frozenset[int]) -> list[int]:
    """``ids`` up to (not including) the first end-of-sequence token."""
    return next((ids[:i] for i, t in enumerate(ids) if t in eos), ids)


def _detokenize(tokenizer: Any, ids: list[int]) -> str:
    """Output text without special tokens (e.g. <|im_end|>) when the tokenizer can skip them."""
    if tokenizer is None:
        return ""
    try:
        return str(tokenizer.decode(ids, skip_special_tokens=True))
    except TypeError:
        return str(tokenizer.decode(ids))


def agreement(a: RunResult, b: RunResult) -> tuple[float, float]:
    """(fraction of requests with identical answers, mean fraction of matching leading tokens).

    Outputs are compared up to their first EOS token (see :func:`run_pipeline`).
    """
    same = [x == y for x, y in zip(a.outputs, b.outputs)]
    prefix = []
    for x, y in zip(a.outputs, b.outputs):
        n = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        prefix.append(n / max(len(x), len(y), 1))
    return sum(same) / max(len(same), 1), statistics.fmean(prefix) if prefix else 0.0


def summarize_runs(baseline: RunResult, dropped: RunResult, n: int) -> dict[str, Any]:
    """The side-by-side summary: throughputs, gain, kept fraction, answers and agreement."""
    identical, prefix = agreement(baseline, dropped)
    kept = dropped.modify["kept_fraction"] if dropped.modify is not None else 1.0
    return {
        "baseline_decode_tput": baseline.decode_tput,
        "dropped_decode_tput": dropped.decode_tput,
        "decode_gain": dropped.decode_tput / baseline.decode_tput,
        "kept_fraction": float(kept),
        "baseline_peak_running": baseline.engine.get("peak_running"),
        "dropped_peak_running": dropped.engine.get("peak_running"),
        "baseline_correct": baseline.correct,
        "dropped_correct": dropped.correct,
        "num_requests": n,
        "identical_outputs": identical,
        "matching_prefix": prefix,
    }
