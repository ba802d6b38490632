"""``kvdrop demo``: baseline vs token dropping, side by side, fully offline (the command: flags,
checks and the printed report; the experiment is :mod:`kvdrop.experiments.demo`).

Starts a kvdrop server and the reference engine in this process (or, with ``--cache-server
lmcache``, runs the engine's LMCache backend against a real ``lmcache server``: the one at
``--url``/``--http-url``, else one it starts), builds a batch of long prompts
(pass-key retrieval with the real SmolLM2 model when installed, so answers can be checked; random
tokens with random weights), and runs baseline (prefill, decode) and dropped (prefill, modify with
a policy, decode) on the same engine, whose KV budget fits every dropped request at once but not
every baseline request. Prints the prefill / modify / decode tables and a summary, or ``--json``.
User errors (bad flags, a missing or unreadable model, a pool the machine cannot hold) are one
line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from kvdrop.commands.args import (
    add_connector_arguments,
    add_keep_ratio_argument,
    add_model_arguments,
)

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``kvdrop demo`` (heavy imports stay in ``run``)."""
    run_ = parser.add_argument_group("experiment")
    run_.add_argument("--policy", default="snapkv", help="drop policy (see `kvdrop list`)")
    add_keep_ratio_argument(run_)
    run_.add_argument(
        "--policy-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra policy parameter (JSON value), e.g. --policy-arg window=32",
    )
    run_.add_argument(
        "--no-rerotate",
        action="store_true",
        help="keep kept keys at their old RoPE positions (default: policies re-rotate them "
        "to 0..k-1, where the engine reads the kept prefix, with the RoPE parameters the "
        "engine registered)",
    )
    run_.add_argument("--num-requests", type=int, default=16, help="prompts in the batch")
    run_.add_argument("--prompt-tokens", type=int, default=512, help="minimum prompt length")
    run_.add_argument("--max-tokens", type=int, default=64, help="tokens decoded per request")
    run_.add_argument("--chunk-size", type=int, default=256, help="server chunk size")
    run_.add_argument(
        "--kv-budget-tokens",
        type=int,
        default=None,
        help="engine KV budget (default: fits every dropped request, not baseline)",
    )
    run_.add_argument("--seed", type=int, default=0, help="seed of prompts and random weights")
    run_.add_argument("--json", action="store_true", help="print one JSON report on stdout")
    run_.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_connector_arguments(
        parser,
        url_help="ZMQ address of a running cache server, e.g. tcp://127.0.0.1:6555 (default: "
        "start a kvdrop server in this process; an LMCache server needs "
        "--supported-transfer-mode auto, and --enable transfer_query for query policies)",
    )
    add_model_arguments(parser)


def _policy_params(args: argparse.Namespace) -> dict[str, Any]:
    """The policy's parameters: its budget by the one keep-ratio rule (``args.keep_ratio`` is
    set to the effective ratio, 1.0 for a spec that keeps a token count), the chunk size and
    each ``--policy-arg``."""
    from kvdrop.spec import keep_budget

    budget = keep_budget(args.policy, args.keep_ratio)
    args.keep_ratio = 1.0 if budget.keep_ratio is None else budget.keep_ratio
    params: dict[str, Any] = {**budget.params, "chunk_size": args.chunk_size}
    for item in args.policy_arg:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--policy-arg expects KEY=VALUE, got {item!r}")
        if key in ("keep_ratio", "keep_tokens"):
            raise ValueError(
                f"--policy-arg {key}=... would bypass the keep-ratio rule: give the budget once, "
                f"in the spec (--policy '{args.policy}({key}={value})') or as --keep-ratio"
            )
        try:
            params[key] = json.loads(value)
        except json.JSONDecodeError:
            params[key] = value
    return params


def run(args: argparse.Namespace) -> int:
    """Run the experiment and print its report; 0 on success, 2 on bad flags."""
    # The in-process server, engine and client threads share two cores: spinning OpenMP workers
    # would steal them from each other (measured: decode steps up to 100x slower under load).
    # Must be set before torch starts its thread pool, so before the first torch import.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import kvdrop

    for flag in ("num_requests", "prompt_tokens", "max_tokens", "chunk_size", "threads"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            print(f"kvdrop demo: error: --{flag.replace('_', '-')} must be > 0", file=sys.stderr)
            return 2
    if args.model is not None and not Path(args.model).exists():
        print(f"kvdrop demo: error: --model {args.model}: no such file or folder", file=sys.stderr)
        return 2
    if (args.url is None) != (args.http_url is None):
        print("kvdrop demo: error: give --url and --http-url together", file=sys.stderr)
        return 2
    if args.cache_server == "lmcache":
        from kvdrop_engine.connectors.lmcache import require_lmcache
        from kvdrop_engine.errors import EngineSetupError

        try:
            require_lmcache()
        except EngineSetupError as exc:
            print(f"kvdrop demo: error: {exc}", file=sys.stderr)
            return 2
    try:
        params = _policy_params(args)
        kvdrop.get(args.policy, **params)  # validate before loading anything heavy
    except (ValueError, KeyError, kvdrop.PolicyConflictError) as exc:
        print(f"kvdrop demo: error: {exc}", file=sys.stderr)
        return 2
    from kvdrop.commands.progress import ProgressBar
    from kvdrop.experiments.demo import run_demo
    from kvdrop.experiments.harness import HarnessError

    def progress(phase: str) -> ProgressBar | None:
        return None if args.no_progress else ProgressBar(label=phase)

    try:
        report = run_demo(args, params, progress=progress)
    except HarnessError as exc:
        print(f"kvdrop demo: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_report(report)
    return 0


def _print_report(report: dict[str, Any]) -> None:
    from kvdrop_sdk.metrics import Metrics
    from kvdrop_sdk.table import format_table

    setup = report["setup"]
    print("setup: " + ", ".join(f"{k}={v}" for k, v in setup.items() if k != "policy_params"))
    for run_name in ("baseline", "dropped"):
        for phase in ("prefill", "modify", "decode"):
            data = report[run_name][phase]
            if data is not None:
                metrics = Metrics(f"{run_name}: {data['title']}", _flat(data["metrics"]))
                print()
                print(metrics.format())
    s = report["summary"]
    rows = [
        {
            "run": "baseline",
            "decode_tok_per_s": s["baseline_decode_tput"],
            "peak_running": s["baseline_peak_running"],
            "kept_fraction": 1.0,
            "correct": _frac(s["baseline_correct"], s["num_requests"]),
        },
        {
            "run": "dropped",
            "decode_tok_per_s": s["dropped_decode_tput"],
            "peak_running": s["dropped_peak_running"],
            "kept_fraction": s["kept_fraction"],
            "correct": _frac(s["dropped_correct"], s["num_requests"]),
        },
    ]
    print()
    print(format_table(rows, title="summary"))
    print(
        f"decode throughput gain: {s['decode_gain']:.2f}x   identical answers (to EOS): "
        f"{s['identical_outputs']:.0%}   matching leading tokens: {s['matching_prefix']:.0%}"
    )
    if setup.get("query_capture"):
        print(
            f"queries saved ({setup['query_capture']} mode): "
            f"{setup['query_bytes_per_prompt_token']:,.0f} bytes per prompt token"
        )
    texts = report["dropped"]["texts"]
    if any(texts):
        print()
        answer_rows = [
            {"request": i, "answer": a, "baseline": _short(b), "dropped": _short(d)}
            for i, (a, b, d) in enumerate(
                zip(report["answers"], report["baseline"]["texts"], texts)
            )
        ]
        print(format_table(answer_rows, title="answers (first tokens of each output)"))


def _flat(metrics: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        if isinstance(value, dict):
            out.update(_flat(value))
        else:
            out[key] = value
    return out


def _frac(correct: int | None, n: int) -> str:
    return "n/a" if correct is None else f"{correct}/{n}"


def _short(text: str, width: int = 30) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"
