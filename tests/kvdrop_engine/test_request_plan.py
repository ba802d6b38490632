"""A request's plan has one owner (``kvdrop_engine.plan``): built once at submission, frozen, its
actions ordered and owned by their modules; one writer of a request's capture and one place that
finishes a request. Its query capture is the cut's policy needs joined with the connector's
window store, honouring ``--query-window``. A window-storing connector
beside a dropper used to shrink the cut's rows to the connector's window (compactor failed,
snapkv saw 8 rows) and a cut request stored no window."""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

import kvdrop
from kvdrop_engine.connectors.base import KVConnector
from kvdrop_engine.drop import CutPrompt, PromptDropper
from kvdrop_engine.engine import Engine
from kvdrop_engine.loading import preset_config
from kvdrop_engine.model import DenseAttention, ModelConfig, Transformer
from kvdrop_engine.plan import RequestPlan
from kvdrop_engine.reconstruct import ReconstructionPrompt, ScorePrompt
from kvdrop_engine.transfer import StoreDecoded, StorePrompt, StoreWindow
from kvdrop_sdk import CacheKind
from kvdrop_sdk.edit import EditContext
from kvdrop_sdk.events import kept_prompt_tokens
from kvdrop_sdk.query_capture import QueryCapture, QueryNeed
from kvdrop_sdk.window import QueryWindow

pytestmark = pytest.mark.timeout(120)

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model() -> Transformer:
    return Transformer.random(preset_config("tiny"), seed=0)


def prompt_of(n: int, seed: int = 1) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 200, (n,), generator=gen).tolist()


class WindowStore(KVConnector):
    """Stores nothing but query windows (a kvdrop server's window store, in a list)."""

    stores_windows = True

    def __init__(self, window: int = 8) -> None:
        super().__init__(QueryCapture(QueryNeed.WINDOW, window=window, stride=0))
        self.windows: list[tuple[list[int], QueryWindow]] = []

    def bind(
        self, config: ModelConfig, dtype: torch.dtype, *, device: torch.device | None = None
    ) -> None:
        self.chunk_size, self.transfer_query = 16, True

    def load(self, tokens: Sequence[int], cache_salt: str = "") -> torch.Tensor | None:
        return None

    def store(
        self,
        kv: torch.Tensor,
        queries: torch.Tensor | None,
        tokens: Sequence[int],
        cache_salt: str = "",
        *,
        query_offset: int = 0,
    ) -> int:
        return 0

    def store_window(
        self, tokens: Sequence[int], window: QueryWindow, cache_salt: str = ""
    ) -> bool:
        self.windows.append((list(tokens), window))
        return True


def spy_rows(engine: Engine) -> list[int]:
    """Record how many query rows each cut hands its policy."""
    seen: list[int] = []
    dropper = engine.dropper
    assert dropper is not None
    original = dropper.start  # the loop gathers the cut's inputs here

    def start(cache, req, c):  # type: ignore[no-untyped-def]
        seen.append(0 if req.window is None else req.window.num_rows)
        return original(cache, req, c)

    dropper.start = start  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("spec", ["compactor", "snapkv"])
def test_a_window_store_beside_a_cut_keeps_the_cut_rows(model: Transformer, spec: str) -> None:
    """Connector window 8, the cut's policy reads 64 (the --query-window default) or every row:
    the cut sees them, the request succeeds and its (post-cut) window is stored."""
    prompt = prompt_of(200)
    conn = WindowStore(window=8)
    dropper = PromptDropper(model.config, spec, keep_ratio=0.5)
    with Engine(model, num_blocks=64, connector=conn, dropper=dropper) as engine:
        seen = spy_rows(engine)
        events = list(engine.post_completion(prompt, {"max_tokens": 4, **GREEDY}))
    need = kvdrop.get(spec).queries
    assert len(events) == 4 and kept_prompt_tokens(events) == 100
    assert seen == [200 if need is QueryNeed.FULL else 64]
    assert len(conn.windows) == 1
    tokens, window = conn.windows[0]
    kept = tokens[:100]
    assert tokens == kept + [e.token_id for e in events]
    # After the cut the window restarts on the kept sequence: decode rows at 100.., at most 8.
    assert window.positions.tolist() == [100, 101, 102]


def test_query_window_reaches_the_cut(model: Transformer) -> None:
    """``query_window`` (``--query-window``) sizes the cut's capture (it was a fixed 64)."""
    dropper = PromptDropper(model.config, "snapkv(window=128)", keep_ratio=0.5, query_window=128)
    with Engine(model, num_blocks=64, dropper=dropper) as engine:
        seen = spy_rows(engine)
        engine.generate(prompt_of(200), {"max_tokens": 2, **GREEDY})
    # Positions 72..199: snapkv reads the last rows only, so no strided sample is captured
    # for it (Needs.query_sample; with one, 0 and 64 came too).
    assert seen == [128]


@pytest.mark.parametrize(("spec", "rows"), [("snapkv", 64), ("h2o", 64 + 3)])
def test_the_strided_sample_is_captured_only_for_a_policy_that_reads_it(
    model: Transformer, spec: str, rows: int
) -> None:
    """A 200-token prompt, window 64 (positions 136..199): h2o's accumulated attention also
    gets the strided sample (0, 64 and 128); snapkv reads the last rows alone and gets no
    sample, at 14K tokens 64 rows a layer where h2o gets 288."""
    dropper = PromptDropper(model.config, spec, keep_ratio=0.5)
    with Engine(model, num_blocks=64, dropper=dropper) as engine:
        seen = spy_rows(engine)
        engine.generate(prompt_of(200), {"max_tokens": 2, **GREEDY})
    assert seen == [rows]


class QueryRecorder(DenseAttention):
    """A dense cache that also keeps every layer's post-RoPE queries ``[N, Hq, d]``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.queries: list[torch.Tensor] = []

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self.queries.append(q.clone())
        return super().__call__(layer, q, k, v)


def test_snapkv_window_128_cut_equals_the_policy_offline(model: Transformer) -> None:
    """``snapkv(window=128)`` cut in the engine keeps the tokens the same policy keeps offline
    from a dense prefill with every query row (it observes only the last 128)."""
    cfg = model.config
    prompt = prompt_of(200)
    spec = "snapkv(window=128)"
    dropper = PromptDropper(cfg, spec, keep_ratio=0.5, query_window=128)
    kept: list[list[int]] = []
    original = dropper.apply  # the loop writes the kept rows back here

    def apply(cache, req, *args):  # type: ignore[no-untyped-def]
        done = original(cache, req, *args)
        kept.append(list(req.prompt[: req.num_computed]))
        return done

    dropper.apply = apply  # type: ignore[method-assign]
    with Engine(model, num_blocks=64, dropper=dropper) as engine:
        engine.generate(prompt, {"max_tokens": 2, **GREEDY})
    n = len(prompt)
    dense = QueryRecorder(cfg)
    with torch.inference_mode():
        model(torch.tensor(prompt), torch.arange(n), dense)
    kv = torch.stack(
        [
            torch.stack([dense.keys(i).reshape(n, -1) for i in range(cfg.num_layers)]),
            torch.stack([dense.values(i).reshape(n, -1) for i in range(cfg.num_layers)]),
        ]
    )
    queries = torch.stack([q.reshape(n, -1) for q in dense.queries]).unsqueeze(0)
    policy = kvdrop.get(spec, keep_ratio=0.5, chunk_size=1)
    context = EditContext(
        positions=torch.arange(n),
        query_positions=torch.arange(n),
        rope=cfg.rope.to_json(),
        prompt_tokens=n,
        head_dim=cfg.head_dim,
    )
    _, offline = policy({CacheKind.KV: kv, CacheKind.QUERY: queries}, prompt, context=context)
    assert kept == [offline]


SRC = Path(__file__).resolve().parents[2] / "src" / "kvdrop_engine"


def _plans(engine: Engine) -> list[RequestPlan]:
    """Record the plan of every request the engine submits."""
    seen: list[RequestPlan] = []
    submit = engine._submit

    def spy(req):  # type: ignore[no-untyped-def]
        seen.append(req.plan)
        submit(req)

    engine._submit = spy  # type: ignore[method-assign]
    return seen


def test_the_plan_orders_each_modules_actions(model: Transformer) -> None:
    prompt = torch.randint(3, 200, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    conn = WindowStore(window=8)
    conn.store_decoded = True
    dropper = PromptDropper(model.config, "snapkv", keep_ratio=0.5)
    with Engine(model, num_blocks=64, connector=conn, dropper=dropper) as engine:
        plans = _plans(engine)
        engine.generate(prompt, {"max_tokens": 3, **GREEDY})
        engine.generate(prompt[:50], {"max_tokens": 3, **GREEDY})  # under the threshold
        engine.generate(prompt, {"max_tokens": 3, "kvdrop": None, **GREEDY})
    cut, short, off = plans
    assert cut.after_prefill == (StorePrompt(), CutPrompt())
    assert cut.after_finish == (StoreDecoded(), StoreWindow())
    assert cut.cut is not None and cut.cut.spec == "snapkv" and cut.store == conn.queries
    assert short.after_prefill == off.after_prefill == (StorePrompt(),) and off.cut is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        cut.cut = None  # type: ignore[misc]
    # The window: the cut's 64 rows until the cut, the store's 8 after it.
    assert cut.window(200, cut_pending=True).window == 64  # type: ignore[union-attr]
    assert cut.window(100, cut_pending=False).window == 8  # type: ignore[union-attr]
    with Engine(model, num_blocks=64) as engine:
        plans = _plans(engine)
        engine.generate(prompt, {"max_tokens": 2, **GREEDY})
    assert plans == [RequestPlan()]  # nothing to do: an empty plan


def test_kvzips_pass_is_the_last_action(model: Transformer) -> None:
    recon = ReconstructionPrompt(first=(1, 2), later=(1,), suffix=(3,))
    with Engine(model, num_blocks=64, connector=WindowStore(), reconstruction=recon) as engine:
        plans = _plans(engine)
        engine.generate(list(range(3, 40)), {"max_tokens": 2, "reconstruct": True, **GREEDY})
    assert plans[0].after_finish == (StoreWindow(), ScorePrompt())


def _writers(attr: str) -> list[str]:
    """``file:line`` of every assignment to ``<something>.attr`` in the engine's sources."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            for t in targets:
                elts = t.elts if isinstance(t, ast.Tuple) else [t]
                for e in elts:
                    if isinstance(e, ast.Attribute) and e.attr == attr:
                        found.append(f"{path.name}:{node.lineno}")
    return found


def test_one_writer_of_a_requests_capture_and_one_place_that_finishes() -> None:
    # (capture.py's ``WindowCapture.window`` is the window's size, not a request's capture.)
    writers = [w for w in _writers("window") if not w.startswith("capture.py")]
    assert len(writers) == 2 and {w.split(":")[0] for w in writers} == {"sequence.py"}, writers
    source = (SRC / "sequence.py").read_text()
    restart = source[source.index("def restart_window") :]
    restart = restart[: restart.index("\n    def ", 1)]
    assert restart.count("self.window =") == 2  # both in Request.restart_window
    engine = (SRC / "engine.py").read_text()
    finish = engine[engine.index("    def _finish(") :]
    finish = finish[: finish.index("\n    def ", 1)]
    calls = engine.count("self._sched.finish(")
    assert calls == finish.count("self._sched.finish(") == 2  # failure, success: in _finish
    assert "requests_finished" not in engine.replace(finish, "")
