"""An OpenAI-compatible HTTP server around any ``PostCompletion`` callable: the transport only.

Serves ``POST /v1/completions`` and ``POST /v1/chat/completions`` (JSON or server-sent events;
``n`` choices, batched prompts), vLLM's ``POST /tokenize`` and ``/detokenize``, ``GET /metrics``
(:mod:`kvdrop_engine.metrics`), ``GET /v1/models`` and ``/v1/models/{id}``, ``/health``,
``/ping``, ``/version`` and optionally ``/stats``, one thread per request so the engine batches
concurrent ones. What a request may hold is :mod:`kvdrop_engine.completions`, a response
:mod:`kvdrop_engine.responses`; with ``return_tokens_as_token_ids`` logprobs tokens carry ids
(what ``kvdrop_sdk.adapters.openai.make_post_completion`` reads). With ``api_key`` every route
but the probes needs ``Authorization: Bearer KEY``.

What one client may cost is :mod:`kvdrop_sdk.http_limits`' rule, shared with the cache server:
the body size checked before reading (413), the JSON's containers, values and depth before
parsing, one deadline for the whole request, a bound on open connections, log fields escaped and
capped. Every request is one log line; a client that goes away cancels its request
(:mod:`kvdrop_engine.client_watch` notices) and is one line too, never a traceback. Only
standard-library networking; nothing here imports torch.
"""

from __future__ import annotations

import hmac
import importlib.metadata
import json
import logging
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from kvdrop_engine.client_watch import (
    DISCONNECTS,
    GONE_CHECK_S,
    ClientWatch,
    client_gone,
    close_all,
)
from kvdrop_engine.completions import (
    CHAT,
    COMPLETIONS,
    BadRequestError,
    CompletionRequest,
    Route,
    Settings,
    max_prompt_chars_for,
    parse_request,
)
from kvdrop_engine.fanout import ChoiceStreams
from kvdrop_engine.metrics import EngineGauges, ServerMetrics
from kvdrop_engine.request_fields import MAX_BODY_BYTES
from kvdrop_engine.responses import (
    ChatCompletionBuilder,
    CompletionBuilder,
    detokenize_body,
    error_body,
    model_card,
    models_body,
    tokenize_body,
)
from kvdrop_engine.sequence import ScoreHandle
from kvdrop_engine.tokenizer import TextTokenizer
from kvdrop_sdk.adapters.openai import token_id_text
from kvdrop_sdk.events import PostCompletion, TokenEvent
from kvdrop_sdk.http_limits import (
    HTTPLimitError,
    HTTPLimits,
    LimitedHandler,
    LimitedHTTPServer,
    dumps_sliced,
    log_field,
)

__all__ = ["ROUTES", "CompletionHTTPServer", "ScorePrompt", "check_api_key"]

#: ``(prompt, top, cache_salt) -> handle``: the log-probability, rank and ``top`` alternatives
#: of each prompt token after the first (``prompt_logprobs``; the CLI builds it from the
#: engine): ``handle.result()`` waits for them, ``handle.close()`` cancels them.
ScorePrompt = Callable[[list[int], int, str], ScoreHandle]
#: Most bytes the log-probabilities of one answer may take (prompt and sampled tokens,
#: alternatives included), as :meth:`CompletionHTTPServer.logprob_bytes` bounds them before
#: anything runs: 64 prompts of 1,000 ids with prompt_logprobs 20 made a 97.2 MB answer.
MAX_LOGPROB_BYTES = 32 << 20
#: Bytes of one log-probability's JSON besides its token's text: the float (at most 24
#: characters), its rank, the keys, quotes, braces and commas of every route's format.
LOGPROB_ENTRY_BYTES = 112
#: The longest token text assumed when the vocabulary cannot be listed (no ``vocab_size``).
UNLISTED_TOKEN_BYTES = 256

logger = logging.getLogger(__name__)


#: The generating POST routes and what each takes.
_POST_ROUTES: dict[str, Route] = {"/v1/completions": COMPLETIONS, "/v1/chat/completions": CHAT}
_TOKEN_ROUTES = ("/tokenize", "/detokenize")
#: Routes answered without the API key (probes and scrapes, open in vLLM too).
_OPEN_ROUTES = frozenset({"/health", "/ping", "/version", "/metrics"})

#: What the server answers, for its start-up line and its 404s.
ROUTES = (
    "POST /v1/completions, POST /v1/chat/completions, POST /tokenize, POST /detokenize, "
    "GET /v1/models, GET /v1/models/{id}, GET /health, GET /metrics, GET /version, GET|POST /ping"
)


class _Server(LimitedHTTPServer):
    """The shared limits' server (connections bounded) with a link to its app."""

    app: CompletionHTTPServer

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away or stalled is one log line; anything else keeps its
        traceback."""
        exc = sys.exc_info()[1]
        client = ":".join(str(part) for part in client_address[:2])
        if isinstance(exc, DISCONNECTS):  # reset, broken pipe, aborted, read timeout
            logger.info("client %s disconnected (%s)", client, exc.strerror or exc)
        else:
            logger.exception("request from %s failed", client)


def check_api_key(key: object, what: str = "api_key") -> str:
    """``key`` if it can be sent as ``Authorization: Bearer KEY``: a non-empty string of
    printable ASCII without surrounding whitespace. A key read with its newline (``$(cat
    file)`` keeps none, ``KEY="k\n"`` does) would otherwise start a server that refuses every
    client; ``ValueError`` names ``what`` and the problem."""
    if not isinstance(key, str) or not key.strip():
        raise ValueError(f"{what} must not be empty (leave it out to serve without a key)")
    if key != key.strip():
        raise ValueError(
            f"{what} has leading or trailing whitespace (a newline from a file or an echo?); "
            "clients cannot send it in an Authorization header: strip it"
        )
    bad = next((c for c in key if not (c.isascii() and c.isprintable())), None)
    if bad is not None:
        raise ValueError(
            f"{what} holds {bad!r}; expected printable ASCII (what an Authorization header carries)"
        )
    return key


class CompletionHTTPServer:
    """OpenAI-compatible ``/v1/completions`` and ``/v1/chat/completions`` server for one
    ``PostCompletion``.

    ``post_completion`` must be safe to call from many threads at once (each HTTP request runs in
    its own thread). It is called as ``post_completion(prompt, params, options)``: the request's
    ``SamplingParams`` and ``RequestOptions``, built and validated once from the body
    (:mod:`kvdrop_engine.request_options`), which ``Engine.post_completion`` takes as they are.
    ``tokenizer`` enables text prompts, and chat when it has a chat template
    (``apply_chat_template``); with ``detokenize`` the server computes each token's text itself
    instead of using ``TokenEvent.text``. Errors the engine raises before its first token as
    ``ValueError``/``TypeError`` are answered with 400, others with 500;
    errors after streaming began are sent as an SSE ``{"error": ...}`` event before ``[DONE]``.
    ``health`` backs ``GET /health`` (503 when it returns False); ``stats``, when given, is served
    as JSON at ``GET /stats`` (the reference engine's counters); ``gauges`` adds the engine's
    queues, KV blocks and cache counters to ``GET /metrics``. With a tokenizer the server
    detokenizes itself unless ``detokenize=False`` (``skip_special_tokens`` and ``stop`` strings
    need it). ``limits`` are the shared HTTP limits (default: ``read_timeout`` as the request
    deadline and idle timeout); ``max_prompt_chars`` bounds text prompts before tokenizing
    (default ``max_model_len`` x 16); ``score_prompt`` serves ``prompt_logprobs`` and ``echo``
    with logprobs; ``api_key`` requires ``Authorization: Bearer KEY``.
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
        detokenize: bool | None = None,
        vocab_size: int | None = None,
        max_model_len: int | None = None,
        health: Callable[[], bool] | None = None,
        stats: Callable[[], dict[str, Any]] | None = None,
        gauges: EngineGauges | None = None,
        read_timeout: float = 30.0,
        limits: HTTPLimits | None = None,
        max_prompt_chars: int | None = None,
        score_prompt: ScorePrompt | None = None,
        api_key: str | None = None,
    ) -> None:
        if not model_name:
            raise ValueError("model_name must be a non-empty string")
        if detokenize and tokenizer is None:
            raise ValueError("detokenize=True needs a tokenizer")
        if limits is None:
            limits = HTTPLimits(
                max_body_bytes=MAX_BODY_BYTES,
                request_timeout_s=read_timeout,
                idle_timeout_s=read_timeout,
            )
        self.limits = limits
        self.read_timeout = limits.request_timeout_s
        self.max_prompt_chars = (
            max_prompt_chars_for(max_model_len) if max_prompt_chars is None else max_prompt_chars
        )
        self.post_completion = post_completion
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.return_tokens_as_token_ids = return_tokens_as_token_ids
        self.detokenize = tokenizer is not None if detokenize is None else detokenize
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.health = health
        self.stats = stats
        self.gauges = gauges
        self.metrics = ServerMetrics(model_name, gauges)
        self.score_prompt = score_prompt
        #: (longest escaped token text, longest bytes list) by token naming (:meth:`logprob_bytes`).
        self._token_costs: dict[bool, tuple[int, int]] = {}
        self.api_key = None if api_key is None else check_api_key(api_key)
        self.settings = Settings(
            model_name=model_name,
            tokenizer=tokenizer,
            vocab_size=vocab_size,
            max_model_len=max_model_len,
            return_tokens_as_token_ids=return_tokens_as_token_ids,
            max_prompt_chars=self.max_prompt_chars,
        )
        self.created = int(time.time())
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._httpd = _Server((host, port), _Handler, limits)
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
        return models_body(self.model_name, self.created, self.max_model_len)

    def parse(self, body: Any, *, chat: bool = False) -> CompletionRequest:
        """Validate a completion (or, with ``chat``, a chat completion) request with this
        server's settings."""
        return parse_request(body, CHAT if chat else COMPLETIONS, self.settings)

    def metrics_text(self) -> str:
        """Body of ``GET /metrics``."""
        return self.metrics.render()

    def token_payload(self, path: str, body: Any) -> dict[str, Any]:
        """Body of ``POST /tokenize`` or ``POST /detokenize`` (vLLM's shapes)."""
        answer = detokenize_body if path == "/detokenize" else tokenize_body
        return answer(body, self.settings)

    def authorized(self, header: str | None) -> bool:
        """Whether a request's ``Authorization`` header carries this server's key (always
        true without one); compared in constant time."""
        if self.api_key is None:
            return True
        scheme, _, token = (header or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(), self.api_key.encode()
        )

    def scoring_top(self, req: CompletionRequest) -> int | None:
        """The alternatives each prompt token lists when the request asks for prompt logprobs
        (or echoes with logprobs), else None; ``BadRequestError`` when this server cannot
        score prompts or the answer's log-probabilities could take more than
        :data:`MAX_LOGPROB_BYTES` (:meth:`logprob_bytes`; checked before anything runs)."""
        top = req.prompt_logprobs
        if req.echo and req.logprobs is not None:
            top = max(top or 0, req.logprobs)
        param = "prompt_logprobs" if req.prompt_logprobs is not None else "echo"
        if top is not None and self.score_prompt is None:
            raise BadRequestError(
                "this server cannot score prompts ('prompt_logprobs', or 'echo' with "
                "'logprobs'); leave them out",
                param=param,
            )
        scored = 0 if top is None else sum(max(0, len(p) - 1) for p in req.prompts) * (top + 1)
        sampled = 0 if req.logprobs is None else req.num_choices * req.max_tokens
        entries = scored + sampled * ((req.logprobs or 0) + 1)
        each = self.logprob_bytes(req.tokens_as_token_ids, req.chat)
        if entries * each > MAX_LOGPROB_BYTES:
            raise BadRequestError(
                f"the answer's log-probabilities could take {entries * each:,} bytes ({entries:,} "
                f"log-probabilities (prompt tokens x (prompt_logprobs + 1) + choices x "
                f"max_tokens x (logprobs + 1)) of up to {each:,} bytes each); at most "
                f"{MAX_LOGPROB_BYTES:,} bytes are answered: ask for fewer alternatives, tokens "
                "or prompts",
                param=param if scored else "logprobs",
            )
        return top

    def logprob_bytes(self, as_ids: bool, chat: bool) -> int:
        """The most bytes one log-probability takes in an answer: :data:`LOGPROB_ENTRY_BYTES`
        plus its token's text twice (JSON-escaped: as a key and as a value), and in a chat
        the JSON list of its UTF-8 bytes, for the longest token text of the vocabulary
        (listed once, on first use; :data:`UNLISTED_TOKEN_BYTES` without ``vocab_size``)."""
        text, listed = self._longest_token(as_ids)
        return LOGPROB_ENTRY_BYTES + 2 * text + (listed if chat else 0)

    def _longest_token(self, as_ids: bool) -> tuple[int, int]:
        """(the longest JSON-escaped token text, the longest JSON list of a token's bytes)."""
        key = as_ids or self.tokenizer is None
        if key not in self._token_costs:
            if as_ids or self.tokenizer is None:
                texts: Iterable[str] = [token_id_text(max(0, (self.vocab_size or 10**9) - 1))]
            elif self.vocab_size is None:
                texts = ["x" * UNLISTED_TOKEN_BYTES]
            else:
                decode = self.tokenizer.decode
                texts = (decode([t]) for t in range(self.vocab_size))
            text = listed = 2
            for t in texts:
                text = max(text, len(json.dumps(t)))
                listed = max(listed, len(json.dumps(list(t.encode("utf-8", "replace")))))
            self._token_costs[key] = (text, listed)
        return self._token_costs[key]


class _Handler(LimitedHandler):
    """One connection: the shared limits (body size before reading, JSON cost before parsing,
    a deadline for the whole request, escaped log fields) and the OpenAI routes."""

    server: _Server
    protocol_version = "HTTP/1.1"
    server_version = "kvdrop-engine"

    # ---- plumbing ------------------------------------------------------------------------

    def limit_error_body(self, status: int, message: str) -> dict[str, Any]:
        return error_body(message, status)

    def handle_one_request(self) -> None:
        # A client closing its keep-alive connection between requests (what a pooled HTTP client
        # does when it is dropped) is normal HTTP: only a request cut off is worth a log line.
        self._in_request = False
        self.command, self.path = "-", "-"
        self._status: int | None = None
        self._tokens = (0, 0)  # prompt, completion tokens of a generating request
        try:
            super().handle_one_request()
        except DISCONNECTS:
            if self._in_request:
                raise
            self.close_connection = True
        finally:
            if self._in_request:
                self._log_request()

    def parse_request(self) -> bool:
        self._in_request = True  # the request line arrived: from now on a reset cuts it off
        self._started = time.monotonic()
        return super().parse_request()

    def send_response(self, code: int, message: str | None = None) -> None:
        self._status = code
        super().send_response(code, message)

    def _log_request(self) -> None:
        """The request's one log line: client, method, path, status, tokens, seconds."""
        cap = self.server.limits.max_log_chars
        logger.info(
            '%s "%s %s" %s prompt_tokens=%d completion_tokens=%d %.3f s',
            self.address_string(),
            log_field(self.command or "-", cap),
            log_field(self.path.split("?", 1)[0], cap),
            self._status or "-",
            *self._tokens,
            time.monotonic() - self._started,
        )

    def _send_json(self, status: int, payload: dict[str, Any]) -> None:
        data = dumps_sliced(payload).encode()  # other threads run between its slices
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:  # say so, or a keep-alive client sends its next one into it
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, status: int, message: str, param: str | None = None) -> None:
        self._send_json(status, error_body(message, status, param))

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _sse(self, payload: dict[str, Any] | str) -> None:
        text = payload if isinstance(payload, str) else json.dumps(payload)
        self._write_chunk(f"data: {text}\n\n".encode())

    def _read_json(self) -> Any:
        """The body as JSON within the shared limits (size, cost, nesting, deadline)."""
        try:
            return self.read_json()
        except HTTPLimitError as exc:
            raise BadRequestError(str(exc), status=exc.status) from None

    def _drain(self) -> None:
        """Read an unwanted body (its size was checked with the headers) so the connection
        stays usable; close it if the body does not come."""
        try:
            self.read_body()
        except (HTTPLimitError, ConnectionError):
            self.close_connection = True

    def _client_gone(self) -> bool:
        return client_gone(self.connection)

    # ---- routes --------------------------------------------------------------------------

    def _refused(self, app: CompletionHTTPServer, path: str) -> bool:
        """Answer 401 (and True) when the server has an API key this request lacks; the probes
        (``/health``, ``/ping``, ``/version``, ``/metrics``) stay open, as in vLLM."""
        if path in _OPEN_ROUTES or app.authorized(self.headers.get("Authorization")):
            return False
        self.close_connection = True
        self._send_error(401, "a valid API key is required: send 'Authorization: Bearer KEY'")
        return True

    def do_GET(self) -> None:
        app = self.server.app
        path = self.path.split("?", 1)[0].rstrip("/")
        if self._refused(app, path):
            return
        if path in ("/ping", "/version"):
            self._send_json(
                200, {"version": importlib.metadata.version("kvdrop")} if path == "/version" else {}
            )
        elif path == "/health":
            healthy = app.health is None or app.health()
            if healthy and not app.closing:
                self._send_json(200, {"status": "ok"})
            else:
                self._send_error(503, "the engine is not healthy or is shutting down")
        elif path == "/metrics":
            data = app.metrics_text().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        elif path == "/stats" and app.stats is not None:
            self._send_json(200, app.stats())
        elif path == "/v1/models":
            self._send_json(200, app.models_payload())
        elif path.startswith("/v1/models/"):
            self._send_model(app, urllib.parse.unquote(path[len("/v1/models/") :]))
        elif path in _POST_ROUTES or path in _TOKEN_ROUTES:
            self._send_error(405, f"use POST for {path}")
        else:
            self._send_error(404, f"no route {path or '/'}; this server answers {ROUTES}")

    def _send_model(self, app: CompletionHTTPServer, model_id: str) -> None:
        """``GET /v1/models/{id}`` (``client.models.retrieve``): the card, or OpenAI's 404."""
        if model_id == app.model_name:
            self._send_json(200, model_card(app.model_name, app.created, app.max_model_len))
        else:
            served = app.model_name
            self._send_error(
                404, f"the model {model_id!r} does not exist; served: {served!r}", "model"
            )

    def do_POST(self) -> None:
        app = self.server.app
        path = self.path.split("?", 1)[0].rstrip("/")
        if self._refused(app, path):
            return
        if path == "/ping":
            self._drain()
            self._send_json(200, {})
            return
        if path not in _POST_ROUTES and path not in _TOKEN_ROUTES:
            self._drain()
            gets = ("/health", "/v1/models", "/metrics")
            status = 405 if path in gets or path.startswith("/v1/models/") else 404
            self._send_error(status, f"no POST route {path or '/'}; this server answers {ROUTES}")
            return
        try:
            body = self._read_json()
            if path in _TOKEN_ROUTES:
                self._send_json(200, app.token_payload(path, body))
                return
            req = parse_request(body, _POST_ROUTES[path], app.settings)
            top = app.scoring_top(req)
        except BadRequestError as exc:
            self.close_connection = exc.status in (408, 411, 413) or self.close_connection
            self._send_error(exc.status, str(exc), exc.param)
            return
        if app.closing:
            self._send_error(503, "the server is shutting down")
            return
        self._complete(app, req, top)

    # ---- completions ---------------------------------------------------------------------

    def _complete(self, app: CompletionHTTPServer, req: CompletionRequest, top: int | None) -> None:
        """Serve one completion while a watcher cancels it the moment its client goes (during a
        prefix load or prefill too, with or without bytes to write)."""
        opened: list[Iterator[TokenEvent]] = []
        watch = ClientWatch(self._client_gone, lambda: close_all(opened))
        try:
            self._complete_watched(app, req, top, opened, watch)
        finally:
            watch.stop()
            if watch.gone:  # also the choices posted after the watcher fired
                close_all(opened)

    def _complete_watched(
        self,
        app: CompletionHTTPServer,
        req: CompletionRequest,
        top: int | None,
        opened: list[Any],
        watch: ClientWatch,
    ) -> None:
        """Score the prompts when asked (``top``: prompt logprobs; cancelled with the rest when
        the client leaves), call the engine (once per choice of each prompt); answer 400/500 if
        it fails before its first token, else stream or collect; account the request in
        ``/metrics``."""
        started = time.monotonic()
        build = self._builder(app, req)
        try:
            if top is not None:
                assert app.score_prompt is not None
                handles = [app.score_prompt(p, top, req.cache_salt) for p in req.prompts]
                opened.extend(handles)  # the watch closes them when the client leaves
                build.scored = [h.result() for h in handles]
                if watch.gone:
                    raise ConnectionAbortedError("the client closed the connection")
            opened.clear()
            for i in range(req.num_choices):
                events = app.post_completion(req.prompt_of(i), req.choice_params(i), req.options)
                opened.append(iter(events))
            streams = ChoiceStreams(opened)
            pairs = iter(streams)
            first = next(pairs, None)
            first_token_s = time.monotonic() - started
        except Exception as exc:
            close_all(opened)
            if watch.gone or isinstance(exc, ConnectionAbortedError):  # nobody to answer
                self.close_connection = True
                logger.info("client %s disconnected; request cancelled", self.address_string())
                return
            if isinstance(exc, (ValueError, TypeError)):
                self._send_error(400, f"the engine rejected the request: {exc}")
                return
            logger.error("engine failed before its first token", exc_info=exc)
            self._send_error(500, f"the engine failed: {type(exc).__name__}: {exc}")
            return
        accounted: list[str] = []

        def account(finish: str) -> None:
            """Account the request in ``/metrics`` once, before its last bytes are written: a
            client that reads ``/metrics`` after its answer then sees the request counted."""
            if not accounted:
                accounted.append(finish)
                self._tokens = (sum(len(p) for p in req.prompts), build.count)
                seconds = time.monotonic() - started
                app.metrics.finished(finish, *self._tokens, seconds, first_token_s)

        try:
            if watch.gone:  # the client left before its first token: nothing to answer
                raise ConnectionAbortedError("the client closed the connection")
            run = self._stream if req.stream else self._collect
            run(app, build, first, pairs, streams, account)
        except DISCONNECTS as exc:
            self.close_connection = True
            logger.info(
                "client %s disconnected (%s); request cancelled",
                self.address_string(),
                exc.strerror or exc,
            )
        finally:
            streams.close()
            account("abort")  # a no-op when the answer was accounted before its end

    def _builder(self, app: CompletionHTTPServer, req: CompletionRequest) -> CompletionBuilder:
        kind = ChatCompletionBuilder if req.chat else CompletionBuilder
        return kind(req, app.model_name, tokenizer=app.tokenizer, detokenize=app.detokenize)

    def _pieces(
        self,
        app: CompletionHTTPServer,
        build: CompletionBuilder,
        first: tuple[int, TokenEvent] | None,
        events: Iterator[tuple[int, TokenEvent]],
        streams: ChoiceStreams,
    ) -> Iterator[tuple[int, Any]]:
        """Each event as ``(choice index, piece)`` until every choice finished (or shutdown)."""
        item = first
        while item is not None:
            index, event = item
            piece = build.add(event, index)
            if piece.finish is not None:
                streams.done(index)
            yield index, piece
            if all(c.finish is not None for c in build.choices) or app.closing:
                return
            item = next(events, None)

    def _stream(
        self,
        app: CompletionHTTPServer,
        build: CompletionBuilder,
        first: tuple[int, TokenEvent] | None,
        events: Iterator[tuple[int, TokenEvent]],
        streams: ChoiceStreams,
        account: Callable[[str], None],
    ) -> None:
        """Stream the answer as server-sent events; ``account`` takes the finish reason before
        the closing events."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for opening in build.preamble():
            self._sse(opening)
        finish = "stop"
        try:
            for index, piece in self._pieces(app, build, first, events, streams):
                if piece.text or piece.token is not None or piece.finish is not None:
                    self._sse(build.chunk(piece, index=index))
            for choice in build.choices:
                if choice.finish is None:  # an EOS the engine did not label, or shutdown
                    self._sse(build.chunk(finish="stop", index=choice.index))
            finish = build.finish or "stop"
        except DISCONNECTS:
            raise
        except Exception as exc:
            logger.exception("engine failed while streaming")
            self._sse(error_body(f"the engine failed: {type(exc).__name__}: {exc}", 500))
            finish = "error"
        account(finish)
        if build.request.include_usage:
            self._sse(build.usage_chunk())
        self._sse("[DONE]")
        self._write_chunk(b"")

    def _collect(
        self,
        app: CompletionHTTPServer,
        build: CompletionBuilder,
        first: tuple[int, TokenEvent] | None,
        events: Iterator[tuple[int, TokenEvent]],
        streams: ChoiceStreams,
        account: Callable[[str], None],
    ) -> None:
        """Collect the whole answer, then send it as one JSON body; ``account`` takes the
        finish reason before it is sent."""
        checked = time.monotonic()
        try:
            for _ in self._pieces(app, build, first, events, streams):
                now = time.monotonic()
                if now - checked >= GONE_CHECK_S:
                    checked = now
                    if self._client_gone():  # nobody will read the answer: stop generating
                        raise ConnectionAbortedError("the client closed the connection")
        except ConnectionAbortedError:
            raise
        except Exception as exc:
            logger.exception("engine failed while generating")
            account("error")
            self._send_error(500, f"the engine failed: {type(exc).__name__}: {exc}")
            return
        account(build.finish or "stop")
        self._send_json(200, build.body())
