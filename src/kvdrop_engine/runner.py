"""One forward of an engine step: the model over a planned batch, on the paged cache.

The :class:`ModelRunner` owns the model's device side: the paged KV cache, the fused ops and the
decode CUDA graphs (:func:`~kvdrop_engine.graphs.accelerate`). A forward changes no request
state, so the engine can retry a failed one with fewer requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from kvdrop_engine.graphs import DecodeGraphs, accelerate
from kvdrop_engine.model import ModelConfig
from kvdrop_engine.paged import PagedAttention, PagedKVCache
from kvdrop_engine.scheduler import StepPlan

__all__ = ["Forward", "ModelRunner"]


@dataclass
class Forward:
    """What one forward gives: ``logits [R, V]`` of the sampled rows, their ``greedy`` argmax
    when a graph computed it, the attention (None for a graph replay) with the ``capture``
    offsets it kept queries for, and the seconds spent capturing a new graph."""

    logits: Tensor
    greedy: Tensor | None = None
    attn: PagedAttention | None = None
    capture: dict[int, list[int]] = field(default_factory=dict)
    capture_seconds: float = 0.0


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
    ) -> None:
        param = next((p for p in model.parameters() if p.is_floating_point()), None)
        self.device = param.device if param is not None else torch.device("cpu")
        self.dtype = param.dtype if param is not None else torch.float32
        self.model = model
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

    def forward(self, plan: StepPlan) -> Forward:
        """Run the model over ``plan``: a graph replay for a decode-only step when graphs are
        on (it captures no queries: a query window then ends with the prompt), else one eager
        forward that keeps the query rows each request's capture wants."""
        if plan.num_prefill == 0 and self.graphs is not None:
            before = self.graphs.capture_seconds
            logits, greedy = self.graphs.run(plan.seqs, plan.tokens)
            return Forward(logits, greedy, capture_seconds=self.graphs.capture_seconds - before)
        capture: dict[int, list[int]] = {}
        for req, n in plan.stepped:
            offsets = req.capture_offsets(n)
            if offsets:
                capture[req.rid] = offsets
        attn = PagedAttention(self.cache, plan.seqs, capture_rows=capture)
        dev = self.device
        with torch.inference_mode():
            logits = self.model(
                torch.tensor(plan.tokens, dtype=torch.long, device=dev),
                torch.tensor(plan.positions, dtype=torch.long, device=dev),
                attn,
                logits_rows=torch.tensor(plan.sample_rows, dtype=torch.long, device=dev),
            )
        return Forward(logits, None, attn, capture)
