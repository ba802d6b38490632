"""One evaluation's wiring and the measurement of one batch (for :mod:`~.eval`): the harness's
server, engine and contexts; per batch the full-KV runs, then every policy's, with accuracy and
fidelity against the full-KV continuation."""

from __future__ import annotations

import functools
import operator
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from kvdrop.experiments.results import FULL, EvalError
from kvdrop.experiments.tasks import Sample
from kvdrop_sdk.query_capture import NO_NEEDS

__all__ = ["Measurement"]

Item = tuple[Sample, str]  # a sample in a setting


class Measurement:
    """The harness (server, engine, contexts) of one evaluation, and the measurement of one
    batch."""

    def __init__(
        self,
        config: Any,  # an EvalConfig (not imported: eval imports this module)
        model: Any,
        tokenizer: Any,
        model_name: str,
        policies: dict[str, dict[float, Any]],
    ) -> None:
        from kvdrop_sdk.query_capture import QueryCapture, needs_of

        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name
        # What each policy reads (its needs, over every keep ratio): queries, and the engine's
        # reconstruction scores (kvzip: its prefill runs the pass, the scores travel through
        # the query context).
        self.needs = {
            name: functools.reduce(operator.or_, map(needs_of, by.values()), NO_NEEDS)
            for name, by in policies.items()
        }
        # Query policies run first: the server's LRU keeps the prompts' queries only while runs
        # read them, and the edits of later runs may push them out (a lookup does not refresh).
        self.policies = dict(
            sorted(policies.items(), key=lambda kv: not self.needs[kv[0]].reads_queries)
        )
        # The lean query window, unless a policy reads every cached token's query (a plugin
        # scorer declaring QueryNeed.FULL): then the engine captures them all for every policy
        # (window-reading scorers then read the chunk queries of the cached part and the
        # window's rows of the rest).
        self.capture = QueryCapture.for_policies(
            fn for by in policies.values() for fn in by.values()
        )
        self.any_query = self.capture.uses_query_context
        self.server_status: dict[str, Any] | None = None
        eos = tuple(model.config.eos_token_ids or ())
        self.eos = eos[0] if eos else None

    def _sizes(self) -> tuple[float, int]:
        """The server's pool (GB) and the engine's KV budget (tokens) for the grid's batches."""
        from kvdrop.experiments.harness import kv_bytes_per_token, query_bytes_per_token

        c, cfg, itemsize = self.config, self.model.config, self.model.dtype.itemsize
        kv_bytes = kv_bytes_per_token(cfg, itemsize)
        q_bytes = query_bytes_per_token(cfg, itemsize)
        sizes = [(n, max(1, c.batch_tokens // n)) for n in c.lengths]  # (length, batch size)
        per_token = kv_bytes + (q_bytes if self.any_query else 0)
        # A batch's prompts with their queries (the settings share all but the last chunk) and
        # one run's edits (both settings). Older runs' edits are never read again and go first
        # (LRU); a needed entry evicted anyway is detected (see _check_loaded).
        need = max(n * b * (1.2 * per_token + len(c.settings) * kv_bytes) for n, b in sizes)
        # Every stream of a run at once: prompt (or kept tokens), question and answer.
        budget = max(b * len(c.settings) * (n + 96 + c.max_tokens) for n, b in sizes)
        return (1.2 * need + 64 * 2**20) / 1e9, budget

    def __enter__(self) -> Measurement:
        from kvdrop.experiments.harness import open_harness

        pool_gb, budget = self._sizes()
        self._harness = open_harness(
            self.model,
            self.tokenizer,
            self.model_name,
            capture=self.capture,
            kv_budget_tokens=budget,
            pool_gb=pool_gb,
            chunk_size=self.config.chunk_size,
            shm_prefix="kvdrop_eval",
        )
        h = self._harness.__enter__()
        self.harness = h
        self.engine, self.connector = h.engine, h.connector
        self.kv_ctx = h.contexts[0]
        self.q_ctx = h.contexts[1] if len(h.contexts) > 1 else None
        return self

    def __exit__(self, *exc: Any) -> None:
        self._harness.__exit__(*exc)
        self.server_status = self.harness.final_status

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
                self.engine, list(zip(full.decode_prompts, conts)), cache_salt=salt
            )
            score_s = time.perf_counter() - t
            for (s, _), cont, lp in zip(items, conts, logprobs):
                reference[(s.task, s.index, setting)] = (cont, lp)
            mine = {(s.task, s.index) for s, st in todo[(FULL, 1.0)] if st == setting}
            fid = [(0.0, 1.0)] * len(items)
            yield self._records(length, FULL, 1.0, items, full, fid, conts, score_s, mine)
        # Prompts whose reconstruction scores the server holds (stored by an earlier run of this
        # batch, under its salt): later runs of policies that read them skip the pass.
        scored: set[tuple[str, int, str]] = set()
        for policy, by_ratio in self.policies.items():
            needs = self.needs[policy]
            uses_q = needs.reads_queries or needs.token_scores
            ctxs = [self.kv_ctx] + ([self.q_ctx] if uses_q else [])
            for ratio, fn in by_ratio.items():
                items = list(todo[(policy, ratio)])
                if not items:
                    yield []
                    continue
                keys = {(s.task, s.index, setting) for s, setting in items}
                reconstruct = needs.token_scores and not keys <= scored
                run = self._run(policy, items, salt, fn, ctxs, reconstruct)
                if reconstruct:
                    scored |= keys
                self._check_loaded(run, items, (length, policy, ratio))
                refs = [reference[(s.task, s.index, setting)] for s, setting in items]
                conts = [cont for cont, _ in refs]
                t = time.perf_counter()
                got = continuation_logprobs(
                    self.engine,
                    list(zip(run.decode_prompts, conts)),
                    cache_salt=run.decode_salts,  # each stream's edit is under its own salt
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
        """One pipeline run over ``items``: prefill (with the reconstruction pass when
        ``reconstruct``), modify with ``fn`` (if any), decode from the edited cache (the question
        appended in the ``after`` setting)."""
        from kvdrop.experiments.prompts import Prompt
        from kvdrop.experiments.runner import run_pipeline
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
