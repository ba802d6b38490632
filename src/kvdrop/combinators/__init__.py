"""Combinators: policies built from other, already built policies (like kvpress's
``ComposedPress(presses)`` and ``ChunkKVPress(press=...)``). The classes never look names up:
they hold built policies. Each module also owns its registered factory (``compose``, ``chunk``,
...), which builds the inner policies from names or specs through :mod:`kvdrop.spec`
(``"streaming+snapkv"``, ``"chunk(policy=snapkv)"``) and hands them to the class;
:mod:`kvdrop.combinators.inner` holds what those factories share.

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
