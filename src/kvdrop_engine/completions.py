"""The OpenAI ``/v1/completions`` and ``/v1/chat/completions`` requests and responses, apart
from any transport.

:func:`parse_completion_request` and :func:`parse_chat_request` validate a decoded JSON body into
a :class:`CompletionRequest` (raising :class:`BadRequestError` with the HTTP status and the
offending field); a chat request's messages become prompt token ids through the model's chat
template. :class:`CompletionBuilder` (and :class:`ChatCompletionBuilder`) turn the engine's
``TokenEvent``s into the response: streamed chunks or one JSON body, with the logprobs tokens
written as token-id text when the client asks for it (the form ``kvdrop_sdk.adapters.openai``
reads back). :mod:`kvdrop_engine.http` serves both.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from kvdrop_engine.tokenizer import IncrementalDetokenizer, TextTokenizer
from kvdrop_sdk.adapters.openai import token_id_text
from kvdrop_sdk.events import TokenEvent
from kvdrop_sdk.validate import is_int, is_number, token_ids

__all__ = [
    "CHARS_PER_TOKEN_BOUND",
    "DEFAULT_MAX_PROMPT_CHARS",
    "DEFAULT_MAX_TOKENS",
    "BadRequestError",
    "ChatCompletionBuilder",
    "ChatTemplater",
    "CompletionBuilder",
    "CompletionRequest",
    "error_body",
    "max_prompt_chars_for",
    "models_body",
    "parse_chat_request",
    "parse_completion_request",
]

#: Request fields that are understood (others are rejected so a typo does not pass silently).
_KNOWN_FIELDS = frozenset(
    {
        "model",
        "prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "ignore_eos",
        "stop",
        "stop_token_ids",
        "stream",
        "stream_options",
        "logprobs",
        "echo",
        "n",
        "best_of",
        "user",
        "presence_penalty",
        "frequency_penalty",
        "cache_salt",
        "return_tokens_as_token_ids",
    }
)

#: What a chat request may hold besides the sampling fields both routes share.
_CHAT_FIELDS = (_KNOWN_FIELDS - {"prompt", "logprobs", "echo", "best_of"}) | {
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "add_generation_prompt",
}

#: OpenAI's default for ``max_tokens`` on the completions endpoint.
DEFAULT_MAX_TOKENS = 16
#: A text prompt longer than ``max_model_len * CHARS_PER_TOKEN_BOUND`` characters cannot fit the
#: context (tokenizers average 3-5 characters per token), so it is refused before tokenizing.
CHARS_PER_TOKEN_BOUND = 16
#: The character limit of text prompts when the model's context length is unknown.
DEFAULT_MAX_PROMPT_CHARS = 2 * 1024 * 1024

#: Fallback ``max_tokens`` of a chat request when the context length is unknown.
DEFAULT_CHAT_MAX_TOKENS = 512


class ChatTemplater(Protocol):
    """What a chat request needs from the tokenizer: messages in, prompt token ids out
    (``kvdrop_engine.tokenizer.Tokenizer`` and ``JSONTokenizer`` render the model's template)."""

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]: ...


class BadRequestError(ValueError):
    """A request the server rejects; ``status`` is the HTTP status, the message says what to fix."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


@dataclass(frozen=True)
class CompletionRequest:
    """A validated ``/v1/completions`` request, ready for the engine."""

    prompt_token_ids: list[int]
    sampling_params: dict[str, Any]
    cache_salt: str
    max_tokens: int
    stream: bool
    include_usage: bool
    logprobs: int | None
    tokens_as_token_ids: bool
    chat: bool = False


# ---------------------------------------------------------------------------------------------
# Request validation
# ---------------------------------------------------------------------------------------------


def _get_int(body: dict[str, Any], name: str, *, minimum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not is_int(value):
        raise BadRequestError(f"'{name}' must be an integer, got {value!r}", param=name)
    if minimum is not None and value < minimum:
        raise BadRequestError(f"'{name}' must be >= {minimum}, got {value}", param=name)
    return int(value)


def _get_float(
    body: dict[str, Any], name: str, *, low: float, high: float, low_open: bool = False
) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not is_number(value) or not math.isfinite(value):
        raise BadRequestError(f"'{name}' must be a finite number, got {value!r}", param=name)
    value = float(value)
    if value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise BadRequestError(
            f"'{name}' must be in {bracket}{low}, {high}], got {value}", param=name
        )
    return value


def _get_bool(body: dict[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise BadRequestError(f"'{name}' must be true or false, got {value!r}", param=name)
    return value


def _token_ids(value: list[Any], vocab_size: int | None, name: str) -> list[int]:
    try:
        return token_ids(value, name, vocab_size=vocab_size)
    except (TypeError, ValueError) as exc:
        raise BadRequestError(str(exc), param=name) from None


def max_prompt_chars_for(max_model_len: int | None) -> int:
    """The default character limit of text prompts for a model of ``max_model_len`` tokens."""
    if max_model_len is None:
        return DEFAULT_MAX_PROMPT_CHARS
    return max_model_len * CHARS_PER_TOKEN_BOUND


def _too_long(chars: int, max_prompt_chars: int | None, what: str, param: str) -> None:
    if max_prompt_chars is not None and chars > max_prompt_chars:
        raise BadRequestError(
            f"{what} is {chars} characters, over this server's limit of {max_prompt_chars} "
            "characters (it could not fit the model's context); shorten it",
            param=param,
        )


def _prompt_ids(
    prompt: Any,
    tokenizer: TextTokenizer | None,
    vocab_size: int | None,
    max_prompt_chars: int | None = None,
    max_model_len: int | None = None,
) -> list[int]:
    """Accept a string, a list of token ids, or a list holding exactly one of those.

    Cheap bounds come first: a text longer than ``max_prompt_chars`` characters is refused before
    the tokenizer sees it, a token list longer than ``max_model_len`` before each id is checked.
    """
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise BadRequestError(
                f"'prompt' holds {len(prompt)} prompts; this server takes one prompt per request "
                "(send concurrent requests instead)",
                param="prompt",
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise BadRequestError(
                "'prompt' is text but this server has no tokenizer; send a list of token ids",
                param="prompt",
            )
        _too_long(len(prompt), max_prompt_chars, "'prompt'", "prompt")
        ids = [int(t) for t in tokenizer.encode(prompt)]
        bad = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
        if bad:
            raise BadRequestError(
                f"the tokenizer turned 'prompt' into token id {bad[0]}, outside the model's "
                f"vocabulary [0, {vocab_size}); the tokenizer does not match the model",
                param="prompt",
            )
    elif isinstance(prompt, list):
        if max_model_len is not None and len(prompt) > max_model_len:
            raise BadRequestError(
                f"'prompt' has {len(prompt)} tokens, more than the model's context length "
                f"{max_model_len}; shorten it",
                param="prompt",
            )
        ids = _token_ids(prompt, vocab_size, "prompt")
    else:
        raise BadRequestError(
            "'prompt' must be a string, a list of token ids, or a list of one of those; "
            f"got {type(prompt).__name__}",
            param="prompt",
        )
    if not ids:
        raise BadRequestError("'prompt' is empty; send at least one token", param="prompt")
    return ids


def _check_body(body: Any, known: frozenset[str], model_name: str) -> dict[str, Any]:
    """A JSON object of known fields naming this server's model (or none)."""
    if not isinstance(body, dict):
        raise BadRequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - known)
    if unknown:
        raise BadRequestError(
            f"unknown field(s) {', '.join(map(repr, unknown))}; supported: "
            + ", ".join(sorted(known)),
            param=unknown[0],
        )
    model = body.get("model")
    if model is not None and model != model_name:
        raise BadRequestError(
            f"the model {model!r} does not exist; this server serves {model_name!r}",
            status=404,
            param="model",
        )
    return body


def _check_unsupported(body: dict[str, Any]) -> None:
    """Fields both routes accept only at their OpenAI defaults."""
    for name, only in (("n", 1), ("best_of", 1)):
        value = _get_int(body, name, minimum=1)
        if value is not None and value != only:
            raise BadRequestError(f"'{name}' must be 1 on this server, got {value}", param=name)
    if _get_bool(body, "echo"):
        raise BadRequestError("'echo' is not supported; leave it false", param="echo")
    for name in ("presence_penalty", "frequency_penalty"):
        value = _get_float(body, name, low=-2.0, high=2.0)
        if value not in (None, 0.0):
            raise BadRequestError(f"'{name}' is not supported; leave it 0", param=name)
    stop = body.get("stop")
    if stop not in (None, [], ""):
        raise BadRequestError(
            "stop strings are not supported; use 'stop_token_ids' instead", param="stop"
        )
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise BadRequestError("'user' must be a string", param="user")


def _finish_request(
    body: dict[str, Any],
    prompt_ids: list[int],
    *,
    max_tokens: int,
    max_tokens_field: str,
    vocab_size: int | None,
    max_model_len: int | None,
    logprobs: int | None,
    return_tokens_as_token_ids: bool,
    chat: bool,
) -> CompletionRequest:
    """Sampling, salt and streaming fields, shared by both routes."""
    if max_model_len is not None and len(prompt_ids) + max_tokens > max_model_len:
        raise BadRequestError(
            f"prompt ({len(prompt_ids)} tokens) + {max_tokens_field} ({max_tokens}) exceeds the "
            f"model's context length {max_model_len}; shorten the prompt or lower "
            f"{max_tokens_field}",
            param=max_tokens_field,
        )
    params: dict[str, Any] = {"max_tokens": max_tokens}
    temperature = _get_float(body, "temperature", low=0.0, high=100.0)
    if temperature is not None:
        params["temperature"] = temperature
    top_p = _get_float(body, "top_p", low=0.0, high=1.0, low_open=True)
    if top_p is not None:
        params["top_p"] = top_p
    top_k = _get_int(body, "top_k", minimum=-1)
    if top_k is not None and top_k > 0:
        params["top_k"] = top_k
    seed = _get_int(body, "seed", minimum=-(2**63))
    if seed is not None:
        if seed >= 2**64:
            raise BadRequestError(f"'seed' must be < 2**64, got {seed}", param="seed")
        params["seed"] = seed
    ignore_eos = _get_bool(body, "ignore_eos")
    if ignore_eos is not None:
        params["ignore_eos"] = ignore_eos
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list):
            raise BadRequestError(
                "'stop_token_ids' must be a list of token ids", param="stop_token_ids"
            )
        params["stop_token_ids"] = _token_ids(stop_ids, vocab_size, "stop_token_ids")

    cache_salt = body.get("cache_salt")
    if cache_salt is None:
        cache_salt = ""
    if not isinstance(cache_salt, str):
        raise BadRequestError(
            f"'cache_salt' must be a string, got {cache_salt!r}", param="cache_salt"
        )

    stream = bool(_get_bool(body, "stream"))
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise BadRequestError(
                "'stream_options' must be an object with only 'include_usage'",
                param="stream_options",
            )
        if not stream:
            raise BadRequestError(
                "'stream_options' is only allowed with 'stream': true", param="stream_options"
            )
        include_usage = bool(_get_bool(options, "include_usage"))
    as_ids = _get_bool(body, "return_tokens_as_token_ids")
    return CompletionRequest(
        prompt_token_ids=prompt_ids,
        sampling_params=params,
        cache_salt=cache_salt,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        logprobs=logprobs,
        tokens_as_token_ids=return_tokens_as_token_ids if as_ids is None else as_ids,
        chat=chat,
    )


def parse_completion_request(
    body: Any,
    *,
    model_name: str,
    tokenizer: TextTokenizer | None = None,
    vocab_size: int | None = None,
    max_model_len: int | None = None,
    return_tokens_as_token_ids: bool = False,
    max_prompt_chars: int | None = None,
) -> CompletionRequest:
    """Validate a decoded JSON body of ``POST /v1/completions``; raise ``BadRequestError``.

    The engine gets ``max_tokens`` always and each other sampling field only when the client set
    it, so the engine's own defaults apply otherwise. ``top_k`` of 0 or -1 means "disabled" (as in
    vLLM) and is not passed on. Text prompts longer than ``max_prompt_chars`` (default
    ``max_prompt_chars_for(max_model_len)``) are refused before tokenizing.
    """
    body = _check_body(body, _KNOWN_FIELDS, model_name)
    if "prompt" not in body:
        raise BadRequestError("'prompt' is required", param="prompt")
    if max_prompt_chars is None:
        max_prompt_chars = max_prompt_chars_for(max_model_len)
    prompt_ids = _prompt_ids(body["prompt"], tokenizer, vocab_size, max_prompt_chars, max_model_len)
    _check_unsupported(body)
    max_tokens = _get_int(body, "max_tokens", minimum=1)
    logprobs = _get_int(body, "logprobs", minimum=0)
    if logprobs is not None and logprobs > 0:
        raise BadRequestError(
            "only 'logprobs': 0 is supported (the sampled token, no alternatives)",
            param="logprobs",
        )
    return _finish_request(
        body,
        prompt_ids,
        max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        max_tokens_field="max_tokens",
        vocab_size=vocab_size,
        max_model_len=max_model_len,
        logprobs=logprobs,
        return_tokens_as_token_ids=return_tokens_as_token_ids,
        chat=False,
    )


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    """``messages`` as ``[{"role": str, "content": str}]``; content parts of type text are
    joined (OpenAI's list form), anything else is refused."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequestError(
            "'messages' is required: a non-empty list of {'role': ..., 'content': ...}",
            param="messages",
        )
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequestError(
                f"{where} must be an object with a string 'role' and a 'content'", param="messages"
            )
        extra = sorted(set(message) - {"role", "content", "name"})
        if extra:
            raise BadRequestError(
                f"{where} has unsupported field(s) {', '.join(map(repr, extra))} (tool calls "
                "are not supported); send 'role' and 'content'",
                param="messages",
            )
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not (
                    isinstance(part, dict)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                ):
                    raise BadRequestError(
                        f"{where}.content: only text parts ({{'type': 'text', 'text': ...}}) are "
                        "supported",
                        param="messages",
                    )
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise BadRequestError(
                f"{where}.content must be a string or a list of text parts, got "
                f"{type(content).__name__}",
                param="messages",
            )
        out.append({"role": message["role"], "content": content})
    return out


def parse_chat_request(
    body: Any,
    *,
    model_name: str,
    tokenizer: TextTokenizer | None = None,
    vocab_size: int | None = None,
    max_model_len: int | None = None,
    return_tokens_as_token_ids: bool = False,
    max_prompt_chars: int | None = None,
) -> CompletionRequest:
    """Validate a decoded JSON body of ``POST /v1/chat/completions``; raise ``BadRequestError``.

    The messages go through the model's chat template (``tokenizer.apply_chat_template``, with
    the assistant's generation prompt unless ``add_generation_prompt`` is false). Sampling fields
    are those of :func:`parse_completion_request`; ``max_completion_tokens`` (or the older
    ``max_tokens``) defaults, as in vLLM, to the rest of the context. ``logprobs: true`` lists the
    sampled tokens (``top_logprobs`` must be 0).
    """
    body = _check_body(body, _CHAT_FIELDS, model_name)
    messages = _messages(body)
    if max_prompt_chars is None:
        max_prompt_chars = max_prompt_chars_for(max_model_len)
    chars = sum(len(m.get("content", "")) for m in messages)
    _too_long(chars, max_prompt_chars, "the chat's text", "messages")  # before templating
    templater = getattr(tokenizer, "apply_chat_template", None)
    if tokenizer is None or templater is None:
        raise BadRequestError(
            "this server has no tokenizer with a chat template; use /v1/completions with token "
            "ids or text",
            param="messages",
        )
    add_generation_prompt = _get_bool(body, "add_generation_prompt")
    try:
        ids = [int(t) for t in templater(messages, add_generation_prompt is not False)]
    except ValueError as exc:  # TokenizerError: no template, or the template refused them
        raise BadRequestError(f"cannot apply the chat template: {exc}", param="messages") from None
    bad = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if bad:
        raise BadRequestError(
            f"the chat template gave token id {bad[0]}, outside the model's vocabulary "
            f"[0, {vocab_size}); the tokenizer does not match the model",
            param="messages",
        )
    if not ids:
        raise BadRequestError("the chat template gave an empty prompt", param="messages")
    _check_unsupported(body)

    field_name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = _get_int(body, field_name, minimum=1)
    if max_tokens is None:
        if max_model_len is None:
            max_tokens = DEFAULT_CHAT_MAX_TOKENS
        elif len(ids) >= max_model_len:
            raise BadRequestError(
                f"the chat ({len(ids)} tokens) fills the model's context length "
                f"{max_model_len}; shorten the messages",
                param="messages",
            )
        else:
            max_tokens = max_model_len - len(ids)
    logprobs = _get_bool(body, "logprobs")
    top = _get_int(body, "top_logprobs", minimum=0)
    if top is not None and not logprobs:
        raise BadRequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    if top:
        raise BadRequestError(
            "only 'top_logprobs': 0 is supported (the sampled token, no alternatives)",
            param="top_logprobs",
        )
    return _finish_request(
        body,
        ids,
        max_tokens=max_tokens,
        max_tokens_field=field_name,
        vocab_size=vocab_size,
        max_model_len=max_model_len,
        logprobs=0 if logprobs else None,
        return_tokens_as_token_ids=return_tokens_as_token_ids,
        chat=True,
    )


# ---------------------------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------------------------


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """The OpenAI-style error object for ``status``."""
    kind = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowed"}.get(
        status, "InternalServerError" if status >= 500 else "InvalidRequestError"
    )
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def models_body(model_name: str, created: int, max_model_len: int | None) -> dict[str, Any]:
    """Body of ``GET /v1/models`` for a server of one model."""
    card: dict[str, Any] = {
        "id": model_name,
        "object": "model",
        "created": created,
        "owned_by": "kvdrop",
        "root": model_name,
    }
    if max_model_len is not None:
        card["max_model_len"] = max_model_len
    return {"object": "list", "data": [card]}


@dataclass(frozen=True)
class Piece:
    """What one token adds to a choice: its text, its logprobs token, where its text starts,
    and the finish reason if it is the last."""

    text: str
    token: str | None
    offset: int
    finish: str | None
    token_id: int = -1


@dataclass
class CompletionBuilder:
    """Builds the response to one request from its ``TokenEvent``s.

    Feed every event to :meth:`add`; stream each returned piece with :meth:`chunk`, or build the
    whole body with :meth:`body` at the end. ``detokenize`` computes each token's text with
    ``tokenizer`` (an :class:`IncrementalDetokenizer`) instead of trusting ``TokenEvent.text``.
    """

    request: CompletionRequest
    model_name: str
    tokenizer: TextTokenizer | None = None
    detokenize: bool = False
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))
    pieces: list[Piece] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._detok = (
            IncrementalDetokenizer(self.tokenizer)
            if self.detokenize and self.tokenizer is not None
            else None
        )
        self._offset = 0

    @property
    def count(self) -> int:
        """Tokens added so far."""
        return len(self.pieces)

    @property
    def finish(self) -> str | None:
        """The finish reason of the last piece (None while generating)."""
        return self.pieces[-1].finish if self.pieces else None

    def add(self, event: TokenEvent) -> Piece:
        """Account one generated token. Its finish reason is the engine's, or "length" once
        ``max_tokens`` tokens arrived (an engine that does not label its last token)."""
        finish = event.finish_reason
        if finish is None and self.count + 1 >= self.request.max_tokens:
            finish = "length"
        if self._detok is not None:
            text = self._detok.add(event.token_id, final=finish is not None)
        else:
            text = event.text
        token = None
        if self.request.logprobs is not None:
            if self.request.tokens_as_token_ids:
                token = token_id_text(event.token_id)
            elif self.tokenizer is not None:
                token = self.tokenizer.decode([event.token_id])
            else:
                token = text
        piece = Piece(
            text=text, token=token, offset=self._offset, finish=finish, token_id=event.token_id
        )
        self._offset += len(text)
        self.pieces.append(piece)
        return piece

    def preamble(self) -> list[dict[str, Any]]:
        """Chunks streamed before the first token (none for completions)."""
        return []

    def chunk(self, piece: Piece | None = None, *, finish: str | None = None) -> dict[str, Any]:
        """One streamed chunk: ``piece``'s text and logprobs, or an empty one ending with
        ``finish`` (an engine that stopped without a reason)."""
        logprobs = None
        if piece is not None and piece.token is not None:
            logprobs = {
                "text_offset": [piece.offset],
                "token_logprobs": [None],
                "tokens": [piece.token],
                "top_logprobs": [None],
            }
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model_name,
            "choices": [
                {
                    "index": 0,
                    "text": "" if piece is None else piece.text,
                    "logprobs": logprobs,
                    "finish_reason": finish if piece is None else piece.finish,
                    "stop_reason": None,
                }
            ],
        }

    def usage(self) -> dict[str, int]:
        """Prompt, completion and total token counts."""
        n_prompt = len(self.request.prompt_token_ids)
        return {
            "prompt_tokens": n_prompt,
            "completion_tokens": self.count,
            "total_tokens": n_prompt + self.count,
        }

    def usage_chunk(self) -> dict[str, Any]:
        """The last streamed chunk of ``stream_options.include_usage``: no choices, the usage."""
        return {**self.chunk(), "choices": [], "usage": self.usage()}

    def body(self) -> dict[str, Any]:
        """The non-streaming response (finish reason "stop" when the engine gave none)."""
        logprobs = None
        if self.request.logprobs is not None:
            logprobs = {
                "text_offset": [p.offset for p in self.pieces],
                "token_logprobs": [None] * self.count,
                "tokens": [p.token for p in self.pieces],
                "top_logprobs": [None] * self.count,
            }
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model_name,
            "choices": [
                {
                    "index": 0,
                    "text": "".join(p.text for p in self.pieces),
                    "logprobs": logprobs,
                    "finish_reason": self.finish or "stop",
                    "stop_reason": None,
                }
            ],
            "usage": self.usage(),
        }


@dataclass
class ChatCompletionBuilder(CompletionBuilder):
    """Builds a ``/v1/chat/completions`` response (``chat.completion`` or its chunks).

    The assistant's content is the generated text without the text of the token that stopped it
    (EOS or a stop token id: ``<|im_end|>`` is not content, as in vLLM); ``logprobs.content``
    lists every sampled token, that one included, in the same form as the completions route.
    """

    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")

    def add(self, event: TokenEvent) -> Piece:
        """Account one generated token (see :meth:`CompletionBuilder.add`)."""
        piece = super().add(event)
        if piece.finish == "stop" and piece.text:
            stop_text = (
                self.tokenizer.decode([event.token_id]) if self.tokenizer is not None else ""
            )
            if stop_text and piece.text.endswith(stop_text):
                piece = replace(piece, text=piece.text[: -len(stop_text)])
                self.pieces[-1] = piece
        return piece

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model_name}

    @staticmethod
    def _logprob(piece: Piece) -> dict[str, Any]:
        return {"token": piece.token, "logprob": None, "bytes": None, "top_logprobs": []}

    def _logprobs(self, pieces: list[Piece]) -> dict[str, Any] | None:
        if self.request.logprobs is None:
            return None
        return {"content": [self._logprob(p) for p in pieces]}

    def preamble(self) -> list[dict[str, Any]]:
        """The first chunk: the assistant role, no content yet (as OpenAI streams it)."""
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return [{**self._head("chat.completion.chunk"), "choices": [choice]}]

    def chunk(self, piece: Piece | None = None, *, finish: str | None = None) -> dict[str, Any]:
        """One streamed ``chat.completion.chunk``: ``piece``'s content delta and logprobs, or an
        empty delta ending with ``finish``."""
        choice: dict[str, Any] = {
            "index": 0,
            "delta": {} if piece is None else {"content": piece.text},
            "logprobs": None if piece is None else self._logprobs([piece]),
            "finish_reason": finish if piece is None else piece.finish,
        }
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def usage_chunk(self) -> dict[str, Any]:
        """The last streamed chunk of ``stream_options.include_usage``: no choices, the usage."""
        return {**self._head("chat.completion.chunk"), "choices": [], "usage": self.usage()}

    def body(self) -> dict[str, Any]:
        """The non-streaming ``chat.completion`` (finish reason "stop" when the engine gave
        none)."""
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": "".join(p.text for p in self.pieces)},
            "logprobs": self._logprobs(self.pieces),
            "finish_reason": self.finish or "stop",
        }
        return {**self._head("chat.completion"), "choices": [choice], "usage": self.usage()}
