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
from kvdrop.spec import describe, get
from kvdrop_rope import RopeConfig, apply_rope
from kvdrop_sdk import CacheKind
from kvdrop_sdk.edit import EditContext
from kvdrop_sdk.query_capture import needs_of

__all__ = ["Compressed", "KVDropPress", "Prefilled", "hf_reconstruction_prompt"]


@dataclass(frozen=True)
class Compressed:
    """A prompt after compression: the smaller ``cache`` (k entries), the ids to hand
    ``generate`` (the kept prompt ids, then the tail that was not prefilled), and the kept
    indices into the prefilled prompt; ``token_scores`` ``[L, Hkv, T]`` are KVzip's
    reconstruction scores when the policy read them."""

    cache: Any
    input_ids: torch.Tensor
    kept: list[int]
    prefilled: int
    token_scores: torch.Tensor | None = None


def _config_dict(model: Any) -> dict[str, Any]:
    """The model's ``config.json`` as a dict (what RoPE and the head count are read from)."""
    return dict(model.config.to_dict())


@dataclass(frozen=True)
class Prefilled:
    """A prompt after :meth:`KVDropPress.prefill`, before selection: the whole ``input_ids``,
    how many were prefilled, their KV ``[2, L, T, Hkv*d]`` and post-RoPE queries
    ``[1, L, T, Hq*d]``, the model's RoPE, and KVzip's scores ``[L, Hkv, T]`` if computed."""

    input_ids: torch.Tensor
    prefilled: int
    kv: torch.Tensor
    queries: torch.Tensor
    rope: RopeConfig
    token_scores: torch.Tensor | None = None


class _QueryCapture:
    """Forward hooks that keep each layer's post-RoPE queries ``[T, Hq * d]`` of one forward
    whose first token sits at position ``offset``."""

    def __init__(self, model: Any, rope: RopeConfig, num_heads: int) -> None:
        self.rope, self.num_heads, self.offset = rope, num_heads, 0
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
            positions = torch.arange(q.shape[0], device=q.device) + self.offset
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
    A policy given by name gets ``chunk_size=1`` unless told otherwise: a dense cache has no
    store chunks, so ``keep_ratio`` is kept to the token.

    Policies that read token scores (``kvzip``) get them from KVzip's reconstruction pass run
    here with the model itself; its prompt is in the model's tokens, so pass ``tokenizer`` (the
    model's Hugging Face tokenizer) or a ready ``reconstruction`` prompt
    (:class:`kvdrop_engine.reconstruct.ReconstructionPrompt`).
    """

    def __init__(
        self,
        policy: str | Policy,
        *,
        tail: int = 1,
        rerotate: bool = True,
        tokenizer: Any = None,
        reconstruction: Any = None,
        **params: Any,
    ) -> None:
        if not isinstance(tail, int) or isinstance(tail, bool) or tail < 1:
            raise ValueError(f"tail must be an int >= 1, got {tail!r}")
        if isinstance(policy, str):
            policy = get(policy, **_dense_defaults(policy, params))
        elif params:
            raise TypeError("parameters go with a policy name, not with a built policy")
        if not isinstance(policy, Policy):
            raise TypeError(f"policy must be a name or a kvdrop.Policy, got {type(policy)}")
        self.policy, self.tail, self.rerotate = policy, tail, rerotate
        self.needs = needs_of(policy)
        if reconstruction is None and tokenizer is not None:
            reconstruction = hf_reconstruction_prompt(tokenizer)
        if self.needs.token_scores and reconstruction is None:
            raise ValueError(
                f"{policy.name} reads KVzip's reconstruction scores, computed here with the model "
                "from a prompt in its tokens: pass KVDropPress(..., tokenizer=<the model's "
                "Hugging Face tokenizer>) or reconstruction=ReconstructionPrompt(...)"
            )
        self.reconstruction = reconstruction

    def compress(self, model: Any, input_ids: torch.Tensor) -> Compressed:
        """Prefill ``input_ids [1, N]`` (but the tail), select, and return the smaller cache."""
        return self.select(model, self.prefill(model, input_ids))

    def prefill(self, model: Any, input_ids: torch.Tensor) -> Prefilled:
        """Step 1 of :meth:`compress`: the prefill of ``input_ids [1, N]`` but the tail, with
        every layer's queries and (when this press's policy reads them) KVzip's scores. Several
        presses of the same ``tail`` may :meth:`select` from one prefill (a press reading token
        scores needs one made by a press that reads them too)."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"input_ids must be [1, N] (batch 1), got {tuple(input_ids.shape)}")
        total = input_ids.shape[1]
        prefill = total - self.tail
        if prefill < 1:
            raise ValueError(f"the prompt ({total} tokens) must be longer than tail={self.tail}")
        config = _config_dict(model)
        rope = RopeConfig.from_hf_config(config)
        cache = _empty_cache(model, prefill, self.needs.token_scores)
        tokens = input_ids[0, :prefill].tolist()
        capture = _QueryCapture(model, rope, int(config["num_attention_heads"]))
        try:
            with torch.no_grad():
                model(input_ids[:, :prefill], **{_cache_keyword(model): cache}, use_cache=True)
                kv = _cache_tensor(cache)
                queries = capture.tensor(kv.shape[1])
                scores = None
                if self.needs.token_scores:
                    scores = _reconstruction_scores(
                        model, cache, tokens, self.reconstruction, capture
                    )
        finally:
            capture.close()
        return Prefilled(input_ids, prefill, kv, queries, rope, scores)

    def select(self, model: Any, prefilled: Prefilled) -> Compressed:
        """Step 2 of :meth:`compress`: this press's policy keeps its tokens of ``prefilled``
        and the smaller cache is built from the kept rows (re-rotated unless ``rerotate``)."""
        if prefilled.input_ids.shape[1] - prefilled.prefilled != self.tail:
            raise ValueError(
                f"this press has tail={self.tail}; the prefill left "
                f"{prefilled.input_ids.shape[1] - prefilled.prefilled} tokens"
            )
        if self.needs.token_scores and prefilled.token_scores is None:
            raise ValueError(f"{self.policy.name} reads token scores; the prefill has none")
        kv, rope, prefill = prefilled.kv, prefilled.rope, prefilled.prefilled
        tensors = {CacheKind.KV: kv}
        if self.needs.reads_queries:
            tensors[CacheKind.QUERY] = prefilled.queries
        tokens = prefilled.input_ids[0, :prefill].tolist()
        context = EditContext(
            positions=torch.arange(prefill),
            rope=rope.to_json() if self.rerotate else None,
            prompt_tokens=prefill,
            head_dim=rope.head_dim,
            token_scores=prefilled.token_scores,
        )
        selected, index = self.policy.select_indices(tensors, tokens, context=context)
        kept_kv, _ = self.policy.keep(selected, tokens, index, context=context)
        smaller = _empty_cache(model, len(index))
        heads = kv.shape[3] // rope.head_dim
        for layer in range(kv.shape[1]):
            keys, values = (_heads(kept_kv[i, layer], heads) for i in (0, 1))
            smaller.update(keys, values, layer)
        kept = index.tolist()
        input_ids = prefilled.input_ids
        ids = torch.cat([input_ids[:, :prefill][:, kept], input_ids[:, prefill:]], dim=1)
        return Compressed(smaller, ids, kept, prefill, prefilled.token_scores)

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
        (kvpress's ``with press(model):``). Presses do not nest (one selection per prompt:
        compose policies with a spec such as ``"streaming+snapkv"`` instead); on exit the model
        gets back exactly the ``generate`` it had (its class's, or a wrapper of the user's)."""
        current = model.generate
        if getattr(current, _PRESS_MARK, None) is not None:
            raise RuntimeError(
                f"a KVDropPress ({getattr(current, _PRESS_MARK).policy.name}) is already active "
                "on this model; presses do not nest: exit its block first, or compose the "
                "policies in one spec ('a+b')"
            )
        own = vars(model).get("generate", _ABSENT)

        def generate(input_ids: torch.Tensor, **kw: Any) -> torch.Tensor:
            return self._generate(model, current, input_ids, **kw)

        setattr(generate, _PRESS_MARK, self)
        model.generate = generate
        try:
            yield self
        finally:
            if own is _ABSENT:
                vars(model).pop("generate", None)  # the class's method again
            else:
                model.generate = own  # the user's own wrapper, as it was


#: Marks the ``generate`` a press installed (to refuse nesting), and "no instance attribute".
_PRESS_MARK = "__kvdrop_press__"
_ABSENT = object()


def _dense_defaults(spec: str, params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with ``chunk_size=1`` added where the policy takes one and none was given (a
    dense cache has no store chunks to align the budget to)."""
    if "chunk_size" in params:
        return params
    names = {p.name for p in describe(spec).params}
    return {**params, "chunk_size": 1} if "chunk_size" in names else params


def hf_reconstruction_prompt(tokenizer: Any, **options: Any) -> Any:
    """KVzip's reconstruction prompt (the engine's,
    :meth:`kvdrop_engine.reconstruct.ReconstructionPrompt.from_tokenizer`) in a Hugging Face
    tokenizer's ids: no special tokens added, the chat template's assistant opening as suffix."""
    from kvdrop_engine.reconstruct import ReconstructionPrompt

    return ReconstructionPrompt.from_tokenizer(_HFTokenizer(tokenizer), **options)


class _HFTokenizer:
    """A Hugging Face tokenizer behind the two calls ``ReconstructionPrompt.from_tokenizer``
    makes of the engine's tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.chat_template = getattr(tokenizer, "chat_template", None)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_bos))

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        return str(
            self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        )


def _reconstruction_scores(
    model: Any, cache: Any, context: list[int], prompt: Any, capture: _QueryCapture
) -> torch.Tensor:
    """KVzip's scores ``[L, Hkv, N]`` of the ``N`` cached tokens: each chunk's reconstruction
    input is teacher-forced after the cache (set back to the prefix after each chunk) and scored
    by the engine's rule (:func:`kvdrop_engine.reconstruct.chunk_scores`)."""
    from kvdrop_engine.reconstruct import chunk_scores

    cached = cache.get_seq_length()
    layers = len(cache.layers)
    heads = capture.num_heads
    device = cache.layers[0].keys.device
    scores = torch.zeros(layers, cache.layers[0].keys.shape[1], len(context), device=device)
    extra = {"logits_to_keep": 1} if "logits_to_keep" in _forward_params(model) else {}
    saved = [(layer.keys, layer.values) for layer in cache.layers]
    for start, end in prompt.chunks(len(context)):
        ids = prompt.input_ids(context, start, end)
        capture.offset = cached
        model(
            torch.tensor([ids], device=device),
            **{_cache_keyword(model): cache},
            use_cache=True,
            **extra,
        )
        for layer in range(layers):
            q = capture.rows[layer].view(len(ids), heads, -1)
            keys = cache.layers[layer].keys[0]  # [Hkv, S + M, d]
            scores[layer, :, start:end] = chunk_scores(q, keys, start, end, prompt.n_sink)
        for layer, (keys, values) in zip(cache.layers, saved, strict=True):
            layer.keys, layer.values = keys, values  # the prefix again (update concatenated)
    capture.offset = 0
    scores[:, :, : prompt.n_sink] = 1.0
    return scores


def _cache_keyword(model: Any) -> str:
    """How the model's ``forward`` takes a cache: ``cache`` (transformers 5.2x) or
    ``past_key_values`` (4.x, early 5.x; deprecated later)."""
    return "cache" if "cache" in _forward_params(model) else "past_key_values"


def _forward_params(model: Any) -> Any:
    return inspect.signature(model.forward).parameters


def _empty_cache(model: Any, tokens: int, extra: bool = False) -> Any:
    """A ``DynamicCache`` for the model that will hold ``tokens`` tokens. Sliding-window layers
    (Mistral, Gemma, Qwen's mixed layers) are fine while those tokens fit their window (each
    layer then holds every token, so one kept list suits all); anything else is refused in one
    line, as is a pass that runs past the window (``extra``: KVzip's reconstruction)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    for index, layer in enumerate(cache.layers):
        kind = type(layer).__name__
        if kind == "DynamicLayer":
            continue
        if kind != "DynamicSlidingWindowLayer":
            raise PolicyInputError(
                f"KVDropPress: layer {index} is a {kind}; only dense full-attention and "
                "sliding-window caches (DynamicCache) are supported"
            )
        window = layer.sliding_window
        if tokens >= window:
            raise PolicyInputError(
                f"KVDropPress: layer {index} has a sliding window of {window} tokens and the "
                f"prompt prefills {tokens}: the window drops tokens, so no one kept list holds "
                "for every layer (use prompts shorter than the window)"
            )
        if extra:
            raise PolicyInputError(
                f"KVDropPress: layer {index} has a sliding window of {window} tokens; KVzip's "
                "reconstruction pass runs past it (use a full-attention model for kvzip)"
            )
    return cache


def _cache_tensor(cache: Any) -> torch.Tensor:
    """The cache as kvdrop's ``[2, L, T, Hkv * d]`` (from ``layers[i].keys/values``
    ``[1, Hkv, T, d]``); refuses layers of different shapes in one line."""
    shapes = {tuple(entry.keys.shape) for entry in cache.layers}
    if len(shapes) != 1:
        raise PolicyInputError(
            f"KVDropPress needs every layer's cache alike ([1, Hkv, T, d]); this model's layers "
            f"hold {sorted(shapes)} (mixed layers are not supported)"
        )
    rows = []
    for entry in cache.layers:
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
