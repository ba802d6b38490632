"""Combinators: policies built from other, already built policies (like kvpress's
``ComposedPress(presses)`` and ``ChunkKVPress(press=...)``). They never look names up; the spec
strings of :mod:`kvdrop.spec` (``"streaming+snapkv"``, ``"chunk(policy=snapkv)"``) build them.

- :class:`Compose`: a union of scorer policies sharing one budget;
- :class:`Chunk`: a scorer policy at chunk granularity;
- :class:`ChunkKV`: a scorer policy keeping whole small chunks (ChunkKV);
- :class:`Block`: a KV-only scorer policy evicting block by block (KeyDiff's BlockPress);
- :class:`Budget`: a per-request budget by prompt length;
- :class:`Rerotate`: any policy, with the kept keys moved to RoPE positions ``0..k-1``.
"""

from kvdrop.combinators.block import Block
from kvdrop.combinators.budget import Budget
from kvdrop.combinators.chunk import Chunk
from kvdrop.combinators.chunkkv import ChunkKV
from kvdrop.combinators.compose import Compose
from kvdrop.combinators.rerotate import Rerotate

__all__ = ["Block", "Budget", "Chunk", "ChunkKV", "Compose", "Rerotate"]
