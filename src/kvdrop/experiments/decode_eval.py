"""What a budget while decoding costs: ``kvdrop eval --decode-budget TOKENS``.

The cut is the engine's (:mod:`kvdrop_engine.decode_cut`), run on one dense cache per sequence
(:class:`kvdrop_engine.decode_reference.DenseDecode`, which the engine's tests check decodes the
same tokens as the engine), so it can be teacher-forced. Two measurements per policy, beside full
KV:

* **fidelity**: each task prompt (question inside) is continued greedily for ``decode_tokens``
  tokens with full KV (EOS suppressed, so the text is long); that continuation is then
  teacher-forced through the cut cache and, at every position, the cut's next-token
  distribution is compared with full KV's: top-1 agreement (with a 95% Wilson band over all
  positions, and the lowest and highest text) and the mean ``KL(full || cut)`` in nats per token;
* **accuracy after a preface** (``preface_tokens`` > 0): each task's context is prefilled, the
  model writes ``preface_tokens`` tokens of its own (greedy, EOS suppressed, cut as it goes),
  then the question is fed and the answer decoded (``max_tokens``), all on the cut cache: does
  the fact survive a long generation? (Wilson band over samples.)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvdrop.experiments.results import wilson
from kvdrop.experiments.tasks import DEFAULT_TASKS, make_samples
from kvdrop_sdk.validate import check_fields

__all__ = ["DEFAULT_DECODE_POLICIES", "DecodeEvalConfig", "format_decode_report", "run_decode_eval"]

#: The policies compared when ``--policies`` is not given.
DEFAULT_DECODE_POLICIES = ("rkv", "snapkv", "tova", "streaming")
FULL = "full"


@dataclass
class DecodeEvalConfig:
    """One decode-time eval: the budget, cut interval, continuation and preface lengths, the
    policies, and the prompts (``tasks`` x ``num_samples`` at ``length`` tokens)."""

    budget: int = 512
    every: int = 128
    decode_tokens: int = 2048
    preface_tokens: int = 0
    policies: Sequence[str] = DEFAULT_DECODE_POLICIES
    tasks: Sequence[str] = tuple(DEFAULT_TASKS)
    length: int = 512
    num_samples: int = 2
    max_tokens: int = 8
    seed: int = 0
    model: str | None = None
    device: str = "cpu"
    dtype: str = "float32"

    def validate(self) -> None:
        """ValueError naming the first bad field."""
        flags = {"budget": "--decode-budget", "every": "--decode-every", "length": "--lengths"}
        counts = ("budget", "every", "decode_tokens", "length", "num_samples", "max_tokens")
        check_fields(
            self,
            ints=dict.fromkeys(counts, 1),
            label=lambda name: flags.get(name, f"--{name.replace('_', '-')}"),
        )
        if self.preface_tokens < 0:
            raise ValueError(f"--preface-tokens must be >= 0, got {self.preface_tokens}")


@dataclass
class DecodeRow:
    """One policy's (or full KV's) figures."""

    policy: str
    positions: int = 0
    agree: int = 0
    kl_sum: float = 0.0
    per_text: list[float] = field(default_factory=list)
    cuts: int = 0
    correct: int = 0
    answered: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        lo, hi = wilson(self.agree, self.positions)
        out: dict[str, Any] = {
            "policy": self.policy,
            "positions": self.positions,
            "top1_agreement": self.agree / self.positions if self.positions else math.nan,
            "top1_low": lo,
            "top1_high": hi,
            "top1_worst_text": min(self.per_text) if self.per_text else math.nan,
            "top1_best_text": max(self.per_text) if self.per_text else math.nan,
            "kl_nats": self.kl_sum / self.positions if self.positions else math.nan,
            "cuts_per_text": self.cuts / max(len(self.per_text), 1),
            "per_text": list(self.per_text),
            "seconds": self.seconds,
        }
        if self.answered:
            a_lo, a_hi = wilson(self.correct, self.answered)
            out |= {
                "accuracy": self.correct / self.answered,
                "accuracy_low": a_lo,
                "accuracy_high": a_hi,
                "answered": self.answered,
            }
        return out


def _greedy(logits: torch.Tensor, eos: Sequence[int]) -> int:
    """The most likely token that is not an EOS (the text goes on)."""
    row = logits.float().clone()
    if eos:
        row[list(eos)] = -math.inf
    return int(row.argmax())


def run_decode_eval(
    config: DecodeEvalConfig, log: Callable[[str], None] = lambda msg: None
) -> dict[str, Any]:
    """Run the eval; ``{"setup": ..., "rows": [...]}`` (full KV first)."""
    from kvdrop_engine.decode_cut import DecodeCompressor
    from kvdrop_engine.decode_reference import DenseDecode
    from kvdrop_engine.loading import ModelSpec, load_model

    config.validate()
    model, tokenizer, name = load_model(
        ModelSpec(model=config.model, dtype=config.dtype, device=config.device, seed=config.seed)
    )
    if tokenizer is None:
        raise ValueError(f"model {name} has no tokenizer, and the tasks are text")
    cfg = model.config
    eos = tuple(cfg.eos_token_ids or ())
    compressor = DecodeCompressor(cfg, budget=config.budget, every=config.every)
    cuts = {p: compressor.choose({"policy": p}) for p in config.policies}
    samples = [
        s
        for task in config.tasks
        for s in make_samples(task, tokenizer, config.length, config.num_samples, config.seed)
    ]
    rows = {FULL: DecodeRow(FULL), **{p: DecodeRow(p) for p in config.policies}}
    capacity = config.length + config.decode_tokens + config.preface_tokens + 64
    for i, sample in enumerate(samples):
        log(f"text {i + 1}/{len(samples)} ({sample.task}): {config.decode_tokens} tokens")
        started = time.perf_counter()
        full = DenseDecode(model, None, compressor, capacity)
        logits = full.prefill(sample.inside)
        text, reference = [], []
        for _ in range(config.decode_tokens):
            reference.append(torch.log_softmax(logits.float(), -1))
            text.append(_greedy(logits, eos))
            logits = full.feed(text[-1])
        rows[FULL].seconds += time.perf_counter() - started
        _count(rows[FULL], reference, reference, 0)
        for policy, cut in cuts.items():
            started = time.perf_counter()
            dense = DenseDecode(model, cut, compressor, capacity)
            first = dense.prefill(sample.inside)
            # Teacher-forced in chunks between cuts (the same logits as one token at a time).
            later = dense.feed_many(text[:-1])
            got = list(torch.log_softmax(torch.cat([first[None], later]).float(), -1))
            rows[policy].seconds += time.perf_counter() - started
            _count(rows[policy], reference, got, dense.cuts)
    if config.preface_tokens:
        for i, sample in enumerate(samples):
            what = f"{config.preface_tokens}-token preface"
            log(f"sample {i + 1}/{len(samples)} ({sample.task}): {what}")
            for policy, cut in [(FULL, None), *cuts.items()]:
                answer = _after_preface(model, cut, compressor, sample, config, eos, capacity)
                rows[policy].answered += 1
                rows[policy].correct += sample.is_correct(tokenizer.decode(answer))
    setup = {
        "model": name,
        "device": config.device,
        "dtype": config.dtype,
        "budget": config.budget,
        "every": config.every,
        "decode_tokens": config.decode_tokens,
        "preface_tokens": config.preface_tokens,
        "length": config.length,
        "texts": len(samples),
        "tasks": list(config.tasks),
    }
    return {"setup": setup, "rows": [r.to_dict() for r in rows.values()]}


def _count(row: DecodeRow, full: list[torch.Tensor], cut: list[torch.Tensor], cuts: int) -> None:
    """Add one text's positions: top-1 agreement and ``KL(full || cut)``."""
    f, c = torch.stack(full), torch.stack(cut)
    agree = int((f.argmax(-1) == c.argmax(-1)).sum())
    kl = (f.exp() * (f - c)).sum(-1).clamp_min(0.0)
    row.positions += f.shape[0]
    row.agree += agree
    row.kl_sum += float(kl.sum())
    row.per_text.append(agree / f.shape[0])
    row.cuts += cuts


def _after_preface(
    model: Any,
    cut: Any,
    compressor: Any,
    sample: Any,
    config: DecodeEvalConfig,
    eos: Sequence[int],
    capacity: int,
) -> list[int]:
    """The answer after the context, a preface the model writes itself and the question, all
    on one cache cut while decoding (``cut`` None: full KV)."""
    from kvdrop_engine.decode_reference import DenseDecode

    dense = DenseDecode(model, cut, compressor, capacity)
    logits = dense.prefill(sample.context)
    for _ in range(config.preface_tokens):
        logits = dense.feed(_greedy(logits, eos))
    for tok in sample.question:
        logits = dense.feed(tok)
    answer: list[int] = []
    for _ in range(config.max_tokens):
        tok = int(logits.argmax())
        if tok in eos:
            break
        answer.append(tok)
        logits = dense.feed(tok)
    return answer


def format_decode_report(report: dict[str, Any]) -> str:
    """The rows as a text table under a one-line setup."""
    from kvdrop_sdk.table import format_table

    s = report["setup"]
    head = (
        f"model {s['model']} ({s['device']}, {s['dtype']}); cut to {s['budget']} tokens every "
        f"{s['every']} while decoding; {s['texts']} texts of {s['length']} prompt tokens "
        f"({', '.join(s['tasks'])}), {s['decode_tokens']} teacher-forced tokens each"
    )
    if s["preface_tokens"]:
        head += f"; accuracy after a {s['preface_tokens']}-token preface"
    table = []
    for r in report["rows"]:
        line = {
            "policy": r["policy"],
            "top-1 agreement": f"{r['top1_agreement']:.3f}",
            "95% band": f"{r['top1_low']:.3f}-{r['top1_high']:.3f}",
            "texts (worst-best)": f"{r['top1_worst_text']:.3f}-{r['top1_best_text']:.3f}",
            "KL nats/token": f"{r['kl_nats']:.4f}",
            "cuts/text": f"{r['cuts_per_text']:.1f}",
        }
        if "accuracy" in r:
            line["accuracy"] = (
                f"{r['accuracy']:.2f} ({r['accuracy_low']:.2f}-{r['accuracy_high']:.2f})"
            )
        table.append(line)
    return head + "\n" + format_table(table)
