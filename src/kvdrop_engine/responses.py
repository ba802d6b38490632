"""The OpenAI completions and chat responses, built from the engine's ``TokenEvent``s.

A :class:`Choice` turns one choice's events into text the way vLLM does: its own incremental
detokenizer (special tokens left out with ``skip_special_tokens``, the default), the text of the
token that stopped generation (EOS, a stop token id) left out, ``stop`` strings cut off (the text
that could still begin one is held back while streaming), and each token's logprob and top
alternatives. :class:`CompletionBuilder` (and :class:`ChatCompletionBuilder`) hold the ``n``
choices of a request and write streamed chunks or one JSON body; with
``return_tokens_as_token_ids`` the logprobs tokens are token-id text (the form
``kvdrop_sdk.adapters.openai`` reads back).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvdrop_engine.completions import (
    CompletionRequest,
    Settings,
    parse_detokenize_request,
    parse_tokenize_request,
)
from kvdrop_engine.sampling import PromptScores
from kvdrop_engine.tokenizer import IncrementalDetokenizer, SpecialTokens, TextTokenizer
from kvdrop_engine.tools import parse_tool_calls
from kvdrop_sdk.adapters.openai import token_id_text
from kvdrop_sdk.events import TokenEvent

__all__ = [
    "ChatCompletionBuilder",
    "Choice",
    "CompletionBuilder",
    "Piece",
    "detokenize_body",
    "error_body",
    "models_body",
    "tokenize_body",
]


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """The OpenAI-style error object for ``status``."""
    kind = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowed"}.get(
        status, "InternalServerError" if status >= 500 else "InvalidRequestError"
    )
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def model_card(model_name: str, created: int, max_model_len: int | None) -> dict[str, Any]:
    """The served model as ``GET /v1/models/{id}`` answers it (OpenAI's model object, with
    vLLM's ``root`` and ``max_model_len``)."""
    card: dict[str, Any] = {
        "id": model_name,
        "object": "model",
        "created": created,
        "owned_by": "kvdrop",
        "root": model_name,
    }
    if max_model_len is not None:
        card["max_model_len"] = max_model_len
    return card


def models_body(model_name: str, created: int, max_model_len: int | None) -> dict[str, Any]:
    """Body of ``GET /v1/models`` for a server of one model."""
    return {"object": "list", "data": [model_card(model_name, created, max_model_len)]}


def tokenize_body(body: Any, settings: Settings) -> dict[str, Any]:
    """The answer to vLLM's ``POST /tokenize`` (each token's text too when asked and there is a
    tokenizer); ``BadRequestError`` for a bad request."""
    ids, with_strs = parse_tokenize_request(body, settings)
    tokenizer = settings.tokenizer
    strs = None
    if with_strs and tokenizer is not None:
        strs = [tokenizer.decode([t]) for t in ids]
    return {
        "count": len(ids),
        "max_model_len": settings.max_model_len,
        "tokens": ids,
        "token_strs": strs,
    }


def detokenize_body(body: Any, settings: Settings) -> dict[str, Any]:
    """The answer to vLLM's ``POST /detokenize``; ``BadRequestError`` for a bad request."""
    ids = parse_detokenize_request(body, settings)
    assert settings.tokenizer is not None  # the parser refuses a server without one
    return {"prompt": settings.tokenizer.decode(ids)}


@dataclass(frozen=True)
class Piece:
    """What one token adds to a choice: the text released with it (empty while it may still
    begin a stop string), its logprobs token and where that starts, its logprob and top
    alternatives, and the finish (and stop) reason if it is the last."""

    text: str
    token: str | None
    offset: int
    finish: str | None
    token_id: int = -1
    logprob: float | None = None
    top: tuple[tuple[str, float], ...] = ()
    stop_reason: str | int | None = None


class Choice:
    """One choice of a request: its pieces, text and finish, from its events in order."""

    def __init__(
        self,
        request: CompletionRequest,
        index: int,
        tokenizer: TextTokenizer | None,
        detokenize: bool,
    ) -> None:
        self.request = request
        self.index = index
        self.tokenizer = tokenizer
        skip = frozenset()
        if request.skip_special_tokens and isinstance(tokenizer, SpecialTokens):
            skip = tokenizer.special_token_ids
        self._detok = (
            IncrementalDetokenizer(tokenizer, skip)
            if detokenize and tokenizer is not None
            else None
        )
        self._hold = max((len(s) for s in request.stop), default=1) - 1
        self._pending = ""
        #: Where the next token's text starts in the choice's text: counted from the tokens'
        #: own text, so text held back (a stop string may begin in it) shifts no offset.
        self._offset = 0
        self.pieces: list[Piece] = []
        self.text = ""
        #: The echoed prompt (``echo``): it begins the text, and the first piece carries it.
        self.prefix = ""
        #: Prompt tokens the engine's cache kept after its drop policy's cut (None: no cut).
        self.kept_prompt_tokens: int | None = None

    @property
    def count(self) -> int:
        """Tokens added so far."""
        return len(self.pieces)

    @property
    def finish(self) -> str | None:
        """The finish reason (None while generating)."""
        return self.pieces[-1].finish if self.pieces else None

    def add(self, event: TokenEvent) -> Piece:
        """Account one generated token. Its finish reason is the engine's, "stop" when a stop
        string appeared, or "length" once ``max_tokens`` tokens arrived."""
        req = self.request
        if event.kept_prompt_tokens is not None:
            self.kept_prompt_tokens = event.kept_prompt_tokens
        finish = event.finish_reason
        if finish is None and self.count + 1 >= req.max_tokens:
            finish = "length"
        stopped_by_token = finish == "stop" and not req.include_stop_str
        delta = self._token_text(event, final=finish is not None, drop=stopped_by_token)
        text, stop = self._release(delta, final=finish is not None)
        if self.prefix and not self.pieces:
            text = self.prefix + text
        stop_reason: str | int | None = stop
        if stop is not None:
            finish = "stop"
        elif finish == "stop" and event.token_id in req.params.stop_set:
            stop_reason = event.token_id
        token, top = self._logprob_tokens(event)
        offset = self._offset + (len(self.prefix) if not self.pieces else 0)
        piece = Piece(text, token, offset, finish, event.token_id, event.logprob, top, stop_reason)
        self._offset = offset + len(delta)
        self.text += text
        self.pieces.append(piece)
        return piece

    def _token_text(self, event: TokenEvent, *, final: bool, drop: bool) -> str:
        """The text ``event`` adds (none for the token that stopped generation, as in vLLM)."""
        if self._detok is None:
            return "" if drop else event.text
        return self._detok.flush() if drop else self._detok.add(event.token_id, final=final)

    def _release(self, delta: str, *, final: bool) -> tuple[str, str | None]:
        """Text safe to send now, and the stop string that ended the choice (if one did)."""
        self._pending += delta
        stops = self.request.stop if self.count + 1 >= self.request.min_tokens else ()
        hits = [(i, s) for s in stops if (i := self._pending.find(s)) >= 0]
        if hits:
            at, stop = min(hits)
            end = at + len(stop) if self.request.include_stop_str else at
            out, self._pending = self._pending[:end], ""
            return out, stop
        cut = len(self._pending) if final else max(len(self._pending) - self._hold, 0)
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out, None

    def _name(self, token_id: int, fallback: str) -> str:
        if self.request.tokens_as_token_ids:
            return token_id_text(token_id)
        if self.tokenizer is not None:
            return self.tokenizer.decode([token_id])
        return fallback

    def _logprob_tokens(
        self, event: TokenEvent
    ) -> tuple[str | None, tuple[tuple[str, float], ...]]:
        if self.request.logprobs is None:
            return None, ()
        top = tuple((self._name(t, ""), lp) for t, lp in event.top_logprobs)
        return self._name(event.token_id, event.text), top


@dataclass
class CompletionBuilder:
    """Builds the ``text_completion`` response to one request (its ``n`` choices).

    Feed every event to :meth:`add` with its choice's index; stream each returned piece with
    :meth:`chunk`, or build the whole body with :meth:`body` at the end. ``detokenize`` computes
    each token's text with ``tokenizer`` instead of trusting ``TokenEvent.text``.
    """

    request: CompletionRequest
    model_name: str
    tokenizer: TextTokenizer | None = None
    detokenize: bool = False
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    #: Each prompt's scored tokens (``prompt_logprobs`` or ``echo`` with ``logprobs``), set by
    #: the server before the first chunk; None where nothing was scored.
    scored: list[PromptScores] | None = None

    def __post_init__(self) -> None:
        req = self.request
        self.choices = [
            Choice(req, i, self.tokenizer, self.detokenize) for i in range(req.num_choices)
        ]
        if req.echo and self.tokenizer is not None:
            for choice in self.choices:
                text = req.prompt_texts[choice.index // req.n] if req.prompt_texts else None
                prompt = req.prompt_of(choice.index)
                choice.prefix = self.tokenizer.decode(prompt) if text is None else text

    def _token_name(self, token_id: int) -> str:
        if self.request.tokens_as_token_ids:
            return token_id_text(token_id)
        return "" if self.tokenizer is None else self.tokenizer.decode([token_id])

    def _prompt_logprobs(self, index: int) -> list[dict[str, Any] | None] | None:
        """vLLM's ``prompt_logprobs`` of choice ``index``'s prompt: None for the first token,
        then ``{token id: {"logprob", "rank", "decoded_token"}}`` (the prompt's token first)."""
        if self.scored is None or self.request.prompt_logprobs is None:
            return None
        scores = self.scored[index // self.request.n]
        top = self.request.prompt_logprobs
        out: list[dict[str, Any] | None] = [None]
        for token, (logprob, rank), alts in scores:
            entry = {str(token): _ranked(logprob, rank, self._token_name(token))}
            for r, (alt, lp) in enumerate(alts[:top], start=1):
                entry.setdefault(str(alt), _ranked(lp, r, self._token_name(alt)))
            out.append(entry)
        return out

    def _echo_logprobs(self, choice: Choice) -> dict[str, Any]:
        """The echoed prompt's part of completions ``logprobs`` (first token: no logprob)."""
        prompt = self.request.prompt_of(choice.index)
        assert self.scored is not None
        scores = self.scored[choice.index // self.request.n]
        names = [self._token_name(t) for t in prompt]
        offsets = [sum(len(x) for x in names[:i]) for i in range(len(names))]
        top = self.request.logprobs or 0
        logprobs: list[float | None] = [None] + [lp for _, (lp, _), _ in scores]
        tops: list[dict[str, float | None] | None] = [None] + [
            {names[i + 1]: lp, **{self._token_name(a): v for a, v in alts[:top]}}
            for i, (_, (lp, _), alts) in enumerate(scores)
        ]
        return {
            "text_offset": offsets,
            "token_logprobs": logprobs,
            "tokens": names,
            "top_logprobs": tops,
        }

    @property
    def count(self) -> int:
        """Tokens added so far, over every choice."""
        return sum(c.count for c in self.choices)

    @property
    def finish(self) -> str | None:
        """The first choice's finish reason (None while it generates)."""
        return self.choices[0].finish

    @property
    def pieces(self) -> list[Piece]:
        """The first choice's pieces."""
        return self.choices[0].pieces

    def add(self, event: TokenEvent, index: int = 0) -> Piece:
        """Account one generated token of choice ``index``."""
        return self.choices[index].add(event)

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model_name}

    def _logprobs(self, pieces: list[Piece]) -> dict[str, Any] | None:
        if self.request.logprobs is None:
            return None
        return {
            "text_offset": [p.offset for p in pieces],
            "token_logprobs": [p.logprob for p in pieces],
            "tokens": [p.token for p in pieces],
            "top_logprobs": [_top_dict(p) for p in pieces],
        }

    def preamble(self) -> list[dict[str, Any]]:
        """Chunks streamed before the first token (none for completions)."""
        return []

    def chunk(
        self, piece: Piece | None = None, *, finish: str | None = None, index: int = 0
    ) -> dict[str, Any]:
        """One streamed chunk of choice ``index``: ``piece``'s text and logprobs, or an empty
        one ending with ``finish`` (an engine that stopped without a reason). A choice's first
        chunk carries what concerns its prompt, as vLLM's: ``prompt_logprobs``, and with
        ``echo`` the prompt's logprobs before the token's."""
        logprobs = None if piece is None else self._logprobs([piece])
        pieces = self.choices[index].pieces
        first = piece is not None and bool(pieces) and pieces[0] is piece
        choice: dict[str, Any] = {
            "index": index,
            "text": "" if piece is None else piece.text,
            "logprobs": logprobs,
            "finish_reason": finish if piece is None else piece.finish,
            "stop_reason": None if piece is None else piece.stop_reason,
        }
        if first and logprobs is not None and self.request.echo and self.scored is not None:
            echoed = self._echo_logprobs(self.choices[index])
            choice["logprobs"] = {k: echoed[k] + logprobs[k] for k in logprobs}
        if first and self.request.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._prompt_logprobs(index)
        return {**self._head("text_completion"), "choices": [choice]}

    def usage(self) -> dict[str, int]:
        """Prompt (each prompt once), completion (all choices) and total token counts;
        ``kept_prompt_tokens`` when the engine drops while serving: the prompt tokens the cache
        kept, summed over every prompt once as ``prompt_tokens`` is (each prompt's first choice:
        its ``n`` choices cut the same prompt alike; ``/metrics`` counts every choice)."""
        n_prompt = sum(len(p) for p in self.request.prompts)
        usage = {
            "prompt_tokens": n_prompt,
            "completion_tokens": self.count,
            "total_tokens": n_prompt + self.count,
        }
        n = self.request.n
        kept = [self.choices[p * n].kept_prompt_tokens for p in range(len(self.request.prompts))]
        if any(k is not None for k in kept):
            prompts = self.request.prompts  # a prompt not cut kept all its tokens
            usage["kept_prompt_tokens"] = sum(
                len(p) if k is None else k for p, k in zip(prompts, kept, strict=True)
            )
        return usage

    def usage_chunk(self) -> dict[str, Any]:
        """The last streamed chunk of ``stream_options.include_usage``: no choices, the usage."""
        return {**self.chunk(), "choices": [], "usage": self.usage()}

    def _choice_body(self, choice: Choice) -> dict[str, Any]:
        last = choice.pieces[-1] if choice.pieces else None
        logprobs = self._logprobs(choice.pieces)
        if logprobs is not None and self.request.echo and self.scored is not None:
            echoed = self._echo_logprobs(choice)
            logprobs = {k: echoed[k] + logprobs[k] for k in logprobs}
        body = {
            "index": choice.index,
            "text": choice.text,
            "logprobs": logprobs,
            "finish_reason": choice.finish or "stop",
            "stop_reason": None if last is None else last.stop_reason,
        }
        if self.request.prompt_logprobs is not None:
            body["prompt_logprobs"] = self._prompt_logprobs(choice.index)
        return body

    def body(self) -> dict[str, Any]:
        """The non-streaming response (finish reason "stop" when the engine gave none)."""
        choices = [self._choice_body(c) for c in self.choices]
        return {**self._head("text_completion"), "choices": choices, "usage": self.usage()}


def _ranked(logprob: float, rank: int, decoded: str) -> dict[str, Any]:
    return {"logprob": logprob, "rank": rank, "decoded_token": decoded}


def _top_dict(piece: Piece) -> dict[str, float | None]:
    """vLLM's ``top_logprobs`` entry: the sampled token and the alternatives, token -> logprob."""
    return {piece.token or "": piece.logprob, **dict(piece.top)}


def _chat_logprob(token: str, logprob: float | None) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


@dataclass
class ChatCompletionBuilder(CompletionBuilder):
    """Builds a ``/v1/chat/completions`` response (``chat.completion`` or its chunks);
    ``logprobs.content`` lists every sampled token, with ``top_logprobs`` alternatives."""

    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")

    def _logprobs(self, pieces: list[Piece]) -> dict[str, Any] | None:
        if self.request.logprobs is None:
            return None
        content = [
            {
                **_chat_logprob(p.token or "", p.logprob),
                "top_logprobs": [_chat_logprob(t, lp) for t, lp in p.top],
            }
            for p in pieces
        ]
        return {"content": content}

    def preamble(self) -> list[dict[str, Any]]:
        """The first chunk of each choice: the assistant role, no content yet (as OpenAI)."""
        return [
            {
                **self._head("chat.completion.chunk"),
                "choices": [
                    {
                        "index": c.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
            for c in self.choices
        ]

    def chunk(
        self, piece: Piece | None = None, *, finish: str | None = None, index: int = 0
    ) -> dict[str, Any]:
        """One streamed ``chat.completion.chunk`` of choice ``index``: ``piece``'s content delta
        and logprobs, or an empty delta ending with ``finish``. With tools the text is held
        until the choice ends, then sent as its content or its ``tool_calls``."""
        delta: dict[str, Any] = {} if piece is None else {"content": piece.text}
        ends = finish if piece is None else piece.finish
        if self.request.tools is not None:
            delta, ends = self._tool_delta(index, ends)
        choice: dict[str, Any] = {
            "index": index,
            "delta": delta,
            "logprobs": None if piece is None else self._logprobs([piece]),
            "finish_reason": ends,
            "stop_reason": None if piece is None else piece.stop_reason,
        }
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def _tool_delta(self, index: int, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """A tool-using choice's delta: nothing until it ends, then its content or calls."""
        if finish is None:
            return {}, None
        message, finish = self._message(self.choices[index], finish)
        delta = {k: v for k, v in message.items() if k != "role" and v is not None}
        if "tool_calls" in delta:
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(delta["tool_calls"])]
        return delta, finish

    def _message(self, choice: Choice, finish: str) -> tuple[dict[str, Any], str]:
        """The assistant message of ``choice`` and its finish reason: with tools, the calls
        its text holds (:func:`kvdrop_engine.tools.parse_tool_calls`)."""
        tools = self.request.tools
        if tools is None:
            return {"role": "assistant", "content": choice.text}, finish
        content, calls = parse_tool_calls(tools, choice.text)
        if not calls:
            return {"role": "assistant", "content": choice.text}, finish
        message = {"role": "assistant", "content": content}
        message["tool_calls"] = [c.to_dict() for c in calls]
        return message, tools.finish if finish == "stop" else finish

    def usage_chunk(self) -> dict[str, Any]:
        """The last streamed chunk of ``stream_options.include_usage``: no choices, the usage."""
        return {**self._head("chat.completion.chunk"), "choices": [], "usage": self.usage()}

    def _choice_body(self, choice: Choice) -> dict[str, Any]:
        last = choice.pieces[-1] if choice.pieces else None
        message, finish = self._message(choice, choice.finish or "stop")
        return {
            "index": choice.index,
            "message": message,
            "logprobs": self._logprobs(choice.pieces),
            "finish_reason": finish,
            "stop_reason": None if last is None else last.stop_reason,
        }

    def body(self) -> dict[str, Any]:
        """The non-streaming ``chat.completion`` (finish reason "stop" when the engine gave
        none; ``prompt_logprobs`` beside the choices, as in vLLM)."""
        choices = [self._choice_body(c) for c in self.choices]
        body = {**self._head("chat.completion"), "choices": choices, "usage": self.usage()}
        if self.request.prompt_logprobs is not None:
            body["prompt_logprobs"] = self._prompt_logprobs(0)
        return body
