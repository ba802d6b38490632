"""The one table of the fields an OpenAI request may hold: for each, the routes that take it,
what the server does with it, and why.

Every field of the official ``openai`` client's request types is here (a test walks
``openai.types`` so a new client field fails it until this table says what the field does),
beside vLLM's and kvdrop's own. A field is one of:

* ``SERVED``: read and acted on by the route's parser (:mod:`kvdrop_engine.completions`).
* ``IGNORED``: accepted at any well-formed value and recorded nowhere, as vLLM does: identifiers
  and hints meant for OpenAI's platform (``user``, ``safety_identifier``, ``metadata``...).
  ``check`` bounds its shape.
* ``NEUTRAL``: accepted only at the values that ask for nothing (null always is); another value
  is a 400 that says why (``why``).

Anything else is an unknown field, and its error lists what this table serves.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "DETOKENIZE",
    "FIELDS",
    "TOKENIZE",
    "Field",
    "Kind",
    "accepted",
    "check_accepted",
    "listed",
    "neutral_fields",
]

#: The routes the table speaks of (``/v1/completions``, ``/v1/chat/completions``, ``/tokenize``
#: and ``/detokenize``).
COMPLETIONS, CHAT, TOKENIZE, DETOKENIZE = "completions", "chat", "tokenize", "detokenize"
_BOTH = frozenset({COMPLETIONS, CHAT})
_CHAT = frozenset({CHAT})
_COMPLETION = frozenset({COMPLETIONS})
_ALL = frozenset({COMPLETIONS, CHAT, TOKENIZE})
_TEMPLATE = frozenset({CHAT, TOKENIZE})


class Kind(enum.Enum):
    SERVED = "served"
    IGNORED = "ignored"
    NEUTRAL = "neutral"


@dataclass(frozen=True)
class Field:
    """One request field: its ``kind``, the ``routes`` taking it, why it is handled so, the
    ``neutral`` values a NEUTRAL field takes, and the shape check of an IGNORED one."""

    kind: Kind
    why: str
    routes: frozenset[str] = _BOTH
    neutral: tuple[Any, ...] = ()
    check: Callable[[Any, str], str | None] | None = None


def _string(limit: int) -> Callable[[Any, str], str | None]:
    def check(value: Any, name: str) -> str | None:
        if not isinstance(value, str):
            return f"'{name}' must be a string, got {type(value).__name__}"
        if len(value) > limit:
            return f"'{name}' is {len(value)} characters; at most {limit} allowed"
        return None

    return check


def _one_of(*values: str) -> Callable[[Any, str], str | None]:
    def check(value: Any, name: str) -> str | None:
        if value not in values:
            return f"'{name}' must be one of {', '.join(map(repr, values))}, got {value!r}"
        return None

    return check


def _string_map(value: Any, name: str) -> str | None:
    """OpenAI's ``metadata``: at most 16 string keys of 64 characters, values of 512."""
    if not isinstance(value, dict) or len(value) > 16:
        return f"'{name}' must be an object of at most 16 string keys and string values"
    for key, item in value.items():
        if not (isinstance(item, str) and len(key) <= 64 and len(item) <= 512):
            return f"'{name}' keys are at most 64 characters and values strings of at most 512"
    return None


def _cache_options(value: Any, name: str) -> str | None:
    if not isinstance(value, dict) or set(value) - {"mode", "ttl"}:
        return f"'{name}' must be an object with 'mode' and 'ttl'"
    if value.get("mode", "implicit") not in ("implicit", "explicit"):
        return f"'{name}.mode' must be 'implicit' or 'explicit'"
    if value.get("ttl", "30m") != "30m":
        return f"'{name}.ttl' must be '30m'"
    return None


_S, _I, _N = Kind.SERVED, Kind.IGNORED, Kind.NEUTRAL
_PLATFORM = "an identifier for OpenAI's platform; recorded nowhere here"
_NO_TOOLS = "the deprecated functions API; use tools and tool_choice"
_NO_MEDIA = "this server serves text only"

#: Every accepted request field (the one owner: the routes' field sets come from here).
FIELDS: dict[str, Field] = {
    # -- what the routes serve ------------------------------------------------------------
    "model": Field(_S, "must name the served model (404 otherwise)", _ALL | {DETOKENIZE}),
    "prompt": Field(
        _S, "the prompt(s): text, token ids, or a list of either", _COMPLETION | {TOKENIZE}
    ),
    "messages": Field(_S, "the chat, rendered by the model's chat template", _TEMPLATE),
    "return_token_strs": Field(_S, "vLLM: each token's text too", frozenset({TOKENIZE})),
    "tokens": Field(_S, "vLLM: the token ids to detokenize", frozenset({DETOKENIZE})),
    "max_tokens": Field(_S, "most tokens generated per choice"),
    "max_completion_tokens": Field(_S, "chat's name for max_tokens", _CHAT),
    "stop": Field(_S, "stop strings"),
    "stream": Field(_S, "server-sent events"),
    "stream_options": Field(_S, "include_usage: a last chunk with the usage"),
    "logprobs": Field(_S, "per-token log-probabilities"),
    "top_logprobs": Field(_S, "alternatives per token with logprobs: true", _CHAT),
    "n": Field(_S, "choices per prompt"),
    "echo": Field(_S, "the prompt before the completion (a 400 on chat says why)"),
    "prompt_logprobs": Field(_S, "vLLM: log-probabilities of the prompt tokens"),
    "add_generation_prompt": Field(_S, "open the assistant turn after the chat", _TEMPLATE),
    "skip_special_tokens": Field(_S, "vLLM: leave special tokens out of the text"),
    "include_stop_str_in_output": Field(_S, "vLLM: keep the stop string in the text"),
    "temperature": Field(_S, "sampling"),
    "top_p": Field(_S, "sampling"),
    "top_k": Field(_S, "vLLM: sampling"),
    "min_p": Field(_S, "vLLM: sampling"),
    "min_tokens": Field(_S, "vLLM: no stop before this many tokens"),
    "presence_penalty": Field(_S, "sampling"),
    "frequency_penalty": Field(_S, "sampling"),
    "repetition_penalty": Field(_S, "vLLM: sampling"),
    "logit_bias": Field(_S, "token id -> bias"),
    "seed": Field(_S, "reproducible sampling"),
    "ignore_eos": Field(_S, "vLLM: generate past the end-of-sequence token"),
    "stop_token_ids": Field(_S, "vLLM: token ids that stop generation"),
    "best_of": Field(_S, "accepted equal to n (no best-of ranking here)"),
    "cache_salt": Field(_S, "vLLM: separates prefix-cache entries"),
    "return_tokens_as_token_ids": Field(_S, "vLLM: logprobs tokens as 'token_id:N'"),
    "kvdrop": Field(_S, "kvdrop: the request's own drop policy, or null for none"),
    "response_format": Field(_S, "structured output: text, json_object or json_schema"),
    "guided_json": Field(_S, "vLLM: output held to a JSON schema"),
    "guided_regex": Field(_S, "vLLM: output held to a regular expression"),
    "guided_choice": Field(_S, "vLLM: output one of the strings listed"),
    "guided_grammar": Field(_S, "vLLM: output held to an EBNF grammar (xgrammar's)"),
    "structured_outputs": Field(_S, "vLLM: one of json, regex, choice, grammar, json_object"),
    "tools": Field(_S, "functions the chat may call (tool_calls in the reply)", _CHAT),
    "tool_choice": Field(_S, "none, auto, required, or a named function", _CHAT),
    "parallel_tool_calls": Field(_S, "false: at most one call", _CHAT),
    "continue_final_message": Field(_S, "vLLM: continue the last (assistant) message", _TEMPLATE),
    "chat_template_kwargs": Field(_S, "vLLM: more variables for the chat template", _TEMPLATE),
    # -- accepted and recorded nowhere ------------------------------------------------------
    "user": Field(_I, _PLATFORM, check=_string(256)),
    "safety_identifier": Field(_I, _PLATFORM, check=_string(128)),
    "prompt_cache_key": Field(
        _I,
        "OpenAI's prompt-cache routing key; the prefix cache here needs none",
        check=_string(256),
    ),
    "prompt_cache_retention": Field(
        _I,
        "OpenAI's prompt-cache lifetime; the prefix cache here keeps blocks while they fit",
        check=_one_of("in_memory", "24h"),
    ),
    "prompt_cache_options": Field(
        _I,
        "OpenAI's prompt-cache breakpoints; the prefix cache here matches whole blocks",
        check=_cache_options,
    ),
    "metadata": Field(
        _I, "a string map for OpenAI's dashboard; recorded nowhere here", check=_string_map
    ),
    # -- accepted only at their neutral values ----------------------------------------------
    "store": Field(_N, "completions are never stored here", neutral=(False,)),
    "service_tier": Field(_N, "one service tier here", neutral=("auto", "default")),
    "verbosity": Field(_N, "a reasoning model's hint", neutral=("medium",)),
    "suffix": Field(_N, "no fill-in-the-middle here", neutral=("",)),
    "use_beam_search": Field(_N, "no beam search here", neutral=(False,)),
    "length_penalty": Field(_N, "beam search only", neutral=(1, 1.0)),
    "truncate_prompt_tokens": Field(_N, "prompts are never truncated here; a long one is a 400"),
    "allowed_token_ids": Field(_N, "use logit_bias"),
    "bad_words": Field(_N, "use logit_bias", neutral=((), [])),
    "spaces_between_special_tokens": Field(_N, "the tokenizer's own decoding", neutral=(True,)),
    "priority": Field(_N, "first come, first served here", neutral=(0,)),
    "request_id": Field(_N, "the server names its requests"),
    "logits_processors": Field(_N, "no server-side code from requests"),
    "kv_transfer_params": Field(_N, "KV transfer is the connector's, not a request's"),
    "add_special_tokens": Field(_N, "the tokenizer's own special tokens", _ALL, neutral=(True,)),
    "functions": Field(_N, _NO_TOOLS, neutral=([],)),
    "function_call": Field(_N, _NO_TOOLS, neutral=("none",)),
    "modalities": Field(_N, _NO_MEDIA, neutral=(["text"],)),
    "audio": Field(_N, _NO_MEDIA),
    "prediction": Field(_N, "no predicted outputs (speculative decoding) here"),
    "reasoning_effort": Field(_N, "not a reasoning model's server"),
    "web_search_options": Field(_N, "no web search here"),
    "moderation": Field(_N, "no moderation is run here"),
    "documents": Field(_N, "no retrieval documents in the chat template"),
    "chat_template": Field(_N, "the model's own chat template only", _ALL),
    "mm_processor_kwargs": Field(_N, _NO_MEDIA, neutral=({},)),
}


def accepted(route: str) -> frozenset[str]:
    """Every field ``route`` accepts (at some value)."""
    return frozenset(name for name, f in FIELDS.items() if route in f.routes)


def neutral_fields() -> dict[str, tuple[Any, ...]]:
    """NEUTRAL fields and their neutral values."""
    return {name: f.neutral for name, f in FIELDS.items() if f.kind is Kind.NEUTRAL}


def listed(known: frozenset[str]) -> tuple[list[str], list[str]]:
    """What an unknown-field error lists of ``known``: the fields taken at any value, and
    those taken only at their neutral values."""
    neutral = [n for n in sorted(known) if n in FIELDS and FIELDS[n].kind is Kind.NEUTRAL]
    return [n for n in sorted(known) if n not in neutral], neutral


def check_accepted(body: Mapping[str, Any]) -> tuple[str, str] | None:
    """The first IGNORED field of ``body`` of a bad shape, or NEUTRAL field at another value
    than its neutral ones, as ``(field, message)``; None when all are fine (null always is)."""
    for name, f in FIELDS.items():
        value = body.get(name)
        if value is None or f.kind is Kind.SERVED:
            continue
        if f.kind is Kind.IGNORED and f.check is not None:
            problem = f.check(value, name)
            if problem is not None:
                return name, problem
        elif f.kind is Kind.NEUTRAL and not any(
            value == v and type(value) is type(v) for v in f.neutral
        ):
            allowed = ", ".join(json.dumps(v) for v in (None, *f.neutral))
            return name, (
                f"'{name}' is not supported by this server ({f.why}); send one of {allowed} "
                "or leave it out"
            )
    return None
