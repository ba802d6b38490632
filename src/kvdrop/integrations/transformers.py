"""kvdrop policies inside Hugging Face ``transformers`` (what a kvpress user reaches for):

    press = KVDropPress("snapkv", keep_ratio=0.5)
    with press(model):
        out = model.generate(input_ids, max_new_tokens=32)

The prompt but its last ``tail`` tokens is prefilled into a ``DynamicCache`` while forward hooks
capture each layer's queries (the output of ``q_proj``, or of ``q_norm`` where the model has one,
rotated with the model's RoPE from its config: the same post-RoPE queries the kvdrop engine
stores). The policy picks the tokens to keep from the ``[2, L, T, D]`` KV and ``[1, L, T, Dq]``
queries exactly as it does on the kvdrop drop path, re-rotates the kept keys to positions
``0..k-1``, and the cache is rebuilt from the kept rows; ``generate`` then continues from the
smaller cache with the kept token ids plus the tail as its input (so positions, masks and the
cache agree). One selection for every layer and head, as everywhere in kvdrop.

``transformers`` is imported lazily: ``pip install 'kvdrop[hf]'`` (transformers >= 4.46; the
cache API used, ``DynamicCache(config=...)``, ``update`` and ``layers``, holds in 4.56+ and 5.x).
Batch size 1, decoder-only models with a ``get_decoder().layers[i].self_attn`` that has
``q_proj`` (Llama, Qwen2/3, Mistral, SmolLM ...).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from kvdrop.errors import PolicyInputError
from kvdrop.policy import Policy
from kvdrop.spec import get
from kvdrop_rope import RopeConfig, apply_rope
from kvdrop_sdk import CacheKind
from kvdrop_sdk.edit import EditContext
from kvdrop_sdk.query_capture import QueryNeed

__all__ = ["Compressed", "KVDropPress"]


@dataclass(frozen=True)
class Compressed:
    """A prompt after compression: the smaller ``cache`` (k entries), the ids to hand
    ``generate`` (the kept prompt ids, then the tail that was not prefilled), and the kept
    indices into the prefilled prompt."""

    cache: Any
    input_ids: torch.Tensor
    kept: list[int]
    prefilled: int


def _config_dict(model: Any) -> dict[str, Any]:
    """The model's ``config.json`` as a dict (what RoPE and the head count are read from)."""
    return dict(model.config.to_dict())


class _QueryCapture:
    """Forward hooks that keep each layer's post-RoPE queries ``[T, Hq * d]`` of one forward."""

    def __init__(self, model: Any, rope: RopeConfig, num_heads: int) -> None:
        self.rope, self.num_heads = rope, num_heads
        self.rows: dict[int, torch.Tensor] = {}
        self._handles = []
        for index, layer in enumerate(model.get_decoder().layers):
            modules = dict(layer.self_attn.named_children())
            if "q_proj" not in modules:
                raise PolicyInputError(
                    f"layer {index}'s attention has no q_proj; this integration supports "
                    "decoder-only models of the Llama family"
                )
            source = modules.get("q_norm", modules["q_proj"])
            self._handles.append(source.register_forward_hook(self._hook(index)))

    def _hook(self, index: int) -> Callable[..., None]:
        def keep(module: Any, args: Any, output: torch.Tensor) -> None:
            q = output[0]  # [T, Hq * d] (q_proj) or [T, Hq, d] (q_norm); batch 1
            q = q.reshape(q.shape[0], self.num_heads, self.rope.head_dim)
            positions = torch.arange(q.shape[0], device=q.device)
            rotated = apply_rope(q.float(), positions, self.rope)
            self.rows[index] = rotated.reshape(q.shape[0], -1)

        return keep

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()

    def tensor(self, num_layers: int) -> torch.Tensor:
        """``[1, L, T, Hq * d]`` float32."""
        return torch.stack([self.rows[i] for i in range(num_layers)]).unsqueeze(0)


class KVDropPress:
    """Applies a kvdrop policy (a registered name or spec with its parameters, or a built
    :class:`kvdrop.Policy`) to a transformers model's cache after prefill.

    ``tail`` prompt tokens (at least 1) are not prefilled: ``generate`` computes them, so it
    has logits to start from (the kvdrop engine likewise recomputes the uncached tail).
    ``rerotate`` (default True) moves the kept keys to contiguous positions; False keeps them at
    their original positions and then generation also continues at the original positions.
    """

    def __init__(
        self, policy: str | Policy, *, tail: int = 1, rerotate: bool = True, **params: Any
    ) -> None:
        if not isinstance(tail, int) or isinstance(tail, bool) or tail < 1:
            raise ValueError(f"tail must be an int >= 1, got {tail!r}")
        if isinstance(policy, str):
            policy = get(policy, **params)
        elif params:
            raise TypeError("parameters go with a policy name, not with a built policy")
        if not isinstance(policy, Policy):
            raise TypeError(f"policy must be a name or a kvdrop.Policy, got {type(policy)}")
        self.policy, self.tail, self.rerotate = policy, tail, rerotate

    def compress(self, model: Any, input_ids: torch.Tensor) -> Compressed:
        """Prefill ``input_ids [1, N]`` (but the tail), select, and return the smaller cache."""
        from transformers import DynamicCache

        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"input_ids must be [1, N] (batch 1), got {tuple(input_ids.shape)}")
        total = input_ids.shape[1]
        prefill = total - self.tail
        if prefill < 1:
            raise ValueError(f"the prompt ({total} tokens) must be longer than tail={self.tail}")
        config = _config_dict(model)
        rope = RopeConfig.from_hf_config(config)
        capture = _QueryCapture(model, rope, int(config["num_attention_heads"]))
        try:
            with torch.no_grad():
                cache = DynamicCache(config=model.config)
                model(input_ids[:, :prefill], **{_cache_keyword(model): cache}, use_cache=True)
        finally:
            capture.close()
        layers = len(model.get_decoder().layers)
        kv = _cache_tensor(cache, layers)
        tensors = {CacheKind.KV: kv, CacheKind.QUERY: capture.tensor(layers)}
        if self.policy.queries is QueryNeed.NONE:
            del tensors[CacheKind.QUERY]
        context = EditContext(
            positions=torch.arange(prefill),
            rope=rope.to_json() if self.rerotate else None,
            prompt_tokens=prefill,
            head_dim=rope.head_dim,
        )
        tokens = input_ids[0, :prefill].tolist()
        selected, index = self.policy.select_indices(tensors, tokens, context=context)
        kept_kv, _ = self.policy.keep(selected, tokens, index, context=context)
        smaller = DynamicCache(config=model.config)
        heads = kv.shape[3] // rope.head_dim
        for layer in range(layers):
            keys, values = (_heads(kept_kv[i, layer], heads) for i in (0, 1))
            smaller.update(keys, values, layer)
        kept = index.tolist()
        ids = torch.cat([input_ids[:, :prefill][:, kept], input_ids[:, prefill:]], dim=1)
        return Compressed(smaller, ids, kept, prefill)

    def generate(self, model: Any, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """``model.generate`` from the compressed cache; returns the prompt followed by the new
        tokens, as ``generate`` does. ``attention_mask``, if given, must be all ones."""
        return self._generate(model, model.generate, input_ids, **kwargs)

    def _generate(
        self, model: Any, generate: Callable[..., torch.Tensor], input_ids: torch.Tensor, **kw: Any
    ) -> torch.Tensor:
        mask = kw.pop("attention_mask", None)
        if mask is not None and not bool(torch.all(mask == 1)):
            raise ValueError("padded prompts are not supported (batch 1, attention_mask all 1)")
        done = self.compress(model, input_ids)
        ones = torch.ones_like(done.input_ids)
        kw[_cache_keyword(model)] = done.cache
        out = generate(done.input_ids, attention_mask=ones, **kw)
        return torch.cat([input_ids, out[:, done.input_ids.shape[1] :]], dim=1)

    @contextmanager
    def __call__(self, model: Any) -> Iterator[KVDropPress]:
        """Within the block, ``model.generate(input_ids, ...)`` compresses the prompt first
        (kvpress's ``with press(model):``)."""
        original = model.generate

        def generate(input_ids: torch.Tensor, **kw: Any) -> torch.Tensor:
            return self._generate(model, original, input_ids, **kw)

        model.generate = generate
        try:
            yield self
        finally:
            del model.generate  # the class's method again


def _cache_keyword(model: Any) -> str:
    """How the model's ``forward`` takes a cache: ``cache`` (transformers 5.2x) or
    ``past_key_values`` (4.x, early 5.x; deprecated later)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _cache_tensor(cache: Any, layers: int) -> torch.Tensor:
    """The cache as kvdrop's ``[2, L, T, Hkv * d]`` (from ``layers[i].keys/values``
    ``[1, Hkv, T, d]``)."""
    rows = []
    for layer in range(layers):
        entry = cache.layers[layer]
        pair = []
        for t in (entry.keys, entry.values):
            _, hkv, n, d = t.shape
            pair.append(t[0].transpose(0, 1).reshape(n, hkv * d))
        rows.append(torch.stack(pair))
    return torch.stack(rows, dim=1)


def _heads(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """``[k, Hkv * d]`` back to the cache's ``[1, Hkv, k, d]``."""
    k = rows.shape[0]
    return rows.reshape(k, heads, -1).transpose(0, 1).unsqueeze(0).contiguous()
