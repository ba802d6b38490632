"""The per-model tensor layout a server registers: layers, heads, head dim and dtype.

A layout fixes the bytes of one chunk, so the server can size its slots and both sides can check
shapes and dtypes before any data moves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvdrop_sdk.cache_kind import CacheKind
from kvdrop_sdk.validate import is_int

__all__ = ["DTYPES", "CacheLayout", "dtype_from_name", "dtype_name"]

#: dtypes a layout may use, by their JSON name.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The JSON name of ``dtype`` (e.g. "bfloat16"); ValueError for unsupported dtypes."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype}; expected one of {sorted(DTYPES)}") from None


def dtype_from_name(name: Any) -> torch.dtype:
    """Parse a dtype JSON name (also accepts "torch.bfloat16"); ValueError when unknown."""
    if isinstance(name, torch.dtype):
        dtype_name(name)
        return name
    if not isinstance(name, str):
        raise ValueError(f"dtype must be a string, got {type(name).__name__}")
    key = name.removeprefix("torch.")
    try:
        return DTYPES[key]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}") from None


@dataclass(frozen=True)
class CacheLayout:
    """Shape of one model's cached tensors: ``(2|1, num_layers, tokens, num_heads * head_dim)``.

    ``num_heads`` is the number of KV heads for the KV kind and of query heads for the QUERY kind.
    """

    num_layers: int
    num_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "head_dim"):
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                raise ValueError(f"CacheLayout.{name} must be a positive int, got {value!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"CacheLayout.dtype must be a torch.dtype, got {self.dtype!r}")
        dtype_name(self.dtype)

    @property
    def width(self) -> int:
        """Elements per token and layer: ``num_heads * head_dim`` (heads major, HND order)."""
        return self.num_heads * self.head_dim

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return torch.empty((), dtype=self.dtype).element_size()

    def shape(self, kind: CacheKind, num_tokens: int) -> tuple[int, ...]:
        """Tensor shape of ``num_tokens`` tokens of ``kind``: ``(2|1, L, T, width)``."""
        lead = 2 if CacheKind.parse(kind) is CacheKind.KV else 1
        return (lead, self.num_layers, num_tokens, self.width)

    def nbytes(self, kind: CacheKind, num_tokens: int) -> int:
        """Bytes of ``num_tokens`` tokens of ``kind`` (e.g. of one chunk)."""
        lead, layers, tokens, width = self.shape(kind, num_tokens)
        return lead * layers * tokens * width * self.itemsize

    def to_json(self) -> dict[str, Any]:
        """JSON-safe dict (dtype by name, e.g. "bfloat16")."""
        return {
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "head_dim": self.head_dim,
            "dtype": dtype_name(self.dtype),
        }

    @classmethod
    def from_json(cls, d: Any) -> CacheLayout:
        """Parse ``to_json``'s output; ValueError naming the bad or missing field."""
        if not isinstance(d, dict):
            raise ValueError(f"layout must be a JSON object, got {type(d).__name__}")
        expected = {"num_layers", "num_heads", "head_dim", "dtype"}
        missing = expected - d.keys()
        extra = d.keys() - expected
        if missing or extra:
            raise ValueError(
                f"layout fields must be exactly {sorted(expected)}; "
                f"missing {sorted(missing)}, unexpected {sorted(map(str, extra))}"
            )
        return cls(
            num_layers=d["num_layers"],
            num_heads=d["num_heads"],
            head_dim=d["head_dim"],
            dtype=dtype_from_name(d["dtype"]),
        )
