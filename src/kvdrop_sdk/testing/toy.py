"""A tiny deterministic in-process engine (a ``PostCompletion``) for tests, docs and demos.

It behaves like a real engine towards the kvdrop server without any model:

* Every KV (and query) row is computed from ``(token id, position)`` alone, so anyone can say
  what a cached row must contain. Channel ``d`` of a row holds, by ``d % 4``: the token id, the
  position the row was computed at, ``4 * layer + plane`` (plane 0 = K, 1 = V, 2 = query) and a
  small mix of the three. Rows keep their original positions when an edit drops tokens, exactly
  like post-RoPE keys do, so ``positions_of(kv)`` tells which original rows an edit kept.
* On each call it retrieves the longest cached chunk-aligned prefix of the prompt, checks every
  element against the formula for those tokens (``ToyEngineError`` on any mismatch), "computes"
  the rest at positions ``T0 .. n-1`` (the positions a real engine gives the tokens it sees, so
  after a drop they may repeat positions of kept rows) and stores the prompt's whole chunks (KV,
  and queries when it has a query context). It never stores the generated tokens' KV.
* Generated tokens are a deterministic function of the previous token and its position; the
  last event has ``finish_reason="length"``, or ``"stop"`` when a token is in
  ``sampling_params["stop_token_ids"]`` or equals the engine's ``eos_token_id``.

Every call is recorded in ``calls`` (prompt, reused positions, output) and the engine counts how
many calls run at once (``max_active``), for tests. Float32/float64 layouts only: the formula's
integers must be exact.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvdrop_sdk.cache_kind import CacheKind
from kvdrop_sdk.events import TokenEvent
from kvdrop_sdk.validate import token_ids

if TYPE_CHECKING:
    from kvdrop_sdk.context import Context
    from kvdrop_sdk.layout import CacheLayout

__all__ = ["ToyCall", "ToyEngine", "ToyEngineError", "encode_rows", "positions_of"]

_EXACT_DTYPES = (torch.float32, torch.float64)
_MAX_EXACT = 2**24  # float32 integers are exact below this


class ToyEngineError(RuntimeError):
    """The toy engine found cached rows that do not match its formula, or was misconfigured."""


def encode_rows(
    kind: CacheKind,
    tokens: Sequence[int],
    positions: Sequence[int],
    layout: CacheLayout,
) -> torch.Tensor:
    """The tensor ``[2|1, L, T, width]`` the toy engine computes for ``tokens`` at ``positions``."""
    if len(tokens) != len(positions):
        raise ToyEngineError(f"{len(tokens)} tokens but {len(positions)} positions")
    lead, layers, t, width = layout.shape(kind, len(tokens))
    tok = torch.tensor(list(tokens), dtype=torch.float64).view(1, 1, t, 1)
    pos = torch.tensor(list(positions), dtype=torch.float64).view(1, 1, t, 1)
    plane = torch.arange(lead, dtype=torch.float64).view(lead, 1, 1, 1)
    if kind is CacheKind.QUERY:
        plane = plane + 2
    layer = torch.arange(layers, dtype=torch.float64).view(1, layers, 1, 1)
    d = torch.arange(width, dtype=torch.float64).view(1, 1, 1, width)
    tag = 4 * layer + plane
    mix = torch.remainder(tok * 7 + pos * 13 + tag * 3 + d, 251)
    channel = torch.remainder(d, 4)
    out = torch.where(
        channel == 0,
        tok,
        torch.where(channel == 1, pos, torch.where(channel == 2, tag, mix)),
    )
    return out.expand(lead, layers, t, width).to(layout.dtype).contiguous()


def positions_of(tensor: torch.Tensor) -> list[int]:
    """The positions stored in toy rows (channel 1 of plane 0, layer 0)."""
    return [int(v) for v in tensor[0, 0, :, 1].tolist()]


@dataclass
class ToyCall:
    """One engine call: what it was sent, which cached rows it reused, what it generated."""

    prompt: list[int]
    sampling_params: dict[str, Any]
    cache_salt: str
    reused_positions: list[int] = field(default_factory=list)
    stored_tokens: int = 0
    generated: list[int] = field(default_factory=list)


class ToyEngine:
    """Deterministic ``PostCompletion`` that stores and checks KV like an engine (see module)."""

    def __init__(
        self,
        kv_ctx: Context,
        q_ctx: Context | None = None,
        *,
        vocab_size: int = 32000,
        default_max_tokens: int = 16,
        eos_token_id: int | None = None,
        token_delay: float = 0.0,
    ) -> None:
        for ctx, kind in ((kv_ctx, CacheKind.KV), (q_ctx, CacheKind.QUERY)):
            if ctx is None:
                continue
            if CacheKind.parse(ctx.kind) is not kind:
                raise ToyEngineError(f"expected a {kind.value!r} context, got {ctx.kind!r}")
            if ctx.layout.dtype not in _EXACT_DTYPES:
                raise ToyEngineError(
                    f"toy engine needs a float32/float64 layout, got {ctx.layout.dtype}"
                )
            if ctx.layout.width < 4:
                raise ToyEngineError(f"toy engine needs width >= 4, got {ctx.layout.width}")
        if vocab_size < 2 or vocab_size > _MAX_EXACT:
            raise ToyEngineError(f"vocab_size must be in [2, {_MAX_EXACT}], got {vocab_size}")
        self.kv_ctx = kv_ctx
        self.q_ctx = q_ctx
        self.vocab_size = vocab_size
        self.default_max_tokens = default_max_tokens
        self.eos_token_id = eos_token_id
        self.token_delay = token_delay
        self.calls: list[ToyCall] = []
        self.active = 0
        self.max_active = 0
        self._lock = threading.Lock()

    @classmethod
    def connect(
        cls,
        url: str,
        http_url: str,
        model_name: str,
        layout: CacheLayout,
        *,
        query_layout: CacheLayout | None = None,
        timeout: float = 60.0,
        **kwargs: Any,
    ) -> ToyEngine:
        """Open the engine's own contexts, registering ``layout`` (and ``query_layout``)."""
        from kvdrop_sdk.context import connect

        kv_ctx = connect(CacheKind.KV, url, http_url, model_name, timeout, layout=layout)
        q_ctx = None
        if query_layout is not None:
            q_ctx = connect(
                CacheKind.QUERY, url, http_url, model_name, timeout, layout=query_layout
            )
        return cls(kv_ctx, q_ctx, **kwargs)

    def close(self) -> None:
        """Close the engine's contexts."""
        self.kv_ctx.close()
        if self.q_ctx is not None:
            self.q_ctx.close()

    def __enter__(self) -> ToyEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def next_token(self, prev: int, position: int) -> int:
        """The token generated after ``prev`` at ``position`` (deterministic)."""
        return (prev * 31 + position * 17 + 7) % self.vocab_size

    def __call__(
        self,
        prompt_token_ids: list[int],
        sampling_params: Mapping[str, Any],
        cache_salt: str,
    ) -> Iterator[TokenEvent]:
        """Prefill (reuse, check, store) then stream generated tokens."""
        return self._run(list(prompt_token_ids), dict(sampling_params), cache_salt)

    def _run(
        self, prompt: list[int], params: dict[str, Any], cache_salt: str
    ) -> Iterator[TokenEvent]:
        if not prompt:
            raise ToyEngineError("empty prompt")
        try:
            token_ids(prompt, "prompt_token_ids", vocab_size=self.vocab_size)
        except (TypeError, ValueError) as exc:
            raise ToyEngineError(str(exc)) from None
        call = ToyCall(prompt=list(prompt), sampling_params=dict(params), cache_salt=cache_salt)
        with self._lock:
            self.calls.append(call)
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            positions = self._prefill(prompt, cache_salt, call)
            max_tokens = int(params.get("max_tokens") or self.default_max_tokens)
            stop_ids = set(params.get("stop_token_ids") or [])
            if self.eos_token_id is not None:
                stop_ids.add(self.eos_token_id)
            prev, pos = prompt[-1], positions[-1] + 1
            for i in range(max_tokens):
                if self.token_delay:
                    time.sleep(self.token_delay)
                tok = self.next_token(prev, pos)
                call.generated.append(tok)
                reason = "stop" if tok in stop_ids else ("length" if i == max_tokens - 1 else None)
                yield TokenEvent(token_id=tok, text=f" t{tok}", finish_reason=reason)
                if reason is not None:
                    break
                prev, pos = tok, pos + 1
        finally:
            with self._lock:
                self.active -= 1

    def _prefill(self, prompt: list[int], cache_salt: str, call: ToyCall) -> list[int]:
        """Reuse and verify the cached prefix, store the prompt's whole chunks; return positions."""
        layout = self.kv_ctx.layout
        cached = self.kv_ctx.retrieve(prompt, cache_salt)
        reused = 0 if cached is None else int(cached.shape[2])
        positions: list[int] = []
        if cached is not None and reused:
            positions = positions_of(cached)
            expected = encode_rows(CacheKind.KV, prompt[:reused], positions, layout)
            if not torch.equal(cached, expected):
                bad = (cached != expected).nonzero()[0].tolist()
                raise ToyEngineError(
                    f"cached KV for this prompt does not match its tokens (first bad element "
                    f"{bad}: {cached[tuple(bad)].item()} != {expected[tuple(bad)].item()})"
                )
        call.reused_positions = list(positions)
        positions = positions + list(range(reused, len(prompt)))
        if self.token_delay:
            time.sleep(self.token_delay)
        chunk = int(self.kv_ctx.chunk_size)
        aligned = (len(prompt) // chunk) * chunk
        if aligned > reused:
            toks, pos = prompt[:aligned], positions[:aligned]
            self.kv_ctx.store(encode_rows(CacheKind.KV, toks, pos, layout), toks, cache_salt)
            if self.q_ctx is not None:
                q = encode_rows(CacheKind.QUERY, toks, pos, self.q_ctx.layout)
                self.q_ctx.store(q, toks, cache_salt)
            call.stored_tokens = aligned
        return positions
