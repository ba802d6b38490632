"""The reference decoder (Llama / Qwen2 / Qwen3 / SmolLM family), gpt-fast style: one plain file.

RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP, optional per-head q/k RMSNorm
(Qwen3), optional q/k/v bias (Qwen2), tied embeddings. This module imports only torch: the
rotary-embedding math arrives in ``ModelConfig.rope`` (any :class:`Rope`; the loading code passes
a ``kvdrop_rope.RopeConfig``), and checkpoints are read by :mod:`kvdrop_engine.loading`.

Elementwise chains (RMSNorm, SwiGLU's ``silu(gate) * up``) can be handed to fused kernels with
:meth:`Transformer.use_ops` (any object with ``rms_norm`` and ``silu_mul``, e.g.
``kvdrop_engine.kernels``, which the engine passes on a GPU); they must round as the plain ops do.

The model never owns a KV cache: every forward hands post-RoPE q and k (and v) of each layer to an
:class:`AttentionBackend`, which stores k/v wherever the engine keeps them (a paged cache, or
:class:`DenseAttention`'s contiguous one) and returns the attention output. Tokens of several
sequences can therefore be packed into one flat forward; the backend knows which token belongs
to which sequence.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

__all__ = [
    "AttentionBackend",
    "DenseAttention",
    "FusedOps",
    "FusesOps",
    "ModelConfig",
    "Rope",
    "Transformer",
    "causal_attention",
    "generate",
]


class Rope(Protocol):
    """The rotary embedding the model applies to q and k (``kvdrop_rope.RopeConfig`` is one).

    ``inv_freq`` gives the inverse frequencies ``[rotary_dim // 2]`` and the attention factor that
    scales cos/sin; ``dynamic`` says whether they depend on the sequence length (dynamic NTK, then
    the model asks ``cos_sin`` per call); ``rotate`` applies precomputed cos/sin to
    ``x [..., T, H, head_dim]``.
    """

    @property
    def head_dim(self) -> int: ...

    @property
    def dynamic(self) -> bool: ...

    def to_json(self) -> dict[str, Any]:
        """The parameters as the SDK's layouts carry them (edit functions re-rotate with them)."""
        ...

    def inv_freq(self, seq_len: int | None = None) -> tuple[torch.Tensor, float]: ...

    def cos_sin(
        self, positions: torch.Tensor, seq_len: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def rotate(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        attention_factor: float = 1.0,
    ) -> torch.Tensor: ...


@dataclass
class ModelConfig:
    """Shapes and options of one decoder. Built by :mod:`kvdrop_engine.loading` from an HF
    ``config.json``, a GGUF file's metadata or a named preset."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: Rope
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    attention_bias: bool = False
    attention_out_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    max_position_embeddings: int = 8192
    name: str = "model"

    def __post_init__(self) -> None:
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{key} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}) for grouped-query attention"
            )
        if self.rope.head_dim != self.head_dim:
            raise ValueError(
                f"ModelConfig.rope.head_dim ({self.rope.head_dim}) must equal head_dim "
                f"({self.head_dim})"
            )
        self.eos_token_ids = tuple(int(t) for t in self.eos_token_ids)

    @property
    def kv_dim(self) -> int:
        """Width of one token's K (or V) row in one layer: ``num_kv_heads * head_dim``."""
        return self.num_kv_heads * self.head_dim

    @property
    def q_dim(self) -> int:
        """Width of one token's query row in one layer: ``num_heads * head_dim``."""
        return self.num_heads * self.head_dim

    @property
    def attention_keys_per_token(self) -> float:
        """How many keys one row's attention must read to cost what the row's matrix work costs
        (multiply-adds of the q/k/v/o projections and the gated MLP, over those of attending to
        one key: ``q_dim`` for the scores and ``q_dim`` for the values). ``tiny``: 288;
        Qwen3-8B: 23,552. The scheduler charges a prompt row ``1 + keys / this`` tokens of a
        client's share (:func:`kvdrop_engine.scheduler.prefill_cost`)."""
        h = self.hidden_size
        matrix = h * (2 * self.q_dim + 2 * self.kv_dim) + 3 * h * self.intermediate_size
        return matrix / (2 * self.q_dim)


@runtime_checkable
class AttentionBackend(Protocol):
    """Where K/V live. Called once per layer per forward with the N new tokens' post-RoPE
    ``q [N, Hq, d]`` and ``k``/``v [N, Hkv, d]``; stores k/v and returns ``[N, Hq, d]`` (causal
    attention of each new token over its own sequence's cached tokens plus the new ones)."""

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Store ``k``/``v`` for ``layer`` and return attention output for ``q``."""
        ...


class FusedOps(Protocol):
    """Fused replacements of the model's elementwise chains (see :meth:`Transformer.use_ops`)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``weight * (x.float() * rsqrt(mean(x.float()**2, -1) + eps)).to(x.dtype)``."""
        ...

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``F.silu(gate) * up``."""
        ...


@runtime_checkable
class FusesOps(Protocol):
    """A model whose elementwise chains can run fused (:class:`Transformer` is one): the engine
    calls ``use_ops`` with :mod:`kvdrop_engine.kernels` on a GPU, or None for plain PyTorch."""

    def use_ops(self, ops: FusedOps | None) -> None: ...


class RMSNorm(nn.Module):
    """RMS normalisation computed in float32, scaled in the input dtype (as HF Llama)."""

    ops: FusedOps | None = None

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    """Projections of one attention layer; the attention itself is the backend's."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.q_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.kv_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.kv_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.q_dim, c.hidden_size, bias=c.attention_out_bias)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(
        self,
        layer: int,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_factor: float,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        c, n = self.c, x.shape[0]
        q = self.q_proj(x).view(n, c.num_heads, c.head_dim)
        k = self.k_proj(x).view(n, c.num_kv_heads, c.head_dim)
        v = self.v_proj(x).view(n, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = c.rope.rotate(q, cos, sin, attention_factor=attn_factor)
        k = c.rope.rotate(k, cos, sin, attention_factor=attn_factor)
        out = attn(layer, q, k, v)
        return self.o_proj(out.reshape(n, c.q_dim))


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    ops: FusedOps | None = None

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.down_proj(self.ops.silu_mul(self.gate_proj(x), self.up_proj(x)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm decoder layer: attention then MLP, each with a residual connection."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(
        self,
        layer: int,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_factor: float,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        h = h + self.self_attn(layer, self.input_layernorm(h), cos, sin, attn_factor, attn)
        return h + self.mlp(self.post_attention_layernorm(h))


class Transformer(nn.Module):
    """The decoder. Parameter names are HF's minus the leading ``model.`` (so checkpoints map
    one to one): ``embed_tokens``, ``layers.{i}.self_attn.q_proj``, ..., ``norm``, ``lm_head``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def use_ops(self, ops: FusedOps | None) -> None:
        """Run every RMSNorm and MLP through ``ops`` (None: back to the plain PyTorch ops)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, MLP)):
                module.ops = ops

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the weights (and of activations)."""
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        """The device of the weights."""
        return self.embed_tokens.weight.device

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        logits_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run ``tokens [N]`` at ``positions [N]`` (possibly several sequences packed; ``attn``
        knows the split) and return float32 logits for every row or only ``logits_rows``.

        For dynamic-NTK RoPE the frequencies follow ``max(positions) + 1`` of the whole call, as
        HF does for one sequence.
        """
        c = self.config
        if tokens.dim() != 1 or positions.shape != tokens.shape:
            raise ValueError(
                f"tokens and positions must be 1-D of equal length, got {tuple(tokens.shape)} "
                f"and {tuple(positions.shape)}"
            )
        if tokens.dtype.is_floating_point or positions.dtype.is_floating_point:
            raise ValueError("tokens and positions must be integer tensors")
        # Checked where it costs no device sync (ids built on the host, the usual case).
        if tokens.device.type == "cpu" and tokens.numel():
            lo, hi = int(tokens.min()), int(tokens.max())
            if lo < 0 or hi >= c.vocab_size:
                raise ValueError(f"token ids must be in [0, {c.vocab_size}), got min {lo} max {hi}")
        tokens, positions = tokens.to(self.device), positions.to(self.device)
        cos, sin, attn_factor = self._cos_sin(positions)
        h = self.embed_tokens(tokens)
        for i, block in enumerate(self.layers):
            h = block(i, h, cos, sin, attn_factor, attn)
        if logits_rows is not None:
            h = h[logits_rows.to(self.device)]
        return self.lm_head(self.norm(h)).float()

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        """``rope.cos_sin`` with the inverse frequencies cached on the model's device (they depend
        on the call only for a ``dynamic`` rope), plus the attention factor."""
        rope = self.config.rope
        if rope.dynamic:
            cos, sin = rope.cos_sin(positions)
            return cos, sin, 1.0
        cached = getattr(self, "_inv_freq_cache", None)
        if cached is None or cached[0] is not rope or cached[1].device != positions.device:
            inv, factor = rope.inv_freq()
            cached = (rope, inv.to(positions.device), factor)
            self._inv_freq_cache = cached
        _, inv, factor = cached
        freqs = positions.to(torch.float32)[..., None] * inv
        cos, sin = freqs.cos(), freqs.sin()
        if factor != 1.0:
            cos, sin = cos * factor, sin * factor
        return cos, sin, factor

    @classmethod
    def random(
        cls,
        config: ModelConfig,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> Transformer:
        """Random weights from ``seed`` (normal, std 0.02; norms 1), reproducible across runs.

        Allocated directly in ``dtype`` on ``device`` (an 8B model never exists in float32 on the
        host). On CPU the values are drawn in float32 and rounded, so a bfloat16 model is the
        float32 one rounded; other devices draw with their own generator (same seed, same
        device kind -> same weights)."""
        device = torch.device(device)
        with torch.device("meta"):
            model = cls(config)
        model = model.to(dtype=dtype).to_empty(device=device)
        on_cpu = device.type == "cpu"
        gen = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif on_cpu and p.dtype != torch.float32:
                    p.copy_(torch.empty(p.shape).normal_(0.0, 0.02, generator=gen))
                else:
                    p.normal_(0.0, 0.02, generator=gen)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        return model.eval()


class DenseAttention:
    """One sequence's KV cache as a contiguous growing tensor per layer (tests, simple generate).

    Stores post-RoPE keys, like the paged engine, head-major (``[Hkv, capacity, d]``) so attention
    reads each head's keys without copying; ``keys(layer)`` / ``values(layer)`` return
    ``[T, Hkv, d]`` views.
    """

    def __init__(self, config: ModelConfig, capacity: int = 256) -> None:
        self.config = config
        self.length = 0
        self._capacity = max(1, capacity)
        self._k: list[torch.Tensor | None] = [None] * config.num_layers
        self._v: list[torch.Tensor | None] = [None] * config.num_layers

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Append ``k``/``v`` after the cached tokens, attend causally, return ``[N, Hq, d]``."""
        n, start = q.shape[0], self.length
        end = start + n
        kc, vc = self._k[layer], self._v[layer]
        if kc is None or vc is None or kc.shape[1] < end or kc.dtype != k.dtype:
            cap = max(self._capacity, end)
            while cap < end:
                cap *= 2
            hkv, d = k.shape[1], k.shape[2]
            new_k, new_v = k.new_empty(hkv, cap, d), v.new_empty(hkv, cap, d)
            if kc is not None and vc is not None:
                new_k[:, :start], new_v[:, :start] = kc[:, :start], vc[:, :start]
            self._k[layer], self._v[layer] = kc, vc = new_k, new_v
            self._capacity = cap
        kc[:, start:end] = k.transpose(0, 1)
        vc[:, start:end] = v.transpose(0, 1)
        out = causal_attention(q, kc[:, :end], vc[:, :end], start)
        if layer == self.config.num_layers - 1:
            self.length = end
        return out

    def keys(self, layer: int) -> torch.Tensor:
        """The cached post-RoPE keys of ``layer``: ``[length, Hkv, d]`` (a view)."""
        k = self._k[layer]
        return k[:, : self.length].transpose(0, 1) if k is not None else torch.empty(0)

    def values(self, layer: int) -> torch.Tensor:
        """The cached values of ``layer``: ``[length, Hkv, d]`` (a view)."""
        v = self._v[layer]
        return v[:, : self.length].transpose(0, 1) if v is not None else torch.empty(0)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Attention of ``q [N, Hq, d]`` (tokens ``start .. start+N-1`` of one sequence) over its
    head-major ``k``/``v [Hkv, start+N, d]``, causal, grouped-query heads.

    Inputs are 4-D so that PyTorch picks its fused (flash) CPU kernel; 3-D inputs fall back to
    the math path, which materialises the score matrix and is ~4x slower for long prefills. One
    decoding token stacks the query heads of a GQA group as rows of their KV head (no mask, no
    repeated K/V)."""
    n, hq, d = q.shape
    hkv, t = k.shape[0], k.shape[1]
    scale = 1.0 / math.sqrt(d)
    kb, vb = k.unsqueeze(0), v.unsqueeze(0)
    if n == 1:
        qg = q.reshape(1, hkv, hq // hkv, d)
        return F.scaled_dot_product_attention(qg, kb, vb, scale=scale).reshape(1, hq, d)
    qh = q.transpose(0, 1).unsqueeze(0)
    gqa = hq != hkv
    if start == 0 and t == n:
        out = F.scaled_dot_product_attention(
            qh, kb, vb, is_causal=True, scale=scale, enable_gqa=gqa
        )
    elif q.device.type == "cuda" and start + n == t:
        # The rows are the last n of t (a later prefill chunk, KVzip's reconstruction): a
        # bottom-right causal bias keeps the flash kernel, where an explicit mask would not.
        out = F.scaled_dot_product_attention(
            qh, kb, vb, attn_mask=causal_lower_right(n, t), scale=scale, enable_gqa=gqa
        )
    else:
        rows = torch.arange(start, start + n, device=q.device)[:, None]
        mask = torch.arange(t, device=q.device)[None, :] <= rows
        out = F.scaled_dot_product_attention(
            qh, kb, vb, attn_mask=mask, scale=scale, enable_gqa=gqa
        )
    return out[0].transpose(0, 1)


@torch.inference_mode()
def generate(
    model: Transformer,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    eos_ids: Iterable[int] | None = None,
    stop_at_eos: bool = True,
    prefill_chunk: int = 2048,
) -> list[int]:
    """Greedy decoding of one sequence with :class:`DenseAttention`; returns the new token ids
    (stops after an EOS id when ``stop_at_eos``). Long prompts prefill in chunks."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    ids = [int(t) for t in prompt_ids]
    if not ids:
        raise ValueError("prompt_ids must not be empty")
    eos = set(model.config.eos_token_ids if eos_ids is None else eos_ids)
    cache = DenseAttention(model.config, capacity=len(ids) + max_new_tokens)
    device = model.device
    out: list[int] = []
    logits = None
    for s in range(0, len(ids), prefill_chunk):
        chunk = torch.tensor(ids[s : s + prefill_chunk], device=device)
        pos = torch.arange(s, s + chunk.numel(), device=device)
        logits = model(chunk, pos, cache, logits_rows=torch.tensor([chunk.numel() - 1]))
    assert logits is not None
    for _ in range(max_new_tokens):
        nxt = int(logits[-1].argmax())
        out.append(nxt)
        if stop_at_eos and nxt in eos:
            break
        pos = torch.tensor([cache.length], device=device)
        logits = model(torch.tensor([nxt], device=device), pos, cache)
    return out
