"""kvdrop and NVIDIA kvpress side by side on ``kvdrop eval``'s prompts: answers per task.

Every prompt of the grid (the eval's generator: same tasks, seed, length and token ids; the HF
model built from the tensors kvdrop's engine loaded, :func:`kvpress_compare.hf_model`) is
answered by

* ``full``: the whole cache;
* ``kvpress``: each press as kvpress runs it, per head and per layer: its ``compress`` on each
  attention layer's own hidden states, keys and values during the prefill (what its forward
  hook does; the prefill is run once and each press compresses the captured layers, which is
  the same computation since kvpress compresses after a layer's attention). ``KVzipPress``,
  whose scores need passes of its own, runs through ``with press(model):``. Kept keys stay at
  their positions and decoding continues at the uncompressed length (kvpress's way; FinchPress
  re-rotates them and continues at the compressed length, as kvpress's pipeline does);
* ``kvdrop c1``: the kvdrop policy of the same name through
  :class:`kvdrop.integrations.transformers.KVDropPress` at chunk 1 (one kept list for every
  layer and head, chosen after the whole prefill; kvzip's reconstruction pass run with the
  model), kept keys re-rotated to ``0..k-1``;
* ``kvdrop c256`` (optional, ``--eval-results``): ``kvdrop eval``'s own answers on the same
  prompts (the server's 256-token chunks, the engine), read from its JSONL files.

Settings as kvdrop eval: ``inside`` compresses the prompt but its last token and decodes that
token first (every answer token from the compressed cache); ``after`` compresses the context
and appends the question. ``finch`` is told the question inside (kvpress: ``window_size``;
kvdrop: the ``delimiter`` token before it, when that token does not recur in the question)
and observes the last context token after (there is no question to see). Greedy answers of
``--max-tokens`` tokens, stopped at EOS. Records go to ``--results`` (JSONL, one line per
prompt and setting, appended as they finish, so a stopped run keeps what it measured).

kvpress 0.5.5 needs ``transformers<5.3``: run it in kvpress's own virtualenv (docs/quality.md)::

    python benchmarks/kvpress_side.py --seeds 1 2 --num-samples 8 --results side.jsonl
    python benchmarks/kvpress_side.py --table side.jsonl \\
        --eval-results docs/data/dev-s*-1024-*.jsonl

``--no-kvpress --kvdrop-policies SPEC ...`` answers with full KV and kvdrop's policies alone (no
kvpress needed): one prefill and one reconstruction pass a prompt for every variant of a policy,
the cheap way to compare variants on CPU::

    python benchmarks/kvpress_side.py --no-kvpress --kvdrop-policies kvzip 'kvzip(head_agg=mean)' \\
        --keep-ratios 0.25 --settings inside --tasks kv multikey --results variants.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from kvdrop.experiments.results import wilson
from kvdrop.experiments.tasks import DEFAULT_TASKS, SETTINGS, Sample, make_samples

#: kvdrop policy -> kvpress press class and its arguments besides the compression ratio.
PRESSES: dict[str, tuple[str, dict[str, Any]]] = {
    "kvzip": ("KVzipPress", {}),
    "expected-attention": ("ExpectedAttentionPress", {}),
    "snapkv": ("SnapKVPress", {}),
    "cap": ("CapPress", {}),
    "leverage": ("LeverageScorePress", {}),
    "compactor": ("CompactorPress", {}),
    "finch": ("FinchPress", {}),
}


def split(sample: Sample, setting: str) -> tuple[list[int], list[int]]:
    """``(prefilled and compressed, fed after)`` token ids of ``sample`` in ``setting``."""
    prompt = sample.prompt(setting)
    if setting == "inside":
        return prompt[:-1], prompt[-1:]
    return prompt, sample.suffix(setting)


def question_length(sample: Sample, setting: str) -> int:
    """Tokens of the question inside the prefilled part (0 after compression)."""
    if setting != "inside":
        return 0
    q = len(sample.question)
    assert sample.inside[-q:] == sample.question, "inside = context + question"
    return q - 1  # the last token is fed after compression


@torch.inference_mode()
def decode(
    model: Any, cache: Any, then: list[int], start: int, max_tokens: int, eos: int
) -> list[int]:
    """Greedy tokens after feeding ``then`` at positions ``start...`` on ``cache``."""
    out: list[int] = []
    device = model.device
    step, pos = torch.tensor([then], device=device), start
    for _ in range(max_tokens):
        positions = torch.arange(pos, pos + step.shape[1], device=device)[None]
        logits = model(input_ids=step, past_key_values=cache, position_ids=positions).logits
        tok = int(logits[0, -1].argmax())
        if tok == eos:
            break
        out.append(tok)
        pos += step.shape[1]
        step = torch.tensor([[tok]], device=device)
    return out


class LayerCapture:
    """Forward hooks keeping each attention layer's inputs during one prefill (kvpress's hook
    reads the same: ``hidden_states``, ``position_embeddings`` and the layer's cache)."""

    def __init__(self, model: Any) -> None:
        self.inputs: dict[int, tuple[torch.Tensor, dict[str, Any]]] = {}
        self.handles = []
        for i, layer in enumerate(model.model.layers):
            self.handles.append(
                layer.self_attn.register_forward_hook(self._keep(i), with_kwargs=True)
            )

    def _keep(self, index: int) -> Any:
        def keep(module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
            small = {"position_embeddings": kwargs["position_embeddings"]}
            self.inputs[index] = (kwargs["hidden_states"].detach(), small)

        return keep

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def kvpress_press(name: str, keep: float, window: int) -> Any:
    import kvpress

    cls, kwargs = PRESSES[name]
    press = getattr(kvpress, cls)(compression_ratio=1.0 - keep, **kwargs)
    if name == "finch":
        press.window_size = max(window, 1)
    return press


@torch.inference_mode()
def kvpress_answers(
    model: Any, prefill: list[int], then: list[int], window: int, args: argparse.Namespace
) -> dict[str, list[int]]:
    """``{"full": text, "kvpress:NAME:KEEP": text}`` for one prompt."""
    from transformers import DynamicCache

    eos = args.eos
    ids = torch.tensor([prefill], device=model.device)
    cache = DynamicCache()
    capture = LayerCapture(model)
    try:
        model(input_ids=ids, past_key_values=cache)
    finally:
        capture.close()
    layers = [(layer.keys, layer.values) for layer in cache.layers]
    answers: dict[str, list[int]] = {
        "full": decode(model, cache, then, len(prefill), args.max_tokens, eos)
    }
    for name in args.presses:
        for keep in args.keep_ratios:
            press = kvpress_press(name, keep, window)
            torch.manual_seed(0)  # leverage's sketch comes from torch's global generator
            smaller = DynamicCache()
            if name == "kvzip":
                with press(model):
                    model(input_ids=ids, past_key_values=smaller)
            else:
                press.post_init_from_model(model)  # what ``with press(model):`` sets up
                for layer in model.model.layers:
                    layer.self_attn.rotary_emb = model.model.rotary_emb
                for i, (keys, values) in enumerate(layers):
                    hidden, kwargs = capture.inputs[i]
                    module = model.model.layers[i].self_attn
                    k, v = press.compress(module, hidden, keys, values, None, kwargs)
                    smaller.update(k, v, i)
            # FinchPress re-rotates its kept keys: kvpress's pipeline then continues at the
            # compressed length; every other press keeps positions (the uncompressed length).
            start = smaller.get_seq_length() if name == "finch" else len(prefill)
            text = decode(model, smaller, then, start, args.max_tokens, eos)
            answers[f"kvpress:{name}:{keep}"] = text
            for layer in model.model.layers:  # KVzipPress masks keys per head; not the next
                layer.self_attn.masked_key_indices = None
    return answers


def kvdrop_answers(
    model: Any,
    tokenizer: Any,
    prefill: list[int],
    then: list[int],
    window: int,
    args: argparse.Namespace,
) -> dict[str, list[int]]:
    """``{"kvdrop c1:NAME:KEEP": text}``: one prefill (with kvzip's pass), every policy's
    selection from it."""
    from kvdrop.integrations.transformers import KVDropPress

    ids = torch.tensor([prefill + then], device=model.device)
    tail = len(then)
    shared = KVDropPress("kvzip", tail=tail, tokenizer=tokenizer).prefill(model, ids)
    answers = {}
    for name in args.kvdrop_policies or args.presses:
        params: dict[str, Any] = {"tokenizer": tokenizer}  # the reconstruction prompt's tokens
        if name == "finch" and window:
            delimiter = prefill[-window - 1]
            if delimiter not in prefill[-window:]:
                params["delimiter"] = delimiter
        for keep in args.keep_ratios:
            press = KVDropPress(name, keep_ratio=keep, tail=tail, chunk_size=1, **params)
            done = press.select(model, shared)
            kept = len(done.kept)
            text = decode(model, done.cache, then, kept, args.max_tokens, args.eos)
            answers[f"kvdrop c1:{name}:{keep}"] = text
    return answers


def run(args: argparse.Namespace) -> None:
    from transformers import DynamicCache, PreTrainedTokenizerFast

    from kvdrop_engine.loading import ModelSpec, load_model

    sys.path.insert(0, str(Path(__file__).parent))
    import kvpress_compare

    torch.set_num_threads(args.threads)
    model, tokenizer, name = load_model(ModelSpec(model=args.model))
    done = set()
    if args.results.exists():
        for line in args.results.read_text().splitlines():
            r = json.loads(line)
            done.add((r["seed"], r["task"], r["index"], r["setting"]))
    with tempfile.TemporaryDirectory() as tmp:
        hf = kvpress_compare.hf_model(model, tokenizer, Path(tmp)).to(args.device)
        hf_tok = PreTrainedTokenizerFast.from_pretrained(tmp)
        args.eos = int(hf_tok.convert_tokens_to_ids(tokenizer.eos_token))
        grid = {
            (seed, task): make_samples(task, tokenizer, args.length, args.num_samples, seed)
            for seed in args.seeds
            for task in args.tasks
        }
        order = [
            (index, seed, task, setting)
            for index in range(args.num_samples)  # depth-major: a stopped run stays balanced
            for seed, task in grid
            for setting in args.settings
        ]
        part, parts = args.shard
        for index, seed, task, setting in order[part::parts]:
            sample = grid[(seed, task)][index]
            if (seed, task, index, setting) in done:
                continue
            t0 = time.perf_counter()
            prefill, then = split(sample, setting)
            window = question_length(sample, setting)
            if args.no_kvpress:
                eos, ids = args.eos, torch.tensor([prefill], device=hf.device)
                cache = DynamicCache()
                with torch.inference_mode():
                    hf(input_ids=ids, past_key_values=cache)
                texts = {"full": decode(hf, cache, then, len(prefill), args.max_tokens, eos)}
            else:
                texts = kvpress_answers(hf, prefill, then, window, args)
            texts |= kvdrop_answers(hf, hf_tok, prefill, then, window, args)
            decoded = {k: tokenizer.decode(v) for k, v in texts.items()}
            record = {
                "seed": seed,
                "task": task,
                "index": index,
                "setting": setting,
                "length": args.length,
                "num_samples": args.num_samples,
                "model": name,
                "seconds": round(time.perf_counter() - t0, 1),
                "correct": {k: sample.is_correct(v) for k, v in decoded.items()},
                "answers": decoded,
            }
            with args.results.open("a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"seed {seed} {task} {index} {setting}: {record['seconds']} s",
                  file=sys.stderr, flush=True)  # fmt: skip


def load_eval(paths: Sequence[Path], length: int, num_samples: int) -> dict[tuple[Any, ...], bool]:
    """``kvdrop eval`` answers ``{(column key, seed, task, index, setting): correct}`` of runs
    with ``num_samples`` prompts a task (the same prompts as the side-by-side's)."""
    out = {}
    for path in paths:
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            r = json.loads(line)
            if int(r["length"]) != length or int(r["config"]["num_samples"]) != num_samples:
                continue
            key = (
                "full" if r["policy"] == "full" else f"kvdrop c256:{r['policy']}:{r['keep_ratio']}"
            )
            for idx, ok in zip(r["samples"], r["correct"]):
                out[(key, int(r["config"]["seed"]), r["task"], int(idx), r["setting"])] = bool(ok)
    return out


def table(records: list[dict[str, Any]], evals: dict[tuple[Any, ...], bool]) -> Iterator[str]:
    """Markdown: a row per press and keep, a column per setting x task x side, pooled cells."""
    cells: dict[tuple[str, str, str], list[bool]] = defaultdict(list)
    for r in records:
        where = (r["seed"], r["task"], r["index"], r["setting"])
        row = dict(r["correct"])
        for key in list(row):
            if key.startswith("kvdrop c1:"):
                c256 = "kvdrop c256:" + key.split(":", 1)[1]
                if (c256, *where) in evals:
                    row[c256] = evals[(c256, *where)]
        if ("full", *where) in evals:
            row["eval full"] = evals[("full", *where)]
        for key, ok in row.items():
            cells[(key, r["setting"], r["task"])].append(bool(ok))
            cells[(key, r["setting"], "all")].append(bool(ok))
    tasks = [*sorted({r["task"] for r in records}, key=list(DEFAULT_TASKS).index), "all"]
    settings = [s for s in SETTINGS if any(r["setting"] == s for r in records)]
    head = [f"{s} {t}" for s in settings for t in tasks]
    yield "| press | keep | side | " + " | ".join(head) + " |"
    yield "|---" * (len(head) + 3) + "|"
    keys = sorted({k[0] for k in cells}, key=_order)
    for key in keys:
        if key in ("full", "eval full"):
            side, name, keep = ("kvpress" if key == "full" else "eval"), "full KV", "1.0"
        else:
            side, name, keep = key.split(":")
        row = []
        for s in settings:
            for t in tasks:
                v = cells.get((key, s, t), [])
                if not v:
                    row.append("-")
                    continue
                text = f"{sum(v)}/{len(v)}"
                if t == "all":
                    lo, hi = wilson(sum(v), len(v))
                    text += f" [{lo:.2f}-{hi:.2f}]"
                row.append(text)
        yield f"| {name} | {keep} | {side} | " + " | ".join(row) + " |"


def _order(key: str) -> tuple[int, str, float, int]:
    if key in ("full", "eval full"):
        return (0, "", 0.0, 0 if key == "full" else 1)
    side, name, keep = key.split(":")
    sides = ["kvpress", "kvdrop c1", "kvdrop c256"]
    return (1, name, -float(keep), sides.index(side))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presses", nargs="+", default=list(PRESSES), choices=list(PRESSES))
    p.add_argument(
        "--kvdrop-policies",
        nargs="+",
        metavar="SPEC",
        help="kvdrop policies or specs for the kvdrop side (default: the presses' names)",
    )
    p.add_argument(
        "--no-kvpress",
        action="store_true",
        help="kvdrop's side only (full KV and --kvdrop-policies): variants of one policy",
    )
    p.add_argument("--keep-ratios", nargs="+", type=float, default=[0.5, 0.25])
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--tasks", nargs="+", default=list(DEFAULT_TASKS))
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--num-samples", type=int, default=8)
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2])
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--model", default=None, help="a .gguf file (default: the installed SmolLM2)")
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--shard",
        type=int,
        nargs=2,
        default=[0, 1],
        metavar=("I", "N"),
        help="run only the I-th of N interleaved parts of the prompts (parallel runs)",
    )
    p.add_argument("--results", type=Path, default=Path("kvpress-side.jsonl"))
    p.add_argument("--table", type=Path, nargs="+", help="print the table of these records")
    p.add_argument("--eval-results", type=Path, nargs="*", default=[])
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.table:
        records = [json.loads(x) for p in args.table for x in p.read_text().splitlines() if x]
        evals = load_eval(args.eval_results, args.length, args.num_samples)
        for line in table(records, evals):
            print(line)
        return 0
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
