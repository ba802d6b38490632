"""The OpenAI ``/v1/completions`` and ``/v1/chat/completions`` requests (and vLLM's
``/tokenize`` and ``/detokenize``), validated apart from any transport.

One parser serves both routes (:func:`parse_request`): a :class:`Route` says what differs (the
fields allowed, how the prompt is made, the ``max_tokens`` default, the logprobs fields), and
everything else (sampling, stops, ``n``, salt, streaming) is read once. Every part of a request
is bounded before the expensive step that would read it: text prompts by characters before
tokenizing, a chat's messages, roles and content parts by count and size before templating,
``stop`` and ``stop_token_ids`` by count. Bad input raises :class:`BadRequestError` with the HTTP
status and the offending field. The responses are :mod:`kvdrop_engine.responses`;
:mod:`kvdrop_engine.http` serves both.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from kvdrop_engine.request_fields import (
    BadRequestError,
    check_body,
    get_bool,
    get_float,
    get_int,
    get_str,
    get_token_ids,
)
from kvdrop_engine.sampling import MAX_LOGPROBS, MIN_TEMPERATURE
from kvdrop_engine.tokenizer import TextTokenizer

__all__ = [
    "CHARS_PER_TOKEN_BOUND",
    "DEFAULT_MAX_PROMPT_CHARS",
    "DEFAULT_MAX_TOKENS",
    "MAX_CHAT_MESSAGES",
    "MAX_N",
    "MAX_ROLE_CHARS",
    "MAX_STOP_STRINGS",
    "MAX_STOP_TOKEN_IDS",
    "BadRequestError",
    "ChatTemplate",
    "CompletionRequest",
    "Settings",
    "max_prompt_chars_for",
    "parse_chat_request",
    "parse_completion_request",
    "parse_detokenize_request",
    "parse_request",
    "parse_tokenize_request",
]

#: Fields both routes understand (others are rejected so that a typo does not pass silently).
_SHARED_FIELDS = frozenset(
    {
        "model", "max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "stop",
        "stop_token_ids", "stream", "stream_options", "logprobs", "n", "best_of", "user",
        "presence_penalty", "frequency_penalty", "cache_salt", "return_tokens_as_token_ids",
        "skip_special_tokens", "include_stop_str_in_output", "kvdrop",
    }
)  # fmt: skip
_COMPLETION_FIELDS = _SHARED_FIELDS | {"prompt", "echo"}
_CHAT_FIELDS = _SHARED_FIELDS | {
    "messages",
    "max_completion_tokens",
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
#: A chat's messages (and, apart, its content parts) when the context length is unknown; with
#: one, ``max_model_len`` (every message adds at least one token to the prompt).
MAX_CHAT_MESSAGES = 4096
#: Longest ``role`` and ``name`` of a message (roles are words: system, user, assistant, tool).
MAX_ROLE_CHARS = 64
#: Most ``stop`` strings, the longest one, and most ``stop_token_ids`` per request.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
#: Most choices per request (``n``).
MAX_N = 16


@runtime_checkable
class ChatTemplate(Protocol):
    """A tokenizer with the model's chat template: messages in, prompt token ids out
    (``kvdrop_engine.tokenizer.Tokenizer`` and ``JSONTokenizer``)."""

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]: ...


@dataclass(frozen=True)
class Settings:
    """What a server's requests are validated against: its model name, tokenizer, vocabulary,
    context length, logprobs token form and text-prompt limit (default from the context)."""

    model_name: str
    tokenizer: TextTokenizer | None = None
    vocab_size: int | None = None
    max_model_len: int | None = None
    return_tokens_as_token_ids: bool = False
    max_prompt_chars: int | None = None

    @property
    def prompt_chars(self) -> int:
        """The character limit of text prompts (and of a chat's text)."""
        if self.max_prompt_chars is not None:
            return self.max_prompt_chars
        return max_prompt_chars_for(self.max_model_len)

    @property
    def chat_items(self) -> int:
        """Most messages (and most content parts) one chat may hold."""
        return MAX_CHAT_MESSAGES if self.max_model_len is None else self.max_model_len


@dataclass(frozen=True)
class CompletionRequest:
    """A validated completions or chat request, ready for the engine.

    ``logprobs`` is None (none asked) or how many alternatives each token lists; ``stop`` are the
    stop strings; ``n`` choices are generated from seeds ``seed + i`` (when a seed is given).
    """

    prompt_token_ids: list[int]
    sampling_params: dict[str, Any]
    cache_salt: str
    max_tokens: int
    stream: bool
    include_usage: bool
    logprobs: int | None
    tokens_as_token_ids: bool
    chat: bool = False
    n: int = 1
    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    include_stop_str: bool = False

    def choice_params(self, index: int) -> dict[str, Any]:
        """The sampling parameters of choice ``index`` (its own seed when one was given)."""
        params = dict(self.sampling_params)
        if index and "seed" in params:
            params["seed"] = (params["seed"] + index) % 2**64
        return params


def max_prompt_chars_for(max_model_len: int | None) -> int:
    """The default character limit of text prompts for a model of ``max_model_len`` tokens."""
    if max_model_len is None:
        return DEFAULT_MAX_PROMPT_CHARS
    return max_model_len * CHARS_PER_TOKEN_BOUND


def _too_long(chars: int, max_prompt_chars: int, what: str, param: str) -> None:
    if chars > max_prompt_chars:
        raise BadRequestError(
            f"{what} is {chars} characters, over this server's limit of {max_prompt_chars} "
            "characters (it could not fit the model's context); shorten it",
            param=param,
        )


def _in_vocab(ids: list[int], vocab_size: int | None, what: str, param: str) -> list[int]:
    bad = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if bad:
        raise BadRequestError(
            f"{what} gave token id {bad[0]}, outside the model's vocabulary [0, {vocab_size}); "
            "the tokenizer does not match the model",
            param=param,
        )
    if not ids:
        raise BadRequestError(f"{what} gave an empty prompt; send at least one token", param=param)
    return ids


# ---------------------------------------------------------------------------------------------
# Prompts: text or token ids (completions), messages through the chat template (chat)
# ---------------------------------------------------------------------------------------------


def _text_ids(text: str, settings: Settings, param: str) -> list[int]:
    tokenizer = settings.tokenizer
    if tokenizer is None:
        raise BadRequestError(
            f"'{param}' is text but this server has no tokenizer; send a list of token ids",
            param=param,
        )
    _too_long(len(text), settings.prompt_chars, f"'{param}'", param)
    ids = [int(t) for t in tokenizer.encode(text)]
    return _in_vocab(ids, settings.vocab_size, f"the tokenizer, on '{param}',", param)


def _completion_prompt(body: dict[str, Any], settings: Settings) -> list[int]:
    """``prompt``: a string, a list of token ids, or a list holding exactly one of those."""
    if "prompt" not in body:
        raise BadRequestError("'prompt' is required", param="prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise BadRequestError(
                f"'prompt' holds {len(prompt)} prompts; this server takes one prompt per request "
                "(send concurrent requests, or 'n' for several choices)",
                param="prompt",
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        return _text_ids(prompt, settings, "prompt")
    if isinstance(prompt, list):
        ids = get_token_ids(prompt, settings.vocab_size, "prompt", settings.max_model_len)
        if not ids:
            raise BadRequestError("'prompt' is empty; send at least one token", param="prompt")
        return ids
    raise BadRequestError(
        "'prompt' must be a string, a list of token ids, or a list of one of those; "
        f"got {type(prompt).__name__}",
        param="prompt",
    )


def _content(content: Any, where: str, parts_left: int) -> tuple[str, int]:
    """A message's content as text (text parts joined) and how many parts it used."""
    if isinstance(content, str):
        return content, 0
    if not isinstance(content, list):
        raise BadRequestError(
            f"{where}.content must be a string or a list of text parts, got "
            f"{type(content).__name__}",
            param="messages",
        )
    if len(content) > parts_left:
        raise BadRequestError(
            f"the messages hold more than {parts_left} content parts in all; send fewer",
            param="messages",
        )
    texts = []
    for part in content:
        if not (isinstance(part, dict) and part.get("type") == "text"):
            raise BadRequestError(
                f"{where}.content: only text parts ({{'type': 'text', 'text': ...}}) are supported",
                param="messages",
            )
        if not isinstance(part.get("text"), str):
            raise BadRequestError(
                f"{where}.content: a text part needs a string 'text'", param="messages"
            )
        texts.append(part["text"])
    return "".join(texts), len(content)


def _messages(body: dict[str, Any], settings: Settings) -> list[dict[str, str]]:
    """``messages`` as ``[{"role": str, "content": str}]``, every part bounded before any is
    read in full: the number of messages and of content parts, each role and name, the text."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequestError(
            "'messages' is required: a non-empty list of {'role': ..., 'content': ...}",
            param="messages",
        )
    limit = settings.chat_items
    if len(messages) > limit:
        raise BadRequestError(
            f"'messages' holds {len(messages)} messages; at most {limit} fit this server's context",
            param="messages",
        )
    out, parts, chars = [], 0, 0
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
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
        if not isinstance(message.get("role"), str):
            raise BadRequestError(
                f"{where} must be an object with a string 'role' and a 'content'", param="messages"
            )
        role = get_str(message, "role", MAX_ROLE_CHARS) or ""
        get_str(message, "name", MAX_ROLE_CHARS)
        content, used = _content(message.get("content"), where, limit - parts)
        parts += used
        chars += len(content) + len(role)
        _too_long(chars, settings.prompt_chars, "the chat's text", "messages")
        out.append({"role": role, "content": content})
    return out


def _chat_prompt(body: dict[str, Any], settings: Settings) -> list[int]:
    messages = _messages(body, settings)
    tokenizer = settings.tokenizer
    if not isinstance(tokenizer, ChatTemplate):
        raise BadRequestError(
            "this server has no tokenizer with a chat template; use /v1/completions with token "
            "ids or text",
            param="messages",
        )
    add_generation_prompt = get_bool(body, "add_generation_prompt") is not False
    try:
        ids = [int(t) for t in tokenizer.apply_chat_template(messages, add_generation_prompt)]
    except ValueError as exc:  # TokenizerError: no template, or the template refused them
        raise BadRequestError(f"cannot apply the chat template: {exc}", param="messages") from None
    return _in_vocab(ids, settings.vocab_size, "the chat template", "messages")


# ---------------------------------------------------------------------------------------------
# The two routes and the one parser
# ---------------------------------------------------------------------------------------------


def _completion_logprobs(body: dict[str, Any]) -> int | None:
    return _bounded_logprobs(get_int(body, "logprobs", minimum=0), "logprobs")


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    wanted = get_bool(body, "logprobs")
    top = get_int(body, "top_logprobs", minimum=0)
    if top is not None and not wanted:
        raise BadRequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return _bounded_logprobs(top or 0, "top_logprobs") if wanted else None


def _bounded_logprobs(value: int | None, name: str) -> int | None:
    if value is not None and value > MAX_LOGPROBS:
        raise BadRequestError(
            f"'{name}' asks for {value} alternatives per token; at most {MAX_LOGPROBS}", param=name
        )
    return value


def _completion_max_tokens(body: dict[str, Any], prompt: list[int], settings: Settings) -> int:
    value = get_int(body, "max_tokens", minimum=1)
    return DEFAULT_MAX_TOKENS if value is None else value


def _chat_max_tokens(body: dict[str, Any], prompt: list[int], settings: Settings) -> int:
    """``max_completion_tokens`` (or the older ``max_tokens``); as in vLLM, the rest of the
    context by default."""
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    value = get_int(body, name, minimum=1)
    if value is not None:
        return value
    if settings.max_model_len is None:
        return DEFAULT_CHAT_MAX_TOKENS
    if len(prompt) >= settings.max_model_len:
        raise BadRequestError(
            f"the chat ({len(prompt)} tokens) fills the model's context length "
            f"{settings.max_model_len}; shorten the messages",
            param="messages",
        )
    return settings.max_model_len - len(prompt)


@dataclass(frozen=True)
class Route:
    """What differs between the completions and the chat route."""

    chat: bool
    fields: frozenset[str]
    prompt: Callable[[dict[str, Any], Settings], list[int]]
    max_tokens: Callable[[dict[str, Any], list[int], Settings], int]
    logprobs: Callable[[dict[str, Any]], int | None]


COMPLETIONS = Route(
    False, _COMPLETION_FIELDS, _completion_prompt, _completion_max_tokens, _completion_logprobs
)
CHAT = Route(True, _CHAT_FIELDS, _chat_prompt, _chat_max_tokens, _chat_logprobs)


def _check_unsupported(body: dict[str, Any], n: int) -> None:
    """Fields accepted only at their OpenAI defaults (or, for ``best_of``, equal to ``n``)."""
    best_of = get_int(body, "best_of", minimum=1)
    if best_of not in (None, n):
        raise BadRequestError(f"'best_of' must equal 'n' ({n}), got {best_of}", param="best_of")
    if get_bool(body, "echo"):
        raise BadRequestError("'echo' is not supported; leave it false", param="echo")
    for name in ("presence_penalty", "frequency_penalty"):
        value = get_float(body, name, low=-2.0, high=2.0)
        if value not in (None, 0.0):
            raise BadRequestError(f"'{name}' is not supported; leave it 0", param=name)
    get_str(body, "user")


def _stop_strings(body: dict[str, Any], settings: Settings) -> tuple[str, ...]:
    """``stop``: a string or a list of strings (capped); text output needs the tokenizer."""
    stop = body.get("stop")
    if stop is None or stop == "":
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise BadRequestError(
            "'stop' must be a string or a list of non-empty strings", param="stop"
        )
    if len(items) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in items):
        raise BadRequestError(
            f"'stop' allows at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} "
            "characters each",
            param="stop",
        )
    if items and settings.tokenizer is None:
        raise BadRequestError(
            "'stop' strings need text output and this server has no tokenizer; use "
            "'stop_token_ids'",
            param="stop",
        )
    return tuple(dict.fromkeys(items))


def _sampling(body: dict[str, Any], max_tokens: int, settings: Settings) -> dict[str, Any]:
    """The engine's sampling parameters: ``max_tokens`` always, the others only when set."""
    params: dict[str, Any] = {"max_tokens": max_tokens}
    temperature = get_float(body, "temperature", low=0.0, high=100.0)
    if temperature is not None:  # a tiny positive one is raised to the minimum, as in vLLM
        params["temperature"] = (
            MIN_TEMPERATURE if 0 < temperature < MIN_TEMPERATURE else temperature
        )
    top_p = get_float(body, "top_p", low=0.0, high=1.0, low_open=True)
    if top_p is not None:
        params["top_p"] = top_p
    top_k = get_int(body, "top_k", minimum=-1)
    if top_k is not None and top_k > 0:  # 0 and -1 mean "disabled", as in vLLM
        params["top_k"] = top_k
    seed = get_int(body, "seed", minimum=-(2**63))
    if seed is not None:
        if seed >= 2**64:
            raise BadRequestError(f"'seed' must be < 2**64, got {seed}", param="seed")
        params["seed"] = seed
    ignore_eos = get_bool(body, "ignore_eos")
    if ignore_eos is not None:
        params["ignore_eos"] = ignore_eos
    if body.get("stop_token_ids") is not None:
        ids = get_token_ids(
            body["stop_token_ids"], settings.vocab_size, "stop_token_ids", MAX_STOP_TOKEN_IDS
        )
        params["stop_token_ids"] = sorted(set(ids))
    return params


def _kvdrop_override(value: Any) -> Any:
    """The ``"kvdrop"`` field as the engine takes it (its shape checked here, the policy by the
    engine): 400 naming the field when it is malformed."""
    from kvdrop_engine.drop import parse_override

    try:
        parsed = parse_override(value)
    except ValueError as exc:
        raise BadRequestError(str(exc), param="kvdrop") from None
    return None if parsed is None else dict(value)


def _streaming(body: dict[str, Any]) -> tuple[bool, bool]:
    """``stream`` and ``stream_options.include_usage``."""
    stream = bool(get_bool(body, "stream"))
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise BadRequestError(
            "'stream_options' must be an object with only 'include_usage'", param="stream_options"
        )
    if not stream:
        raise BadRequestError(
            "'stream_options' is only allowed with 'stream': true", param="stream_options"
        )
    return stream, bool(get_bool(options, "include_usage"))


def parse_request(body: Any, route: Route, settings: Settings) -> CompletionRequest:
    """Validate a decoded JSON body of ``route``; raise ``BadRequestError``.

    Cheap checks come first (fields, ``n``, ``stop``), then the prompt (bounded before it is
    tokenized or templated), then what depends on its length.
    """
    body = check_body(body, route.fields, settings.model_name)
    n = get_int(body, "n", minimum=1) or 1
    if n > MAX_N:
        raise BadRequestError(f"'n' must be at most {MAX_N}, got {n}", param="n")
    _check_unsupported(body, n)
    stop = _stop_strings(body, settings)
    logprobs = route.logprobs(body)
    stream, include_usage = _streaming(body)
    cache_salt = get_str(body, "cache_salt") or ""
    as_ids = get_bool(body, "return_tokens_as_token_ids")
    skip_special = get_bool(body, "skip_special_tokens")
    include_stop = get_bool(body, "include_stop_str_in_output")
    prompt = route.prompt(body, settings)
    max_tokens = route.max_tokens(body, prompt, settings)
    limit = settings.max_model_len
    if limit is not None and len(prompt) + max_tokens > limit:
        name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        raise BadRequestError(
            f"prompt ({len(prompt)} tokens) + {name} ({max_tokens}) exceeds the model's context "
            f"length {limit}; shorten the prompt or lower {name}",
            param=name,
        )
    params = _sampling(body, max_tokens, settings)
    if "kvdrop" in body:  # null (no cut) or {"policy", "keep_ratio"}: kvdrop_engine.drop
        params["kvdrop"] = _kvdrop_override(body["kvdrop"])
    if logprobs is not None:
        params["logprobs"] = logprobs  # the engine computes the values
    return CompletionRequest(
        prompt_token_ids=prompt,
        sampling_params=params,
        cache_salt=cache_salt,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        logprobs=logprobs,
        tokens_as_token_ids=settings.return_tokens_as_token_ids if as_ids is None else as_ids,
        chat=route.chat,
        n=n,
        stop=stop,
        skip_special_tokens=skip_special is not False,
        include_stop_str=bool(include_stop),
    )


def parse_completion_request(body: Any, **settings: Any) -> CompletionRequest:
    """``POST /v1/completions`` (keywords: the fields of :class:`Settings`)."""
    return parse_request(body, COMPLETIONS, Settings(**settings))


def parse_chat_request(body: Any, **settings: Any) -> CompletionRequest:
    """``POST /v1/chat/completions`` (keywords: the fields of :class:`Settings`)."""
    return parse_request(body, CHAT, Settings(**settings))


def parse_tokenize_request(body: Any, settings: Settings) -> list[int]:
    """vLLM's ``POST /tokenize``: ``{"prompt": text}`` or ``{"messages": [...]}`` (with
    ``add_generation_prompt``, default true) to token ids, bounded as the routes bound them."""
    known = frozenset(
        {"model", "prompt", "messages", "add_generation_prompt", "add_special_tokens"}
    )
    body = check_body(body, known, settings.model_name)
    get_bool(body, "add_special_tokens")
    if ("prompt" in body) == ("messages" in body):
        raise BadRequestError("send exactly one of 'prompt' (text) or 'messages'", param="prompt")
    if "messages" in body:
        return _chat_prompt(body, settings)
    text = get_str(body, "prompt")
    return _text_ids(text or "", settings, "prompt") if text else []


def parse_detokenize_request(body: Any, settings: Settings) -> list[int]:
    """vLLM's ``POST /detokenize``: ``{"tokens": [ids]}``, ids in the vocabulary."""
    body = check_body(body, frozenset({"model", "tokens"}), settings.model_name)
    if settings.tokenizer is None:
        raise BadRequestError("this server has no tokenizer", param="tokens")
    return get_token_ids(body.get("tokens"), settings.vocab_size, "tokens", settings.max_model_len)
