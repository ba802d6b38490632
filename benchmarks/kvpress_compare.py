"""kvdrop against NVIDIA kvpress on identical token ids: correct answers per method and setting.

kvpress (https://github.com/NVIDIA/kvpress) compresses an HF transformers model's cache during
prefill. This script runs its presses on exactly the prompts ``kvdrop eval`` measures (the same
generated tasks, seed, length and token ids, the same weights: the HF model is built from the
tensors kvdrop's engine loaded) and prints both columns side by side, with the versions:

* the kvdrop column is read from a ``kvdrop eval --results FILE.jsonl`` of the same grid
  (``--kvdrop-results``; its seed, samples and answer tokens must match, checked);
* the kvpress column is computed here: per prompt, the press runs in the prefill, then greedy
  decoding continues from the compressed cache only. ``inside``: the prompt but its last token is
  prefilled and compressed, the last token then decoded from the compressed cache (so every answer
  token comes from it, as kvdrop eval's fresh decode); ``after``: the context is compressed and
  the question appended. Positions continue from the uncompressed length (kvpress keeps the kept
  keys at their positions; kvdrop re-rotates them to ``0..k-1``).

``--scores`` compares instead the scores themselves, pair by pair, on identical tensors (one
attention layer of a small random-weight HF Llama; :mod:`kvpress_pairs`): the largest score
difference before kvdrop's shared aggregation over heads and layers, and the Jaccard index of
the kept sets where both select one list::

    python benchmarks/kvpress_compare.py --scores --tokens 777 --seed 0 --heads 8 1 16
    python benchmarks/kvpress_compare.py --scores --tokens 1500 --model-layers 0 9 19 29

kvpress 0.5.5 needs ``transformers<5.3`` while kvdrop's ``lmcache`` extra needs ``>=5.4``, so it
lives in its own virtualenv (``pip install -e '.[kvpress]'`` there; docs/quality.md)::

    python benchmarks/kvpress_compare.py --kvdrop-results eval.jsonl --seed 7 --lengths 1024 \\
        --num-samples 12 --presses snapkv tova knorm keydiff kvzip --keep-ratio 0.5
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from kvdrop.experiments.tasks import DEFAULT_TASKS, SETTINGS, TASKS, Sample, make_samples
from kvdrop_engine.loading import ModelSpec, load_model

#: kvdrop policy name -> kvpress press class name (and its arguments besides the ratio).
PRESSES: dict[str, tuple[str, dict[str, Any]]] = {
    "snapkv": ("SnapKVPress", {"window_size": 64, "kernel_size": 5}),
    "tova": ("TOVAPress", {}),
    "knorm": ("KnormPress", {}),
    "keydiff": ("KeyDiffPress", {}),
    "kvzip": ("KVzipPress", {}),
}


def hf_model(model: Any, tokenizer: Any, workdir: Path) -> Any:
    """An HF ``LlamaForCausalLM`` with exactly ``model``'s weights (kvdrop's layout is HF's),
    its tokenizer saved in ``workdir`` (``config.name_or_path``: KVzipPress loads it there)."""
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    c = model.config
    rope = c.rope.to_json()
    config = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=float(rope.get("rope_theta", rope.get("theta", 10000.0))),
        tie_word_embeddings=c.tie_word_embeddings,
        max_position_embeddings=c.max_position_embeddings,
        attn_implementation="sdpa",
    )
    hf = LlamaForCausalLM(config)
    state = {f"model.{k}" if k != "lm_head.weight" else k: v for k, v in model.state_dict().items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise SystemExit(f"weights do not map onto HF Llama: missing {missing}, extra {unexpected}")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer._tk,
        chat_template=tokenizer.chat_template,
        eos_token=tokenizer.eos_token,
        bos_token=tokenizer.bos_token,
    )
    fast.save_pretrained(workdir)
    hf.config.name_or_path = str(workdir)
    hf.config._name_or_path = str(workdir)
    return hf.eval()


def build_press(name: str, keep_ratio: float) -> Any:
    """The kvpress press for kvdrop policy ``name`` at ``keep_ratio`` (None for full KV)."""
    if name == "full":
        return None
    import kvpress

    cls_name, kwargs = PRESSES[name]
    return getattr(kvpress, cls_name)(compression_ratio=1.0 - keep_ratio, **kwargs)


@torch.inference_mode()
def answer(
    model: Any, press: Any, prefill: list[int], then: list[int], max_tokens: int
) -> list[int]:
    """Greedy tokens after compressing ``prefill`` with ``press`` and feeding ``then``."""
    from transformers import DynamicCache

    cache = DynamicCache()
    ids = torch.tensor([prefill])
    with press(model) if press is not None else contextlib.nullcontext():
        model(input_ids=ids, past_key_values=cache)
    pos = len(prefill)
    step = torch.tensor([then])
    out: list[int] = []
    for _ in range(max_tokens):
        positions = torch.arange(pos, pos + step.shape[1])[None]
        logits = model(input_ids=step, past_key_values=cache, position_ids=positions).logits
        tok = int(logits[0, -1].argmax())
        out.append(tok)
        pos += step.shape[1]
        step = torch.tensor([[tok]])
    return out


def kvpress_column(
    model: Any, tokenizer: Any, samples: Sequence[Sample], args: argparse.Namespace
) -> tuple[dict[tuple[str, str], list[bool]], dict[str, float]]:
    """``{(policy, setting): [correct per sample]}`` and seconds per policy."""
    got: dict[tuple[str, str], list[bool]] = defaultdict(list)
    seconds: dict[str, float] = defaultdict(float)
    for name in ["full", *args.presses]:
        press = build_press(name, args.keep_ratio)
        t0 = time.perf_counter()
        for s in samples:
            for setting in args.settings:
                prompt = s.prompt(setting)
                prefill, then = (
                    (prompt[:-1], prompt[-1:])
                    if setting == "inside"
                    else (
                        prompt,
                        s.suffix(setting),
                    )
                )
                tokens = answer(model, press, prefill, then, args.max_tokens)
                text = tokenizer.decode(tokens)
                got[(name, setting)].append(s.is_correct(text))
        seconds[name] = time.perf_counter() - t0
        print(f"  kvpress {name}: {seconds[name]:.0f} s", file=sys.stderr)
    return got, seconds


def kvdrop_column(path: Path, args: argparse.Namespace) -> dict[tuple[str, str], list[bool]]:
    """``{(policy, setting): [correct]}`` of the eval records matching this grid."""
    got: dict[tuple[str, str], dict[tuple[str, int, int], bool]] = defaultdict(dict)
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        cfg = rec["config"]
        if (cfg["seed"], cfg["num_samples"], cfg["max_tokens"]) != (
            args.seed,
            args.num_samples,
            args.max_tokens,
        ):
            raise SystemExit(
                f"{path} holds seed {cfg['seed']}, {cfg['num_samples']} samples, "
                f"{cfg['max_tokens']} answer tokens; this run is seed {args.seed}, "
                f"{args.num_samples}, {args.max_tokens}"
            )
        ratio_ok = rec["policy"] == "full" or abs(rec["keep_ratio"] - args.keep_ratio) < 1e-9
        if not ratio_ok or rec["length"] not in args.lengths or rec["task"] not in args.tasks:
            continue
        for idx, ok in zip(rec["samples"], rec["correct"]):
            if idx not in subset(args):
                continue
            got[(rec["policy"], rec["setting"])][(rec["task"], rec["length"], idx)] = bool(ok)
    return {key: list(v.values()) for key, v in got.items()}


def subset(args: argparse.Namespace) -> set[int]:
    """Indices of the samples this run measures (all, or ``--subset`` evenly spaced)."""
    n, k = args.num_samples, args.subset
    if k is None or k >= n:
        return set(range(n))
    return {round(i * (n - 1) / max(k - 1, 1)) for i in range(k)}


def versions() -> dict[str, str]:
    out = {}
    for dist in ("kvdrop", "kvpress", "transformers", "torch"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def table(
    kvdrop: dict[tuple[str, str], list[bool]],
    kvpress: dict[tuple[str, str], list[bool]],
    args: argparse.Namespace,
) -> Iterator[str]:
    def cell(col: dict[tuple[str, str], list[bool]], key: tuple[str, str]) -> str:
        values = col.get(key)
        return "-" if not values else f"{sum(values)}/{len(values)}"

    head = ["policy"] + [f"{s}: {side}" for s in args.settings for side in ("kvdrop", "kvpress")]
    yield "| " + " | ".join(head) + " |"
    yield "|" + "---|" * len(head)
    for name in ["full", *args.presses]:
        cells = [cell(col, (name, s)) for s in args.settings for col in (kvdrop, kvpress)]
        yield f"| {name} | " + " | ".join(cells) + " |"


def score_identity(args: argparse.Namespace) -> int:
    """``--scores``: the pair table of :mod:`kvpress_pairs`, with versions: one random-weight
    layer of ``--heads``, or with ``--model-layers`` those layers of the real model on an eval
    prompt (``--tasks``' first task, ``--tokens`` long, ``--seed``)."""
    import kvpress_pairs

    if args.model_layers:
        model, tokenizer, name = load_model(ModelSpec())
        sample = make_samples(args.tasks[0], tokenizer, args.tokens, 2, args.seed)[1]
        with tempfile.TemporaryDirectory() as tmp:
            hf = hf_model(model, tokenizer, Path(tmp))
            setups = list(kvpress_pairs.real_setups(hf, sample.inside, args.model_layers))
        where = [f"{name} layer {i}" for i in sorted(args.model_layers)]
        what = f"{args.tasks[0]} prompt of {len(sample.inside)} tokens"
    else:
        setups = [kvpress_pairs.build(args.tokens, args.seed, tuple(args.heads))]
        hq, hkv, d = args.heads
        where = [
            f"a random-weight HF LlamaForCausalLM layer ({hq} query heads, {hkv} KV heads, "
            f"head_dim {d}, float32)"
        ]
        what = f"T={args.tokens}"
    found = {w: kvpress_pairs.setup_rows(s, args.keep_ratio) for w, s in zip(where, setups)}
    if not args.model_layers:  # kvzip's scores need a whole model: a random one of these heads
        kvzip = kvpress_pairs.kvzip_pair(args.tokens, args.seed, tuple(args.heads))
        found = {w: [kvzip if r.pair == "kvzip" else r for r in rs] for w, rs in found.items()}
    if args.json:
        rows = {w: [vars(r) for r in rs] for w, rs in found.items()}
        print(json.dumps({"versions": versions(), "rows": rows}))
        return 0
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions().items()))
    for w, rs in found.items():
        print(
            f"\nscore identity on identical tensors: {w}, {what}, seed {args.seed}, "
            f"keep {args.keep_ratio}"
        )
        for line in kvpress_pairs.table(rs):
            print(line)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kvdrop-results", type=Path, help="a kvdrop eval --results file, same grid")
    p.add_argument("--presses", nargs="+", default=list(PRESSES), choices=list(PRESSES))
    p.add_argument("--keep-ratio", type=float, default=0.5)
    p.add_argument("--lengths", nargs="+", type=int, default=[1024])
    p.add_argument("--tasks", nargs="+", default=list(DEFAULT_TASKS), choices=list(TASKS))
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--num-samples", type=int, default=12)
    p.add_argument(
        "--subset",
        type=int,
        default=None,
        help="run only this many of the samples, evenly spaced in depth (both columns)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--scores",
        action="store_true",
        help="compare scores pair by pair on identical tensors instead of answers",
    )
    p.add_argument("--tokens", type=int, default=512, help="--scores: prompt length")
    p.add_argument(
        "--heads",
        nargs=3,
        type=int,
        default=[4, 2, 32],
        metavar=("HQ", "HKV", "D"),
        help="--scores: query heads, KV heads and head_dim of the random-weight layer",
    )
    p.add_argument(
        "--model-layers",
        nargs="+",
        type=int,
        default=None,
        help="--scores: compare on these layers of the real model (an eval prompt) instead",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        import kvpress  # noqa: F401
    except ImportError:
        print(
            "kvpress is not installed: pip install -e '.[kvpress]' in a virtualenv of its own "
            "(it needs transformers<5.3; docs/quality.md)",
            file=sys.stderr,
        )
        return 2
    if args.scores:
        return score_identity(args)
    model, tokenizer, name = load_model(ModelSpec())
    samples = [
        s
        for n in args.lengths
        for t in args.tasks
        for s in make_samples(t, tokenizer, n, args.num_samples, args.seed)
        if s.index in subset(args)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        hf = hf_model(model, tokenizer, Path(tmp))
        del model
        press_col, seconds = kvpress_column(hf, tokenizer, samples, args)
    drop_col = kvdrop_column(args.kvdrop_results, args) if args.kvdrop_results else {}
    info = versions()
    if args.json:
        rows = {
            f"{k[0]}:{k[1]}": {"kvdrop": drop_col.get(k), "kvpress": press_col.get(k)}
            for k in press_col
        }
        print(json.dumps({"versions": info, "seconds": seconds, "rows": rows}))
        return 0
    print(
        f"model {name} (float32, identical weights and token ids); {len(samples)} prompts "
        f"({', '.join(args.tasks)} x {args.lengths} tokens, seed {args.seed}) x "
        f"{len(args.settings)} settings; keep {args.keep_ratio}; correct answers"
    )
    print("versions: " + ", ".join(f"{k} {v}" for k, v in info.items()))
    for line in table(drop_col, press_col, args):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
