"""Serving throughput with and without dropping, in the shape of vLLM's ``benchmark_serving``.

Starts ``kvdrop engine`` twice, one after the other, with the same model, prompts and KV budget:
once as it is, once with ``--policy`` (each prompt's cache cut after its prefill). Each time N
HTTP clients stream ``/v1/completions`` (token-id prompts, greedy, ``ignore_eos``, so every
request generates ``--max-tokens`` tokens), sent all at once (``--request-rate inf``, the default)
or as a Poisson process of that rate. Prints, side by side: TTFT (median, p99), TPOT (median,
p99), end-to-end latency, output tokens/s over the whole run and the ratio of each to the run
without a policy, plus what the engine saw (peak running requests, prompt tokens kept).

``--load mixed`` is a mixed load instead, as a service sees one: prompts of log-uniform lengths in
``--mixed-prompt-tokens`` (default 1K-14K), outputs uniform in ``--mixed-max-tokens`` (default
128-2,048), arriving as a Poisson process of ``--request-rate``. By default the rate keeps the
baseline at its KV limit: each server first runs a pilot (as many mean-length prompts as the budget
holds without a cut, all at once, 32 tokens each; the same pilot for both), the baseline's pilot
gives its decode TPOT at that occupancy (the last-prefilled request's, which decodes after every
prefill) and its prefill rate, hence a mean request time T and a capacity of ``fit / T``
requests/s, and the rate is ``--mixed-load-factor`` (default 2) times that capacity: the baseline's
queue for memory grows through the run while the policy's budget, which holds every request after
its cut, admits each one on arrival. Beside the latency table it prints goodput: the requests that
met both SLOs (TTFT <= ``--slo-ttft-s``, default 10 s; TPOT <= ``--slo-tpot-ms``, default 50 ms)
per second of the run, with and without the policy. ``--load both`` runs the all-at-once load and
then the mixed one. ``--structured`` also holds the baseline server's requests to a regular
expression that cannot end before ``max_tokens`` (xgrammar's mask on every step: what structured
outputs cost; needs ``--model`` for its tokenizer), alternating plain and guided runs of the same
prompts on that one server ``--repeat`` times (each run under its own ``cache_salt``, so no run
reuses another's prefill): pairs side by side, so the machine's load drifts less between the two
halves of a ratio. ``--policy none`` runs no policy server (the structured comparison alone).

The KV budget defaults to one that holds every request at once after the cut (the kept part
plus its generated tokens), plus room for the longest prompt's prefill beyond that (a request
holds its whole prompt until it is cut), so the budget, not compute, is what limits the run
without a policy, as in ``kvdrop demo``.

    python benchmarks/serve.py --model-preset tiny                       # seconds
    python benchmarks/serve.py                                           # SmolLM2 shape, demo size
    python benchmarks/serve.py --device cuda --dtype bfloat16 --model-preset qwen3-8b \\
        --num-prompts 30 --prompt-tokens 8192 14336 --max-tokens 2048 --max-prefill-tokens 8192
    python benchmarks/serve.py --threads 2 --load mixed --mixed-prompt-tokens 128 1024 \
        --mixed-max-tokens 16 64 --num-prompts 24 --slo-ttft-s 20 --slo-tpot-ms 500   # a CPU
    python benchmarks/serve.py --threads 2 --model SmolLM2.gguf --structured --repeat 3 \
        --policy none                                                    # mask cost, 3 pairs
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from kvdrop_sdk.table import format_table

#: Seconds a server may take to load its model and bind.
START_TIMEOUT_S = 600.0


def log(msg: str) -> None:
    print(f"[serve {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-preset", default="smollm2-135m", help="random-weight preset")
    p.add_argument("--model", default=None, help="a .gguf file or HF folder instead of a preset")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[512, 1024], help="MIN [MAX]")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument(
        "--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)"
    )
    p.add_argument(
        "--policy", default="snapkv", help="the drop policy of the second server (none: no second)"
    )
    p.add_argument("--keep-ratio", type=float, default=0.5)
    p.add_argument("--kv-budget-tokens", type=int, default=None, help="default: see above")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-prefill-tokens", type=int, default=2048)
    p.add_argument("--threads", type=int, default=None, help="torch threads of each server")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the report to this JSON file")
    p.add_argument(
        "--load",
        choices=("burst", "mixed", "both"),
        default="burst",
        help="burst: every request at once (or at --request-rate); mixed: see above",
    )
    p.add_argument(
        "--mixed-prompt-tokens", type=int, nargs=2, default=[1024, 14336], metavar=("MIN", "MAX")
    )
    p.add_argument(
        "--mixed-max-tokens", type=int, nargs=2, default=[128, 2048], metavar=("MIN", "MAX")
    )
    p.add_argument(
        "--mixed-load-factor",
        type=float,
        default=2.0,
        help="mixed arrival rate over the baseline's capacity measured by the pilot",
    )
    p.add_argument("--slo-ttft-s", type=float, default=10.0, help="goodput's TTFT bound")
    p.add_argument("--slo-tpot-ms", type=float, default=50.0, help="goodput's TPOT bound")
    p.add_argument(
        "--structured",
        action="store_true",
        help="also run the baseline with every request held to a regex (needs --model)",
    )
    p.add_argument(
        "--repeat", type=int, default=1, help="--structured: plain/guided pairs on one server"
    )
    args = p.parse_args(argv)
    if args.structured and not args.model:
        p.error("--structured needs --model (a tokenizer for the grammar)")
    if args.num_prompts < 1 or args.max_tokens < 2 or not 0 < args.keep_ratio <= 1:
        p.error("--num-prompts >= 1, --max-tokens >= 2 and --keep-ratio in (0, 1] expected")
    if args.repeat < 1 or args.mixed_load_factor <= 0:
        p.error("--repeat >= 1 and --mixed-load-factor > 0 expected")
    if args.policy == "none" and args.load != "burst":
        p.error("--policy none is for the burst's structured comparison (--load burst)")
    return args


def make_prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    lo, hi = args.prompt_tokens[0], args.prompt_tokens[-1]
    return [
        [rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))]
        for _ in range(args.num_prompts)
    ]


def make_mixed(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[int]]:
    """The mixed load's prompts (log-uniform lengths) and each one's output tokens (uniform)."""
    rng = random.Random(args.seed + 2)
    lo, hi = args.mixed_prompt_tokens
    outs_lo, outs_hi = args.mixed_max_tokens
    lengths = [
        round(math.exp(rng.uniform(math.log(lo), math.log(hi)))) for _ in range(args.num_prompts)
    ]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    return prompts, [rng.randint(outs_lo, outs_hi) for _ in prompts]


def default_budget(
    lengths: list[int], args: argparse.Namespace, outputs: list[int] | None = None
) -> int:
    """Tokens that hold every request at once after the cut (its kept prompt and its output:
    ``outputs``, else ``--max-tokens``), plus room for the longest prompt's prefill beyond its
    cut size (a request holds its whole prompt until its cut)."""
    bs = args.block_size
    outs = outputs or [args.max_tokens] * len(lengths)

    def blocks(tokens: int) -> int:
        return -(-tokens // bs)

    cut = [blocks(math.ceil(args.keep_ratio * n) + m - 1) for n, m in zip(lengths, outs)]
    extra = max(max(0, blocks(n) - c) for n, c in zip(lengths, cut))
    return max(sum(cut) + extra, max(blocks(n + m - 1) for n, m in zip(lengths, outs))) * bs


@dataclass
class Server:
    """A ``kvdrop engine`` subprocess on a free 127.0.0.1 port."""

    argv: list[str]
    proc: subprocess.Popen[str] | None = None
    url: str = ""
    lines: list[str] = field(default_factory=list)

    def start(self) -> Server:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        ready = threading.Event()
        threading.Thread(target=self._read, args=(ready,), daemon=True).start()
        if not ready.wait(START_TIMEOUT_S) or not self.url:
            self.stop()
            raise RuntimeError("the server did not start:\n" + "".join(self.lines[-20:]))
        return self

    def _read(self, ready: threading.Event) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if " serving " in line and " on http://" in line:
                self.url = line.split(" on ", 1)[1].split()[0]
                ready.set()
        ready.set()  # the process ended

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=30) as resp:
            return resp.read().decode()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def server_argv(args: argparse.Namespace, budget: int, policy: str | None) -> list[str]:
    model = ["--model", args.model] if args.model else ["--random-preset", args.model_preset]
    argv = [sys.executable, "-m", "kvdrop", "engine", *model, "--port", "0"]
    argv += ["--device", args.device, "--dtype", args.dtype, "--seed", str(args.seed)]
    argv += ["--kv-budget-tokens", str(budget), "--block-size", str(args.block_size)]
    argv += ["--max-prefill-tokens", str(args.max_prefill_tokens)]
    if args.threads is not None:
        argv += ["--threads", str(args.threads)]
    if policy is not None:
        argv += ["--policy", policy, "--keep-ratio", str(args.keep_ratio)]
    return argv


@dataclass
class Result:
    """One request as its client saw it."""

    sent: float = 0.0
    first: float = 0.0
    end: float = 0.0
    output_tokens: int = 0
    kept_prompt_tokens: int | None = None
    error: str = ""


def stream_one(
    url: str,
    prompt: list[int],
    max_tokens: int,
    out: Result,
    guided: str | None = None,
    salt: str = "",
) -> None:
    """One streamed completion. TTFT is when the response's headers arrive: the server sends
    them once the request's first token exists (a server without a tokenizer sends no text
    chunks before the last one, so the headers are the first-token signal there); the end is
    the last chunk."""
    host, port = url.removeprefix("http://").rstrip("/").split(":")
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if salt:  # a run of its own: no prefix cached by an earlier run of the same prompts
        body["cache_salt"] = salt
    if guided is not None:  # held to a regex that cannot end early (structured outputs end at EOS)
        body["guided_regex"] = guided
        del body["ignore_eos"]
    conn = http.client.HTTPConnection(host, int(port), timeout=3600)
    try:
        out.sent = time.perf_counter()
        headers = {"Content-Type": "application/json"}
        conn.request("POST", "/v1/completions", json.dumps(body), headers)
        resp = conn.getresponse()
        out.first = time.perf_counter()
        if resp.status != 200:
            out.error = f"HTTP {resp.status}: {resp.read()[:200]!r}"
            return
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            usage = json.loads(line[6:]).get("usage")
            if usage:
                out.output_tokens = usage["completion_tokens"]
                out.kept_prompt_tokens = usage.get("kept_prompt_tokens")
            else:
                out.end = time.perf_counter()  # the last chunk with a choice
    except OSError as exc:
        out.error = repr(exc)
    finally:
        conn.close()


def run_clients(
    url: str,
    prompts: list[list[int]],
    args: argparse.Namespace,
    outputs: list[int] | None = None,
    rate: float | None = None,
    guided: str | None = None,
    salt: str = "",
) -> tuple[list[Result], float]:
    """Every prompt on its own client thread, sent at its arrival time (Poisson at ``rate``,
    default ``--request-rate``), with its own output length when ``outputs`` gives one; the
    run's wall time."""
    rng = random.Random(args.seed + 1)
    rate = args.request_rate if rate is None else rate
    delays, t = [], 0.0
    for _ in prompts:
        delays.append(t)
        if math.isfinite(rate):
            t += rng.expovariate(rate)
    results = [Result() for _ in prompts]
    start = time.perf_counter()

    def client(i: int) -> None:
        wait = start + delays[i] - time.perf_counter()
        if wait > 0:
            time.sleep(wait)  # the arrival process, not a readiness wait
        tokens = args.max_tokens if outputs is None else outputs[i]
        stream_one(url, prompts[i], tokens, results[i], guided, salt)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return results, time.perf_counter() - start


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def summarise(
    name: str,
    results: list[Result],
    wall: float,
    stats: dict[str, Any],
    slos: tuple[float, float] | None = None,
) -> dict[str, Any]:
    """One run's row; ``slos`` (TTFT s, TPOT ms) say which requests count as goodput."""
    ok = [r for r in results if not r.error and r.end]
    ttft = [1e3 * (r.first - r.sent) for r in ok]
    tpot = [1e3 * (r.end - r.first) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    e2e = [r.end - r.sent for r in ok]
    out_tokens = sum(r.output_tokens for r in ok)
    kept = [r.kept_prompt_tokens for r in ok if r.kept_prompt_tokens is not None]
    slo = slos or (math.inf, math.inf)
    good = [
        r for r in ok
        if r.first - r.sent <= slo[0]
        and (r.output_tokens < 2 or 1e3 * (r.end - r.first) / (r.output_tokens - 1) <= slo[1])
    ]  # fmt: skip
    return {
        "run": name,
        "ok": f"{len(ok)}/{len(results)}",
        "ttft_median_ms": statistics.median(ttft) if ttft else None,
        "ttft_p99_ms": pct(ttft, 0.99) if ttft else None,
        "tpot_median_ms": statistics.median(tpot) if tpot else None,
        "tpot_p99_ms": pct(tpot, 0.99) if tpot else None,
        "e2e_median_s": statistics.median(e2e) if e2e else None,
        "output_tok_s": out_tokens / wall,
        "wall_s": wall,
        "output_tokens": out_tokens,
        "peak_running": stats.get("peak_running"),
        "prompt_tokens_kept": sum(kept) if kept else None,
        "cut_s": stats.get("cut_seconds"),
        "errors": sorted({r.error for r in results if r.error})[:3],
        "good": f"{len(good)}/{len(results)}",
        "goodput_req_s": len(good) / wall,
    }


@dataclass
class Load:
    """What one run sends: the prompts, each one's output tokens (None: ``--max-tokens``), the
    arrival rate (None: ``--request-rate``), a regex every request is held to, the SLOs."""

    prompts: list[list[int]]
    outputs: list[int] | None = None
    rate: float | None = None
    guided: str | None = None
    slos: tuple[float, float] | None = None
    name: str = ""
    salt: str = ""


def measure(server: Server, name: str, load: Load, args: argparse.Namespace) -> dict[str, Any]:
    """One load on a started server: its row."""
    before = json.loads(server.get("/stats"))
    log(f"{name}: {len(load.prompts)} clients on {server.url}")
    results, wall = run_clients(
        server.url, load.prompts, args, load.outputs, load.rate, load.guided, load.salt
    )
    stats = json.loads(server.get("/stats"))
    for key in ("cut_seconds",):
        stats[key] = stats.get(key, 0.0) - before.get(key, 0.0)
    row = summarise(name, results, wall, stats, load.slos)
    log(f"{name}: {row['output_tok_s']:.1f} output tok/s in {wall:.1f} s, {row['ok']} ok")
    log(f"{name}: {json.dumps(row, default=str)}")  # kept if a later run is cut short
    return row


def bench(
    name: str,
    argv: list[str],
    load: Load | list[Load],
    args: argparse.Namespace,
    pilot: Callable[[Server], Load] | None = None,
) -> list[dict[str, Any]]:
    """Start a server, warm it, run ``pilot`` (which returns the load to run) or each of
    ``load`` in turn (a row each, named by its ``name`` or ``name``), stop it."""
    log(f"{name}: starting {' '.join(argv[1:])}")
    server = Server(argv).start()
    loads = load if isinstance(load, list) else [load]
    try:
        warm = Result()  # graphs, allocator and threads warmed before the clock starts
        stream_one(server.url, loads[0].prompts[0][:64], 4, warm, None, "warm-up")
        if warm.error:
            raise RuntimeError(f"warm-up request failed: {warm.error}")
        guided = next((one.guided for one in loads if one.guided), None)
        if guided is not None:  # the grammar compiled and the masked path warmed too
            stream_one(server.url, loads[0].prompts[0][:64], 4, warm, guided, "warm-up")
        if pilot is not None:
            loads = [pilot(server)]
        return [measure(server, one.name or name, one, args) for one in loads]
    finally:
        server.stop()


def ratios(base: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    keys = [
        "ttft_median_ms",
        "ttft_p99_ms",
        "tpot_median_ms",
        "tpot_p99_ms",
        "e2e_median_s",
        "output_tok_s",
        "goodput_req_s",
    ]
    row: dict[str, Any] = {"run": f"{other['run']} / baseline"}
    for k in keys:
        a, b = base.get(k), other.get(k)
        row[k] = b / a if a and b is not None else None
    return row


COLUMNS = [
    "run", "ok", "ttft_median_ms", "ttft_p99_ms", "tpot_median_ms", "tpot_p99_ms",
    "e2e_median_s", "output_tok_s", "wall_s", "peak_running", "prompt_tokens_kept", "cut_s",
]  # fmt: skip


def burst(args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """Today's run: every request at once (or at ``--request-rate``), with and without the
    policy, and with ``--structured`` the baseline held to a regex."""
    prompts = make_prompts(args, vocab)
    lengths = [len(p) for p in prompts]
    budget = args.kv_budget_tokens or default_budget(lengths, args)
    fit = budget / (statistics.mean(lengths) + args.max_tokens)
    log(
        f"{len(prompts)} prompts of {min(lengths)}-{max(lengths)} tokens, {args.max_tokens} output "
        f"tokens each, KV budget {budget} tokens (about {fit:.1f} requests without a cut)"
    )
    rows: list[dict[str, Any]] = []
    if args.structured:  # a regex that cannot end before max_tokens: the mask on every step
        regex = f"[a-z ]{{{8 * args.max_tokens}}}"
        pairs = []
        for i in range(args.repeat):
            tag = f" {i + 1}" if args.repeat > 1 else ""
            pairs += [
                Load(prompts, name=f"baseline{tag}", salt=f"plain-{i}"),
                Load(prompts, guided=regex, name=f"structured{tag}", salt=f"guided-{i}"),
            ]
        served = bench("baseline", server_argv(args, budget, None), pairs, args)
        for plain, guided in zip(served[::2], served[1::2]):
            rows += [plain, guided, ratios(plain, guided)]
    else:
        rows += bench("baseline", server_argv(args, budget, None), Load(prompts), args)
    if args.policy != "none":
        policy = f"{args.policy} {args.keep_ratio:g}"
        rows += bench(policy, server_argv(args, budget, args.policy), Load(prompts), args)
        rows.append(ratios(rows[0], rows[-1]))
    title = (
        f"benchmarks/serve.py: {args.model or args.model_preset} on {args.device}, "
        f"{len(prompts)} prompts of {min(lengths)}-{max(lengths)} tokens, {args.max_tokens} output "
        f"tokens, request rate {args.request_rate:g}/s, KV budget {budget} tokens"
    )
    print(format_table(rows, COLUMNS, title=title))
    return {"load": "burst", "budget": budget, "rows": rows}


def mixed(args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """The mixed load: Poisson arrivals, prompts and outputs of many lengths, and goodput under
    the SLOs, with and without the policy."""
    prompts, outputs = make_mixed(args, vocab)
    lengths = [len(p) for p in prompts]
    mean_request = statistics.mean(lengths) + statistics.mean(outputs)
    budget = args.kv_budget_tokens or default_budget(lengths, args, outputs)
    fit = budget / mean_request
    slos = (args.slo_ttft_s, args.slo_tpot_ms)
    log(
        f"mixed: {len(prompts)} prompts of {min(lengths)}-{max(lengths)} tokens, outputs "
        f"{min(outputs)}-{max(outputs)}, KV budget {budget} tokens (about {fit:.1f} mean "
        f"requests without a cut), SLOs TTFT <= {slos[0]:g} s, TPOT <= {slos[1]:g} ms"
    )
    load = Load(prompts, outputs, args.request_rate, slos=slos, salt="mixed")
    pilot_prompts = _pilot_prompts(lengths, fit, args, vocab)
    capacity: dict[str, float] = {}

    def baseline_pilot(server: Server) -> Load:
        """The pilot, then the load at a rate from it (unless ``--request-rate`` gives one)."""
        found = pilot(server, pilot_prompts, args)
        mean_s = (
            statistics.mean(outputs) * found["tpot_s"]
            + statistics.mean(lengths) / found["prefill_tok_s"]
        )
        capacity.update(found, mean_request_s=mean_s, capacity_req_s=fit / mean_s)
        if math.isfinite(args.request_rate):
            return load
        rate = args.mixed_load_factor * capacity["capacity_req_s"]
        capacity["rate"] = rate
        log(
            f"mixed: the baseline's pilot decodes at {1e3 * found['tpot_s']:.1f} ms a token with "
            f"{len(pilot_prompts)} running and prefills {found['prefill_tok_s']:.0f} tokens/s: a "
            f"mean request takes about {mean_s:.1f} s, a capacity of {fit / mean_s:.3g} "
            f"requests/s; arrivals at {args.mixed_load_factor:g}x that: {rate:.3g}/s"
        )
        return replace(load, rate=rate)

    def policy_pilot(server: Server) -> Load:
        pilot(server, pilot_prompts, args)  # the same warm-up as the baseline's
        return replace(load, rate=capacity.get("rate", args.request_rate))

    policy = f"{args.policy} {args.keep_ratio:g}"
    rows = bench("mixed baseline", server_argv(args, budget, None), load, args, baseline_pilot)
    rows += bench(
        f"mixed {policy}", server_argv(args, budget, args.policy), load, args, policy_pilot
    )
    rows.append(ratios(rows[0], rows[1]))
    rate = capacity.get("rate", args.request_rate)
    title = (
        f"benchmarks/serve.py --load mixed: {args.model or args.model_preset} on {args.device}, "
        f"{len(prompts)} prompts of {min(lengths)}-{max(lengths)} tokens, outputs "
        f"{min(outputs)}-{max(outputs)}, Poisson {rate:.3g}/s, KV budget {budget} tokens, goodput "
        f"SLOs TTFT <= {slos[0]:g} s and TPOT <= {slos[1]:g} ms"
    )
    columns = ["run", "ok", "good", "goodput_req_s", *COLUMNS[2:8], "peak_running"]
    print(format_table(rows, columns, title=title))
    return {"load": "mixed", "rate": rate, "budget": budget, "pilot": capacity, "rows": rows}


#: Output tokens of each pilot request.
PILOT_TOKENS = 32


def _pilot_prompts(
    lengths: list[int], fit: float, args: argparse.Namespace, vocab: int
) -> list[list[int]]:
    """As many mean-length prompts as the budget holds without a cut (fresh tokens)."""
    rng = random.Random(args.seed + 3)
    n = round(statistics.mean(lengths))
    return [[rng.randrange(3, vocab) for _ in range(n)] for _ in range(max(1, math.floor(fit)))]


def pilot(server: Server, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, float]:
    """The pilot's findings: ``tpot_s``, the least TPOT of its requests sent at once (the last
    prefilled decodes after every prefill, with all of them running: decode at the budget's
    occupancy) and ``prefill_tok_s``, its prompt tokens over the time to the last first token."""
    results, _ = run_clients(
        server.url, prompts, args, [PILOT_TOKENS] * len(prompts), math.inf, None, "pilot"
    )
    bad = [r.error for r in results if r.error or not r.end]
    if bad:
        raise RuntimeError(f"the pilot failed: {bad[:2]}")
    tpot = min((r.end - r.first) / (r.output_tokens - 1) for r in results)
    first = max(r.first for r in results) - min(r.sent for r in results)
    return {"tpot_s": tpot, "prefill_tok_s": sum(map(len, prompts)) / first}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from kvdrop_engine.loading import preset_config

    vocab = 49152 if args.model else preset_config(args.model_preset).vocab_size
    reports = []
    if args.load in ("burst", "both"):
        reports.append(burst(args, vocab))
    if args.load in ("mixed", "both"):
        reports.append(mixed(args, vocab))
    for report in reports:
        for row in report["rows"]:
            if row.get("errors"):
                print(f"{row['run']}: errors {row['errors']}")
    if args.json:
        with open(args.json, "w") as f:
            args_out = {k: v for k, v in vars(args).items() if k != "json"}
            json.dump({"args": args_out, "reports": reports}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
