"""An OpenAI-compatible HTTP server around any ``PostCompletion`` callable.

Serves ``POST /v1/completions`` (JSON or server-sent events, one event per token), ``GET
/v1/models``, ``GET /health`` and optionally ``GET /stats`` with the stdlib's threading HTTP
server: every request runs in its own thread, so concurrent requests reach the engine together and
it can batch them. With ``return_tokens_as_token_ids`` (as vLLM's ``--return-tokens-as-token-ids``)
the logprobs tokens read ``"token_id:N"``, which is how
``kvdrop_sdk.adapters.openai.make_post_completion`` learns the ids.

Only standard-library networking; nothing here imports torch.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from kvdrop_sdk.events import PostCompletion, TokenEvent

__all__ = [
    "MAX_BODY_BYTES",
    "BadRequestError",
    "CompletionHTTPServer",
    "CompletionRequest",
    "IncrementalDetokenizer",
    "TextTokenizer",
    "parse_completion_request",
]

logger = logging.getLogger(__name__)

#: Largest request body accepted (a 100K-token prompt as JSON ids is about 0.7 MB).
MAX_BODY_BYTES = 32 * 1024 * 1024

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

#: OpenAI's default for ``max_tokens`` on the completions endpoint.
DEFAULT_MAX_TOKENS = 16


class TextTokenizer(Protocol):
    """What the server needs from a tokenizer: text prompts in, token text out."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


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


# ---------------------------------------------------------------------------------------------
# Request validation
# ---------------------------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _get_int(body: dict[str, Any], name: str, *, minimum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
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
    if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value):
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
    for i, tok in enumerate(value):
        if not _is_int(tok) or tok < 0:
            raise BadRequestError(
                f"'{name}[{i}]' must be a non-negative integer token id, got {tok!r}", param=name
            )
        if vocab_size is not None and tok >= vocab_size:
            raise BadRequestError(
                f"'{name}[{i}]' = {tok} is outside the vocabulary [0, {vocab_size})", param=name
            )
    return [int(t) for t in value]


def _prompt_ids(prompt: Any, tokenizer: TextTokenizer | None, vocab_size: int | None) -> list[int]:
    """Accept a string, a list of token ids, or a list holding exactly one of those."""
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
        ids = [int(t) for t in tokenizer.encode(prompt)]
        bad = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
        if bad:
            raise BadRequestError(
                f"the tokenizer turned 'prompt' into token id {bad[0]}, outside the model's "
                f"vocabulary [0, {vocab_size}); the tokenizer does not match the model",
                param="prompt",
            )
    elif isinstance(prompt, list):
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


def parse_completion_request(
    body: Any,
    *,
    model_name: str,
    tokenizer: TextTokenizer | None = None,
    vocab_size: int | None = None,
    max_model_len: int | None = None,
    return_tokens_as_token_ids: bool = False,
) -> CompletionRequest:
    """Validate a decoded JSON body of ``POST /v1/completions``; raise ``BadRequestError``.

    The engine gets ``max_tokens`` always and each other sampling field only when the client set
    it, so the engine's own defaults apply otherwise. ``top_k`` of 0 or -1 means "disabled" (as in
    vLLM) and is not passed on.
    """
    if not isinstance(body, dict):
        raise BadRequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - _KNOWN_FIELDS)
    if unknown:
        raise BadRequestError(
            f"unknown field(s) {', '.join(map(repr, unknown))}; supported: "
            + ", ".join(sorted(_KNOWN_FIELDS)),
            param=unknown[0],
        )
    model = body.get("model")
    if model is not None and model != model_name:
        raise BadRequestError(
            f"the model {model!r} does not exist; this server serves {model_name!r}",
            status=404,
            param="model",
        )
    if "prompt" not in body:
        raise BadRequestError("'prompt' is required", param="prompt")
    prompt_ids = _prompt_ids(body["prompt"], tokenizer, vocab_size)

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

    max_tokens = _get_int(body, "max_tokens", minimum=1)
    max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    if max_model_len is not None and len(prompt_ids) + max_tokens > max_model_len:
        raise BadRequestError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's "
            f"context length {max_model_len}; shorten the prompt or lower max_tokens",
            param="max_tokens",
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
    logprobs = _get_int(body, "logprobs", minimum=0)
    if logprobs is not None and logprobs > 0:
        raise BadRequestError(
            "only 'logprobs': 0 is supported (the sampled token, no alternatives)",
            param="logprobs",
        )
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
    )


# ---------------------------------------------------------------------------------------------
# Token text
# ---------------------------------------------------------------------------------------------


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without splitting multi-byte characters.

    Decodes a short window (the previous token(s) plus the new ones) and emits what it adds; a
    trailing U+FFFD means an incomplete UTF-8 sequence, so the text is held until it completes.
    """

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def add(self, token_id: int) -> str:
        """Append one token; return the new text it completes (possibly empty)."""
        self._ids.append(token_id)
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read])
        new_text = self._tok.decode(self._ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self._prefix = self._read
            self._read = len(self._ids)
            return delta
        return ""


# ---------------------------------------------------------------------------------------------
# HTTP server
# ---------------------------------------------------------------------------------------------


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    # Many clients connect at once (a batch of 30 streams); the stdlib's backlog of 5 drops some.
    request_queue_size = 256
    app: CompletionHTTPServer


class CompletionHTTPServer:
    """OpenAI-compatible ``/v1/completions`` server for one ``PostCompletion``.

    ``post_completion`` must be safe to call from many threads at once (each HTTP request runs in
    its own thread). ``tokenizer`` enables text prompts; with ``detokenize`` the server computes
    each token's text itself instead of using ``TokenEvent.text``. Errors the engine raises before
    its first token as ``ValueError``/``TypeError`` are answered with 400, others with 500;
    errors after streaming began are sent as an SSE ``{"error": ...}`` event before ``[DONE]``.
    ``health`` backs ``GET /health`` (503 when it returns False); ``stats``, when given, is served
    as JSON at ``GET /stats`` (the reference engine's counters).
    """

    def __init__(
        self,
        post_completion: PostCompletion,
        *,
        model_name: str,
        tokenizer: TextTokenizer | None = None,
        host: str = "127.0.0.1",
        port: int = 8000,
        return_tokens_as_token_ids: bool = False,
        detokenize: bool = False,
        vocab_size: int | None = None,
        max_model_len: int | None = None,
        health: Callable[[], bool] | None = None,
        stats: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        if not model_name:
            raise ValueError("model_name must be a non-empty string")
        if detokenize and tokenizer is None:
            raise ValueError("detokenize=True needs a tokenizer")
        self.post_completion = post_completion
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.return_tokens_as_token_ids = return_tokens_as_token_ids
        self.detokenize = detokenize
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.health = health
        self.stats = stats
        self.created = int(time.time())
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._httpd = _Server((host, port), _Handler)
        self._httpd.app = self

    @property
    def host(self) -> str:
        """The address the server is bound to."""
        return str(self._httpd.server_address[0])

    @property
    def port(self) -> int:
        """The bound port (useful with ``port=0``)."""
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:8000`` (clients append ``/v1/completions``)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def closing(self) -> bool:
        """True once ``stop`` was called; running streams end at their next token."""
        return self._closing.is_set()

    def start(self) -> CompletionHTTPServer:
        """Serve in a background daemon thread; returns self."""
        if self._thread is not None:
            raise RuntimeError("server already started")
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.05},  # how soon ``stop`` is noticed
            name="kvdrop-http",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop accepting requests, end running streams, and close the socket."""
        self._closing.set()
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
            self._thread = None
        self._httpd.server_close()

    def __enter__(self) -> CompletionHTTPServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- responses (called by the handler) -----------------------------------------------

    def models_payload(self) -> dict[str, Any]:
        """Body of ``GET /v1/models``."""
        card: dict[str, Any] = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "kvdrop",
            "root": self.model_name,
        }
        if self.max_model_len is not None:
            card["max_model_len"] = self.max_model_len
        return {"object": "list", "data": [card]}

    def parse(self, body: Any) -> CompletionRequest:
        """Validate a completion request with this server's settings."""
        return parse_completion_request(
            body,
            model_name=self.model_name,
            tokenizer=self.tokenizer,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            return_tokens_as_token_ids=self.return_tokens_as_token_ids,
        )


def _error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    kind = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowed"}.get(
        status, "InternalServerError" if status >= 500 else "InvalidRequestError"
    )
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


class _ChoiceBuilder:
    """Builds the per-token pieces of a choice: text delta, logprobs token and finish reason."""

    def __init__(self, app: CompletionHTTPServer, req: CompletionRequest) -> None:
        self.app = app
        self.req = req
        self.detok = (
            IncrementalDetokenizer(app.tokenizer) if app.detokenize and app.tokenizer else None
        )
        self.count = 0
        self.offset = 0

    def text_of(self, event: TokenEvent) -> str:
        return self.detok.add(event.token_id) if self.detok is not None else event.text

    def logprob_token(self, event: TokenEvent, text: str) -> str:
        if self.req.tokens_as_token_ids:
            return f"token_id:{event.token_id}"
        if self.app.tokenizer is not None:
            return self.app.tokenizer.decode([event.token_id])
        return text

    def finish_of(self, event: TokenEvent) -> str | None:
        if event.finish_reason is not None:
            return event.finish_reason
        return "length" if self.count >= self.req.max_tokens else None


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    server_version = "kvdrop-engine"

    # ---- plumbing ------------------------------------------------------------------------

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s %s", self.address_string(), format % args)

    def _send_json(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, status: int, message: str, param: str | None = None) -> None:
        self._send_json(status, _error_body(message, status, param))

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _sse(self, payload: dict[str, Any] | str) -> None:
        text = payload if isinstance(payload, str) else json.dumps(payload)
        self._write_chunk(f"data: {text}\n\n".encode())

    def _read_json(self) -> Any:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raise BadRequestError(
                "chunked request bodies are not supported; send Content-Length", status=411
            )
        length_header = self.headers.get("Content-Length")
        if length_header is None:
            raise BadRequestError(
                "a JSON body with a Content-Length header is required", status=411
            )
        try:
            length = int(length_header)
        except ValueError:
            raise BadRequestError(f"bad Content-Length {length_header!r}") from None
        if length < 0 or length > MAX_BODY_BYTES:
            raise BadRequestError(
                f"request body of {length} bytes is over the limit of {MAX_BODY_BYTES}", status=413
            )
        raw = self.rfile.read(length)
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise BadRequestError(f"the request body is not valid JSON: {exc}") from None

    # ---- routes --------------------------------------------------------------------------

    def do_GET(self) -> None:
        app = self.server.app
        path = self.path.split("?", 1)[0].rstrip("/")
        if path == "/health":
            healthy = app.health is None or app.health()
            if healthy and not app.closing:
                self._send_json(200, {"status": "ok"})
            else:
                self._send_error(503, "the engine is not healthy or is shutting down")
        elif path == "/stats" and app.stats is not None:
            self._send_json(200, app.stats())
        elif path == "/v1/models":
            self._send_json(200, app.models_payload())
        elif path == "/v1/completions":
            self._send_error(405, "use POST for /v1/completions")
        else:
            self._send_error(
                404, f"no route {path or '/'}; try /v1/completions, /v1/models, /health"
            )

    def do_POST(self) -> None:
        app = self.server.app
        path = self.path.split("?", 1)[0].rstrip("/")
        if path != "/v1/completions":
            # Drain a sane body so the connection stays usable; otherwise close it after refusing.
            length = self.headers.get("Content-Length") or "0"
            if length.isdigit() and int(length) <= MAX_BODY_BYTES:
                self.rfile.read(int(length))
            else:
                self.close_connection = True
            status = 405 if path in ("/health", "/v1/models") else 404
            self._send_error(status, f"no POST route {path or '/'}; POST /v1/completions")
            return
        try:
            req = app.parse(self._read_json())
        except BadRequestError as exc:
            self.close_connection = exc.status in (411, 413)
            self._send_error(exc.status, str(exc), exc.param)
            return
        if app.closing:
            self._send_error(503, "the server is shutting down")
            return
        self._complete(app, req)

    # ---- completions ---------------------------------------------------------------------

    def _complete(self, app: CompletionHTTPServer, req: CompletionRequest) -> None:
        """Call the engine; answer 400/500 if it fails before its first token, else stream/JSON."""
        events: Iterator[TokenEvent] | None = None
        try:
            events = iter(
                app.post_completion(req.prompt_token_ids, dict(req.sampling_params), req.cache_salt)
            )
            first: TokenEvent | None = next(events)
        except StopIteration:
            first = None
        except (ValueError, TypeError) as exc:
            _close(events)
            self._send_error(400, f"the engine rejected the request: {exc}")
            return
        except Exception as exc:
            logger.exception("engine failed before its first token")
            _close(events)
            self._send_error(500, f"the engine failed: {type(exc).__name__}: {exc}")
            return
        assert events is not None
        try:
            if req.stream:
                self._stream(app, req, first, events)
            else:
                self._collect(app, req, first, events)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
            logger.info("client disconnected; request cancelled")
        finally:
            _close(events)

    def _stream(
        self,
        app: CompletionHTTPServer,
        req: CompletionRequest,
        first: TokenEvent | None,
        events: Iterator[TokenEvent],
    ) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        build = _ChoiceBuilder(app, req)

        def chunk(text: str, logprobs: dict[str, Any] | None, finish: str | None) -> dict[str, Any]:
            return {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": app.model_name,
                "choices": [
                    {
                        "index": 0,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": finish,
                        "stop_reason": None,
                    }
                ],
            }

        finish: str | None = None
        event = first
        try:
            while event is not None:
                build.count += 1
                text = build.text_of(event)
                finish = build.finish_of(event)
                logprobs = None
                if req.logprobs is not None:
                    logprobs = {
                        "text_offset": [build.offset],
                        "token_logprobs": [None],
                        "tokens": [build.logprob_token(event, text)],
                        "top_logprobs": [None],
                    }
                build.offset += len(text)
                self._sse(chunk(text, logprobs, finish))
                if finish is not None or app.closing:
                    break
                event = next(events, None)
            if finish is None:
                # The engine ended without a reason: an EOS it did not label, or server shutdown.
                finish = "stop"
                self._sse(chunk("", None, finish))
        except (BrokenPipeError, ConnectionResetError):
            raise
        except Exception as exc:
            logger.exception("engine failed while streaming")
            self._sse(_error_body(f"the engine failed: {type(exc).__name__}: {exc}", 500))
        if req.include_usage:
            usage = {
                "prompt_tokens": len(req.prompt_token_ids),
                "completion_tokens": build.count,
                "total_tokens": len(req.prompt_token_ids) + build.count,
            }
            self._sse({**chunk("", None, None), "choices": [], "usage": usage})
        self._sse("[DONE]")
        self._write_chunk(b"")

    def _collect(
        self,
        app: CompletionHTTPServer,
        req: CompletionRequest,
        first: TokenEvent | None,
        events: Iterator[TokenEvent],
    ) -> None:
        build = _ChoiceBuilder(app, req)
        texts: list[str] = []
        tokens: list[str] = []
        offsets: list[int] = []
        finish: str | None = None
        event = first
        try:
            while event is not None:
                build.count += 1
                text = build.text_of(event)
                finish = build.finish_of(event)
                tokens.append(build.logprob_token(event, text))
                offsets.append(build.offset)
                build.offset += len(text)
                texts.append(text)
                if finish is not None or app.closing:
                    break
                event = next(events, None)
        except Exception as exc:
            logger.exception("engine failed while generating")
            self._send_error(500, f"the engine failed: {type(exc).__name__}: {exc}")
            return
        logprobs = None
        if req.logprobs is not None:
            logprobs = {
                "text_offset": offsets,
                "token_logprobs": [None] * len(tokens),
                "tokens": tokens,
                "top_logprobs": [None] * len(tokens),
            }
        n_prompt = len(req.prompt_token_ids)
        self._send_json(
            200,
            {
                "id": f"cmpl-{uuid.uuid4().hex}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": app.model_name,
                "choices": [
                    {
                        "index": 0,
                        "text": "".join(texts),
                        "logprobs": logprobs,
                        "finish_reason": finish or "stop",
                        "stop_reason": None,
                    }
                ],
                "usage": {
                    "prompt_tokens": n_prompt,
                    "completion_tokens": build.count,
                    "total_tokens": n_prompt + build.count,
                },
            },
        )


def _close(events: Iterator[TokenEvent] | None) -> None:
    """Close a generator so the engine frees the request's blocks (no-op for other iterators)."""
    close = getattr(events, "close", None)
    if callable(close):
        try:
            close()
        except Exception:
            logger.exception("closing the engine's event stream failed")
