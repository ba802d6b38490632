"""Structured outputs: a request's text held to a JSON schema, any JSON object, a regular
expression, a list of choices or an EBNF grammar, through xgrammar (vLLM's default backend).

Why xgrammar: it is maintained, vLLM's and SGLang's default, ships a CPU wheel that installs
here and on the device (and a CUDA/Triton kernel for the mask), compiles JSON schemas, regexes
and EBNF grammars against the tokenizer's vocabulary once (cached), and fills a step's token
masks for all rows in one batched C++ call: no Python loop over the vocabulary. It is an
optional extra (``pip install 'kvdrop[structured]'``); without it a request that asks for
structure is a 400 that names the extra.

A request carries its :class:`Guide` in the engine's sampling dict under ``"structured_outputs"``
(what :func:`guide_of` reads); the engine compiles it into a matcher when the request is posted
(:meth:`Grammars.matcher`, on the caller's thread), masks the logits of every guided row of a
step at once (:func:`mask_logits`) and feeds each sampled token back (:func:`accept`). Once the
grammar is complete, only the end-of-sequence token is allowed, so a guided request ends as any
other does.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from kvdrop_engine.errors import InvalidRequestError

if TYPE_CHECKING:
    import xgrammar

__all__ = [
    "GUIDE_KINDS",
    "MISSING",
    "Grammars",
    "Guide",
    "accept",
    "available",
    "guide_of",
    "mask_logits",
]

#: What a guide may hold: ``json`` (a JSON schema, as text), ``json_object`` (any JSON object),
#: ``regex``, ``choice`` (a JSON list of strings, as text), ``grammar`` (xgrammar's EBNF).
GUIDE_KINDS = ("json", "json_object", "regex", "choice", "grammar")
#: The error when xgrammar is not installed.
MISSING = "structured outputs need xgrammar: pip install 'kvdrop[structured]'"


def available() -> bool:
    """Whether xgrammar can be imported (looked up without importing it)."""
    return importlib.util.find_spec("xgrammar") is not None


@dataclass(frozen=True)
class Guide:
    """What a request's output must follow: ``kind`` (one of :data:`GUIDE_KINDS`) and its
    ``value`` as text (empty for ``json_object``)."""

    kind: str
    value: str = ""

    def to_dict(self) -> dict[str, str]:
        """The form the engine's sampling dict carries."""
        return {"kind": self.kind, "value": self.value}


def guide_of(value: Any) -> Guide:
    """The engine's ``"structured_outputs"`` entry as a :class:`Guide` (InvalidRequestError
    when it is malformed)."""
    if isinstance(value, Guide):
        return value
    if not isinstance(value, Mapping) or set(value) - {"kind", "value"}:
        raise InvalidRequestError(
            "'structured_outputs' must be {'kind': KIND, 'value': TEXT} with KIND one of "
            + ", ".join(GUIDE_KINDS)
        )
    kind, text = value.get("kind"), value.get("value", "")
    if kind not in GUIDE_KINDS or not isinstance(text, str):
        raise InvalidRequestError(
            f"'structured_outputs.kind' must be one of {', '.join(GUIDE_KINDS)} with a text "
            f"'value', got {kind!r}"
        )
    return Guide(kind, text)


_ANY_OBJECT = '{"type": "object"}'


def _choice_grammar(text: str) -> str:
    """An EBNF grammar whose only sentences are the choices (each a JSON string literal,
    which xgrammar's EBNF reads with the same escapes)."""
    choices = json.loads(text)
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


class Grammars:
    """Compiles guides against one tokenizer's vocabulary and hands out their matchers.

    ``tokenizer`` is an engine tokenizer with ``backend()`` (its ``tokenizers.Tokenizer``);
    ``vocab_size`` the model's logits width (it may exceed the tokenizer's); ``stop_token_ids``
    the ids that end a request, the only ones allowed once a grammar is complete. xgrammar's
    compiler caches what it compiled, so a schema sent again costs nothing.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        if not available():
            raise InvalidRequestError(MISSING)
        import xgrammar as xgr

        backend = tokenizer.backend()
        vocab = backend.get_vocab(with_added_tokens=True)
        encoded = [""] * vocab_size
        for token, index in vocab.items():
            if index < vocab_size:
                encoded[index] = token
        kind = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())  # as from_huggingface
        info = xgr.TokenizerInfo(
            encoded,
            kind["vocab_type"],
            vocab_size=vocab_size,
            stop_token_ids=sorted(stop_token_ids),
            add_prefix_space=kind["add_prefix_space"],
        )
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        self._batch = xgr.BatchGrammarMatcher(max_threads=2)

    def compile(self, guide: Guide) -> xgrammar.CompiledGrammar:
        """The compiled grammar of ``guide``; InvalidRequestError when it does not compile."""
        compiler = self._compiler
        try:
            # JSON without free whitespace: a small model given room for it fills max_tokens
            # with blank lines (vLLM's disable_any_whitespace); any object, extra keys allowed.
            if guide.kind == "json_object":
                return compiler.compile_json_schema(
                    _ANY_OBJECT, any_whitespace=False, strict_mode=False
                )
            if guide.kind == "json":
                return compiler.compile_json_schema(guide.value, any_whitespace=False)
            if guide.kind == "regex":
                return compiler.compile_regex(guide.value)
            if guide.kind == "choice":
                return compiler.compile_grammar(_choice_grammar(guide.value))
            return compiler.compile_grammar(guide.value)
        except (RuntimeError, ValueError, TypeError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise InvalidRequestError(f"the {guide.kind} guide does not compile: {first}") from None

    def matcher(self, guide: Guide) -> xgrammar.GrammarMatcher:
        """A fresh matcher of ``guide`` (one per request)."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(guide))

    def fill(self, matchers: Sequence[xgrammar.GrammarMatcher], bitmask: Tensor) -> None:
        """Every matcher's allowed tokens into its row of ``bitmask`` (one batched call)."""
        self._batch.batch_fill_next_token_bitmask(list(matchers), bitmask)


def mask_logits(
    logits: Tensor, rows: Sequence[tuple[int, xgrammar.GrammarMatcher]], grammars: Grammars
) -> Tensor:
    """``logits [R, V]`` with each guided row's disallowed tokens at -inf (``rows``: the row
    index and its matcher). A copy when a row is guided: the caller's tensor is left alone."""
    rows = [(r, m) for r, m in rows if not m.is_terminated()]  # ended: nothing left to mask
    if not rows:
        return logits
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(rows), grammars.vocab_size)
    grammars.fill([m for _, m in rows], bitmask)
    out = logits.float().clone()
    index = torch.tensor([r for r, _ in rows], dtype=torch.long, device=out.device)
    sub = out.index_select(0, index)
    xgr.apply_token_bitmask_inplace(sub, bitmask.to(out.device), vocab_size=grammars.vocab_size)
    out.index_copy_(0, index, sub)
    return out


def accept(matcher: xgrammar.GrammarMatcher, token_id: int) -> None:
    """Feed a sampled token to its matcher (a token the mask allowed is always accepted)."""
    if not matcher.accept_token(int(token_id)):
        raise InvalidRequestError(f"token {token_id} breaks the request's structured output")
