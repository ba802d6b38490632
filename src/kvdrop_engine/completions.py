"""The OpenAI ``/v1/completions`` and ``/v1/chat/completions`` requests (and vLLM's
``/tokenize`` and ``/detokenize``), validated apart from any transport.

One parser serves both routes (:func:`parse_request`); a :class:`Route` says what differs. The
sampling values go to ``SamplingParams``, their one validator, under the engine's names. Every
part of a request is bounded before the step that would read it: its prompts in
:mod:`kvdrop_engine.request_prompts` (text by characters before tokenizing, a chat's messages
and parts before templating), ``stop`` and ``stop_token_ids`` by count. Bad input raises
:class:`BadRequestError` with the HTTP status and the field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvdrop_engine.drop import UNSET
from kvdrop_engine.errors import InvalidRequestError
from kvdrop_engine.request_fields import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    DETOKENIZE_FIELDS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SAMPLING_FIELDS,
    TOKENIZE_FIELDS,
    BadRequestError,
    check_body,
    check_neutral,
    get_bool,
    get_int,
    get_stop_strings,
    get_str,
    get_streaming,
    get_token_ids,
)
from kvdrop_engine.request_guides import guide_from_body
from kvdrop_engine.request_options import RequestOptionError, RequestOptions, check_request
from kvdrop_engine.request_prompts import (
    CHARS_PER_TOKEN_BOUND,
    DEFAULT_MAX_PROMPT_CHARS,
    MAX_CHAT_MESSAGES,
    MAX_PROMPTS,
    MAX_ROLE_CHARS,
    ChatTemplate,
    Settings,
    chat_prompt,
    completion_prompts,
    max_prompt_chars_for,
    text_ids,
)
from kvdrop_engine.sampling import (
    MAX_LOGPROBS,
    MIN_TEMPERATURE,
    SamplingParamError,
    SamplingParams,
)
from kvdrop_engine.structured import MISSING as STRUCTURED_MISSING
from kvdrop_engine.structured import available as structured_available
from kvdrop_engine.tools import Tools, parse_tools
from kvdrop_sdk.validate import is_int, is_number

__all__ = [
    "CHARS_PER_TOKEN_BOUND",
    "DEFAULT_MAX_PROMPT_CHARS",
    "DEFAULT_MAX_TOKENS",
    "MAX_CHAT_MESSAGES",
    "MAX_N",
    "MAX_PROMPTS",
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

#: OpenAI's default for ``max_tokens`` on the completions endpoint.
DEFAULT_MAX_TOKENS = 16
#: Fallback ``max_tokens`` of a chat request when the context length is unknown.
DEFAULT_CHAT_MAX_TOKENS = 512
#: Most choices per request (``n``); prompts x ``n`` are bounded by ``MAX_PROMPTS``.
MAX_N = 16


@dataclass(frozen=True)
class CompletionRequest:
    """A validated completions or chat request, ready for the engine.

    ``prompts`` holds every prompt of a batched completions request (``prompt_token_ids`` is
    the first); choice ``p * n + i`` is choice ``i`` of prompt ``p``, as in vLLM. ``logprobs``
    is None (none asked) or how many alternatives each token lists; ``prompt_logprobs`` how
    many each prompt token lists; ``stop`` are the stop strings; ``n`` choices are generated
    from seeds ``seed + i`` (when a seed is given); ``echo`` puts each prompt before its text.
    """

    prompt_token_ids: list[int]
    params: SamplingParams
    options: RequestOptions
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
    prompts: tuple[list[int], ...] = ()
    echo: bool = False
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    #: Each prompt's text as sent (None for token ids): what ``echo`` repeats.
    prompt_texts: tuple[str | None, ...] = ()
    #: A chat's tools when its choices may call them (``tool_choice`` not "none"): the reply's
    #: text is parsed into ``tool_calls`` (:mod:`kvdrop_engine.tools`).
    tools: Tools | None = None

    def __post_init__(self) -> None:
        if not self.prompts:
            object.__setattr__(self, "prompts", (self.prompt_token_ids,))

    @property
    def num_choices(self) -> int:
        """Choices over every prompt: ``n`` per prompt."""
        return self.n * len(self.prompts)

    def prompt_of(self, index: int) -> list[int]:
        """The prompt of choice ``index``."""
        return self.prompts[index // self.n]

    @property
    def cache_salt(self) -> str:
        """The request's cache salt (one of its options)."""
        return self.options.cache_salt

    def choice_params(self, index: int) -> SamplingParams:
        """The sampling parameters of choice ``index`` (its own seed when one was given; the
        choices of each prompt use the same seeds, as separate requests would)."""
        offset = index % self.n
        if not offset or self.params.seed is None:
            return self.params
        return dataclasses.replace(self.params, seed=(self.params.seed + offset) % 2**64)


def _completion_logprobs(body: dict[str, Any]) -> Any:
    return body.get("logprobs")


def _chat_logprobs(body: dict[str, Any]) -> Any:
    """``top_logprobs`` alternatives when ``logprobs`` is true (the value is checked by
    ``SamplingParams`` under the name ``logprobs``)."""
    wanted = get_bool(body, "logprobs")
    top = body.get("top_logprobs")
    if top is not None and not wanted:
        raise BadRequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    if not wanted:
        return None
    return 0 if top is None else top


def _completion_max_tokens(body: dict[str, Any], prompt: list[int], settings: Settings) -> Any:
    value = body.get("max_tokens")
    return DEFAULT_MAX_TOKENS if value is None else value


def _chat_max_tokens(body: dict[str, Any], prompt: list[int], settings: Settings) -> Any:
    """``max_completion_tokens`` (or the older ``max_tokens``); as in vLLM, the rest of the
    context by default."""
    value = body.get(_max_tokens_name(body))
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


def _completion_prompts(
    body: dict[str, Any], settings: Settings, tools: Tools | None
) -> list[list[int]]:
    return completion_prompts(body, settings)


def _chat_prompts(body: dict[str, Any], settings: Settings, tools: Tools | None) -> list[list[int]]:
    return [chat_prompt(body, settings, None if tools is None else tools.template())]


def _max_tokens_name(body: dict[str, Any]) -> str:
    return "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"


@dataclass(frozen=True)
class Route:
    """What differs between the completions and the chat route: the fields, the prompts, the
    ``max_tokens`` default, and the field that asks for logprobs (with its engine name)."""

    chat: bool
    fields: frozenset[str]
    prompts: Callable[[dict[str, Any], Settings, Tools | None], list[list[int]]]
    max_tokens: Callable[[dict[str, Any], list[int], Settings], Any]
    logprobs: Callable[[dict[str, Any]], Any]
    logprobs_name: str


COMPLETIONS = Route(
    False,
    COMPLETION_FIELDS,
    _completion_prompts,
    _completion_max_tokens,
    _completion_logprobs,
    "logprobs",
)
CHAT = Route(True, CHAT_FIELDS, _chat_prompts, _chat_max_tokens, _chat_logprobs, "top_logprobs")


def _engine_values(body: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """The sampling fields sent, under the engine's names and in its forms (JSON types only:
    the values are ``SamplingParams``'): a tiny positive temperature raised to the minimum and
    ``top_k`` 0 read as -1 (as vLLM does), ``stop_token_ids`` bounded in count first."""
    params = {name: body[name] for name in SAMPLING_FIELDS if body.get(name) is not None}
    temperature = params.get("temperature")
    if is_number(temperature) and 0 < temperature < MIN_TEMPERATURE:
        params["temperature"] = MIN_TEMPERATURE
    if params.get("top_k") == 0 and is_int(params["top_k"]):
        params["top_k"] = -1
    if "stop_token_ids" in params:
        ids = get_token_ids(
            params["stop_token_ids"], settings.vocab_size, "stop_token_ids", MAX_STOP_TOKEN_IDS
        )
        params["stop_token_ids"] = sorted(set(ids))
    bias = params.get("logit_bias")
    if bias is not None and not isinstance(bias, dict):
        raise BadRequestError(
            "'logit_bias' must be an object of token id -> bias", param="logit_bias"
        )
    return params


def _options(body: dict[str, Any], tools: Tools | None) -> RequestOptions:
    """The request's options (``cache_salt``, the ``"kvdrop"`` override: null for no cut or
    ``{"policy", "keep_ratio"}``, the structured output its ``response_format`` / ``guided_*``
    or a required or named ``tool_choice`` asks for), built once; 400 naming the field when one
    is malformed."""
    salt = body.get("cache_salt")
    cut = body["kvdrop"] if "kvdrop" in body else UNSET
    guide = guide_from_body(body)  # response_format, guided_*: kvdrop_engine.structured
    forced = None if tools is None else tools.guide()  # kvdrop_engine.tools
    if guide is not None and forced is not None:
        raise BadRequestError(
            "a required or named 'tool_choice' sets the output's structure; leave out "
            "'response_format' and the guided fields",
            param="tool_choice",
        )
    if forced is not None and not structured_available():
        raise BadRequestError(f"'tool_choice': {STRUCTURED_MISSING}", param="tool_choice")
    guide = guide or forced
    try:
        return RequestOptions("" if salt is None else salt, cut, guide=guide)
    except RequestOptionError as exc:
        raise BadRequestError(str(exc), param=exc.field) from None


def _sampling(
    body: dict[str, Any], route: Route, values: dict[str, Any], settings: Settings
) -> SamplingParams:
    """``values`` validated by ``SamplingParams`` (the one validator); its error names the field
    as the client sent it."""
    names = {"max_tokens": _max_tokens_name(body), "logprobs": route.logprobs_name}
    try:
        params = SamplingParams.from_dict(values)
        if settings.vocab_size is not None:
            params.check_vocab(settings.vocab_size)
    except SamplingParamError as exc:
        name = names.get(exc.field, exc.field)
        message = str(exc).replace(f"'{exc.field}'", f"'{name}'", 1)
        raise BadRequestError(message, param=name) from None
    except InvalidRequestError as exc:
        raise BadRequestError(str(exc)) from None
    return params


def _check_context(
    body: dict[str, Any], prompts: list[list[int]], max_tokens: int, limit: int | None
) -> None:
    longest = max(len(p) for p in prompts)
    if limit is not None and longest + max_tokens > limit:
        name = _max_tokens_name(body)
        raise BadRequestError(
            f"prompt ({longest} tokens) + {name} ({max_tokens}) exceeds the model's context "
            f"length {limit}; shorten the prompt or lower {name}",
            param=name,
        )


def _echo_options(body: dict[str, Any], route: Route) -> tuple[bool, int | None]:
    """``echo`` (completions only: the prompt before the text) and ``prompt_logprobs``."""
    echo = bool(get_bool(body, "echo"))
    if echo and route.chat:
        raise BadRequestError(
            "'echo' on chat repeats the last message, which this server does not do; leave it "
            "false",
            param="echo",
        )
    top = get_int(body, "prompt_logprobs", minimum=0)
    if top is not None and top > MAX_LOGPROBS:
        raise BadRequestError(
            f"'prompt_logprobs' asks for {top} alternatives per token; at most {MAX_LOGPROBS}",
            param="prompt_logprobs",
        )
    return echo, top


def _texts_of(prompt: Any) -> tuple[str | None, ...]:
    batch = isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list))
    return tuple(p if isinstance(p, str) else None for p in (prompt if batch else [prompt]))


def parse_request(body: Any, route: Route, settings: Settings) -> CompletionRequest:
    """Validate a decoded JSON body of ``route``; raise ``BadRequestError``.

    Cheap checks come first (fields, ``n``, ``stop``), then the prompts (bounded before they
    are tokenized or templated), then what depends on their length.
    """
    body = check_body(body, route.fields, settings.model_name)
    n = get_int(body, "n", minimum=1) or 1
    if n > MAX_N:
        raise BadRequestError(f"'n' must be at most {MAX_N}, got {n}", param="n")
    check_neutral(body, n)
    stop = get_stop_strings(body, settings.tokenizer is not None)
    stream, include_usage = get_streaming(body)
    echo, prompt_logprobs = _echo_options(body, route)
    if echo and settings.tokenizer is None:
        raise BadRequestError("'echo' needs text output and this server has no tokenizer")
    tools = parse_tools(body) if route.chat else None
    options = _options(body, tools)
    as_ids = get_bool(body, "return_tokens_as_token_ids")
    skip_special = get_bool(body, "skip_special_tokens")
    include_stop = get_bool(body, "include_stop_str_in_output")
    values = _engine_values(body, settings)
    values["logprobs"] = route.logprobs(body)
    prompts = route.prompts(body, settings, tools)
    values["max_tokens"] = route.max_tokens(body, prompts[0], settings)
    params = _sampling(body, route, values, settings)
    try:
        check_request(params, options)  # sampling against options: guides, ignore_eos, min_tokens
    except RequestOptionError as exc:
        raise BadRequestError(str(exc), param=exc.field) from None
    _check_context(body, prompts, params.max_tokens, settings.max_model_len)
    return CompletionRequest(
        prompt_token_ids=prompts[0],
        params=params,
        options=options,
        max_tokens=params.max_tokens,
        stream=stream,
        include_usage=include_usage,
        logprobs=params.logprobs,
        tokens_as_token_ids=settings.return_tokens_as_token_ids if as_ids is None else as_ids,
        chat=route.chat,
        n=n,
        stop=stop,
        skip_special_tokens=skip_special is not False,
        include_stop_str=bool(include_stop),
        prompts=tuple(prompts),
        prompt_texts=_texts_of(body.get("prompt")),
        echo=echo,
        prompt_logprobs=prompt_logprobs,
        min_tokens=params.min_tokens,
        tools=None if tools is None or tools.choice == "none" else tools,
    )


def parse_completion_request(body: Any, **settings: Any) -> CompletionRequest:
    """``POST /v1/completions`` (keywords: the fields of :class:`Settings`)."""
    return parse_request(body, COMPLETIONS, Settings(**settings))


def parse_chat_request(body: Any, **settings: Any) -> CompletionRequest:
    """``POST /v1/chat/completions`` (keywords: the fields of :class:`Settings`)."""
    return parse_request(body, CHAT, Settings(**settings))


def parse_tokenize_request(body: Any, settings: Settings) -> tuple[list[int], bool]:
    """vLLM's ``POST /tokenize``: ``{"prompt": text}`` or ``{"messages": [...]}`` (with
    ``add_generation_prompt``, default true) to token ids, bounded as the routes bound them,
    and whether ``return_token_strs`` asks for each token's text too."""
    body = check_body(body, TOKENIZE_FIELDS, settings.model_name)
    check_neutral(body, 1)
    with_strs = bool(get_bool(body, "return_token_strs"))
    if ("prompt" in body) == ("messages" in body):
        raise BadRequestError("send exactly one of 'prompt' (text) or 'messages'", param="prompt")
    if "messages" in body:
        return chat_prompt(body, settings), with_strs
    text = get_str(body, "prompt")
    return (text_ids(text or "", settings, "prompt") if text else []), with_strs


def parse_detokenize_request(body: Any, settings: Settings) -> list[int]:
    """vLLM's ``POST /detokenize``: ``{"tokens": [ids]}``, ids in the vocabulary."""
    body = check_body(body, DETOKENIZE_FIELDS, settings.model_name)
    if settings.tokenizer is None:
        raise BadRequestError("this server has no tokenizer", param="tokens")
    return get_token_ids(body.get("tokens"), settings.vocab_size, "tokens", settings.max_model_len)
