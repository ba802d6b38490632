"""The per-model tensor layout a server registers: layers, heads, head dim, dtype (and RoPE).

A layout fixes the bytes of one chunk, so the server can size its slots and both sides can check
shapes and dtypes before any data moves. An engine also registers the model's rotary embedding
(``rope``, a JSON dict): cached keys are post-RoPE, and an edit that drops tokens must re-rotate
the kept keys to the positions the engine will read them at, which needs exactly these parameters.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kvdrop_sdk.cache_kind import CacheKind
from kvdrop_sdk.validate import is_int, is_number

__all__ = ["DTYPES", "ROPE_FIELDS", "CacheLayout", "check_rope", "dtype_from_name", "dtype_name"]

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


#: Keys of a layout's ``rope`` dict (``kvdrop_rope.RopeConfig.to_json()`` writes exactly these).
ROPE_FIELDS = (
    "head_dim",
    "theta",
    "rotary_dim",
    "interleaved",
    "scaling",
    "max_position_embeddings",
)


def check_rope(rope: Any) -> dict[str, Any]:
    """A validated copy of a layout's ``rope`` dict; ValueError naming the bad field.

    ``head_dim``, ``rotary_dim`` (<= head_dim, even) and ``max_position_embeddings`` are positive
    ints, ``theta`` a positive number, ``interleaved`` a bool (GPT-J pairs; False = NeoX halves),
    ``scaling`` an HF ``rope_scaling`` dict or None.
    """
    if not isinstance(rope, Mapping):
        raise ValueError(f"rope must be a JSON object, got {type(rope).__name__}")
    missing = set(ROPE_FIELDS) - rope.keys()
    extra = rope.keys() - set(ROPE_FIELDS)
    if missing or extra:
        raise ValueError(
            f"rope fields must be exactly {list(ROPE_FIELDS)}; missing {sorted(missing)}, "
            f"unexpected {sorted(map(str, extra))}"
        )
    for name in ("head_dim", "rotary_dim", "max_position_embeddings"):
        if not is_int(rope[name]) or rope[name] <= 0:
            raise ValueError(f"rope.{name} must be a positive int, got {rope[name]!r}")
    if rope["rotary_dim"] > rope["head_dim"] or rope["rotary_dim"] % 2:
        raise ValueError(
            f"rope.rotary_dim must be even and <= head_dim={rope['head_dim']}, got "
            f"{rope['rotary_dim']!r}"
        )
    if not is_number(rope["theta"]) or not rope["theta"] > 0:
        raise ValueError(f"rope.theta must be a positive number, got {rope['theta']!r}")
    if not isinstance(rope["interleaved"], bool):
        raise ValueError(f"rope.interleaved must be a bool, got {rope['interleaved']!r}")
    if rope["scaling"] is not None and not isinstance(rope["scaling"], Mapping):
        raise ValueError(f"rope.scaling must be an object or null, got {rope['scaling']!r}")
    out = dict(rope)
    out["scaling"] = None if rope["scaling"] is None else dict(rope["scaling"])
    return out


@dataclass(frozen=True)
class CacheLayout:
    """Shape of one model's cached tensors: ``(2|1, num_layers, tokens, num_heads * head_dim)``.

    ``num_heads`` is the number of KV heads for the KV kind and of query heads for the QUERY kind.
    ``rope`` (optional) is the model's rotary embedding as a JSON dict (:data:`ROPE_FIELDS`); it
    does not take part in equality (two layouts of the same bytes are the same layout), see
    :meth:`merged`.
    """

    num_layers: int
    num_heads: int
    head_dim: int
    dtype: torch.dtype
    rope: Mapping[str, Any] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "head_dim"):
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                raise ValueError(f"CacheLayout.{name} must be a positive int, got {value!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"CacheLayout.dtype must be a torch.dtype, got {self.dtype!r}")
        dtype_name(self.dtype)
        if self.rope is not None:
            try:
                object.__setattr__(self, "rope", check_rope(self.rope))
            except ValueError as exc:
                raise ValueError(f"CacheLayout.{exc}") from None

    def merged(self, other: CacheLayout) -> CacheLayout:
        """``self`` completed with ``other``'s RoPE parameters (a layout registered without them
        gains them); ValueError when shapes/dtypes differ or both carry different RoPE."""
        if self != other:
            raise ValueError(f"layouts differ: {self.to_json()} vs {other.to_json()}")
        if other.rope is None or self.rope == other.rope:
            return self
        if self.rope is not None:
            raise ValueError(f"RoPE parameters differ: {self.rope} vs {other.rope}")
        return other

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
        """JSON-safe dict (dtype by name, e.g. "bfloat16"; "rope" only when known)."""
        out: dict[str, Any] = {
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "head_dim": self.head_dim,
            "dtype": dtype_name(self.dtype),
        }
        if self.rope is not None:
            out["rope"] = check_rope(self.rope)
        return out

    @classmethod
    def from_json(cls, d: Any) -> CacheLayout:
        """Parse ``to_json``'s output; ValueError naming the bad or missing field."""
        if not isinstance(d, dict):
            raise ValueError(f"layout must be a JSON object, got {type(d).__name__}")
        expected = {"num_layers", "num_heads", "head_dim", "dtype"}
        missing = expected - d.keys()
        extra = d.keys() - expected - {"rope"}
        if missing or extra:
            raise ValueError(
                f"layout fields must be exactly {sorted(expected)} (and optionally 'rope'); "
                f"missing {sorted(missing)}, unexpected {sorted(map(str, extra))}"
            )
        return cls(
            num_layers=d["num_layers"],
            num_heads=d["num_heads"],
            head_dim=d["head_dim"],
            dtype=dtype_from_name(d["dtype"]),
            rope=d.get("rope"),
        )
