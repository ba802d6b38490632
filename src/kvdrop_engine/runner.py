"""Every pass over the model and the paged cache: a step's forward and the side passes.

The :class:`ModelRunner` owns the model's device side: the paged KV cache, the fused ops and the
decode CUDA graphs (:func:`~kvdrop_engine.graphs.accelerate`), and every pass that reads them:

* :meth:`ModelRunner.forward` -- one engine step over a planned batch (generating requests'
  sampled rows, scoring requests' teacher-forced log-probs), through the one paged attention
  backend (or a decode graph replay);
* :meth:`ModelRunner.read_kv` -- a request's KV in the server layout, for the stores;
* :meth:`ModelRunner.window_records` -- the finished requests' query windows, each with its
  attention log-normalisers read from its own keys (one synchronisation for all);
* :meth:`ModelRunner.reconstruct_piece` -- a bounded piece of KVzip's reconstruction pass over a
  request's prompt (:meth:`ModelRunner.reconstruction_pass`).

A forward changes no request state, so the engine can retry a failed one with fewer requests.
Results leave the device here (through page-locked memory): the stores run on other threads,
whose device calls could meet a CUDA graph capture of the loop thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from kvdrop_engine.capture import WindowCapture, log_normalisers
from kvdrop_engine.graphs import DecodeGraphs, accelerate
from kvdrop_engine.model import ModelConfig
from kvdrop_engine.paged import PagedAttention, PagedKVCache, to_host, to_host_all
from kvdrop_engine.reconstruct import ReconstructionPass, ReconstructionPrompt
from kvdrop_engine.scheduler import StepPlan
from kvdrop_engine.sequence import Request

__all__ = ["Forward", "ModelRunner", "WindowRecord"]


#: A finished request's query window on the host: ``(positions [R], queries [L, R, Hq, d],
#: lse [L, R, Hq])``.
WindowRecord = tuple[Tensor, Tensor, Tensor]


@dataclass
class Forward:
    """What one forward gives: ``logits [R, V]`` of the sampled rows, their ``greedy`` argmax
    when a graph computed it, ``scores`` (float32 log-softmax rows of the plan's ``score_rows``,
    on the host), the attention (None for a graph replay) with the ``capture`` offsets it kept
    queries for (a replay: ``queries [L, B, Hq, d]``, one row per decode, in ``rows`` order),
    and the seconds spent capturing a new graph."""

    logits: Tensor
    greedy: Tensor | None = None
    scores: Tensor | None = None
    attn: PagedAttention | None = None
    capture: dict[int, list[int]] = field(default_factory=dict)
    capture_seconds: float = 0.0
    queries: Tensor | None = None
    rows: dict[int, int] = field(default_factory=dict)

    def captured_rows(self, rid: int) -> Tensor:
        """The query rows ``[L, r, Hq, d]`` kept for request ``rid`` (in ``capture``)."""
        if self.attn is not None:
            return self.attn.captured_rows(rid)
        assert self.queries is not None
        row = self.rows[rid]
        return self.queries[:, row : row + 1]


class ModelRunner:
    """Runs ``model`` over step plans on a paged cache of ``num_blocks`` blocks."""

    def __init__(
        self,
        model: nn.Module,
        config: ModelConfig,
        *,
        num_blocks: int,
        block_size: int,
        max_batch_size: int,
        fused_ops: bool | None,
        cuda_graphs: bool | None,
        graph_batch_sizes: Sequence[int] | None = None,
    ) -> None:
        param = next((p for p in model.parameters() if p.is_floating_point()), None)
        self.device = param.device if param is not None else torch.device("cpu")
        self.dtype = param.dtype if param is not None else torch.float32
        self.model = model
        self.config = config
        self.cache = PagedKVCache(
            num_layers=config.num_layers,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=self.dtype,
            device=self.device,
        )
        self.graphs: DecodeGraphs | None = accelerate(
            model, config, self.cache, max_batch_size, fused_ops=fused_ops, cuda_graphs=cuda_graphs
        )
        if self.graphs is not None:  # before any other thread touches the device
            self.graphs.precapture(graph_batch_sizes)

    def forward(self, plan: StepPlan) -> Forward:
        """Run the model over ``plan``: a graph replay for a decode-only step when graphs are
        on (its decode rows' queries come from the graphs' buffer), else one eager forward that
        keeps the query rows each request's capture wants."""
        capture: dict[int, list[int]] = {}
        for req, n in plan.stepped:
            offsets = req.capture_offsets(n)
            if offsets:
                capture[req.rid] = offsets
        if plan.num_prefill == 0 and self.graphs is not None:
            before = self.graphs.capture_seconds
            logits, greedy = self.graphs.run(plan.seqs, plan.tokens)
            out = Forward(logits, greedy, capture_seconds=self.graphs.capture_seconds - before)
            if capture:  # a decode's one row: its query, from the graphs' buffer
                out.capture = capture
                out.queries = self.graphs.queries(len(plan.seqs))
                out.rows = {req.rid: i for i, (req, _) in enumerate(plan.stepped)}
            return out
        attn = PagedAttention(self.cache, plan.seqs, capture_rows=capture)
        dev = self.device
        rows = plan.sample_rows + plan.score_rows
        with torch.inference_mode():
            logits = self.model(
                torch.tensor(plan.tokens, dtype=torch.long, device=dev),
                torch.tensor(plan.positions, dtype=torch.long, device=dev),
                attn,
                logits_rows=torch.tensor(rows, dtype=torch.long, device=dev),
            )
            scores = None
            if plan.score_rows:
                sampled = len(plan.sample_rows)
                scores = to_host(torch.log_softmax(logits[sampled:].float(), dim=-1))
                logits = logits[:sampled]
        return Forward(logits, None, scores, attn, capture)

    def read_kv(self, blocks: Sequence[int], num_tokens: int) -> Tensor:
        """KV ``[2, L, T, Hkv*d]`` of a request's first ``num_tokens`` tokens, on the host."""
        return self.cache.read_cpu(blocks, num_tokens)

    def finished_windows(
        self, ended: Sequence[tuple[Request, int | None, str | None]]
    ) -> dict[int, WindowRecord | None]:
        """The query windows of the requests a step ends (with a token and a finish reason, a
        window, not cancelled), while their blocks are their own, in one batched call. ``{}``
        when the batch fails: each request then computes its own (failing only itself)."""
        taking = [
            req
            for req, tok, reason in ended
            if tok is not None and reason is not None and req.window is not None
            and not req.cancelled
        ]  # fmt: skip
        if not taking:
            return {}
        jobs = [(req.blocks, len(req.prompt) + len(req.output) - 1, req.window) for req in taking]
        try:
            records = self.window_records(jobs)  # type: ignore[arg-type]
        except Exception:
            return {}
        return {req.rid: rec for req, rec in zip(taking, records, strict=True)}

    def window_records(
        self, finished: Sequence[tuple[Sequence[int], int, WindowCapture]]
    ) -> list[WindowRecord | None]:
        """:meth:`window_record` of every ``(blocks, num_computed, window)`` of the requests
        finishing in one step, in one call: every request's log-normalisers are queued before
        the one synchronisation that brings them all to the host (a sync per request leaves the
        device idle while the loop queues the next request's work)."""
        on_device = [self._window_on_device(*job) for job in finished]
        host = iter(to_host_all(*(t for rec in on_device if rec is not None for t in rec)))
        return [None if rec is None else (next(host), next(host), next(host)) for rec in on_device]

    def window_record(
        self, blocks: Sequence[int], num_computed: int, window: WindowCapture
    ) -> WindowRecord | None:
        """A finished request's query window on the host: ``(positions [R], queries [L, R, Hq,
        d], lse [L, R, Hq])``, the log-normalisers read from the request's own ``num_computed``
        keys (while its blocks are its own); None when it kept no rows."""
        return self.window_records([(blocks, num_computed, window)])[0]

    def _window_on_device(
        self, blocks: Sequence[int], num_computed: int, window: WindowCapture
    ) -> WindowRecord | None:
        rows = window.rows()
        if rows is None:
            return None
        positions, queries = rows
        cache = self.cache
        heads = (-1, cache.num_kv_heads, cache.head_dim)
        with torch.inference_mode():
            slots = cache.slots(blocks, 0, num_computed)  # once (a host-to-device copy)
            lse = log_normalisers(
                queries,
                positions,
                lambda layer: cache.k[layer].view(heads)[slots],
                self.config.head_dim**-0.5,
            )
        return positions, queries, lse

    def reconstruction_pass(
        self,
        prompt: Sequence[int],
        blocks: Sequence[int],
        num_computed: int,
        reconstruction: ReconstructionPrompt,
    ) -> ReconstructionPass:
        """KVzip's pass over a request's ``N``-token ``prompt``, reading its own
        ``num_computed`` cached tokens (:mod:`kvdrop_engine.reconstruct`); run it with
        :meth:`reconstruct_piece` (the request's blocks must stay its own until it is done)."""
        cache = self.cache
        heads = (-1, cache.num_kv_heads, cache.head_dim)
        slots = cache.slots(blocks, 0, num_computed)  # once a pass, not per layer and piece
        return ReconstructionPass(
            self.model,
            prompt,
            num_computed,
            lambda layer: cache.k[layer].view(heads)[slots],
            lambda layer: cache.v[layer].view(heads)[slots],
            reconstruction,
        )

    def reconstruct_piece(self, run: ReconstructionPass, rows: int) -> Tensor | None:
        """Compute up to ``rows`` rows of ``run``; its scores ``[L, Hkv, N]`` (host, float32)
        once it is done, else None."""
        run.step(rows)
        return to_host(run.scores) if run.done else None
