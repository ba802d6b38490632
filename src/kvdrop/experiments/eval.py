"""Accuracy and fidelity of drop policies against full KV on a real model, offline: the
measurement behind ``kvdrop eval`` (the command, tables and plot: :mod:`kvdrop.commands.eval_cmd`).

The measurement goes through the real pipeline of :mod:`kvdrop.experiments.runner`: an
in-process kvdrop server, the reference engine (prefill stores KV and queries in the server), the
SDK's ``modify`` with the policy (re-rotated), and the engine decoding on the edited cache. For
every cell of the grid ``task x setting x length x policy x keep_ratio`` it reports:

* **accuracy**: greedy answers (``max_tokens`` tokens, all from the edited cache: decoding starts
  from the kept tokens, never after a token sampled from the full cache) checked against the
  task's known answer, with a 95% Wilson interval;
* **fidelity**: over a teacher-forced continuation (the full-KV answer, with its EOS), the mean
  ``KL(full || dropped)`` of the next-token distributions (nats per token) and how often their
  top-1 tokens agree (:func:`kvdrop_engine.logprobs.continuation_logprobs` reads the same edited
  cache the decode read). Fidelity moves before accuracy does, with less noise.

Full KV is the row with policy ``full`` and keep ratio 1.0 (fidelity 0 and 1 by definition). The
settings (see :mod:`kvdrop.experiments.tasks`): ``inside`` compresses the prompt with the question
in it; ``after`` compresses the context alone and appends the question once the cache is edited
(query-agnostic compression).

Samples of every task at one length run together in batches of about ``batch_tokens`` prompt
tokens, both settings in one pipeline run per (policy, keep ratio). Per batch the full-KV runs
prefill every prompt once under the batch's cache salt; each policy run re-uses that prefill (the
engine loads it from the server), edits, decodes and scores. With ``results`` (a JSONL file) every
finished cell of a batch is appended at once and a rerun with the same settings skips it, so an
interrupted grid resumes where it stopped.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import platform
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvdrop.experiments.measure import Measurement
from kvdrop.experiments.results import (
    FULL,
    KEY,
    EvalError,
    aggregate,
    append_results,
    load_results,
    sort_rows,
    wilson,
)
from kvdrop.experiments.tasks import DEFAULT_TASKS, SETTINGS, TASKS, Sample, make_samples
from kvdrop_sdk.validate import check_fields

__all__ = [
    "FULL",
    "PRESETS",
    "ROW_FIELDS",
    "EvalConfig",
    "EvalError",
    "EvalReport",
    "aggregate",
    "run_eval",
    "wilson",
]

#: The columns of every result row (``--json``), in order.
ROW_FIELDS = (
    "task",
    "setting",
    "length",
    "policy",
    "keep_ratio",
    "n",
    "correct",
    "accuracy",
    "ci_low",
    "ci_high",
    "kl",
    "top1_agreement",
    "kept_fraction",
    "modify_ms",
    "cost_s",
)

#: Named grids. ``quick`` is CI's smoke run (seconds of compute); ``default`` is the grid of
#: docs/quality.md (every registered policy; under 30 minutes on two CPU cores).
PRESETS: dict[str, dict[str, Any]] = {
    "quick": dict(
        policies=("snapkv", "random"),
        keep_ratios=(0.5,),
        lengths=(512,),
        tasks=("passkey",),
        num_samples=2,
    ),
    "default": dict(
        policies=None,
        keep_ratios=(0.75, 0.5, 0.25),
        lengths=(1024,),
        tasks=DEFAULT_TASKS,
        num_samples=6,
    ),
    # The lengths that matter (docs/quality.md): the recommended policies at 1K-4K tokens, 12
    # samples a cell; add 8192 with --lengths (SmolLM2 takes 8K; hours on two CPU cores).
    "long": dict(
        policies=("kvzip", "snapkv", "knorm"),
        keep_ratios=(0.5, 0.25),
        lengths=(1024, 2048, 4096),
        tasks=DEFAULT_TASKS,
        num_samples=12,
    ),
}


def keep_ratio_value(r: object) -> float:
    """The eval grid's keep-ratio rule (the flag and the config both ask it): a number in
    (0, 1); 1.0 is the full-KV row every grid already has. ValueError otherwise."""
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r < 1:
        raise ValueError(f"keep ratios must be in (0, 1) (1.0 is full KV), got {r!r}")
    return float(r)


@dataclass(frozen=True)
class EvalConfig:
    """One grid: policies (None = every registered one) x keep ratios x lengths x tasks x settings,
    ``num_samples`` prompts per task and length. Defaults are the ``default`` preset's."""

    policies: tuple[str, ...] | None = None
    keep_ratios: tuple[float, ...] = PRESETS["default"]["keep_ratios"]
    lengths: tuple[int, ...] = PRESETS["default"]["lengths"]
    tasks: tuple[str, ...] = DEFAULT_TASKS
    settings: tuple[str, ...] = SETTINGS
    num_samples: int = PRESETS["default"]["num_samples"]
    max_tokens: int = 8
    chunk_size: int = 256
    seed: int = 0
    rerotate: bool = True
    batch_tokens: int = 8192
    model: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    threads: int | None = None

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field and what is expected."""

        def positive(name: str, value: Any) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

        counts = ("num_samples", "max_tokens", "chunk_size", "batch_tokens")
        check_fields(self, ints=dict.fromkeys(counts, 1), label=str)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if self.threads is not None:
            positive("threads", self.threads)
        for name in ("keep_ratios", "lengths", "tasks", "settings"):
            values = getattr(self, name)
            if not values:
                raise ValueError(f"{name} must not be empty")
            if len(set(values)) != len(values):
                raise ValueError(f"{name} lists a value twice: {list(values)}")
        for r in self.keep_ratios:
            keep_ratio_value(r)
        for n in self.lengths:
            positive("every length", n)
            if n < 256:
                raise ValueError(f"lengths must be at least 256 tokens, got {n}")
        for t in self.tasks:
            if t not in TASKS:
                raise ValueError(f"unknown task {t!r}; expected some of {', '.join(TASKS)}")
        for s in self.settings:
            if s not in SETTINGS:
                raise ValueError(f"unknown setting {s!r}; expected some of {', '.join(SETTINGS)}")
        if self.policies is not None:
            if not self.policies:
                raise ValueError("policies must not be empty (None means every registered one)")
            if FULL in self.policies:
                raise ValueError(f"{FULL!r} is always measured; do not list it as a policy")
            if len(set(self.policies)) != len(self.policies):
                raise ValueError(f"policies lists a name twice: {list(self.policies)}")

    def fingerprint(self, model_name: str) -> dict[str, Any]:
        """What a stored result depends on: results of another fingerprint are never mixed in."""
        return {
            "model": model_name,
            "dtype": self.dtype,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "max_tokens": self.max_tokens,
            "chunk_size": self.chunk_size,
            "rerotate": self.rerotate,
        }


@dataclass
class EvalReport:
    """Aggregated rows (see :data:`ROW_FIELDS`), the setup, the default policies left out (name ->
    why) and the per-batch records the rows come from."""

    rows: list[dict[str, Any]]
    setup: dict[str, Any]
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    records: list[dict[str, Any]] = dataclasses.field(default_factory=list, repr=False)

    def pooled(self, by: Sequence[str] = ("setting", "policy", "keep_ratio")) -> list[dict]:
        """Rows pooled over the fields not in ``by`` (by default over tasks and lengths)."""
        return sort_rows(aggregate(self.records, by=by), self.setup["grid"]["policies"])

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` report: setup, left-out policies and rows (records stay in the file)."""
        return {"setup": self.setup, "skipped": self.skipped, "rows": self.rows}


# ---------------------------------------------------------------------------------------------
# Policies
# ---------------------------------------------------------------------------------------------


def _policy_params(
    name: str, info: Any, ratio: float, chunk_size: int, head_dim: int
) -> dict[str, Any]:
    """What the grid builds ``name`` with at ``ratio``: its budget by the one keep-ratio rule
    (:func:`kvdrop.spec.keep_budget`: a spec carrying a different budget of its own is a
    ``PolicyParamError``, never silently one or the other), the chunk and the model's head_dim."""
    from kvdrop.spec import keep_budget

    budget = keep_budget(name, ratio)
    params: dict[str, Any] = {**info.example, **budget.params, "chunk_size": chunk_size}
    if "head_dim" in {p.name for p in info.params}:
        params["head_dim"] = head_dim  # a fact of the model, not a choice
    return params


def _is_combinator(info: Any) -> bool:
    """A registered combinator takes other policies as parameters."""
    return bool({p.name for p in info.params} & {"policy", "policies"})


def build_policies(
    config: EvalConfig, head_dim: int, rope: Any
) -> tuple[dict[str, dict[float, Any]], dict[str, str]]:
    """``{name: {ratio: policy}}`` and the registered policies left out
    of a default grid (name -> why): combinators without a ``PolicyInfo.example`` (they are
    measured as spec strings, e.g. ``chunk(policy=snapkv)``) and any that fail to build. A policy
    named in ``config.policies`` that fails raises."""
    import kvdrop

    explicit = config.policies is not None
    names = list(config.policies) if config.policies is not None else kvdrop.available()
    built: dict[str, dict[float, Any]] = {}
    skipped: dict[str, str] = {}
    rerotate = rope if config.rerotate else None
    for name in names:
        try:
            info = kvdrop.describe(name)
            if not explicit and _is_combinator(info) and not info.example:
                skipped[name] = "a combinator without an example; name it as a spec string"
                continue
            built[name] = {
                r: kvdrop.get(
                    name,
                    rerotate=rerotate,
                    **_policy_params(name, info, r, config.chunk_size, head_dim),
                )
                for r in config.keep_ratios
            }
        except (ValueError, KeyError, TypeError, kvdrop.PolicyConflictError) as exc:
            if explicit:
                raise
            skipped[name] = f"{type(exc).__name__}: {exc}"
    return built, skipped


# ---------------------------------------------------------------------------------------------
# The grid
# ---------------------------------------------------------------------------------------------


def batches(samples: Sequence[Sample], length: int, batch_tokens: int) -> list[list[Sample]]:
    """``samples`` (all of one length) in batches of about ``batch_tokens`` prompt tokens."""
    size = max(1, batch_tokens // length)
    return [list(samples[i : i + size]) for i in range(0, len(samples), size)]


def _load(config: EvalConfig, log: Callable[[str], None]) -> tuple[Any, Any, str]:
    """The model of ``config``, announced before and after (loading takes seconds)."""
    from kvdrop_engine.loading import ModelSpec, load_model

    t0 = time.perf_counter()
    log(f"loading {config.model or 'the installed SmolLM2 model'} ...")
    model, tokenizer, model_name = load_model(
        ModelSpec(model=config.model, dtype=config.dtype, device=config.device, seed=config.seed)
    )
    if tokenizer is None:
        raise EvalError(
            f"model {model_name} has no tokenizer, and the tasks are text: use a .gguf file or "
            "an HF folder with tokenizer.json"
        )
    cfg = model.config
    log(f"model {model_name}: {cfg.num_layers} layers (loaded in {time.perf_counter() - t0:.1f}s)")
    return model, tokenizer, model_name


def _plan(config: EvalConfig, tokenizer: Any) -> list[tuple[int, list[Sample]]]:
    """``(length, batch)`` for every batch of the grid, in run order."""
    return [
        (length, batch)
        for length in config.lengths
        for batch in batches(
            [
                s
                for task in config.tasks
                for s in make_samples(task, tokenizer, length, config.num_samples, config.seed)
            ],
            length,
            config.batch_tokens,
        )
    ]


@dataclass
class _Grid:
    """The grid's progress: records so far (resumed ones included), what each cell has done."""

    config: EvalConfig
    fingerprint: dict[str, Any]
    path: Path | None
    records: list[dict[str, Any]]
    runs: list[tuple[str, float]]
    done: dict[tuple[Any, ...], set[int]] = dataclasses.field(
        default_factory=lambda: defaultdict(set)
    )

    def __post_init__(self) -> None:
        for rec in self.records:
            self.done[tuple(rec[f] for f in KEY)].update(rec["samples"])

    def todo(self, length: int, batch: Sequence[Sample]) -> dict[tuple[str, float], list[Any]]:
        """Per run, the (sample, setting) items of ``batch`` not measured yet."""
        return {
            run: [
                (s, setting)
                for setting in self.config.settings
                for s in batch
                if s.index not in self.done[(s.task, setting, length, *run)]
            ]
            for run in self.runs
        }

    def add(self, new: list[dict[str, Any]]) -> None:
        """Keep (and append to the results file) one run's records."""
        for rec in new:
            rec["config"] = self.fingerprint
            self.records.append(rec)
            self.done[tuple(rec[f] for f in KEY)].update(rec["samples"])
        if self.path is not None:
            append_results(self.path, new)


def _measure(
    config: EvalConfig,
    loaded: tuple[Any, Any, str],
    policies: dict[str, dict[float, Any]],
    grid: _Grid,
    progress: Callable[[int, int, str], None] | None,
) -> Measurement:
    """Every batch of the grid through one harness; the finished measurement."""
    model, tokenizer, model_name = loaded
    plan = _plan(config, tokenizer)
    total = len(plan) * (len(grid.runs) + len(config.settings) - 1)
    finished = 0
    if progress is not None:
        progress(0, total, "eval")
    with Measurement(config, model, tokenizer, model_name, policies) as measure:
        for number, (length, batch) in enumerate(plan):
            for new in measure.batch(length, number, batch, grid.todo(length, batch)):
                grid.add(new)
                finished += 1
                if progress is not None:
                    progress(finished, total, "eval")
    return measure


def run_eval(
    config: EvalConfig,
    *,
    results: str | Path | None = None,
    progress: Callable[[int, int, str], None] | None = None,
    log: Callable[[str], None] = lambda msg: None,
) -> EvalReport:
    """Measure the grid of ``config`` and return the aggregated rows (see the module docstring).

    ``results`` names a JSONL file: records already there (same configuration) are reused and new
    ones appended as each finishes. ``progress(done, total, phase)`` is called per pipeline run
    (one full-KV run per setting, one run per policy and keep ratio, for each batch).
    """
    config.validate()
    # Server, engine and client threads share the cores: spinning OpenMP workers would steal
    # them from each other. Must be set before torch starts its thread pool.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    t0 = time.perf_counter()
    if config.threads:
        torch.set_num_threads(config.threads)
    loaded = _load(config, log)
    cfg = loaded[0].config
    policies, skipped = build_policies(config, cfg.head_dim, cfg.rope)
    if not policies:
        raise EvalError("no policy could be built; name some with --policies")
    _check_layout(config, cfg, policies, skipped)
    for name, why in skipped.items():
        log(f"left out {name}: {why}")
    fingerprint = config.fingerprint(loaded[2])
    path = Path(results) if results is not None else None
    records = load_results(path, fingerprint) if path is not None else []
    if records:
        log(f"resuming: {len(records)} records from {path}")
    runs = [(FULL, 1.0)] + [(p, r) for p in policies for r in config.keep_ratios]
    grid = _Grid(config, fingerprint, path, records, runs)
    repeats = _RepeatedEdits()
    request_log = logging.getLogger("kvdrop_sdk.request")
    request_log.addFilter(repeats)
    try:
        measure = _measure(config, loaded, policies, grid, progress)
    finally:
        request_log.removeFilter(repeats)
    cells = {
        (t, s, n, p, r)
        for t in config.tasks
        for s in config.settings
        for n in config.lengths
        for p, r in runs
    }
    kept = [rec for rec in grid.records if tuple(rec[f] for f in KEY) in cells]
    setup = _setup(config, loaded[2], list(policies), fingerprint, measure)
    setup["wall_seconds"] = time.perf_counter() - t0
    setup["edits_already_stored"] = repeats.count
    return EvalReport(sort_rows(aggregate(kept), list(policies)), setup, skipped, kept)


def _setup(
    config: EvalConfig,
    model_name: str,
    policies: list[str],
    fingerprint: dict[str, Any],
    measure: Measurement,
) -> dict[str, Any]:
    """The report's setup: the grid, what results depend on, the machine, the capture."""
    import torch

    return {
        "model": model_name,
        "grid": {
            "policies": policies,
            "keep_ratios": list(config.keep_ratios),
            "lengths": list(config.lengths),
            "tasks": list(config.tasks),
            "settings": list(config.settings),
            "num_samples": config.num_samples,
        },
        **fingerprint,
        "device": config.device,
        "torch_threads": torch.get_num_threads(),
        "machine": _machine(),
        "wall_seconds": 0.0,
        "query_capture": measure.capture.mode.value if measure.any_query else None,
        "server_evictions": (measure.server_status or {}).get("evictions"),
        "edits_already_stored": 0,
    }


def _check_layout(
    config: EvalConfig, cfg: Any, policies: dict[str, dict[float, Any]], skipped: dict[str, str]
) -> None:
    """Every built policy, run once on the model's layout before any prefill: one named in
    ``config.policies`` that cannot edit this model raises EvalError; one of the default grid is
    left out (in ``skipped``, with why)."""
    from kvdrop.experiments.harness import HarnessError, check_policies
    from kvdrop_sdk.query_capture import QueryCapture

    for name in list(policies):
        fns = {f"{name} (keep {r})": fn for r, fn in policies[name].items()}
        try:
            check_policies(fns, cfg, QueryCapture.for_policies(fns.values()), config.chunk_size)
        except HarnessError as exc:
            if config.policies is not None:
                raise EvalError(str(exc)) from None
            skipped[name] = str(exc)
            del policies[name]
    if not policies:
        raise EvalError("no policy can edit this model's caches; name some with --policies")


class _RepeatedEdits(logging.Filter):
    """Counts (and keeps off the terminal) the SDK's warning that an edit was already stored:
    expected here, when two keep ratios align to the same chunk budget or two policies keep the
    same tokens of a prompt (the stored copy is the same edit)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if "already held every chunk of the edit" in record.getMessage():
            self.count += 1
            return False
        return True


def _machine() -> str:
    """CPU model and core count (Linux), else the platform's name."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores ({platform.system()})"
