"""The engine loop's host time per decode step, where a GPU step is short enough for it to show.

Two measurements, no GPU needed:

1. ``table``: what a decode graph's step spends on its block table when one row grew by a
   block: :class:`~kvdrop_engine.graphs.TableRows` (the changed rows only) against writing the
   whole table from the batch's block lists, as every such step did before 2026-12-08, at
   ``--rows`` rows of ``--blocks`` blocks in a table ``--width`` wide (the issue-31 shape: 30
   rows of about 700 blocks, graphs captured 16,384 wide);
2. ``loop``: the whole engine (``tiny`` preset, random weights, CPU, ``--threads``) decoding
   ``--rows`` requests of ``--prompt-tokens`` for ``--max-tokens`` each; wall seconds and steps;
3. ``slice``: one 3,000-token prompt scored alone in slices of ``--slices`` rows a step
   (``max_prefill_tokens``; at most 256, the scoring's bound): what a step costs as its rows
   grow, i.e. what a step pays for the context whatever its rows (docs/reliability.md: the
   prompt scoring's cost beside good clients).

    python benchmarks/step_host.py
    python benchmarks/step_host.py --rows 20 --repeat 3
    PYTHONPATH=/path/to/older/src python benchmarks/step_host.py --parts loop   # an A/B
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvdrop_engine.engine import Engine
from kvdrop_engine.loading import preset_config
from kvdrop_engine.model import Transformer
from kvdrop_engine.paged import SeqStep
from kvdrop_sdk.table import format_table


def whole_table(seqs: list[SeqStep], batch: int, width: int, scratch: int) -> torch.Tensor:
    """Every row written from its block list (the rule before TableRows)."""
    table = torch.full((batch, width), scratch, dtype=torch.int32)
    for i, s in enumerate(seqs):
        blocks = list(s.block_table[:width])
        table[i, : len(blocks)] = torch.as_tensor(blocks, dtype=torch.int32)
    return table


def table_times(rows: int, blocks: int, width: int, repeat: int) -> dict[str, float]:
    """Milliseconds per step of one row growing by a block, both ways (medians)."""
    from kvdrop_engine.graphs import TableRows  # here: --parts loop runs on older builds too

    batch = 1 << (rows - 1).bit_length()
    tables = [tuple(range(i * blocks, (i + 1) * blocks)) for i in range(rows)]
    table_rows = TableRows(batch, width, scratch=width)
    table_rows.update([SeqStep(i, t, 0, 1) for i, t in enumerate(tables)])
    new, old = [], []
    for step in range(repeat):
        i = step % rows
        tables[i] = (*tables[i][:-1], tables[i][-1])  # a new tuple: the row "grew"
        seqs = [SeqStep(j, t, 0, 1) for j, t in enumerate(tables)]
        t0 = time.perf_counter()
        table_rows.update(seqs)
        new.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        seen = tuple((s.seq_id, tuple(s.block_table)) for s in seqs)  # the old per-step check
        whole_table(seqs, batch, width, width)
        old.append(time.perf_counter() - t0)
        del seen
    return {
        "changed_rows_ms": 1e3 * statistics.median(new),
        "whole_ms": 1e3 * statistics.median(old),
    }


def loop_seconds(rows: int, prompt: int, max_tokens: int, threads: int) -> tuple[float, int]:
    """Wall seconds and engine steps for ``rows`` requests decoded together."""
    torch.set_num_threads(threads)
    model = Transformer.random(preset_config("tiny"))
    with Engine(model, num_blocks=4096, block_size=16, max_prefill_tokens=128) as eng:
        eng.generate(list(range(5, 5 + prompt)), {"max_tokens": 4, "temperature": 0})
        before = eng.stats().steps
        params = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        t0 = time.perf_counter()
        handles = [
            eng.post_completion(list(range(10 + i, 10 + i + prompt)), params) for i in range(rows)
        ]
        for h in handles:
            list(h)
        return time.perf_counter() - t0, eng.stats().steps - before


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=30)
    p.add_argument("--blocks", type=int, default=700, help="blocks per row (table part)")
    p.add_argument("--width", type=int, default=16384, help="table width (table part)")
    p.add_argument("--prompt-tokens", type=int, default=200, help="(loop part)")
    p.add_argument("--max-tokens", type=int, default=150, help="(loop part)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (loop part)")
    p.add_argument("--repeat", type=int, default=1, help="loop runs")
    p.add_argument("--slices", type=int, nargs="+", default=[4, 16, 64], help="(slice part)")
    p.add_argument(
        "--parts", nargs="+", choices=("table", "loop", "slice"), default=["table", "loop", "slice"]
    )
    args = p.parse_args(argv)
    if "table" in args.parts:
        table_part(args)
    if "loop" in args.parts:
        loop_part(args)
    if "slice" in args.parts:
        slice_part(args)


def slice_part(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    model = Transformer.random(preset_config("tiny"))
    prompt = [3 + (t * 7) % 500 for t in range(3000)]
    rows = []
    for rows_a_step in args.slices:
        with Engine(model, num_blocks=1024, block_size=16, max_prefill_tokens=rows_a_step) as eng:
            eng.generate(list(range(5, 25)), {"max_tokens": 2, "temperature": 0})
            before, t0 = eng.stats().steps, time.perf_counter()
            eng.post_prompt_scoring(prompt, 0).result()
            seconds, steps = time.perf_counter() - t0, eng.stats().steps - before
        rows.append({"rows_a_step": rows_a_step, "steps": steps, "seconds": round(seconds, 3),
                     "ms_per_step": round(1e3 * seconds / steps, 3)})  # fmt: skip
    print(
        f"\n3,000-token prompt scored alone, tiny preset, CPU, {args.threads} thread(s), "
        "by rows a step"
    )
    print(format_table(rows))


def table_part(args: argparse.Namespace) -> None:
    t = table_times(args.rows, args.blocks, args.width, repeat=200)
    print(
        f"block table, one row grown, {args.rows} rows x {args.blocks} blocks, "
        f"width {args.width}, int32, 1 thread"
    )
    print(
        format_table(
            [
                {
                    **{k: round(v, 3) for k, v in t.items()},
                    "ratio": round(t["whole_ms"] / t["changed_rows_ms"], 1),
                }
            ]
        )
    )


def loop_part(args: argparse.Namespace) -> None:
    rows = []
    for _ in range(args.repeat):
        seconds, steps = loop_seconds(args.rows, args.prompt_tokens, args.max_tokens, args.threads)
        rows.append(
            {
                "seconds": round(seconds, 3),
                "steps": steps,
                "ms_per_step": round(1e3 * seconds / steps, 3),
            }
        )
    print(
        f"\nengine loop, tiny preset, CPU, {args.threads} thread(s), {args.rows} requests of "
        f"{args.prompt_tokens} prompt tokens, {args.max_tokens} decoded each"
    )
    print(format_table(rows))


if __name__ == "__main__":
    main()
