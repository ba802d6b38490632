"""Paged KV cache with a fixed block budget, and a batched attention backend over it.

The engine can hold only ``num_blocks * block_size`` tokens of KV at once (like vLLM's GPU memory
fraction); that budget is what makes token dropping raise decode throughput: a shorter cache lets
more requests run in the same step.

Storage per layer is ``[num_blocks, block_size, num_kv_heads, head_dim]`` for K and for V, in the
model dtype and on the model device. A sequence owns a list of blocks (its block table); token ``t``
of a sequence lives in block ``table[t // block_size]`` at offset ``t % block_size``.

``PagedAttention`` implements the model's ``AttentionBackend`` for one engine step that mixes
sequences prefilling a chunk of new tokens with sequences decoding one token. On CUDA (with Triton)
decoding sequences share one paged-attention kernel launch that reads their blocks in place
(:func:`kvdrop_engine.kernels.paged_decode`); the plain PyTorch path (CPU, CI) batches them into
``scaled_dot_product_attention`` calls over a padded gather of their blocks. Each prefill chunk is
one call. Query capture is keyed by sequence id, never by batch position, and takes only the rows
asked for (one ``index_select`` per layer for the whole step). ``PagedDecode`` is the backend of a
decode-only step over fixed device tensors, which a CUDA graph can replay
(:mod:`kvdrop_engine.graphs`).

Storage holds one block more than the budget: the *scratch* block (id ``num_blocks``) that padded
rows of a replayed decode graph write to and read from; the allocator never hands it out.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from kvdrop_engine import kernels
from kvdrop_sdk.transport.buffers import run_copies

__all__ = [
    "BlockAllocator",
    "OutOfBlocksError",
    "PagedAttention",
    "PagedDecode",
    "PagedKVCache",
    "SeqStep",
    "blocks_needed",
    "to_device",
    "to_host",
    "to_host_all",
]


_NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class OutOfBlocksError(RuntimeError):
    """More blocks were requested than are free."""


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Number of blocks that hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


class BlockAllocator:
    """Thread-safe free list of block ids ``0 .. num_blocks-1``.

    Freed blocks go to the front of the list, so they are the first ones reused (keeps the working
    set small and makes reuse observable in tests).
    """

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() from the end
        self._owned = [False] * num_blocks
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        """Blocks currently free."""
        return len(self._free)

    def allocate(self, n: int) -> tuple[int, ...]:
        """Take ``n`` free blocks; raises ``OutOfBlocksError`` (taking none) when fewer are free.
        A tuple: a request's block list is replaced, never changed in place, so a decode graph
        knows a row's blocks are unchanged when it holds the same object."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        with self._lock:
            if n > len(self._free):
                raise OutOfBlocksError(f"requested {n} blocks, {len(self._free)} free")
            taken = tuple(self._free.pop() for _ in range(n))
            for b in taken:
                self._owned[b] = True
            return taken

    def free(self, blocks: Sequence[int]) -> None:
        """Return ``blocks`` to the free list; freeing a block twice is an error."""
        with self._lock:
            for b in blocks:
                if not 0 <= b < self.num_blocks or not self._owned[b]:
                    raise ValueError(f"block {b} is not allocated")
                self._owned[b] = False
            self._free.extend(reversed(list(blocks)))


class PagedKVCache:
    """K and V block storage for every layer plus the block allocator."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
        ):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        # One block more than the budget: the scratch block (see the module docstring).
        shape = (num_layers, num_blocks + 1, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)
        self.allocator = BlockAllocator(num_blocks)

    @property
    def capacity_tokens(self) -> int:
        """Tokens the whole budget can hold."""
        return self.num_blocks * self.block_size

    @property
    def scratch_block(self) -> int:
        """Id of the block no sequence owns (padding rows of decode graphs use it)."""
        return self.num_blocks

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V one token takes over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.k.element_size()

    def slots(self, block_table: Sequence[int], start: int, stop: int) -> Tensor:
        """Flat slot indices (``block * block_size + offset``) of tokens ``start .. stop-1``, on
        the cache's device."""
        return self.to_device(self.host_slots(block_table, start, stop))

    def host_slots(self, block_table: Sequence[int], start: int, stop: int) -> Tensor:
        """:meth:`slots` on the host."""
        bs = self.block_size
        if stop > len(block_table) * bs or start < 0 or stop < start:
            raise ValueError(f"tokens {start}..{stop} do not fit {len(block_table)} blocks of {bs}")
        if stop - start == 1:  # a decode row: no tensor arithmetic for one slot
            return torch.tensor([int(block_table[start // bs]) * bs + start % bs])
        first, last = start // bs, (stop - 1) // bs + 1  # only the blocks the tokens lie in
        pos = torch.arange(start, stop)
        table = torch.as_tensor(block_table[first:last], dtype=torch.long)
        return table[pos // bs - first] * bs + pos % bs

    def to_device(self, index: Tensor) -> Tensor:
        """A host index tensor on the cache's device: on CUDA through page-locked memory, an
        asynchronous copy, where a pageable one blocks the calling thread (the loop) until the
        device has caught up."""
        if self.device.type != "cuda":
            return index
        return index.pin_memory().to(self.device, non_blocking=True)

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Store ``k``/``v`` ``[N, Hkv, d]`` of one layer at flat ``slots`` ``[N]``."""
        flat = (-1, self.num_kv_heads, self.head_dim)
        self.k[layer].view(flat).index_copy_(0, slots, k.to(self.dtype))
        self.v[layer].view(flat).index_copy_(0, slots, v.to(self.dtype))

    def load(self, block_table: Sequence[int], kv: Tensor, start: int = 0) -> None:
        """Write a server-layout KV ``[2, L, T, Hkv*d]`` into tokens ``start .. start+T-1``."""
        expected = (2, self.num_layers, self.num_kv_heads * self.head_dim)
        if kv.dim() != 4 or (kv.shape[0], kv.shape[1], kv.shape[3]) != expected:
            raise ValueError(
                f"KV tensor has shape {tuple(kv.shape)}; "
                f"expected [2, {expected[1]}, T, {expected[2]}]"
            )
        n = kv.shape[2]
        slots = self.slots(block_table, start, start + n)
        kv = to_device(kv.to(self.dtype), self.device)
        kv = kv.view(2, self.num_layers, n, self.num_kv_heads, self.head_dim)
        flat = (self.num_layers, -1, self.num_kv_heads, self.head_dim)
        self.k.view(flat)[:, slots] = kv[0]
        self.v.view(flat)[:, slots] = kv[1]

    def keys(self, block_table: Sequence[int], layer: int, num_tokens: int) -> Tensor:
        """Keys of tokens ``0 .. num_tokens-1`` of one layer: ``[T, Hkv, d]`` (a gathered copy)."""
        slots = self.slots(block_table, 0, num_tokens)
        return self.k[layer].view(-1, self.num_kv_heads, self.head_dim)[slots]

    def values(self, block_table: Sequence[int], layer: int, num_tokens: int) -> Tensor:
        """Values of tokens ``0 .. num_tokens-1`` of one layer: ``[T, Hkv, d]`` (a copy)."""
        slots = self.slots(block_table, 0, num_tokens)
        return self.v[layer].view(-1, self.num_kv_heads, self.head_dim)[slots]

    def read(self, block_table: Sequence[int], num_tokens: int) -> Tensor:
        """KV of tokens ``0 .. num_tokens-1`` in the server layout ``[2, L, T, Hkv*d]``, on the
        cache's device."""
        return self.read_slots(self.slots(block_table, 0, num_tokens))

    def read_slots(self, slots: Tensor) -> Tensor:
        """KV at flat ``slots`` ``[T]`` (of any sequences) as ``[2, L, T, Hkv*d]``, a copy on the
        cache's device."""
        num_tokens = slots.numel()
        flat = (self.num_layers, -1, self.num_kv_heads, self.head_dim)
        out = torch.empty(
            2,
            self.num_layers,
            num_tokens,
            self.num_kv_heads,
            self.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        torch.index_select(self.k.view(flat), 1, slots, out=out[0])
        torch.index_select(self.v.view(flat), 1, slots, out=out[1])
        return out.view(2, self.num_layers, num_tokens, -1)

    def read_keys(self, slots: Tensor) -> Tensor:
        """Keys at flat ``slots`` ``[T]`` as ``[L, T, Hkv*d]``, a copy on the cache's device
        (:meth:`read_slots` without the values)."""
        flat = (self.num_layers, -1, self.num_kv_heads, self.head_dim)
        return torch.index_select(self.k.view(flat), 1, slots).flatten(2)

    def move_slots(self, src: Tensor, dst: Tensor) -> None:
        """Copy the KV at flat slots ``src`` to ``dst`` (``[N]`` each, on the cache's device):
        read whole first, so the two may overlap (a cut moving kept rows to its first slots)."""
        self.write_slots(dst, self.read_slots(src))

    def write_slots(self, slots: Tensor, kv: Tensor) -> None:
        """Write ``kv`` ``[2, L, T, Hkv*d]`` (on the cache's device) at flat ``slots`` ``[T]``."""
        n = slots.numel()
        kv = kv.to(self.dtype).view(2, self.num_layers, n, self.num_kv_heads, self.head_dim)
        flat = (self.num_layers, -1, self.num_kv_heads, self.head_dim)
        self.k.view(flat).index_copy_(1, slots, kv[0])
        self.v.view(flat).index_copy_(1, slots, kv[1])

    def read_cpu(self, block_table: Sequence[int], num_tokens: int) -> Tensor:
        """:meth:`read` copied to host memory. From a GPU the copy goes through page-locked
        memory (several times faster than into pageable memory); it is complete on return."""
        return to_host(self.read(block_table, num_tokens))


_STAGING = threading.local()
#: Bytes of each of a thread's two page-locked staging buffers (see :func:`to_device`).
STAGING_BYTES = 128 << 20


def _staging(nbytes: int, device: torch.device) -> list[tuple[Tensor, torch.cuda.Event]]:
    """This thread's two page-locked staging buffers (at least ``nbytes`` each) and the events
    that say when the device has finished reading each."""
    bufs = getattr(_STAGING, "bufs", None)
    if bufs is None or bufs[0][0].numel() < nbytes:
        bufs = [
            (torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), torch.cuda.Event())
            for _ in range(2)
        ]
        _STAGING.bufs = bufs
    return bufs


def _host_copy(dst: Tensor, src: Tensor) -> None:
    """``dst.copy_(src)`` for a contiguous staging piece: eight ``memmove`` slices on the SDK's
    copy threads when ``src`` is contiguous too. Several loads stage at once (one per load
    thread), and a torch ``copy_`` from each is an OpenMP team of every core: oversubscribed."""
    if not src.is_contiguous():
        dst.copy_(src)
        return
    nbytes = dst.numel() * dst.element_size()
    step = -(-nbytes // 8)
    d, s = dst.data_ptr(), src.data_ptr()
    run_copies(
        [
            lambda o=o: ctypes.memmove(d + o, s + o, min(step, nbytes - o))
            for o in range(0, nbytes, step)
        ],
        nbytes,
    )


def to_device(t: Tensor, device: torch.device | str) -> Tensor:
    """``t.to(device)``; a large host tensor bound for a GPU goes through two page-locked staging
    buffers of this thread, a few rows (of its first two dims) at a time: the multi-threaded
    host copy of one piece overlaps the DMA of the previous one, and no page-locked memory is
    allocated per call. On an H200 host the driver's pageable path moved 9 GB/s, a pinned DMA
    55 GB/s and a multi-threaded host copy 49 GB/s."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu" or t.numel() * t.element_size() < 1 << 24:
        return t.to(device)
    rows = t.reshape(-1, *t.shape[2:]) if t.dim() > 2 else t.reshape(-1, t.shape[-1])
    out = torch.empty(rows.shape, dtype=t.dtype, device=device)
    row_bytes = rows[0].numel() * t.element_size()
    per = max(1, STAGING_BYTES // row_bytes)
    bufs = _staging(per * row_bytes, device)
    stream = torch.cuda.current_stream(device)
    for i, r0 in enumerate(range(0, rows.shape[0], per)):
        r1 = min(r0 + per, rows.shape[0])
        buf, done = bufs[i % 2]
        done.synchronize()  # the DMA that last read this buffer has finished
        piece = buf[: (r1 - r0) * row_bytes].view(t.dtype).view(r1 - r0, *rows.shape[1:])
        _host_copy(piece, rows[r0:r1])
        out[r0:r1].copy_(piece, non_blocking=True)
        done.record(stream)
    return out.view(t.shape)


def to_host(t: Tensor) -> Tensor:
    """``t`` in host memory; from a GPU through page-locked memory (complete on return)."""
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    torch.cuda.current_stream(t.device).synchronize()
    return host


def to_host_all(*tensors: Tensor) -> tuple[Tensor, ...]:
    """:func:`to_host` of several tensors with one synchronisation: each GPU tensor is copied
    into its own page-locked buffer asynchronously, then the stream is waited for once."""
    out = []
    streams = set()
    for t in tensors:
        if t.device.type != "cuda":
            out.append(t)
            continue
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        streams.add(t.device)
        out.append(host)
    for device in streams:
        torch.cuda.current_stream(device).synchronize()
    return tuple(out)


@dataclass(frozen=True)
class SeqStep:
    """One sequence's part of an engine step.

    ``start`` tokens of the sequence are already in its blocks; this step brings ``num_new`` more
    (their q/k/v are rows ``offset .. offset+num_new-1`` of the forward, in sequence order).
    ``pos_offset``: what the tokens' RoPE positions add to their slots (the tokens a cut while
    decoding dropped, :mod:`kvdrop_engine.decode_cut`); attention reads slots only.
    """

    seq_id: Hashable
    block_table: Sequence[int]
    start: int
    num_new: int
    pos_offset: int = 0


class _Group:
    """Precomputed indices for one SDPA call (a batch of decodes, or one prefill chunk)."""

    def __init__(
        self, rows: Tensor, blocks: Tensor, mask: Tensor, length: int, prefill: bool
    ) -> None:
        self.rows = rows  # forward rows of this group's queries
        self.blocks = blocks  # [B, nblk] block ids (padded with 0)
        self.mask = mask  # decode: [B, 1, 1, T]; prefill: [n, T] (True = attend)
        self.length = length  # keys gathered per sequence (T)
        self.prefill = prefill


class PagedAttention:
    """``AttentionBackend`` for one step over a ``PagedKVCache``.

    Build one per engine step with the step's sequences in forward-row order. Each layer call
    writes the new k/v into the sequences' blocks, then computes causal attention of every new
    query over its sequence's cached and new keys (grouped-query attention without repeating K/V).
    ``capture`` names sequence ids whose post-RoPE queries are all kept, ``capture_rows`` maps
    sequence ids to the offsets (``0..num_new-1``) of the rows to keep; ``captured_rows(seq_id)``
    returns them as ``[L, rows, Hq, d]`` after the forward (``captured[seq_id][layer]`` is the
    per-layer view).
    """

    def __init__(
        self,
        cache: PagedKVCache,
        seqs: Sequence[SeqStep],
        *,
        capture: Collection[Hashable] = (),
        capture_rows: Mapping[Hashable, Sequence[int]] | None = None,
        max_decode_padding: float = 0.25,
    ) -> None:
        self.cache = cache
        self.seqs = list(seqs)
        bs = cache.block_size
        dev = cache.device
        slot_parts: list[Tensor] = []
        self._capture_spans: dict[Hashable, tuple[int, int]] = {}
        capture_index: list[int] = []
        capture_rows = capture_rows or {}
        decodes: list[tuple[int, SeqStep]] = []  # (row, seq)
        self._groups: list[_Group] = []
        row = 0
        for s in self.seqs:
            if s.num_new <= 0:
                raise ValueError(f"sequence {s.seq_id!r} brings no new tokens")
            slot_parts.append(cache.host_slots(s.block_table, s.start, s.start + s.num_new))
            offsets: Sequence[int] | None = None
            if s.seq_id in capture:
                offsets = range(s.num_new)
            elif s.seq_id in capture_rows:
                offsets = capture_rows[s.seq_id]
            if offsets is not None:
                first = len(capture_index)
                for off in offsets:
                    if not 0 <= off < s.num_new:
                        raise ValueError(
                            f"capture offset {off} is outside sequence {s.seq_id!r}'s "
                            f"{s.num_new} new tokens"
                        )
                    capture_index.append(row + off)
                self._capture_spans[s.seq_id] = (first, len(capture_index))
            total = s.start + s.num_new
            if s.num_new == 1:
                decodes.append((row, s))
            else:
                nblk = blocks_needed(total, bs)
                blocks = torch.as_tensor(list(s.block_table[:nblk]), dtype=torch.long)
                q_pos = torch.arange(s.start, total).unsqueeze(1)
                mask = torch.arange(total).unsqueeze(0) <= q_pos  # [n, T]
                rows = torch.arange(row, row + s.num_new)
                self._groups.append(
                    _Group(rows.to(dev), blocks.unsqueeze(0).to(dev), mask.to(dev), total, True)
                )
            row += s.num_new
        self.num_tokens = row
        empty = torch.empty(0, dtype=torch.long, device=dev)
        self.slot_mapping = cache.to_device(torch.cat(slot_parts)) if slot_parts else empty
        self._kernel: PagedDecode | None = None
        if decodes and use_kernel(cache):
            rows = torch.tensor([r for r, _ in decodes], device=dev)
            self._kernel = PagedDecode.build(cache, [s for _, s in decodes], rows=rows)
        else:
            self._groups.extend(self._decode_groups(decodes, max_decode_padding))
        self._capture_index = (
            torch.tensor(capture_index, dtype=torch.long, device=dev) if capture_index else None
        )
        self._capture_layers: list[Tensor] = []
        self._stacked: Tensor | None = None

    def captured_rows(self, seq_id: Hashable) -> Tensor:
        """The captured query rows of ``seq_id``: ``[L, rows, Hq, d]`` (after the forward)."""
        first, end = self._capture_spans[seq_id]
        if self._stacked is None or self._stacked.shape[0] != len(self._capture_layers):
            self._stacked = torch.stack(self._capture_layers)
        return self._stacked[:, first:end]

    @property
    def captured(self) -> dict[Hashable, list[Tensor]]:
        """Captured queries per sequence id and layer (``[rows, Hq, d]`` each)."""
        return {
            sid: [layer[first:end] for layer in self._capture_layers]
            for sid, (first, end) in self._capture_spans.items()
        }

    def _decode_groups(
        self, decodes: list[tuple[int, SeqStep]], max_padding: float
    ) -> list[_Group]:
        """Batch decoding sequences, splitting by length so padding stays under ``max_padding``."""
        if not decodes:
            return []
        bs = self.cache.block_size
        dev = self.cache.device
        decodes = sorted(decodes, key=lambda rs: -(rs[1].start + 1))
        groups: list[list[tuple[int, SeqStep]]] = [[]]
        used = 0
        for item in decodes:
            cur = groups[-1]
            n = item[1].start + 1
            if cur:
                longest = cur[0][1].start + 1
                padded = longest * (len(cur) + 1)
                if padded - (used + n) > max_padding * padded:
                    groups.append([])
                    cur = groups[-1]
                    used = 0
            cur.append(item)
            used += n
        out = []
        for grp in groups:
            lengths = torch.tensor([s.start + 1 for _, s in grp])
            nblk = blocks_needed(int(lengths.max()), bs)
            table = torch.tensor(
                [_padded(s.block_table, blocks_needed(s.start + 1, bs), nblk) for _, s in grp],
                dtype=torch.long,
            )
            t = nblk * bs
            mask = (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).view(len(grp), 1, 1, t)
            rows = torch.tensor([r for r, _ in grp])
            out.append(_Group(rows.to(dev), table.to(dev), mask.to(dev), t, False))
        return out

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Store this step's k/v for ``layer`` and return attention output ``[N, Hq, d]``."""
        n, hq, d = q.shape
        if n != self.num_tokens:
            raise ValueError(f"step was built for {self.num_tokens} tokens, forward passed {n}")
        cache = self.cache
        hkv = cache.num_kv_heads
        if hq % hkv:
            raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads")
        group = hq // hkv
        cache.write(layer, self.slot_mapping, k, v)
        if self._capture_index is not None:
            self._capture_layers.append(q.detach().index_select(0, self._capture_index))
        kc, vc = cache.k[layer], cache.v[layer]  # [num_blocks + 1, bs, Hkv, d]
        out = torch.empty_like(q)
        scale = d**-0.5
        if self._kernel is not None:
            dk = self._kernel
            out[dk.rows] = dk.attend(layer, q[dk.rows])
        for g in self._groups:
            b = g.blocks.shape[0]
            kb = kc[g.blocks].reshape(b, -1, hkv, d)[:, : g.length].transpose(1, 2)
            vb = vc[g.blocks].reshape(b, -1, hkv, d)[:, : g.length].transpose(1, 2)
            qg = q[g.rows]  # [rows, Hq, d]
            if g.prefill and q.is_cuda:
                # Flash attention with bottom-right causal alignment (new tokens are the last
                # rows of the sequence) and native GQA: no mask tensor, no repeated K/V. Never
                # cuDNN, which PyTorch picks for a chunk at the start (square causal): cuDNN
                # builds a graph for every new sequence length (hundreds of ms each), and prefill
                # chunk lengths vary from step to step.
                rows = qg.shape[0]
                qh = qg.transpose(0, 1).unsqueeze(0)  # [1, Hq, n, d]
                bias = causal_lower_right(rows, g.length)
                with sdpa_kernel(_NO_CUDNN):
                    o = F.scaled_dot_product_attention(
                        qh, kb, vb, attn_mask=bias, scale=scale, enable_gqa=group > 1
                    )
                o = o[0].transpose(0, 1)
            elif g.prefill:
                # One sequence: rows ordered (token, group member) so one [n*G, T] mask serves.
                rows = qg.shape[0]
                qh = qg.view(rows, hkv, group, d).permute(1, 0, 2, 3)
                qh = qh.reshape(1, hkv, rows * group, d)
                mask = g.mask.repeat_interleave(group, dim=0)
                o = F.scaled_dot_product_attention(qh, kb, vb, attn_mask=mask, scale=scale)
                o = o.view(hkv, rows, group, d).permute(1, 0, 2, 3).reshape(rows, hq, d)
            else:
                # One token per sequence: the G query heads of a KV head act as G query rows.
                # Padding slots zeroed: masked out, a stale NaN still poisons (NaN + -inf, 0 * NaN).
                # kb and vb are views of the gather's own copy: zeroed in place.
                pad = ~g.mask.transpose(-1, -2)
                kb, vb = kb.masked_fill_(pad, 0.0), vb.masked_fill_(pad, 0.0)
                qh = qg.view(b, hkv, group, d)
                o = F.scaled_dot_product_attention(qh, kb, vb, attn_mask=g.mask, scale=scale)
                o = o.reshape(b, hq, d)
            out[g.rows] = o.to(out.dtype)
        return out


def _padded(blocks: Sequence[int], used: int, width: int) -> list[int]:
    """The first ``used`` of ``blocks``, padded with block 0 to ``width`` (masked out)."""
    return [*blocks[:used], *[0] * (width - used)]


def use_kernel(cache: PagedKVCache) -> bool:
    """Whether decode attention over ``cache`` runs the Triton paged kernel (CUDA with Triton, a
    power-of-two head size and block size)."""
    d, bs = cache.head_dim, cache.block_size
    return kernels.available(cache.device) and d >= 16 and not d & (d - 1) and not bs & (bs - 1)


class PagedDecode:
    """``AttentionBackend`` of decode rows (one new token per sequence) over fixed tensors.

    ``slots [B]`` (int64) are where each row's new k/v go, ``table [B, W]`` (int32) and
    ``lens [B]`` (int32, the new token included) what each row attends to. Nothing here reads a
    host value, so a step built on it can be captured once in a CUDA graph and replayed with the
    tensors refilled in place. ``rows`` (optional) are the forward rows it serves inside a mixed
    step (:class:`PagedAttention` writes k/v itself then). ``queries`` (optional, ``[L, B, Hq,
    d]``) receives each layer's queries (a graph's decode rows keep their query windows there).
    """

    def __init__(
        self,
        cache: PagedKVCache,
        slots: Tensor,
        table: Tensor,
        lens: Tensor,
        *,
        splits: int | None = None,
        rows: Tensor | None = None,
        queries: Tensor | None = None,
    ) -> None:
        self.cache = cache
        self.slots = slots
        self.table = table
        self.lens = lens
        self.rows = rows
        self.queries = queries
        self.splits = splits or kernels.decode_splits(
            table.shape[0], cache.num_kv_heads, cache.device
        )

    @classmethod
    def build(
        cls, cache: PagedKVCache, seqs: Sequence[SeqStep], *, rows: Tensor | None = None
    ) -> PagedDecode:
        """The backend for decoding ``seqs`` (each brings its token at position ``start``)."""
        bs = cache.block_size
        width = max(blocks_needed(s.start + 1, bs) for s in seqs)
        table = torch.full((len(seqs), width), cache.scratch_block, dtype=torch.int32)
        slots = torch.empty(len(seqs), dtype=torch.long)
        for i, s in enumerate(seqs):
            k = blocks_needed(s.start + 1, bs)
            table[i, :k] = torch.as_tensor(list(s.block_table[:k]), dtype=torch.int32)
            slots[i] = int(s.block_table[s.start // bs]) * bs + s.start % bs
        lens = torch.tensor([s.start + 1 for s in seqs], dtype=torch.int32)
        dev = cache.device
        return cls(cache, slots.to(dev), table.to(dev), lens.to(dev), rows=rows)

    def attend(self, layer: int, q: Tensor) -> Tensor:
        """Attention of ``q [B, Hq, d]`` over the cached tokens (k/v already written)."""
        c = self.cache
        return kernels.paged_decode(
            q, c.k[layer], c.v[layer], self.table, self.lens, splits=self.splits
        )

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Store this step's k/v for ``layer`` and return attention output ``[B, Hq, d]``."""
        self.cache.write(layer, self.slots, k, v)
        if self.queries is not None:
            self.queries[layer].copy_(q)
        return self.attend(layer, q)
