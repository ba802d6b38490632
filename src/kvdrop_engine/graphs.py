"""CUDA graphs of the decode-only engine step: one capture per batch size bucket, replayed.

A decode step of an 8B model is ~700 small kernel launches; launched one by one from Python they
cost more than the step's memory traffic. :class:`DecodeGraphs` captures the whole step (model
forward over a :class:`~kvdrop_engine.paged.PagedDecode` backend, plus the greedy ``argmax``)
once per (padded batch size, block-table width) and replays it: a step is then one host-to-device
copy of the step's ids, one graph launch and one device-to-host read of the chosen tokens.

Rows past the real batch are padding: they write to and attend over the cache's scratch block.
Only the block-table rows whose sequence or blocks changed are rewritten (:class:`TableRows`: a
new batch, a request that grew by a block, a cut that freed blocks, a swapped one back in other
blocks), in a page-locked copy of the table that goes to the device asynchronously when any row
changed. (Rewriting the whole table, as wide as the cache has blocks, through a pageable copy on
every step where some request grew by a block cost the loop milliseconds a step:
``benchmarks/step_host.py``.)

A step replays the narrowest captured graph whose table is wide enough (the kernel's work follows
the sequences' lengths, not the table's width), so :meth:`DecodeGraphs.precapture` at engine start
(every batch bucket at the widest table the cache can need) leaves nothing to capture mid-run.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from kvdrop_engine import kernels
from kvdrop_engine.errors import InvalidRequestError
from kvdrop_engine.model import FusesOps, ModelConfig
from kvdrop_engine.paged import PagedDecode, PagedKVCache, SeqStep, blocks_needed, use_kernel

__all__ = [
    "BATCH_BUCKETS",
    "DecodeGraphs",
    "TableRows",
    "accelerate",
    "pick_graph",
    "precapture_keys",
]

#: Padded batch sizes a graph is captured for (a batch takes the smallest that fits).
BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256)


def table_width(blocks: int) -> int:
    """The block-table width a graph is captured with for sequences of up to ``blocks``
    blocks: a power of two, at least 16."""
    return max(16, 1 << (max(blocks, 1) - 1).bit_length())


def precapture_keys(
    batch_sizes: Sequence[int], max_batch_size: int, num_blocks: int
) -> list[tuple[int, int]]:
    """(bucket, width) of the graphs to capture at start for ``batch_sizes`` (each taken to its
    bucket, at most ``max_batch_size``'s), all at the widest table a sequence can need (every
    block of the cache)."""
    top = DecodeGraphs.bucket(max_batch_size)
    buckets = sorted({DecodeGraphs.bucket(max(1, int(n))) for n in batch_sizes} - {0})
    width = table_width(num_blocks)
    return [(b, width) for b in buckets if b <= top]


def pick_graph(captured: Iterable[tuple[int, int]], bucket: int, need: int) -> tuple[int, int]:
    """The key a step of ``bucket`` rows needing ``need`` table columns replays: the narrowest
    captured graph of that bucket at least that wide, else a new one's key (to capture)."""
    fits = [w for b, w in captured if b == bucket and w >= need]
    return (bucket, min(fits)) if fits else (bucket, table_width(need))


class TableRows:
    """The host side of a decode graph's block table ``[B, W]``: each row's sequence id and
    blocks as last written, so a step rewrites only the rows that changed.

    A row's blocks are compared by identity when they are a tuple (a request's
    :attr:`~kvdrop_engine.sequence.Request.blocks` is replaced, never changed in place), else by
    value. Blocks past ``W`` are not written; a row without a sequence holds ``scratch``."""

    def __init__(self, batch: int, width: int, scratch: int, *, pin: bool = False) -> None:
        self.host = torch.full((batch, width), scratch, dtype=torch.int32, pin_memory=pin)
        self.scratch = scratch
        self._rows: list[tuple[Hashable, tuple[int, ...]] | None] = [None] * batch

    def update(self, seqs: Sequence[SeqStep]) -> bool:
        """Write the rows of ``seqs`` (row ``i`` is ``seqs[i]``) whose sequence or blocks
        changed, reset the rows past them; whether any row changed."""
        width = self.host.shape[1]
        changed = False
        for i, s in enumerate(seqs):
            blocks = s.block_table if isinstance(s.block_table, tuple) else tuple(s.block_table)
            seen = self._rows[i]
            if seen is not None and seen[0] == s.seq_id:
                if seen[1] is blocks or seen[1] == blocks:
                    continue
            row, kept = self.host[i], blocks[:width]
            row[: len(kept)] = torch.as_tensor(kept, dtype=torch.int32)
            row[len(kept) :] = self.scratch
            self._rows[i] = (s.seq_id, blocks)
            changed = True
        for i in range(len(seqs), len(self._rows)):
            if self._rows[i] is not None:
                self.host[i] = self.scratch
                self._rows[i] = None
                changed = True
        return changed


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    ids: Tensor  # [4, B] int64 on the device: tokens, positions, slots, lens
    table: Tensor  # [B, W] int32 on the device
    host_ids: Tensor  # [4, B] int64, page-locked
    logits: Tensor  # [B, V] float32 (graph output)
    greedy: Tensor  # [B] int64 (graph output)
    rows: TableRows  # the table's page-locked host copy and what each row holds
    #: Recorded after the last step's copies from ``host_ids`` and ``rows.host``: those
    #: buffers are not written again before it has passed.
    copied: torch.cuda.Event


class DecodeGraphs:
    """Captured decode steps of ``model`` over ``cache`` (CUDA only; see the module docstring).

    ``run(seqs, tokens)`` returns the step's ``logits [B, V]`` and greedy tokens ``[B]`` (device
    views, valid until the next ``run``). ``capture_seconds`` is the time spent capturing.
    """

    def __init__(self, model: nn.Module, cache: PagedKVCache, max_batch_size: int) -> None:
        if cache.device.type != "cuda":
            raise ValueError("DecodeGraphs needs a CUDA cache")
        self.model = model
        self.cache = cache
        self.max_batch_size = max_batch_size
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle()
        cfg = model.config
        #: Every graph writes its rows' queries here (one buffer: graphs replay one at a time).
        self._queries = torch.empty(
            cfg.num_layers,
            self.bucket(max_batch_size),
            cfg.num_heads,
            cfg.head_dim,
            dtype=cache.dtype,
            device=cache.device,
        )
        self.capture_seconds = 0.0  # mid-run captures (inside measured steps)
        self.precapture_seconds = 0.0  # :meth:`precapture` (at engine start)

    @property
    def captured(self) -> list[tuple[int, int]]:
        """(batch size, table width) of every graph captured so far."""
        return sorted(self._graphs)

    @staticmethod
    def bucket(n: int) -> int:
        """The padded batch size for ``n`` rows."""
        return next((b for b in BATCH_BUCKETS if b >= n), n)

    def precapture(self, batch_sizes: Sequence[int] | None = None) -> None:
        """Capture the graphs of ``batch_sizes`` (default every bucket up to the engine's batch
        limit) at the widest table, so steps never capture (see the module docstring)."""
        sizes = BATCH_BUCKETS if batch_sizes is None else batch_sizes
        started = time.perf_counter()
        for key in precapture_keys(sizes, self.max_batch_size, self.cache.num_blocks):
            if key not in self._graphs:
                self._graphs[key] = self._capture(*key)
        self.precapture_seconds += time.perf_counter() - started

    def run(self, seqs: Sequence[SeqStep], tokens: Sequence[int]) -> tuple[Tensor, Tensor]:
        """Decode one token for each of ``seqs`` (``tokens[i]`` at position ``seqs[i].start``)."""
        n = len(seqs)
        bs = self.cache.block_size
        need = max(blocks_needed(s.start + 1, bs) for s in seqs)
        key = pick_graph(self._graphs, self.bucket(n), need)
        g = self._graphs.get(key)
        if g is None:
            started = time.perf_counter()
            g = self._capture(*key)
            self._graphs[key] = g
            self.capture_seconds += time.perf_counter() - started
        g.copied.synchronize()  # (passed already when the last step's tokens were read)
        if g.rows.update(seqs):
            g.table.copy_(g.rows.host, non_blocking=True)
        pad = g.host_ids.shape[1] - n
        starts = [s.start for s in seqs]
        slots = [int(s.block_table[p // bs]) * bs + p % bs for s, p in zip(seqs, starts)]
        rows = [
            [*tokens, *[0] * pad],
            [*(s.start + s.pos_offset for s in seqs), *[0] * pad],
            [*slots, *[self.cache.scratch_block * bs] * pad],
            [*(p + 1 for p in starts), *[1] * pad],
        ]
        host = g.host_ids
        host.copy_(torch.tensor(rows, dtype=torch.long))
        g.ids.copy_(host, non_blocking=True)
        g.copied.record()
        g.graph.replay()
        return g.logits[:n], g.greedy[:n]

    def queries(self, n: int) -> Tensor:
        """The post-RoPE queries ``[L, n, Hq, d]`` of the last replay's first ``n`` rows (a view
        of the graphs' shared buffer, valid until the next ``run``): the engine keeps the query
        windows of decode-time cuts from them."""
        return self._queries[:, :n]

    def _capture(self, batch: int, width: int) -> _Graph:
        dev = self.cache.device
        ids = torch.zeros(4, batch, dtype=torch.long, device=dev)
        ids[2] = self.cache.scratch_block * self.cache.block_size
        ids[3] = 1
        table = torch.full((batch, width), self.cache.scratch_block, dtype=torch.int32, device=dev)
        host_ids = torch.empty(4, batch, dtype=torch.long, pin_memory=True)
        backend = PagedDecode(self.cache, ids[2], table, ids[3], queries=self._queries[:, :batch])

        def step() -> tuple[Tensor, Tensor]:
            logits = self.model(ids[0], ids[1], backend)
            return logits, logits.argmax(dim=-1)

        with torch.inference_mode():
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up: kernel compilation, cuBLAS handles, workspaces
                    step()
            torch.cuda.current_stream(dev).wait_stream(side)
            # capture_begin/end rather than ``torch.cuda.graph``, whose entry also empties the
            # allocator's cache and runs the garbage collector (about a second per capture in an
            # engine holding tens of GB; the next steps then paid for fresh device allocations).
            graph = torch.cuda.CUDAGraph()
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    logits, greedy = step()
                finally:
                    graph.capture_end()
            torch.cuda.current_stream(dev).wait_stream(side)
        rows = TableRows(batch, width, self.cache.scratch_block, pin=True)
        copied = torch.cuda.Event()
        copied.record()
        return _Graph(graph, ids, table, host_ids, logits, greedy, rows, copied)


def accelerate(
    model: nn.Module,
    config: ModelConfig,
    cache: PagedKVCache,
    max_batch_size: int,
    *,
    fused_ops: bool | None,
    cuda_graphs: bool | None,
) -> DecodeGraphs | None:
    """Turn on what the engine's device allows: fused norms/SwiGLU (``fused_ops``, on a model
    that declares :class:`~kvdrop_engine.model.FusesOps`) and decode CUDA graphs
    (``cuda_graphs``); None means "when available". Returns the graphs, or None without them."""
    device = cache.device
    gpu = device.type == "cuda" and kernels.available(device)
    can_fuse = isinstance(model, FusesOps)
    if fused_ops or (fused_ops is None and gpu and can_fuse):
        if not (kernels.available(device) and isinstance(model, FusesOps)):
            raise InvalidRequestError(
                "fused_ops=True needs a CUDA model with use_ops (a Transformer) and Triton"
            )
        model.use_ops(kernels)
    elif fused_ops is False and isinstance(model, FusesOps):
        model.use_ops(None)
    dynamic_rope = config.rope.dynamic
    if cuda_graphs or (cuda_graphs is None and gpu and not dynamic_rope):
        if not (use_kernel(cache) and device.type == "cuda") or dynamic_rope:
            raise InvalidRequestError(
                "cuda_graphs=True needs a CUDA model, Triton, power-of-two head and block "
                "sizes and a RoPE that does not depend on the sequence length"
            )
        return DecodeGraphs(model, cache, max_batch_size)
    return None
