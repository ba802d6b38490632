"""What KVzip's reconstruction pass costs against the prefill of the same prompt, part by part.

For each ``--prompt-tokens`` length ``N`` a random prompt is prefilled into a paged cache the way
the engine runs it (steps of ``--max-prefill-tokens`` rows through :class:`PagedAttention`), then
its reconstruction pass runs the way the engine runs it (:meth:`ModelRunner.reconstruction_pass`:
pieces of at most ``--max-prefill-tokens`` rows, the scores brought to the host at the end).
Both are timed whole (``total_s``, the figure ``pass_x_prefill`` compares), then once more with
a timer around each part (a device synchronisation on either side of every timed call):

* ``proj_mlp_s``: the model with its attention replaced by a no-op, over the same rows and
  pieces (embeddings, norms, projections, RoPE, MLP: what the weights cost);
* ``attention_s``: the attention backend's attention (the prefill's paged attention; the pass's
  attention over the cache and its own rows, with the scoring keys' log-normalisers);
* ``scores_s``: the pass's scores from those (logits of the scored keys, their max);
* ``gather_s``: the pass's reads of the paged cache (a gathered copy per layer and piece);
* ``host_s``: the scores' copy to the host;
* ``other_s``: the timed run's total less its parts (the rest of the backends: cache writes,
  the chunk's own rows kept; Python).

    python benchmarks/reconstruct_cost.py                     # CPU, tiny preset, seconds
    python benchmarks/reconstruct_cost.py --device cuda --dtype bfloat16 --model-preset qwen3-8b \\
        --prompt-tokens 8192 14336
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from kvdrop_engine import reconstruct
from kvdrop_engine.loading import preset_config
from kvdrop_engine.model import Transformer
from kvdrop_engine.paged import PagedAttention, PagedKVCache, SeqStep, blocks_needed, to_host
from kvdrop_engine.reconstruct import ReconstructionPass, ReconstructionPrompt

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PARTS = ("proj_mlp_s", "attention_s", "scores_s", "gather_s", "host_s", "other_s")
#: The pass's parts by the names they have in :mod:`kvdrop_engine.reconstruct` (first found).
ATTENTION_NAMES = ("split_attention", "causal_attention")
SCORE_NAMES = ("scored_max", "chunk_scores")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--model-preset", default="tiny", help="random-weight shape preset")
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[600], help="each measured")
    p.add_argument("--chunk-tokens", type=int, default=2048, help="reconstruction chunk")
    p.add_argument("--max-prefill-tokens", type=int, default=8192, help="rows a step/piece")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3, help="a warm-up, then best of this (in turns)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="one JSON object a length")
    args = p.parse_args(argv)
    if args.repeat < 1 or min(args.prompt_tokens) < 1:
        p.error("--repeat and --prompt-tokens must be >= 1")
    return args


class Timer:
    """Seconds per part, each call fenced by device synchronisations."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = {}

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **kw: Any) -> Any:
            self.sync()
            started = time.perf_counter()
            out = fn(*a, **kw)
            self.sync()
            self.seconds[part] = self.seconds.get(part, 0.0) + time.perf_counter() - started
            return out

        return timed


def _null_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return q


def prefill(model: Transformer, cache: PagedKVCache, table: list[int], ids: list[int],
            step: int, attention: Callable[..., Any] | None = None) -> None:  # fmt: skip
    """The prompt through the model in engine steps of ``step`` rows (``attention`` wraps the
    paged backend; the no-op backend when it is :func:`_null_attention`)."""
    dev = model.device
    for start in range(0, len(ids), step):
        n = min(step, len(ids) - start)
        backend: Any = PagedAttention(cache, [SeqStep(0, table, start, n)])
        if attention is _null_attention:
            backend = _null_attention
        elif attention is not None:
            backend = attention(backend)
        model(
            torch.tensor(ids[start : start + n], device=dev),
            torch.arange(start, start + n, device=dev),
            backend,
            logits_rows=torch.tensor([n - 1]),
        )


def new_pass(
    model: Transformer, cache: PagedKVCache, table: list[int], ids: list[int],
    prompt: ReconstructionPrompt, gather: Callable[..., Any] | None = None,
) -> ReconstructionPass:  # fmt: skip
    """The pass as :meth:`ModelRunner.reconstruction_pass` builds it (``gather`` wraps the
    per-layer reads of the paged cache)."""
    heads = (-1, cache.num_kv_heads, cache.head_dim)
    slots = cache.slots(table, 0, len(ids))

    def keys(layer: int) -> torch.Tensor:
        return cache.k[layer].view(heads)[slots]

    def values(layer: int) -> torch.Tensor:
        return cache.v[layer].view(heads)[slots]

    if gather is not None:
        keys, values = gather(keys), gather(values)
    return ReconstructionPass(model, ids, len(ids), keys, values, prompt)


def run_pass(run: ReconstructionPass, step: int, host: Callable[..., Any] = to_host) -> None:
    while not run.done:
        run.step(step)
    host(run.scores)


@contextlib.contextmanager
def patched(module: Any, names: tuple[str, ...], wrap: Callable[..., Any]) -> Iterator[None]:
    """The first of ``names`` that ``module`` has, wrapped by ``wrap`` while inside."""
    name = next(n for n in names if hasattr(module, n))
    fn = getattr(module, name)
    setattr(module, name, wrap(fn))
    try:
        yield
    finally:
        setattr(module, name, fn)


def best_of(fn: Callable[[], None], timer: Timer, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        timer.sync()
        started = time.perf_counter()
        fn()
        timer.sync()
        times.append(time.perf_counter() - started)
    return min(times)


def best_of_each(fns: list[Callable[[], None]], timer: Timer, repeat: int) -> list[float]:
    """The best time of each of ``fns``, run in turn ``repeat`` times after a warm-up (so that
    a busy spell of a shared machine falls on all of them alike)."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, out in zip(fns, times, strict=True):
            timer.sync()
            started = time.perf_counter()
            fn()
            timer.sync()
            out.append(time.perf_counter() - started)
    return [min(t) for t in times]


def measure(model: Transformer, n: int, args: argparse.Namespace) -> dict[str, Any]:
    cfg, dev = model.config, model.device
    gen = torch.Generator().manual_seed(args.seed + n)
    ids = torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist()
    nblk = blocks_needed(n, args.block_size)
    cache = PagedKVCache(
        num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        num_blocks=nblk, block_size=args.block_size, dtype=model.dtype, device=dev,
    )  # fmt: skip
    table = list(range(nblk))
    prompt = ReconstructionPrompt.synthetic(cfg.vocab_size, chunk_tokens=args.chunk_tokens)
    step = args.max_prefill_tokens
    timer = Timer(dev)
    out: dict[str, Any] = {"prompt_tokens": n}
    with torch.inference_mode():
        pre: dict[str, float] = {}
        ps: dict[str, float] = {}
        pre["total_s"], ps["total_s"] = best_of_each(
            [
                lambda: prefill(model, cache, table, ids, step),
                lambda: run_pass(new_pass(model, cache, table, ids, prompt), step),
            ],
            timer,
            args.repeat,
        )
        pre["proj_mlp_s"] = best_of(
            lambda: prefill(model, cache, table, ids, step, _null_attention), timer, args.repeat
        )
        timer.seconds = {}
        started = time.perf_counter()
        prefill(model, cache, table, ids, step, lambda b: timer.wrap("attention_s", b))
        timer.sync()
        timed = time.perf_counter() - started
        pre["attention_s"] = timer.seconds["attention_s"]
        pre["other_s"] = timed - pre["attention_s"] - pre["proj_mlp_s"]

        rows = new_pass(model, cache, table, ids, prompt).total_rows

        def null_rows() -> None:  # the pass's rows and pieces through the weights alone
            run = new_pass(model, cache, table, ids, prompt)

            def weights_only(tokens: Any, positions: Any, attn: Any, logits_rows: Any) -> Any:
                return model(tokens, positions, _null_attention, logits_rows)

            run.model = weights_only  # type: ignore[assignment]
            run_pass(run, step, host=lambda t: t)

        ps["proj_mlp_s"] = best_of(null_rows, timer, args.repeat)
        timer.seconds = {}
        with (
            patched(reconstruct, ATTENTION_NAMES, lambda f: timer.wrap("attention_s", f)),
            patched(reconstruct, SCORE_NAMES, lambda f: timer.wrap("scores_s", f)),
        ):
            run = new_pass(model, cache, table, ids, prompt, lambda f: timer.wrap("gather_s", f))
            timer.sync()
            started = time.perf_counter()
            run_pass(run, step, host=timer.wrap("host_s", to_host))
            timer.sync()
            timed = time.perf_counter() - started
        ps.update(timer.seconds)
        ps["other_s"] = timed - sum(v for k, v in ps.items() if k in PARTS and k != "other_s")
    out["pass_rows"] = rows
    for name, parts in (("prefill", pre), ("pass", ps)):
        for key in ("total_s", *PARTS):
            out[f"{name}_{key}"] = parts.get(key, 0.0)
    out["pass_x_prefill"] = ps["total_s"] / pre["total_s"]
    return out


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    torch.manual_seed(args.seed)
    cfg = preset_config(args.model_preset)
    model = Transformer.random(cfg, seed=args.seed, dtype=dtype, device=device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "-"
    setup = {
        "device": str(device), "gpu": gpu, "dtype": args.dtype, "model": args.model_preset,
        "layers": cfg.num_layers, "q_heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "hidden": cfg.hidden_size, "threads": torch.get_num_threads(),
        "torch": torch.__version__, "chunk_tokens": args.chunk_tokens,
        "max_prefill_tokens": args.max_prefill_tokens,
    }  # fmt: skip
    results = [measure(model, n, args) for n in args.prompt_tokens]
    if args.json:
        for r in results:
            print(json.dumps({**setup, **r}))
        return 0
    print(table([list(setup), [str(v) for v in setup.values()]]))
    print()
    head = ["prompt_tokens", "run", "rows", "total_s", *PARTS, "x_prefill"]
    rows = [head]
    for r in results:
        for name in ("prefill", "pass"):
            total = r[f"{name}_total_s"]
            rows.append([
                str(r["prompt_tokens"]), name,
                str(r["prompt_tokens"] if name == "prefill" else r["pass_rows"]),
                *(f"{r[f'{name}_{k}']:.4f}" for k in ("total_s", *PARTS)),
                f"{total / r['prefill_total_s']:.3f}",
            ])  # fmt: skip
    print(table(rows))
    print("\nparts: a second run, a device sync around each timed call; total_s: an untimed run")
    print("(best of --repeat, prefill and pass in turns); x_prefill: total_s / the prefill's")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
