"""The hostile clients of soak phase ``round4`` (``benchmarks/soak_round4.py``), in a process
of their own: ``python benchmarks/soak_round4_hostile.py URL SEEN.json [KINDS] [SALT]``
(``KINDS``: ``bombs,cut,scoring``; ``SALT``: the ``cache_salt`` of every hostile request, so
the engine sees one client, a tenant; none by default) prints ``ready``, runs until its stdin
closes, then prints what each client was answered as one JSON line.

A process of its own (and no torch import) so that the good clients' latencies measure the
engine, not the hostile clients' own JSON encoding and reply parsing under the soak's GIL.
Clients: override bombs (each must be a 400 at once), batches of six 200-token cut requests of
120 greedy tokens (preempted beside the scoring; each reply must equal the first reply to its
prompt, kept across runs in ``SEEN.json``), and ``prompt_logprobs`` (a 3,000-token prompt
scored, an answer over the bound refused with a 400, 16 x 1,000-token scorings left after
0.3 s).
"""

from __future__ import annotations

import itertools
import json
import random
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests

CUT_PROMPT, CUT_TOKENS = 200, 120
BOMBS = (
    "leverage(sketch_dimension=4000)",
    "+".join(["knorm"] * 3000),
    "expected-attention(n_future_positions=4000000)",
    "cap(n_future_positions=400000)",
    "value-norm",  # a plugin's policy: not allowed by --client-policies builtin
)


#: Every hostile request's ``cache_salt`` ("": none); set once by :func:`main`.
SALT = ""


def _salted(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with the hostile tenant's ``cache_salt`` (:data:`SALT`), when there is one."""
    return {**body, "cache_salt": SALT} if SALT else body


def _post(url: str, body: dict[str, Any], timeout: float = 120) -> requests.Response:
    return requests.post(f"{url}/v1/completions", json=_salted(body), timeout=timeout)


def _bombs(url: str, count: Callable[[str], None], stop: threading.Event) -> None:
    """Override bombs, round and round: each must be refused with a 400 at once."""
    prompt = [3 + t % 400 for t in range(300)]
    for spec in itertools.cycle(BOMBS):
        if stop.wait(0.2):
            return
        body = {"prompt": prompt, "max_tokens": 4, "kvdrop": {"policy": spec}}
        started = time.monotonic()
        try:
            r = _post(url, body, 30)
            count(f"override bomb answered {r.status_code}")
            count(f"override bomb answered within {1 if time.monotonic() - started < 1 else 30} s")
        except requests.RequestException as exc:
            count(f"override bomb: {type(exc).__name__}")


def _cut_prompt(n: int) -> list[int]:
    rng = random.Random(n)
    return [rng.randrange(3, 500) for _ in range(CUT_PROMPT)]


def _preempted(url: str, count: Callable[[str], None], stop: threading.Event,
               seen: dict[str, list[Any]], lock: threading.Lock) -> None:  # fmt: skip
    """Batches of six cut requests of 120 greedy tokens, one a second (beside the scoring they
    outgrow the budget and are preempted): each reply must equal the first reply to its
    prompt."""
    n = 0
    while not stop.is_set():
        n += 1
        prompts = [(n + k) % 6 for k in range(6)]
        replies: list[Any] = [None] * 6
        threads = [
            threading.Thread(target=_one_cut, args=(url, p, replies, k))
            for k, p in enumerate(prompts)
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join(300)
        for p, r in zip(prompts, replies, strict=True):
            if not isinstance(r, requests.Response) or r.status_code != 200:
                count(f"cut request failed: {getattr(r, 'status_code', r)!s:.80}")
                continue
            toks = r.json()["choices"][0]["logprobs"]["tokens"]
            with lock:
                same = seen.setdefault(str(p), toks) == toks
            count("cut request: same answer" if same else "cut request: OTHER answer")
        stop.wait(1.0)


def _one_cut(url: str, p: int, replies: list[Any], k: int) -> None:
    body = {"prompt": _cut_prompt(p), "max_tokens": CUT_TOKENS, "temperature": 0}
    body |= {"ignore_eos": True, "logprobs": 0}
    try:
        replies[k] = _post(url, body)
    except requests.RequestException as exc:
        replies[k] = exc


def _scoring(url: str, count: Callable[[str], None], stop: threading.Event) -> None:
    """prompt_logprobs: a 3,000-token prompt scored, an answer over the bound (400), and a
    client that posts 16 x 1,000-token prompts and leaves after 0.3 s."""
    long = [3 + (t * 7) % 500 for t in range(3000)]
    many = [[3 + (t * 11 + k) % 500 for t in range(1000)] for k in range(16)]
    huge = [[3 + (t + k) % 500 for t in range(1000)] for k in range(64)]
    raw = json.dumps(_salted({"prompt": many, "max_tokens": 1, "prompt_logprobs": 0})).encode()
    port = int(url.rsplit(":", 1)[1])
    while not stop.is_set():
        try:
            r = _post(url, {"prompt": long, "max_tokens": 1, "prompt_logprobs": 1})
            count(f"3,000-token prompt_logprobs answered {r.status_code}")
            body = {"prompt": huge, "max_tokens": 4, "prompt_logprobs": 20, "logprobs": 20}
            count(f"97 MB-answer request answered {_post(url, body).status_code}")
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(raw)}\r\n\r\n".encode()
                    + raw
                )
                time.sleep(0.3)
            count("16 x 1,000-token scorings left after 0.3 s")
        except requests.RequestException as exc:
            count(f"scoring: {type(exc).__name__}")
        stop.wait(1.0)


def main(url: str, seen_path: str, which: str = "bombs,cut,scoring", salt: str = "") -> None:
    """Run the hostile clients ``which`` names (every request with ``cache_salt`` ``salt``,
    when given) until stdin closes; print their counts (one JSON line)."""
    global SALT
    SALT = salt
    path = Path(seen_path)
    seen: dict[str, list[Any]] = json.loads(path.read_text()) if path.exists() else {}
    h: Counter[str] = Counter()
    lock, stop = threading.Lock(), threading.Event()

    def count(key: str) -> None:
        with lock:
            h[key] += 1

    clients = {
        "bombs": lambda: _bombs(url, count, stop),
        "cut": lambda: _preempted(url, count, stop, seen, lock),
        "scoring": lambda: _scoring(url, count, stop),
    }
    threads = [threading.Thread(target=clients[c], daemon=True) for c in which.split(",")]
    for th in threads:
        th.start()
    print("ready", flush=True)
    sys.stdin.read()  # until the soak closes it
    stop.set()
    for th in threads:
        th.join(300)
    path.write_text(json.dumps(seen))
    print(json.dumps(dict(h)), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:5])
