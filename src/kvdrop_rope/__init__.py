"""Rotary position embeddings (RoPE) with the scalings of HF transformers, forward and inverse.

A neutral, pure-torch package with two users: the reference engine (``kvdrop_engine.loading`` puts
a ``RopeConfig`` into the model config; the model rotates q/k through it) and kvdrop's
``rerotate`` (re-rotate kept keys from their old positions to new ones:
``apply_rope(apply_rope(k, old, cfg, inverse=True), new, cfg)``). Frequencies are computed exactly
as transformers' ``modeling_rope_utils`` does, so a key rotated here equals one rotated by an HF
model with the same config.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any

import torch

__all__ = [
    "ROPE_FIELDS",
    "SCALING_TYPES",
    "RopeConfig",
    "apply_rope",
    "rerotate_rows",
    "rotate",
]

#: The ``rope_type`` values understood here (HF spelling); ``None``/"default" means unscaled.
SCALING_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")

# Keys each scaling needs (beyond rope_type) and the ones it may carry besides those; anything
# else in a scaling dict is refused (a misspelt key would otherwise be ignored silently).
_REQUIRED: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "yarn": (),
}
_OPTIONAL: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": (),
    "dynamic": (),
    "llama3": ("original_max_position_embeddings",),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    ),
}
_INT_KEYS = ("original_max_position_embeddings",)
_BOOL_KEYS = ("truncate",)
#: Scaling numbers that may be zero (yarn's mscale terms: 0 means "not used", as in HF).
_NON_NEGATIVE = ("mscale", "mscale_all_dim")


def _finite_positive(value: Any, what: str, *, zero_ok: bool = False) -> float:
    """``value`` as a float if it is a finite number > 0 (>= 0 with ``zero_ok``); else
    ValueError naming ``what``."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and math.isfinite(value) and (value >= 0 if zero_ok else value > 0):
        return float(value)
    bound = ">= 0" if zero_ok else "> 0"
    raise ValueError(f"{what} must be a finite number {bound}, got {value!r}")


def _check_scaling(scaling: Any, rotary_dim: int) -> dict[str, Any]:
    """A validated copy of an HF ``rope_scaling`` dict: a known type, every required field, no
    unknown field, each number finite and positive, and the relations the formulas divide by."""
    if not isinstance(scaling, Mapping):
        raise ValueError(
            f"RopeConfig.scaling must be a mapping (HF rope_scaling) or None, "
            f"got {type(scaling).__name__}"
        )
    kind = _scaling_type(scaling)
    if kind not in SCALING_TYPES:
        raise ValueError(
            f"RopeConfig.scaling rope_type {kind!r} is not supported; expected one of "
            f"{', '.join(SCALING_TYPES)}"
        )
    allowed = {"rope_type", "type", *_REQUIRED[kind], *_OPTIONAL[kind]}
    unknown = sorted(str(k) for k in scaling if k not in allowed)
    if unknown:
        raise ValueError(
            f"RopeConfig.scaling has unknown field(s) {unknown} for rope_type {kind!r}; "
            f"expected only {sorted(allowed)}"
        )
    for key in _REQUIRED[kind]:
        if scaling.get(key) is None:
            raise ValueError(
                f"RopeConfig.scaling[{key!r}] is required for rope_type {kind!r} and must be a "
                f"finite number > 0, got None"
            )
    for key, value in scaling.items():
        what = f"RopeConfig.scaling[{key!r}]"
        if key in ("rope_type", "type") or value is None:
            continue
        if key in _BOOL_KEYS:
            if not isinstance(value, bool):
                raise ValueError(f"{what} must be a bool, got {value!r}")
        elif key in _INT_KEYS:
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{what} must be a positive int, got {value!r}")
        else:
            _finite_positive(value, what, zero_ok=key in _NON_NEGATIVE)
    if kind == "llama3" and not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
        raise ValueError(
            "RopeConfig.scaling['high_freq_factor'] must be > low_freq_factor for llama3, got "
            f"{scaling['high_freq_factor']!r} and {scaling['low_freq_factor']!r}"
        )
    if kind == "dynamic" and rotary_dim <= 2:
        raise ValueError(f"dynamic NTK scaling needs rotary_dim > 2, got {rotary_dim}")
    return dict(scaling)


def _scaling_type(scaling: Mapping[str, Any] | None) -> str:
    """Normalised rope type of an HF ``rope_scaling`` dict (``rope_type`` or legacy ``type``)."""
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


@dataclass(frozen=True)
class RopeConfig:
    """Everything needed to rotate one head: dimensions, base, layout and HF-style scaling.

    ``rotary_dim`` < ``head_dim`` rotates only the first ``rotary_dim`` channels (HF
    ``partial_rotary_factor``); ``interleaved`` selects GPT-J pairs ``(x[2i], x[2i+1])`` instead
    of the NeoX/HF half split ``(x[i], x[i + rotary_dim/2])``. ``scaling`` is an HF
    ``rope_scaling`` dict.
    """

    head_dim: int
    theta: float = 10000.0
    rotary_dim: int | None = None
    interleaved: bool = False
    scaling: Mapping[str, Any] | None = None
    max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        hd = self.head_dim
        if not isinstance(hd, int) or isinstance(hd, bool) or hd <= 0 or hd % 2:
            raise ValueError(
                f"RopeConfig.head_dim must be a positive even int, got {self.head_dim!r}"
            )
        rd = self.head_dim if self.rotary_dim is None else self.rotary_dim
        if not isinstance(rd, int) or isinstance(rd, bool) or rd <= 0 or rd % 2 or rd > hd:
            raise ValueError(
                f"RopeConfig.rotary_dim must be a positive even int <= head_dim={self.head_dim}, "
                f"got {self.rotary_dim!r}"
            )
        object.__setattr__(self, "rotary_dim", rd)
        theta = self.theta
        ok = isinstance(theta, (int, float)) and not isinstance(theta, bool)
        if not (ok and math.isfinite(theta) and theta > 1):
            # theta <= 1 gives frequencies >= 1 per position (and yarn divides by log(theta)).
            raise ValueError(f"RopeConfig.theta must be a finite number > 1, got {theta!r}")
        if not isinstance(self.interleaved, bool):
            raise ValueError(f"RopeConfig.interleaved must be a bool, got {self.interleaved!r}")
        mpe = self.max_position_embeddings
        if not isinstance(mpe, int) or isinstance(mpe, bool) or mpe <= 0:
            raise ValueError(
                f"RopeConfig.max_position_embeddings must be a positive int, got {mpe!r}"
            )
        if self.scaling is not None:
            scaling = _check_scaling(self.scaling, rd)
            object.__setattr__(self, "scaling", MappingProxyType(scaling))
        self._check_frequencies()

    def _check_frequencies(self) -> None:
        """A last guard: parameters each in range can still combine into unusable ones."""
        try:
            inv, attn = self.inv_freq()
        except (ArithmeticError, ValueError) as exc:
            raise ValueError(f"RoPE parameters {self.to_json()} are unusable: {exc}") from None
        finite = bool(torch.isfinite(inv).all()) and math.isfinite(attn)
        if not (finite and bool((inv > 0).all()) and attn > 0):
            raise ValueError(
                f"RoPE parameters {self.to_json()} give non-finite or zero frequencies "
                f"(attention factor {attn!r}); check theta and the scaling factors"
            )

    @property
    def rope_type(self) -> str:
        """The scaling in use: one of :data:`SCALING_TYPES`."""
        return _scaling_type(self.scaling)

    @property
    def dynamic(self) -> bool:
        """True when the frequencies depend on the sequence length (dynamic NTK scaling)."""
        return self.rope_type == "dynamic"

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> RopeConfig:
        """Build from an HF ``config.json`` dict (old ``rope_theta``/``rope_scaling`` keys or the
        newer ``rope_parameters`` dict; ``type`` or ``rope_type``; ``partial_rotary_factor``)."""
        if not isinstance(cfg, Mapping):
            raise ValueError(
                f"config must be a mapping (config.json dict), got {type(cfg).__name__}"
            )
        params = cfg.get("rope_parameters")
        if params is not None and not isinstance(params, Mapping):
            raise ValueError(f"config 'rope_parameters' must be a mapping, got {params!r}")
        params = dict(params or {})
        scaling = cfg.get("rope_scaling")
        if scaling is not None and not isinstance(scaling, Mapping):
            raise ValueError(f"config 'rope_scaling' must be a mapping or null, got {scaling!r}")
        merged: dict[str, Any] = {**params, **dict(scaling or {})}
        theta = merged.pop("rope_theta", None)
        if theta is None:
            theta = cfg.get("rope_theta", 10000.0)
        partial = merged.pop("partial_rotary_factor", None)
        if partial is None:
            partial = cfg.get("partial_rotary_factor", 1.0)
        head_dim = cfg.get("head_dim")
        if head_dim is None:
            hidden, heads = cfg.get("hidden_size"), cfg.get("num_attention_heads")
            if not isinstance(hidden, int) or not isinstance(heads, int) or heads <= 0:
                raise ValueError(
                    "config needs 'head_dim' or int 'hidden_size' and 'num_attention_heads', "
                    f"got hidden_size={hidden!r}, num_attention_heads={heads!r}"
                )
            head_dim = hidden // heads
        if not isinstance(partial, (int, float)) or not 0 < partial <= 1:
            raise ValueError(f"config 'partial_rotary_factor' must be in (0, 1], got {partial!r}")
        max_pos = cfg.get("max_position_embeddings", 8192)
        kind = _scaling_type(merged)
        if kind in ("llama3", "yarn"):
            merged.setdefault(
                "original_max_position_embeddings",
                cfg.get("original_max_position_embeddings", max_pos),
            )
        merged.pop("type", None)
        merged["rope_type"] = kind
        return cls(
            head_dim=int(head_dim),
            theta=float(theta),
            rotary_dim=int(head_dim * partial),
            interleaved=False,
            scaling=None if kind == "default" else merged,
            max_position_embeddings=int(max_pos),
        )

    def to_json(self) -> dict[str, Any]:
        """Every field as a JSON-safe dict (what an engine registers with its cache layout)."""
        return {
            "head_dim": self.head_dim,
            "theta": float(self.theta),
            "rotary_dim": int(self.rotary_dim),  # type: ignore[arg-type]
            "interleaved": bool(self.interleaved),
            "scaling": None if self.scaling is None else dict(self.scaling),
            "max_position_embeddings": self.max_position_embeddings,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RopeConfig:
        """Inverse of :meth:`to_json`; ValueError naming a missing or unexpected field."""
        if not isinstance(d, Mapping):
            raise ValueError(f"RoPE parameters must be a mapping, got {type(d).__name__}")
        names = set(ROPE_FIELDS)
        missing, extra = names - d.keys(), d.keys() - names
        if missing or extra:
            raise ValueError(
                f"RoPE parameters must have exactly {sorted(names)}; missing {sorted(missing)}, "
                f"unexpected {sorted(map(str, extra))}"
            )
        return cls(**{k: d[k] for k in names})

    def inv_freq(self, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        """Inverse frequencies (float32, ``[rotary_dim // 2]``) and the attention factor that
        multiplies cos/sin (1.0 except for yarn). ``seq_len`` matters only for dynamic NTK."""
        dim = int(self.rotary_dim)  # type: ignore[arg-type]
        base = float(self.theta)
        s = self.scaling or {}
        kind = self.rope_type
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
        if kind == "dynamic":
            factor = float(s["factor"])
            max_pos = self.max_position_embeddings
            length = max_pos if seq_len is None else max(int(seq_len), max_pos)
            base = base * ((factor * length / max_pos) - (factor - 1)) ** (dim / (dim - 2))
            return 1.0 / (base**exponents), 1.0
        inv = 1.0 / (base**exponents)
        if kind == "linear":
            return inv / float(s["factor"]), 1.0
        if kind == "llama3":
            return self._llama3(inv, s), 1.0
        if kind == "yarn":
            return self._yarn(dim, base, s)
        return inv, 1.0

    def _llama3(self, inv: torch.Tensor, s: Mapping[str, Any]) -> torch.Tensor:
        """Llama 3.1 frequency-dependent interpolation (as HF ``_compute_llama3_parameters``)."""
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_len = s.get("original_max_position_embeddings", self.max_position_embeddings)
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        out = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, out)

    def _yarn(self, dim: int, base: float, s: Mapping[str, Any]) -> tuple[torch.Tensor, float]:
        """YaRN ramp between interpolated and extrapolated frequencies (HF semantics)."""
        orig = s.get("original_max_position_embeddings", self.max_position_embeddings)
        factor = s.get("factor")
        if factor is None:
            factor = self.max_position_embeddings / orig

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attn = s.get("attention_factor")
        if attn is None:
            m, m_all = s.get("mscale"), s.get("mscale_all_dim")
            attn = (
                float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
            )
        beta_fast = s.get("beta_fast") or 32
        beta_slow = s.get("beta_slow") or 1

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if s.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
        extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
        extra_factor = 1 - ramp
        inv = interpolation * (1 - extra_factor) + extrapolation * extra_factor
        return inv, float(attn)

    def cos_sin(
        self, positions: torch.Tensor, seq_len: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos and sin of shape ``[*positions.shape, rotary_dim // 2]``, already multiplied
        by the attention factor. For dynamic NTK, ``seq_len`` defaults to ``max(positions) + 1``
        (HF recomputes its frequencies from the longest position seen in the call)."""
        if positions.dtype.is_floating_point or positions.dtype == torch.bool:
            raise ValueError(f"positions must be an integer tensor, got dtype {positions.dtype}")
        if seq_len is None and self.dynamic and positions.numel():
            seq_len = int(positions.max()) + 1
        inv, attn = self.inv_freq(seq_len)
        freqs = positions.to(torch.float32)[..., None] * inv.to(positions.device)
        cos, sin = freqs.cos(), freqs.sin()
        if attn != 1.0:
            cos, sin = cos * attn, sin * attn
        return cos, sin

    def rotate(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        inverse: bool = False,
        attention_factor: float = 1.0,
    ) -> torch.Tensor:
        """:func:`rotate` with this config (the form the engine's model calls)."""
        return rotate(x, cos, sin, self, inverse=inverse, attention_factor=attention_factor)


#: The fields of ``RopeConfig.to_json()`` (and of a cache layout's ``rope`` dict), in order.
ROPE_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(RopeConfig))


def rotate(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cfg: RopeConfig,
    *,
    inverse: bool = False,
    attention_factor: float = 1.0,
) -> torch.Tensor:
    """Rotate ``x [..., T, H, head_dim]`` with precomputed ``cos``/``sin [..., T, rotary_dim/2]``.

    The low-level half of :func:`apply_rope`, for callers that reuse cos/sin across layers.
    ``inverse`` rotates by the negative angle and divides by ``attention_factor`` squared (cos/sin
    already carry it once), so it exactly undoes the forward rotation.
    """
    rd = int(cfg.rotary_dim)  # type: ignore[arg-type]
    if x.shape[-1] != cfg.head_dim:
        raise ValueError(
            f"x's last dim must be head_dim={cfg.head_dim}, got shape {tuple(x.shape)}"
        )
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if inverse:
        scale = attention_factor * attention_factor
        cos, sin = cos / scale, -sin / scale
    xf = x.to(torch.float32)
    rot = xf[..., :rd]
    if cfg.interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        half = rd // 2
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    if rd < cfg.head_dim:
        out = torch.cat((out, xf[..., rd:]), dim=-1)
    return out.to(x.dtype)


def apply_rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    cfg: RopeConfig,
    *,
    inverse: bool = False,
    seq_len: int | None = None,
) -> torch.Tensor:
    """Rotate ``x [..., T, H, head_dim]`` to ``positions [T]`` (or ``[..., T]``); float32 math,
    result in ``x.dtype``. ``inverse=True`` undoes the rotation (angle -> -angle, and yarn's
    attention factor divided out). Channels past ``rotary_dim`` pass through unchanged."""
    if x.dim() < 3:
        raise ValueError(f"x must be [..., T, H, head_dim], got shape {tuple(x.shape)}")
    if positions.shape[-1] != x.shape[-3]:
        raise ValueError(
            f"positions must have T={x.shape[-3]} entries (x is [..., T, H, D]), "
            f"got shape {tuple(positions.shape)}"
        )
    cos, sin = cfg.cos_sin(positions.to(x.device), seq_len)
    attn = cfg.inv_freq(seq_len)[1] if cfg.rope_type == "yarn" else 1.0
    return rotate(x, cos, sin, cfg, inverse=inverse, attention_factor=attn)


def rerotate_rows(
    keys: torch.Tensor,
    old: torch.Tensor,
    new: torch.Tensor,
    cfg: RopeConfig,
    old_seq_len: int | None,
    new_seq_len: int | None,
) -> None:
    """Re-rotate post-RoPE keys ``[L, k, D]`` in place from positions ``old [k]`` to ``new [k]``.

    Per layer, one layer's moved rows alive in float32 at a time: inverse rotation at ``old``,
    rotation at ``new``, one cast back; rows that do not move stay bit-identical (every row
    moves under dynamic NTK, whose frequencies depend on ``*_seq_len``). The one rule for kept
    keys: kvdrop's policies and the cache server's keep both call it. ValueError when ``D`` is
    not a multiple of ``head_dim``.
    """
    layers, _, width = keys.shape
    if width % cfg.head_dim:
        raise ValueError(
            f"KV width D={width} is not a multiple of the RoPE head_dim={cfg.head_dim}; "
            "expected num_kv_heads * head_dim"
        )
    inv_old, attn_old = cfg.inv_freq(old_seq_len)
    inv_new, attn_new = cfg.inv_freq(new_seq_len)
    if torch.equal(inv_old, inv_new) and attn_old == attn_new:
        moved = (old != new).nonzero().squeeze(1)
    else:
        moved = torch.arange(old.numel())
    if moved.numel() == 0:
        return
    old_m, new_m = old[moved].to(torch.int64), new[moved].to(torch.int64)
    cos_old, sin_old = cfg.cos_sin(old_m, old_seq_len)
    cos_new, sin_new = cfg.cos_sin(new_m, new_seq_len)
    cos_old, sin_old = cos_old.to(keys.device), sin_old.to(keys.device)
    cos_new, sin_new = cos_new.to(keys.device), sin_new.to(keys.device)
    heads = width // cfg.head_dim
    index = moved.to(keys.device)
    for layer in range(layers):
        x = keys[layer].index_select(0, index).to(torch.float32).view(-1, heads, cfg.head_dim)
        x = rotate(x, cos_old, sin_old, cfg, inverse=True, attention_factor=attn_old)
        x = rotate(x, cos_new, sin_new, cfg)
        keys[layer].index_copy_(0, index, x.view(-1, width).to(keys.dtype))
