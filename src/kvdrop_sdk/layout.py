"""The per-model tensor layout a server registers: layers, heads, head dim, dtype (and RoPE).

A layout fixes the bytes of one chunk, so the server can size its slots and both sides can check
shapes and dtypes before any data moves. An engine also registers the model's rotary embedding
(``rope``, a JSON dict): cached keys are post-RoPE, and an edit that drops tokens must re-rotate
the kept keys to the positions the engine will read them at, which needs exactly these parameters.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from kvdrop_rope import ROPE_FIELDS, RopeConfig
from kvdrop_sdk.cache_kind import CacheKind
from kvdrop_sdk.validate import check_fields

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


def check_rope(rope: Any) -> dict[str, Any]:
    """A validated copy of a layout's ``rope`` dict; ValueError naming the bad field.

    The one set of rules is ``kvdrop_rope.RopeConfig``'s (exactly :data:`ROPE_FIELDS`; theta
    finite and > 1; each scaling kind with every field it needs, each finite and positive, no
    unknown field; frequencies that come out finite), so a layout never carries RoPE parameters
    that re-rotation could not use. Normalised as ``RopeConfig.to_json()`` writes it.
    """
    if not isinstance(rope, Mapping):
        raise ValueError(f"rope must be a JSON object, got {type(rope).__name__}")
    try:
        key = json.dumps(rope, sort_keys=True, allow_nan=True)
    except (TypeError, ValueError, RecursionError):
        raise ValueError("rope must be a JSON object of numbers, bools and strings") from None
    return dict(_checked_rope(key))


@functools.lru_cache(maxsize=256)
def _checked_rope(key: str) -> MappingProxyType[str, Any]:
    """Validation of one ``rope`` dict, by its canonical JSON (requests repeat the same few)."""
    try:
        rope = RopeConfig.from_json(json.loads(key))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"rope: {exc}") from None
    return MappingProxyType(rope.to_json())


@dataclass(frozen=True)
class CacheLayout:
    """Shape of one model's cached tensors: ``(2|1, num_layers, tokens, num_heads * head_dim)``.

    ``num_heads`` is the number of KV heads for the KV kind and of query heads for the QUERY kind.
    ``rope`` (optional) is the model's rotary embedding as a JSON dict (:data:`ROPE_FIELDS`,
    validated by ``kvdrop_rope``). It is part of the layout's identity: cached keys are post-RoPE,
    so two layouts of the same bytes but other RoPE parameters are different layouts (a server
    refuses to re-register one over the other as it refuses another dtype). Only a layout without
    RoPE parameters matches one with them, see :meth:`merged`.
    """

    num_layers: int
    num_heads: int
    head_dim: int
    dtype: torch.dtype
    rope: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        check_fields(self, ints={"num_layers": 1, "num_heads": 1, "head_dim": 1})
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"CacheLayout.dtype must be a torch.dtype, got {self.dtype!r}")
        dtype_name(self.dtype)
        if self.rope is not None:
            try:
                rope = check_rope(self.rope)
            except ValueError as exc:
                raise ValueError(f"CacheLayout.{exc}") from None
            if rope["head_dim"] != self.head_dim:
                raise ValueError(
                    f"CacheLayout.rope.head_dim is {rope['head_dim']}, but the layout's head_dim "
                    f"is {self.head_dim}"
                )
            object.__setattr__(self, "rope", MappingProxyType(rope))

    def __hash__(self) -> int:
        rope = None if self.rope is None else json.dumps(dict(self.rope), sort_keys=True)
        return hash((self.num_layers, self.num_heads, self.head_dim, self.dtype, rope))

    def same_bytes(self, other: CacheLayout) -> bool:
        """Whether ``other`` lays out the same bytes (RoPE parameters aside)."""
        return (self.num_layers, self.num_heads, self.head_dim, self.dtype) == (
            other.num_layers,
            other.num_heads,
            other.head_dim,
            other.dtype,
        )

    def matches(self, assumed: CacheLayout) -> bool:
        """Whether a request that assumes ``assumed`` may use this (registered) layout: the same
        bytes, and the same RoPE parameters unless ``assumed`` names none."""
        return self.same_bytes(assumed) and (assumed.rope is None or assumed == self)

    def merged(self, other: CacheLayout) -> CacheLayout:
        """``self`` completed with ``other``'s RoPE parameters (a layout registered without them
        gains them; one registered with them keeps them against ``other`` without); ValueError
        when shapes/dtypes differ or both carry different RoPE."""
        if not self.same_bytes(other):
            raise ValueError(f"layouts differ: {self.to_json()} vs {other.to_json()}")
        if other.rope is None or dict(self.rope or {}) == dict(other.rope):
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
            out["rope"] = dict(self.rope)
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
