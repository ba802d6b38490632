"""Accuracy and fidelity of drop policies against full KV on a real model, offline: the
measurement behind ``kvdrop eval`` (the command, tables and plot: :mod:`~.eval_cli`).

The measurement goes through the real pipeline of :mod:`kvdrop.experiments.pipeline`: an
in-process kvdrop server, the reference engine (prefill stores KV and queries in the server), the
SDK's ``modify`` with the policy (re-rotated), and the engine decoding on the edited cache. For
every cell of the grid ``task x setting x length x policy x keep_ratio`` it reports:

* **accuracy**: greedy answers (``max_tokens`` tokens, all from the edited cache: decoding starts
  from the kept tokens, never after a token sampled from the full cache) checked against the
  task's known answer, with a 95% Wilson interval;
* **fidelity**: over a teacher-forced continuation (the full-KV answer, with its EOS), the mean
  ``KL(full || dropped)`` of the next-token distributions (nats per token) and how often their
  top-1 tokens agree (:func:`kvdrop_engine.scoring.continuation_logprobs` reads the same edited
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
import json
import logging
import math
import os
import platform
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvdrop.experiments.tasks import DEFAULT_TASKS, SETTINGS, TASKS, Sample, make_samples

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
)
#: The policy name of the full-KV rows.
FULL = "full"

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
}


class EvalError(RuntimeError):
    """The evaluation cannot run as configured, or its measurement would be wrong."""


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

        for name in ("num_samples", "max_tokens", "chunk_size", "batch_tokens"):
            positive(name, getattr(self, name))
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
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r < 1:
                raise ValueError(f"keep ratios must be in (0, 1) (1.0 is full KV), got {r!r}")
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
# Statistics and aggregation
# ---------------------------------------------------------------------------------------------


def wilson(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of ``correct`` successes in ``n`` trials (95% for z=1.96)."""
    if n <= 0:
        return (0.0, 1.0)
    if not 0 <= correct <= n:
        raise ValueError(f"correct must be in [0, n={n}], got {correct}")
    p = correct / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


KEY = ("task", "setting", "length", "policy", "keep_ratio")


def aggregate(
    records: Iterable[Mapping[str, Any]], by: Sequence[str] = KEY
) -> list[dict[str, Any]]:
    """Rows from per-batch records, grouped by the fields ``by`` (the others pooled).

    Accuracy pools the answers; ``kl`` and ``top1_agreement`` are means over every scored
    position; ``kept_fraction`` is the tokens decoded from (kept plus any uncompressed tail) over
    the prompt tokens; ``modify_ms`` the modify phase's wall time per prompt. A sample measured
    twice (an interrupted batch run again) counts once.
    """
    groups: dict[tuple[Any, ...], dict[tuple[Any, ...], dict[str, Any]]] = defaultdict(dict)
    for rec in records:
        key = tuple(rec[f] for f in by)
        share = rec.get("seconds", {}).get("modify", 0.0) / max(1, len(rec["samples"]))
        for i, idx in enumerate(rec["samples"]):
            groups[key][(*(rec[f] for f in KEY), idx)] = {
                "correct": bool(rec["correct"][i]),
                "kl": rec["kl"][i],
                "top1": rec["top1"][i],
                "positions": rec["positions"][i],
                "kept": rec["kept"][i],
                "prompt": rec["prompt"][i],
                "modify_s": share,
            }
    rows = []
    for key, samples in groups.items():
        vals = list(samples.values())
        n = len(vals)
        correct = sum(v["correct"] for v in vals)
        positions = sum(v["positions"] for v in vals)
        lo, hi = wilson(correct, n)
        row: dict[str, Any] = dict(zip(by, key))
        row.update(
            n=n,
            correct=correct,
            accuracy=correct / n,
            ci_low=lo,
            ci_high=hi,
            kl=sum(v["kl"] * v["positions"] for v in vals) / positions if positions else 0.0,
            top1_agreement=(
                sum(v["top1"] * v["positions"] for v in vals) / positions if positions else 1.0
            ),
            kept_fraction=sum(v["kept"] for v in vals) / max(1, sum(v["prompt"] for v in vals)),
            modify_ms=1000 * sum(v["modify_s"] for v in vals) / n,
        )
        rows.append(row)
    return rows


def sort_rows(rows: list[dict[str, Any]], policy_order: Sequence[str]) -> list[dict[str, Any]]:
    """Rows in report order: task, setting, length, then full KV and ``policy_order``, keep ratio
    falling (fields a row lacks sort first)."""
    order = {p: i for i, p in enumerate([FULL, *policy_order])}
    tasks = {t: i for i, t in enumerate(TASKS)}
    settings = {s: i for i, s in enumerate(SETTINGS)}
    return sorted(
        rows,
        key=lambda r: (
            tasks.get(r.get("task", ""), -1),
            settings.get(r.get("setting", ""), -1),
            r.get("length", 0),
            order.get(r.get("policy", ""), len(order)),
            -r.get("keep_ratio", 1.0),
        ),
    )


# ---------------------------------------------------------------------------------------------
# Results file
# ---------------------------------------------------------------------------------------------


def load_results(path: Path, fingerprint: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The records of ``path`` (a missing file has none). A line cut short by an interrupted run is
    ignored (its cell runs again); ``EvalError`` when the file holds another configuration's."""
    if not path.exists():
        return []
    records = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(rec, dict) or "config" not in rec or "samples" not in rec:
                raise EvalError(f"{path}:{lineno} is not a kvdrop eval record")
            if rec["config"] != dict(fingerprint):
                raise EvalError(
                    f"{path} holds results of another configuration ({rec['config']}); this "
                    f"run is {dict(fingerprint)}. Use another --results file or remove it."
                )
            records.append(rec)
    return records


def append_results(path: Path, records: Sequence[Mapping[str, Any]]) -> None:
    """Append ``records`` as JSON lines (after ending a line an interrupted run left open)."""
    cut = False
    if path.exists() and path.stat().st_size > 0:
        with path.open("rb") as f:
            f.seek(-1, os.SEEK_END)
            cut = f.read(1) != b"\n"
    with path.open("a") as f:
        if cut:
            f.write("\n")
        for rec in records:
            f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())


# ---------------------------------------------------------------------------------------------
# Policies
# ---------------------------------------------------------------------------------------------


def _policy_params(info: Any, ratio: float, chunk_size: int, head_dim: int) -> dict[str, Any]:
    params: dict[str, Any] = {**info.example, "keep_ratio": ratio, "chunk_size": chunk_size}
    if "head_dim" in {p.name for p in info.params}:
        params["head_dim"] = head_dim  # a fact of the model, not a choice
    return params


def _is_combinator(info: Any) -> bool:
    """A registered combinator takes other policies as parameters."""
    return bool({p.name for p in info.params} & {"policy", "policies"})


def build_policies(
    config: EvalConfig, head_dim: int, rope: Any
) -> tuple[dict[str, dict[float, Any]], dict[str, bool], dict[str, str]]:
    """``{name: {ratio: policy}}``, ``{name: needs_query}`` and the registered policies left out
    of a default grid (name -> why): combinators without a ``PolicyInfo.example`` (they are
    measured as spec strings, e.g. ``chunk(policy=snapkv)``) and any that fail to build. A policy
    named in ``config.policies`` that fails raises."""
    import kvdrop

    explicit = config.policies is not None
    names = list(config.policies) if config.policies is not None else kvdrop.available()
    built: dict[str, dict[float, Any]] = {}
    needs_query: dict[str, bool] = {}
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
                    name, rerotate=rerotate, **_policy_params(info, r, config.chunk_size, head_dim)
                )
                for r in config.keep_ratios
            }
            needs_query[name] = bool(info.needs_query)
        except (ValueError, KeyError, TypeError, kvdrop.PolicyConflictError) as exc:
            if explicit:
                raise
            skipped[name] = f"{type(exc).__name__}: {exc}"
    return built, needs_query, skipped


# ---------------------------------------------------------------------------------------------
# The grid
# ---------------------------------------------------------------------------------------------


def batches(samples: Sequence[Sample], length: int, batch_tokens: int) -> list[list[Sample]]:
    """``samples`` (all of one length) in batches of about ``batch_tokens`` prompt tokens."""
    size = max(1, batch_tokens // length)
    return [list(samples[i : i + size]) for i in range(0, len(samples), size)]


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

    from kvdrop_engine.loading import ModelSpec, load_model

    t0 = time.perf_counter()
    if config.threads:
        torch.set_num_threads(config.threads)
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
    policies, needs_query, skipped = build_policies(config, cfg.head_dim, cfg.rope)
    for name, why in skipped.items():
        log(f"left out {name}: {why}")
    if not policies:
        raise EvalError("no policy could be built; name some with --policies")
    fingerprint = config.fingerprint(model_name)
    path = Path(results) if results is not None else None
    records = load_results(path, fingerprint) if path is not None else []
    if records:
        log(f"resuming: {len(records)} records from {path}")
    done: dict[tuple[Any, ...], set[int]] = defaultdict(set)
    for rec in records:
        done[tuple(rec[f] for f in KEY)].update(rec["samples"])

    plan = [
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
    runs = [(FULL, 1.0)] + [(p, r) for p in policies for r in config.keep_ratios]
    total = len(plan) * (len(runs) + len(config.settings) - 1)
    finished = 0
    if progress is not None:
        progress(0, total, "eval")
    repeats = _RepeatedEdits()
    request_log = logging.getLogger("kvdrop_sdk.request")
    request_log.addFilter(repeats)
    try:
        with _Measurement(config, model, tokenizer, model_name, policies, needs_query) as measure:
            for number, (length, batch) in enumerate(plan):
                todo = {
                    run: [
                        (s, setting)
                        for setting in config.settings
                        for s in batch
                        if s.index not in done[(s.task, setting, length, *run)]
                    ]
                    for run in runs
                }
                for new in measure.batch(length, number, batch, todo):
                    for rec in new:
                        rec["config"] = fingerprint
                        records.append(rec)
                        done[tuple(rec[f] for f in KEY)].update(rec["samples"])
                    if path is not None:
                        append_results(path, new)
                    finished += 1
                    if progress is not None:
                        progress(finished, total, "eval")
        server_status = measure.server_status
        query_capture = measure.query_capture if measure.any_query else None
    finally:
        request_log.removeFilter(repeats)
    grid = {
        (t, s, n, p, r)
        for t in config.tasks
        for s in config.settings
        for n in config.lengths
        for p, r in runs
    }
    records = [rec for rec in records if tuple(rec[f] for f in KEY) in grid]
    setup = {
        "model": model_name,
        "grid": {
            "policies": list(policies),
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
        "wall_seconds": time.perf_counter() - t0,
        "query_capture": query_capture,
        "server_evictions": (server_status or {}).get("evictions"),
        "edits_already_stored": repeats.count,
    }
    return EvalReport(sort_rows(aggregate(records), list(policies)), setup, skipped, records)


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


# ---------------------------------------------------------------------------------------------
# One batch through the pipeline
# ---------------------------------------------------------------------------------------------


Item = tuple[Sample, str]  # a sample in a setting


class _Measurement:
    """The server, engine and contexts of one evaluation, and the measurement of one batch."""

    def __init__(
        self,
        config: EvalConfig,
        model: Any,
        tokenizer: Any,
        model_name: str,
        policies: dict[str, dict[float, Any]],
        needs_query: dict[str, bool],
    ) -> None:
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name
        # Query policies run first: the server's LRU keeps the prompts' queries only while runs
        # read them, and the edits of later runs may push them out (a lookup does not refresh).
        self.policies = dict(sorted(policies.items(), key=lambda kv: not needs_query[kv[0]]))
        self.needs_query = needs_query
        # Policies that read the engine's reconstruction scores (kvzip): their prefill runs the
        # pass, and the scores travel through the query context.
        self.scores = {
            name: any(fn.token_scores for fn in by.values()) for name, by in policies.items()
        }
        self.any_query = any(needs_query.values()) or any(self.scores.values())
        # The lean query window, unless a policy reads every cached token's query (a plugin
        # scorer without sparse_queries): then the engine captures them all for every policy
        # (window-reading scorers then read the chunk queries of the cached part and the
        # window's rows of the rest).
        full = any(fn.needs_full_queries for by in policies.values() for fn in by.values())
        self.query_capture = "full" if full else "window"
        self.server_status: dict[str, Any] | None = None
        cfg = model.config
        eos = tuple(getattr(cfg, "eos_token_ids", ()) or ())
        self.eos = eos[0] if eos else None
        itemsize = model.dtype.itemsize
        self.kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize
        self.q_bytes = cfg.num_layers * cfg.num_heads * cfg.head_dim * itemsize

    def __enter__(self) -> _Measurement:
        from kvdrop_engine.connector import ServerConnector
        from kvdrop_engine.engine import Engine
        from kvdrop_engine.reconstruct import ReconstructionPrompt
        from kvdrop_sdk import kvcache, qcache
        from kvdrop_sdk.server.app import Server
        from kvdrop_sdk.server.config import ServerConfig
        from kvdrop_sdk.server.pool import unique_shm_name

        c = self.config
        sizes = [(n, max(1, c.batch_tokens // n)) for n in c.lengths]  # (length, batch size)
        per_token = self.kv_bytes + (self.q_bytes if self.any_query else 0)
        # A batch's prompts with their queries (the settings share all but the last chunk) and
        # one run's edits (both settings). Older runs' edits are never read again and go first
        # (LRU); a needed entry evicted anyway is detected (see _check_loaded).
        need = max(n * b * (1.2 * per_token + len(c.settings) * self.kv_bytes) for n, b in sizes)
        # Every stream of a run at once: prompt (or kept tokens), question and answer.
        budget = max(b * len(c.settings) * (n + 96 + c.max_tokens) for n, b in sizes)
        self.server = Server(
            ServerConfig(
                port=0,
                http_port=0,
                chunk_size=c.chunk_size,
                l1_size_gb=(1.2 * need + 64 * 2**20) / 1e9,
                shm_name=unique_shm_name("kvdrop_eval"),
                enable=("transfer_query",) if self.any_query else (),
            )
        ).start()
        try:
            self.connector = ServerConnector(
                self.server.url,
                self.server.http_url,
                self.model_name,
                query_capture=self.query_capture,
            )
            self.engine = Engine(
                self.model,
                tokenizer=self.tokenizer,
                kv_budget_tokens=budget,
                connector=self.connector,
                reconstruction=ReconstructionPrompt.from_tokenizer(self.tokenizer),
            ).start()
            self.kv_ctx = kvcache.connect(self.server.url, self.server.http_url, self.model_name)
            self.q_ctx = (
                qcache.connect(self.server.url, self.server.http_url, self.model_name)
                if self.any_query
                else None
            )
        except BaseException:
            self.server.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.server_status = self.server.status_json()
            self.engine.stop()
            for ctx in (self.kv_ctx, self.q_ctx):
                if ctx is not None:
                    ctx.close()
            self.connector.close()
        finally:
            self.server.stop()

    def batch(
        self,
        length: int,
        number: int,
        batch: Sequence[Sample],
        todo: Mapping[tuple[str, float], Sequence[Item]],
    ) -> Iterator[list[dict[str, Any]]]:
        """Full KV (one run per setting), then every (policy, ratio) with work in ``todo``
        ({(policy, ratio): items}); yields, for each of these runs in order, its records (one per
        (task, setting) group; none for a run with nothing to do)."""
        from kvdrop_engine.logprobs import continuation_logprobs

        if not any(todo.values()):
            yield from ([] for _ in range(len(self.config.settings) + len(todo) - 1))
            return
        salt = f"kvdrop-eval:{self.config.seed}:{length}:{number}"
        needed = {(s.task, s.index, setting) for items in todo.values() for s, setting in items}
        reference: dict[tuple[str, int, str], tuple[list[int], Any]] = {}
        for setting in self.config.settings:  # one run each: the second loads the shared prefix
            items = [(s, setting) for s in batch if (s.task, s.index, setting) in needed]
            if not items:
                yield []
                continue
            full = self._run(FULL, items, salt, None, [self.kv_ctx])
            conts = [self._continuation(o) for o in full.outputs]
            t = time.perf_counter()
            logprobs = continuation_logprobs(
                self.model,
                list(zip(full.decode_prompts, conts)),
                connector=self.connector,
                cache_salt=salt,
                max_batch_tokens=self.config.batch_tokens,
            )
            score_s = time.perf_counter() - t
            for (s, _), cont, lp in zip(items, conts, logprobs):
                reference[(s.task, s.index, setting)] = (cont, lp)
            mine = {(s.task, s.index) for s, st in todo[(FULL, 1.0)] if st == setting}
            fid = [(0.0, 1.0)] * len(items)
            yield self._records(length, FULL, 1.0, items, full, fid, conts, score_s, mine)
        for policy, by_ratio in self.policies.items():
            uses_q = self.needs_query[policy] or self.scores[policy]
            ctxs = [self.kv_ctx] + ([self.q_ctx] if uses_q else [])
            for ratio, fn in by_ratio.items():
                items = list(todo[(policy, ratio)])
                if not items:
                    yield []
                    continue
                run = self._run(policy, items, salt, fn, ctxs, reconstruct=self.scores[policy])
                self._check_loaded(run, items, (length, policy, ratio))
                refs = [reference[(s.task, s.index, setting)] for s, setting in items]
                conts = [cont for cont, _ in refs]
                t = time.perf_counter()
                got = continuation_logprobs(
                    self.model,
                    list(zip(run.decode_prompts, conts)),
                    connector=self.connector,
                    cache_salt=run.decode_salts,  # each stream's edit is under its own salt
                    max_batch_tokens=self.config.batch_tokens,
                )
                score_s = time.perf_counter() - t
                fid = []
                for (_, ref), lp in zip(refs, got):
                    kl = (ref.exp() * (ref - lp)).sum(-1).clamp_min(0.0)
                    fid.append(
                        (float(kl.mean()), float((ref.argmax(-1) == lp.argmax(-1)).float().mean()))
                    )
                yield self._records(length, policy, ratio, items, run, fid, conts, score_s)

    def _run(
        self,
        name: str,
        items: Sequence[Item],
        salt: str,
        fn: Any,
        contexts: list,
        reconstruct: bool = False,
    ) -> Any:
        """One pipeline run over ``items``: prefill, modify with ``fn`` (if any), decode from the
        edited cache (the question appended in the ``after`` setting)."""
        from kvdrop.experiments.pipeline import Prompt, run_pipeline
        from kvdrop_sdk.batch import BatchedStreamFailures

        try:
            return run_pipeline(
                name,
                self.engine,
                contexts,
                [Prompt(s.prompt(setting), s.answer) for s, setting in items],
                {"temperature": 0.0, "max_tokens": self.config.max_tokens},
                modify_fn=fn,
                cache_salt=salt,
                suffixes=[s.suffix(setting) for s, setting in items],
                reconstruct=reconstruct,
            )
        except BatchedStreamFailures as exc:
            first = next(iter(exc.failures.values()))
            raise EvalError(
                f"{name}: {len(exc.failures)} of {len(items)} streams failed in {exc.phase} "
                f"({first}); a missing cached chunk means the server evicted this batch's "
                "prompts: lower --batch-tokens"
            ) from exc

    def _continuation(self, output: list[int]) -> list[int]:
        """The teacher-forced continuation: the full-KV answer and, if it stopped, its EOS."""
        if len(output) < self.config.max_tokens and self.eos is not None:
            return [*output, self.eos]
        return list(output) or ([self.eos] if self.eos is not None else [])

    def _check_loaded(self, run: Any, items: Sequence[Item], what: tuple[Any, ...]) -> None:
        """The decode must have loaded every edited prefix from the server: an evicted edit would
        be recomputed from the kept tokens alone, silently."""
        chunk = self.config.chunk_size
        expected = 0
        for (s, setting), prompt in zip(items, run.decode_prompts):
            body = len(prompt) - len(s.suffix(setting))  # kept tokens + uncached tail
            expected += min(body - body % chunk, len(prompt) - 1)
        loaded = int(run.engine.get("tokens_loaded", 0))
        if loaded < expected:
            raise EvalError(
                f"{what}: the engine loaded {loaded} of the {expected} edited tokens from the "
                "server (an edit was evicted before decoding); lower --batch-tokens"
            )

    def _records(
        self,
        length: int,
        policy: str,
        ratio: float,
        items: Sequence[Item],
        run: Any,
        fidelity: Sequence[tuple[float, float]],
        conts: Sequence[list[int]],
        score_s: float,
        only: set[tuple[str, int]] | None = None,
    ) -> list[dict[str, Any]]:
        """One record per (task, setting) group of ``items`` (restricted to ``only``)."""
        groups: dict[tuple[str, str], list[int]] = defaultdict(list)
        for i, (s, setting) in enumerate(items):
            if only is None or (s.task, s.index) in only:
                groups[(s.task, setting)].append(i)
        seconds = {
            "prefill": float(run.prefill["duration"]),
            "modify": float(run.modify["duration"]) if run.modify is not None else 0.0,
            "decode": float(run.decode["duration"]),
            "score": score_s,
            "reconstruct": float(run.prefill_engine.get("reconstruction_seconds", 0.0)),
        }
        out = []
        for (task, setting), idx in groups.items():
            share = len(idx) / len(items)
            out.append(
                {
                    "task": task,
                    "setting": setting,
                    "length": length,
                    "policy": policy,
                    "keep_ratio": ratio,
                    "samples": [items[i][0].index for i in idx],
                    "correct": [items[i][0].is_correct(run.texts[i]) for i in idx],
                    "kl": [fidelity[i][0] for i in idx],
                    "top1": [fidelity[i][1] for i in idx],
                    "positions": [len(conts[i]) for i in idx],
                    "kept": [
                        len(run.decode_prompts[i]) - len(items[i][0].suffix(setting)) for i in idx
                    ],
                    "prompt": [len(items[i][0].prompt(setting)) for i in idx],
                    "answers": [items[i][0].answer for i in idx],
                    "outputs": [run.texts[i] for i in idx],
                    "seconds": {k: v * share for k, v in seconds.items()},
                }
            )
        return out
