"""``PostCompletion`` over HTTP for vLLM or any OpenAI-compatible completions server.

The SDK keys the cache by token ids, so every generated token's id must come back. vLLM returns
them when started with ``--return-tokens-as-token-ids``: with ``"logprobs": 0`` each streamed
chunk's ``choices[0].logprobs.tokens`` holds the ids as text (:func:`token_id_text`, read back by
:func:`parse_token_id_text`). ``kvdrop engine`` writes the same form with its own
``--return-tokens-as-token-ids`` flag.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import requests

from kvdrop_sdk.errors import RequestStreamError
from kvdrop_sdk.events import TokenEvent

__all__ = [
    "TOKEN_ID_PREFIX",
    "CompletionHTTPError",
    "HTTPPostCompletion",
    "MissingTokenIdsError",
    "make_post_completion",
    "parse_token_id_text",
    "token_id_text",
]

#: A token id written as text in ``logprobs.tokens`` (vLLM's ``--return-tokens-as-token-ids``).
TOKEN_ID_PREFIX = "token_id:"
_TOKEN_ID = re.compile(re.escape(TOKEN_ID_PREFIX) + r"(-?\d+)")

_FIX_TOKEN_IDS = (
    "start the server with --return-tokens-as-token-ids (vllm serve ... "
    "--return-tokens-as-token-ids, or kvdrop engine --return-tokens-as-token-ids)"
)


def token_id_text(token_id: int) -> str:
    """``token_id`` as a server writes it in ``logprobs.tokens``: ``"token_id:123"``."""
    return f"{TOKEN_ID_PREFIX}{token_id}"


def parse_token_id_text(token: Any) -> int | None:
    """The id in a :func:`token_id_text` string, or None when ``token`` is not one."""
    match = _TOKEN_ID.fullmatch(token) if isinstance(token, str) else None
    return None if match is None else int(match.group(1))


class CompletionHTTPError(RequestStreamError):
    """The completions server could not be reached, refused the request, or broke the stream."""


class MissingTokenIdsError(CompletionHTTPError):
    """The server streamed tokens without their ids (:func:`token_id_text`); the cache cannot be
    keyed."""


def _normalise_base_url(base_url: str) -> str:
    """``http://host:8000``, ``http://host:8000/`` and ``http://host:8000/v1`` all mean the same."""
    if not isinstance(base_url, str) or not re.match(r"^https?://[^/\s]+", base_url):
        raise ValueError(f"base_url must look like 'http://127.0.0.1:8000', got {base_url!r}")
    url = base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _token_ids_of(choice: dict[str, Any], endpoint: str) -> list[int]:
    """The generated token ids of one streamed choice, from ``logprobs.tokens``."""
    logprobs = choice.get("logprobs")
    tokens = logprobs.get("tokens") if isinstance(logprobs, dict) else None
    if not isinstance(tokens, list):
        raise MissingTokenIdsError(
            f"{endpoint} streamed a token without logprobs.tokens, so its token id is unknown; "
            + _FIX_TOKEN_IDS
        )
    ids: list[int] = []
    for token in tokens:
        token_id = parse_token_id_text(token)
        if token_id is None:
            raise MissingTokenIdsError(
                f"{endpoint} returned the token {token!r} instead of '{TOKEN_ID_PREFIX}N'; "
                + _FIX_TOKEN_IDS
            )
        ids.append(token_id)
    return ids


def _error_message(response: requests.Response) -> str:
    """The server's error message from a JSON error body, else the start of the body."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500].strip() or response.reason or "no body"
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(body.get("message"), str):
            return body["message"]
        if isinstance(body.get("detail"), str):
            return body["detail"]
    return json.dumps(body)[:500]


class HTTPPostCompletion:
    """A ``PostCompletion`` that streams ``/v1/completions`` of one OpenAI-compatible server.

    Thread-safe: each calling thread keeps its own ``requests.Session`` (connection reuse without
    sharing a session across threads).
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        timeout: float = 600.0,
        connect_timeout: float = 10.0,
        api_key: str | None = None,
    ) -> None:
        if not isinstance(model, str) or not model:
            raise ValueError(f"model must be the served model name, got {model!r}")
        if not timeout > 0 or not connect_timeout > 0:
            raise ValueError(f"timeouts must be > 0, got {timeout!r} and {connect_timeout!r}")
        self.base_url = _normalise_base_url(base_url)
        self.endpoint = self.base_url + "/v1/completions"
        self.model = model
        self.timeout = float(timeout)
        self.connect_timeout = float(connect_timeout)
        self._headers = {"Accept": "text/event-stream"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._local = threading.local()

    def __repr__(self) -> str:
        return f"HTTPPostCompletion({self.endpoint!r}, model={self.model!r})"

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
        return session

    def payload(
        self, prompt_token_ids: list[int], sampling_params: dict[str, Any], cache_salt: str
    ) -> dict[str, Any]:
        """The JSON body sent for one request (sampling params first, then the fixed fields)."""
        body: dict[str, Any] = {
            **sampling_params,
            "model": self.model,
            "prompt": [int(t) for t in prompt_token_ids],
            "stream": True,
            "logprobs": 0,
        }
        if cache_salt:
            body["cache_salt"] = cache_salt
        return body

    def __call__(
        self, prompt_token_ids: list[int], sampling_params: dict[str, Any], cache_salt: str = ""
    ) -> Iterator[TokenEvent]:
        """Stream the completion of ``prompt_token_ids``: one ``TokenEvent`` per generated token.

        Raises ``CompletionHTTPError`` (a ``RequestStreamError``) on connection failures, HTTP
        errors, timeouts, error events or a stream cut before ``[DONE]``;
        ``MissingTokenIdsError`` when the server does not return token ids.
        """
        body = self.payload(prompt_token_ids, dict(sampling_params), cache_salt)
        try:
            response = self._session().post(
                self.endpoint,
                json=body,
                headers=self._headers,
                stream=True,
                timeout=(self.connect_timeout, self.timeout),
            )
        except requests.exceptions.ConnectionError as exc:
            raise CompletionHTTPError(
                f"cannot connect to {self.endpoint}: {exc}. Is the server running? "
                "(start it with `kvdrop engine` or `vllm serve ... --return-tokens-as-token-ids`)"
            ) from exc
        except requests.exceptions.Timeout as exc:
            raise CompletionHTTPError(
                f"{self.endpoint} did not answer within {self.timeout:g} s; "
                "raise timeout= in make_post_completion"
            ) from exc
        with response:
            if response.status_code != 200:
                message = _error_message(response)
                raise CompletionHTTPError(
                    f"{self.endpoint} answered HTTP {response.status_code}: {message}"
                )
            yield from self._events(response)

    def _events(self, response: requests.Response) -> Iterator[TokenEvent]:
        """Parse the server-sent events of one response into ``TokenEvent``s."""
        done = False
        try:
            for raw in response.iter_lines(chunk_size=None, decode_unicode=False):
                line = raw.decode("utf-8") if isinstance(raw, bytes) else raw
                if not line.startswith("data:"):
                    continue  # blank separators, comments (": ping"), "event:" lines
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                try:
                    chunk = json.loads(data)
                except json.JSONDecodeError as exc:
                    raise CompletionHTTPError(
                        f"{self.endpoint} sent an event that is not JSON: {data[:200]!r}"
                    ) from exc
                if not isinstance(chunk, dict):
                    raise CompletionHTTPError(
                        f"{self.endpoint} sent a non-object event: {data[:200]!r}"
                    )
                if "error" in chunk:
                    err = chunk["error"]
                    message = err.get("message", err) if isinstance(err, dict) else err
                    raise CompletionHTTPError(f"{self.endpoint} reported an error: {message}")
                choices = chunk.get("choices")
                if not choices:
                    continue  # e.g. the usage-only chunk of stream_options.include_usage
                choice = choices[0]
                finish = choice.get("finish_reason")
                text = choice.get("text") or ""
                logprobs = choice.get("logprobs")
                if not text and not finish and not logprobs:
                    continue  # keep-alive / empty chunk
                if (
                    finish
                    and not text
                    and not (isinstance(logprobs, dict) and logprobs.get("tokens"))
                ):
                    # A finish-only chunk: the last token was already yielded (vLLM attaches the
                    # reason to the last token's chunk, so this is rare).
                    continue
                ids = _token_ids_of(choice, self.endpoint)
                if not ids:
                    continue  # no new token in this chunk
                for i, token_id in enumerate(ids):
                    last = i == len(ids) - 1
                    yield TokenEvent(
                        token_id=token_id,
                        text=text if last else "",
                        finish_reason=finish if last else None,
                        time=now,
                    )
        except requests.exceptions.Timeout as exc:
            raise CompletionHTTPError(
                f"{self.endpoint} sent nothing for {self.timeout:g} s; raise timeout= in "
                "make_post_completion"
            ) from exc
        except requests.exceptions.RequestException as exc:
            raise CompletionHTTPError(f"the stream from {self.endpoint} broke: {exc}") from exc
        if not done:
            raise CompletionHTTPError(
                f"the stream from {self.endpoint} ended before 'data: [DONE]' (server stopped?)"
            )


def make_post_completion(
    base_url: str,
    model: str,
    timeout: float = 600.0,
    *,
    api_key: str | None = None,
) -> HTTPPostCompletion:
    """A ``PostCompletion`` that streams from ``base_url``'s ``/v1/completions``.

    ``base_url`` is the server root (``http://127.0.0.1:8000``; a trailing ``/v1`` is accepted),
    ``model`` the served model name, ``timeout`` the longest wait in seconds for the next bytes of
    a response (the first token comes after the whole prefill, so keep it generous on CPU).
    ``api_key`` is sent as a bearer token (vLLM's ``--api-key``).
    """
    return HTTPPostCompletion(base_url, model, timeout=timeout, api_key=api_key)
