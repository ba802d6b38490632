"""The prompt of an OpenAI request, as token ids: text or token ids (``/v1/completions``, one
prompt or a batch), a chat's messages through the model's chat template (``/v1/chat/completions``
and ``/tokenize``).

Every part is bounded before the step that would read it: text by characters before tokenizing,
a chat's messages and content parts before templating; the ids the tokenizer or template gives
are checked against the vocabulary. :class:`Settings` is what a server's requests are validated
against. Bad input raises :class:`BadRequestError` naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from kvdrop_engine.request_fields import BadRequestError, get_bool, get_str, get_token_ids
from kvdrop_engine.tokenizer import TextTokenizer

__all__ = [
    "CHARS_PER_TOKEN_BOUND",
    "DEFAULT_MAX_PROMPT_CHARS",
    "MAX_CHAT_MESSAGES",
    "MAX_PROMPTS",
    "MAX_ROLE_CHARS",
    "ChatTemplate",
    "Settings",
    "chat_prompt",
    "completion_prompts",
    "max_prompt_chars_for",
    "template_options",
    "text_ids",
]

#: A text prompt longer than ``max_model_len * CHARS_PER_TOKEN_BOUND`` characters cannot fit the
#: context (tokenizers average 3-5 characters per token), so it is refused before tokenizing.
CHARS_PER_TOKEN_BOUND = 16
#: The character limit of text prompts when the model's context length is unknown.
DEFAULT_MAX_PROMPT_CHARS = 2 * 1024 * 1024
#: A chat's messages (and, apart, its content parts) when the context length is unknown; with
#: one, ``max_model_len`` (every message adds at least one token to the prompt).
MAX_CHAT_MESSAGES = 4096
#: Longest ``role`` and ``name`` of a message (roles are words: system, user, assistant, tool).
MAX_ROLE_CHARS = 64
#: Most choices of a batched request in all (prompts x ``n``).
MAX_PROMPTS = 64


@runtime_checkable
class ChatTemplate(Protocol):
    """A tokenizer with the model's chat template: messages in, prompt token ids out
    (``kvdrop_engine.tokenizer.Tokenizer`` and ``JSONTokenizer``)."""

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
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


def text_ids(text: str, settings: Settings, param: str) -> list[int]:
    tokenizer = settings.tokenizer
    if tokenizer is None:
        raise BadRequestError(
            f"'{param}' is text but this server has no tokenizer; send a list of token ids",
            param=param,
        )
    _too_long(len(text), settings.prompt_chars, f"'{param}'", param)
    ids = [int(t) for t in tokenizer.encode(text)]
    return _in_vocab(ids, settings.vocab_size, f"the tokenizer, on '{param}',", param)


def _one_prompt(prompt: Any, settings: Settings) -> list[int]:
    if isinstance(prompt, str):
        return text_ids(prompt, settings, "prompt")
    if isinstance(prompt, list):
        ids = get_token_ids(prompt, settings.vocab_size, "prompt", settings.max_model_len)
        if not ids:
            raise BadRequestError("'prompt' is empty; send at least one token", param="prompt")
        return ids
    raise BadRequestError(
        "'prompt' must be a string, a list of token ids, or a list of those; "
        f"got {type(prompt).__name__}",
        param="prompt",
    )


def completion_prompts(body: dict[str, Any], settings: Settings) -> list[list[int]]:
    """``prompt``: a string, a list of token ids, or a list of those (a batch, at most
    ``MAX_PROMPTS``; their characters count together against the text limit)."""
    if "prompt" not in body:
        raise BadRequestError("'prompt' is required", param="prompt")
    prompt = body["prompt"]
    if not (isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list))):
        return [_one_prompt(prompt, settings)]
    n = body.get("n") or 1  # checked already; choices in all are bounded (a thread each)
    if len(prompt) * n > MAX_PROMPTS:
        raise BadRequestError(
            f"'prompt' holds {len(prompt)} prompts; at most {MAX_PROMPTS // n} per request "
            f"with n={n}",
            param="prompt",
        )
    chars = sum(len(p) for p in prompt if isinstance(p, str))
    _too_long(chars, settings.prompt_chars, "'prompt'", "prompt")
    return [_one_prompt(p, settings) for p in prompt]


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
        extra = sorted(set(message) - _MESSAGE_FIELDS)
        if extra:
            raise BadRequestError(
                f"{where} has unsupported field(s) {', '.join(map(repr, extra))}; send 'role', "
                "'content' and, for tools, 'tool_calls' or 'tool_call_id'",
                param="messages",
            )
        if not isinstance(message.get("role"), str):
            raise BadRequestError(
                f"{where} must be an object with a string 'role' and a 'content'", param="messages"
            )
        role = get_str(message, "role", MAX_ROLE_CHARS) or ""
        get_str(message, "name", MAX_ROLE_CHARS)
        calls = message.get("tool_calls")
        bare = calls and message.get("content") is None  # an assistant turn of calls only
        content, used = ("", 0) if bare else _content(message.get("content"), where, limit - parts)
        parts += used
        entry: dict[str, Any] = {"role": role, "content": content}
        if calls:
            entry["tool_calls"], used = _tool_calls(calls, where, limit - parts)
            parts += used
            chars += sum(len(c["function"]["name"]) + c["length"] for c in entry["tool_calls"])
        if message.get("tool_call_id") is not None:
            entry["tool_call_id"] = get_str(message, "tool_call_id", MAX_ROLE_CHARS)
        chars += len(content) + len(role)
        _too_long(chars, settings.prompt_chars, "the chat's text", "messages")
        out.append(entry)
    for entry in out:
        for call in entry.get("tool_calls", ()):
            call.pop("length")
    return out


def _tool_calls(calls: Any, where: str, left: int) -> tuple[list[dict[str, Any]], int]:
    """An assistant message's ``tool_calls`` as templates read them (each call's ``arguments``
    a dict when it is JSON, as transformers passes them), with its text length."""
    if not isinstance(calls, list) or len(calls) > left:
        raise BadRequestError(f"{where}.tool_calls must be a list of calls", param="messages")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments", "{}") if isinstance(function, dict) else None
        if not isinstance(name, str) or not isinstance(arguments, str) or len(name) > 64:
            raise BadRequestError(
                f"{where}.tool_calls[{j}] must be {{'id': ..., 'type': 'function', 'function': "
                "{'name': ..., 'arguments': JSON text}}",
                param="messages",
            )
        try:
            parsed: Any = json.loads(arguments)
        except json.JSONDecodeError:
            parsed = arguments
        entry = {"id": str(call.get("id", "")), "type": "function", "length": len(arguments)}
        entry["function"] = {"name": name, "arguments": parsed}
        out.append(entry)
    return out, len(calls)


#: What a chat message may hold.
_MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})
#: Most ``chat_template_kwargs`` entries, and what they may not name (the server sets those).
MAX_TEMPLATE_KWARGS = 32
_RESERVED_KWARGS = frozenset(
    {
        "messages",
        "tools",
        "add_generation_prompt",
        "continue_final_message",
        "bos_token",
        "eos_token",
    }
)


def template_options(body: dict[str, Any], tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    """What the chat template is given beside the messages: ``add_generation_prompt`` (default
    true, false with ``continue_final_message``), ``continue_final_message``, the request's
    ``tools`` and its ``chat_template_kwargs`` (a small object of JSON values, e.g.
    ``{"enable_thinking": false}``)."""
    cont = bool(get_bool(body, "continue_final_message"))
    add = get_bool(body, "add_generation_prompt")
    if cont and add:
        raise BadRequestError(
            "'continue_final_message' continues the last message; it cannot be combined with "
            "'add_generation_prompt': true",
            param="continue_final_message",
        )
    extra = body.get("chat_template_kwargs") or {}
    if not isinstance(extra, dict) or len(extra) > MAX_TEMPLATE_KWARGS:
        raise BadRequestError(
            f"'chat_template_kwargs' must be an object of at most {MAX_TEMPLATE_KWARGS} entries",
            param="chat_template_kwargs",
        )
    clash = sorted(set(extra) & _RESERVED_KWARGS)
    if clash:
        raise BadRequestError(
            f"'chat_template_kwargs' may not set {', '.join(clash)} (the request's own fields do)",
            param="chat_template_kwargs",
        )
    options: dict[str, Any] = {**extra, "add_generation_prompt": not cont and add is not False}
    if cont:
        options["continue_final_message"] = True
    if tools:
        options["tools"] = tools
    return options


def chat_prompt(
    body: dict[str, Any], settings: Settings, tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """A chat body's messages through the model's chat template (with :func:`template_options`:
    the generation prompt, continuing the last message, ``tools``, ``chat_template_kwargs``)."""
    messages = _messages(body, settings)
    tokenizer = settings.tokenizer
    if not isinstance(tokenizer, ChatTemplate):
        raise BadRequestError(
            "this server has no tokenizer with a chat template; use /v1/completions with token "
            "ids or text",
            param="messages",
        )
    options = template_options(body, tools)
    if options.get("continue_final_message") and messages[-1]["role"] != "assistant":
        raise BadRequestError(
            "'continue_final_message' continues the last message, which must be the assistant's",
            param="continue_final_message",
        )
    add_generation_prompt = options.pop("add_generation_prompt")
    try:
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt, **options)
        ids = [int(t) for t in rendered]
    except ValueError as exc:  # TokenizerError: no template, or the template refused them
        raise BadRequestError(f"cannot apply the chat template: {exc}", param="messages") from None
    except TypeError as exc:  # a chat_template_kwargs value the template cannot use
        raise BadRequestError(
            f"cannot apply the chat template: {exc}", param="chat_template_kwargs"
        ) from None
    return _in_vocab(ids, settings.vocab_size, "the chat template", "messages")
