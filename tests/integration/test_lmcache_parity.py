"""Drop-in parity with ``lmcache.sdk`` 0.5.6: code written for it behaves the same with
``import kvdrop_sdk as lmc_sdk``.

* The upstream document's example (connect, create_request, the batch's prefill / modify /
  decode, metrics, the reference table's calls) runs on kvdrop_sdk with only the import changed.
* The same example run by the real ``lmcache.sdk`` on a real LMCache server and by kvdrop_sdk on a
  kvdrop server (same model, prompts and edit) gives the same tokens, flags and report keys.
* Every public function, class, method, property and attribute of ``lmcache.sdk`` exists in
  kvdrop_sdk with a compatible signature: the same positional parameters in the same order with
  the same defaults; kvdrop's additions are keyword-only or defaulted. ``DIFFERENCES`` lists,
  with the reason, the few places that knowingly differ.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import importlib
import inspect
import random
import textwrap
import types
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import kvdrop_sdk
from kvdrop_engine.connectors.kvdrop import ServerConnector
from kvdrop_engine.engine import Engine
from kvdrop_engine.loading import preset_config
from kvdrop_engine.model import Transformer
from kvdrop_sdk.query_capture import QueryCapture, QueryNeed
from kvdrop_sdk.testing.server import ServerHandle, spawn_server

CHUNK = 256
MODULES = ["", ".cache_kind", ".context", ".kvcache", ".qcache", ".request", ".batch"]
#: Names the upstream document uses on a module that imports them from another one.
DOCUMENTED_REEXPORTS = {".context": {"LMCacheSDKCacheKind", "ModifyFnType"}}
#: Knowing differences: ``"module:Class.member"`` (or ``...member.param``) -> why.
DIFFERENCES = {
    ".batch:LMCacheBatchedStream.prefill.fmt": "None: the process-wide default handlers (a "
    "terminal table unless replaced); 'terminal' attaches one explicitly. Same output.",
    ".batch:LMCacheBatchedStream.decode.fmt": "as prefill.fmt",
    ".batch:LMCacheBatchedStream.modify.fmt": "as prefill.fmt",
    ".context:LMCacheSDKContext.instance_id": "LMCache's transport registration id; kvdrop's "
    "transport has none",
    ".context:LMCacheSDKContext.shm_name": "LMCache's L1 pool name; kvdrop's context reports "
    "its transport in transfer_ctx.mode",
    ".context:LMCacheSDKContext.blocks_in_chunk": "LMCache's paged registration detail",
    ".request:LMCacheRequestStream.tokens": "not in upstream's API document; kvdrop's is the "
    "next prompt (kept tokens + suffix), upstream's (the kept tokens + generated) is "
    "output_tokens in both",
}


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def model() -> Transformer:
    return Transformer.random(preset_config("tiny"), seed=21)


@pytest.fixture(scope="module")
def kv_server() -> Iterator[ServerHandle]:
    with spawn_server(enable=["transfer_query"], chunk_size=CHUNK, l1_size_gb=0.05) as srv:
        yield srv


def prompts() -> list[list[int]]:
    rng = random.Random(8)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in (3 * CHUNK + 30, 4 * CHUNK + 5)]


# ------------------------------------------------------------------------------ the example
def document_example(
    lmc_sdk: Any, url: str, http_url: str, model_name: str, post_completion: Any
) -> dict[str, Any]:
    """The upstream document's example and reference table, written against ``lmc_sdk`` (either
    ``lmcache.sdk`` or ``kvdrop_sdk``) exactly as the document spells it."""
    lmc_request = importlib.import_module(lmc_sdk.__name__ + ".request")
    lmc_batch = importlib.import_module(lmc_sdk.__name__ + ".batch")
    kind = lmc_sdk.LMCacheSDKCacheKind

    kv_ctx = lmc_sdk.kvcache.connect(
        url=url,  # must match --port
        http_url=http_url,  # must match --http-port
        model_name=model_name,
        timeout=60,
    )
    q_ctx = lmc_sdk.qcache.connect(url=url, http_url=http_url, model_name=model_name, timeout=60)
    other = lmc_sdk.connect(kind.KV, url, http_url, model_name, 60.0)

    def drop_half(tensors: Any, tokens: Any) -> tuple[torch.Tensor, list[int]]:
        """Drop half of the request's KV chunks from the middle (the document's edit)."""
        kv = tensors[kind.KV]
        assert tensors[kind.QUERY].shape[2] == kv.shape[2] == len(tokens)
        n = kv.shape[2] // CHUNK
        keep_chunks = [*range(n - n // 2 - 1), n - 1]
        rows = [c * CHUNK + i for c in keep_chunks for i in range(CHUNK)]
        return kv[:, :, rows].contiguous(), [tokens[r] for r in rows]

    batch = lmc_batch.LMCacheBatchedStream()
    for p in prompts():
        batch.add(lmc_request.create_request([kv_ctx, q_ctx], post_completion, p))
    sid = next(iter(batch.request_streams))
    assert batch.get_request_stream(sid) is batch.request_streams[sid]
    with pytest.raises(lmc_batch.LMCacheBatchedStreamError):
        batch.get_request_stream("no-such-stream")
    reports = [
        batch.prefill({"temperature": 0.0}),
        batch.modify(drop_half),
        batch.decode({"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}),
    ]
    for report in reports:
        report.emit()
    streams = list(batch.request_streams.values())
    kept = [
        s.output_tokens[: (len(p) // CHUNK + 1) // 2 * CHUNK]
        for s, p in zip(streams, prompts(), strict=True)
    ]
    # kvdrop_sdk stores an edit under its request's own salt (so requests whose kept tokens
    # coincide never read each other's edit); upstream under the request's salt ("" here).
    salt = getattr(streams[0], "active_cache_salt", "")
    retrieved = other.retrieve(kept[0], salt)
    result = {
        "reports": [r.to_dict() for r in reports],
        "output_tokens": [s.output_tokens for s in streams],
        "decoded_tokens": [s.decoded_tokens for s in streams],
        "output_text": [s.output_text for s in streams],
        "is_done": [s.is_done for s in streams],
        "suffix_tokens": [s.suffix_tokens for s in streams],
        "perf_fields": sorted(
            f.name for f in dataclasses.fields(next(iter(batch.perf_metrics.values())))
        ),
        "perf_output_tokens": [
            batch.perf_metrics[s.request_stream_id].output_tokens for s in streams
        ],
        "retrieved_shape": tuple(retrieved.shape),
        "store_again": other.store(retrieved, kept[0], salt),  # every chunk cached: False
        "chunk_size": kv_ctx.chunk_size,
        "kinds": (kv_ctx.kind.value, q_ctx.kind.value),
        "positional_perf": lmc_request.StreamPerfMetrics(1.0, 2, 3, 4.0, 5.0, [0.5], 0.25).ttft,
        "server_model_name": kind.QUERY.server_model_name("m"),
    }
    kv_ctx.close()
    q_ctx.close()
    other.close()
    return result


def run_on_kvdrop(model: Transformer, srv: ServerHandle) -> dict[str, Any]:
    name = f"doc-{uuid.uuid4().hex[:8]}"
    # The document's edit reads every prompt token's query ([1, L, T, Dq]): the full mode.
    conn = ServerConnector(srv.url, srv.http_url, name, queries=QueryCapture(QueryNeed.FULL))
    with Engine(model, num_blocks=512, connector=conn) as engine:
        result = document_example(kvdrop_sdk, srv.url, srv.http_url, name, engine)
    conn.close()
    return result


def test_the_document_example_runs_on_kvdrop_sdk(
    model: Transformer, kv_server: ServerHandle, capsys: pytest.CaptureFixture[str]
) -> None:
    got = run_on_kvdrop(model, kv_server)
    out = capsys.readouterr().out
    assert "Batched Stream Modify Metrics" in out and "output_tput" in out  # emit() printed
    prefill, modify, decode = got["reports"]
    assert prefill["metrics"]["config"]["num_request_streams"] == 2
    assert modify["metrics"]["results"]["duration"] > 0
    assert decode["metrics"]["results"]["output_tokens"] == 16
    # output_tokens is the whole sequence: kept tokens, the re-sent tail, every generated token.
    for toks, p in zip(got["output_tokens"], prompts(), strict=True):
        half = (len(p) // CHUNK + 1) // 2 * CHUNK
        assert len(toks) == half + len(p) % CHUNK + 9
    assert got["decoded_tokens"] == [9, 9] and got["is_done"] == [False, False]
    assert got["retrieved_shape"] == (2, 2, 2 * CHUNK, 32) and got["store_again"] is False
    assert got["positional_perf"] == 0.25 and got["kinds"] == ("kv", "query")


def test_the_same_example_gives_the_same_results_on_lmcache(
    model: Transformer, kv_server: ServerHandle, lmcache_server: Any
) -> None:
    import lmcache.sdk

    from kvdrop_engine.connectors.lmcache import LMCacheConnector

    name = f"doc-{uuid.uuid4().hex[:8]}"
    conn = LMCacheConnector(lmcache_server.url, lmcache_server.http_url, name)
    with Engine(model, num_blocks=512, connector=conn) as engine:
        upstream = document_example(
            lmcache.sdk, lmcache_server.url, lmcache_server.http_url, name, engine
        )
    conn.close()
    ours = run_on_kvdrop(model, kv_server)
    for key in upstream:
        if key == "reports":
            continue
        assert ours[key] == upstream[key], key
    for mine, theirs in zip(ours["reports"], upstream["reports"], strict=True):
        assert mine["title"] == theirs["title"]
        for section, values in theirs["metrics"].items():
            assert set(values) <= set(mine["metrics"][section]), (theirs["title"], section)
        theirs_results = theirs["metrics"]["results"]
        for key in ("input_tokens", "output_tokens"):
            if key in theirs_results:
                assert mine["metrics"]["results"][key] == theirs_results[key]
        if "config" in theirs["metrics"]:
            assert mine["metrics"]["config"] == theirs["metrics"]["config"]


def test_an_edit_function_may_index_with_lmcaches_own_enum(
    model: Transformer, kv_server: ServerHandle, require_lmcache: None
) -> None:
    from lmcache.sdk.cache_kind import LMCacheSDKCacheKind

    name = f"enum-{uuid.uuid4().hex[:8]}"
    conn = ServerConnector(kv_server.url, kv_server.http_url, name)
    with Engine(model, num_blocks=512, connector=conn) as engine:
        kv_ctx = kvdrop_sdk.kvcache.connect(kv_server.url, kv_server.http_url, name, 60)
        stream = kvdrop_sdk.create_request([kv_ctx], engine, prompts()[0])
        stream.generate({"max_tokens": 1})

        def keep_first_chunk(tensors: Any, tokens: Any) -> tuple[torch.Tensor, list[int]]:
            assert LMCacheSDKCacheKind.KV in tensors and LMCacheSDKCacheKind.QUERY not in tensors
            return tensors[LMCacheSDKCacheKind.KV][:, :, :CHUNK].contiguous(), tokens[:CHUNK]

        assert stream.modify_kv(keep_first_chunk).kept_tokens == CHUNK
        assert tuple(stream.retrieve(LMCacheSDKCacheKind.KV).shape) == (2, 2, CHUNK, 32)
        kv_ctx.close()
    conn.close()


# ------------------------------------------------------------------------------ signatures
def _public(mod: types.ModuleType, suffix: str) -> set[str]:
    names = set(getattr(mod, "__all__", ())) | DOCUMENTED_REEXPORTS.get(suffix, set())
    for name, obj in vars(mod).items():
        defined_here = getattr(obj, "__module__", None) == mod.__name__
        if not name.startswith("_") and (inspect.isclass(obj) or inspect.isfunction(obj)):
            if defined_here:
                names.add(name)
    return names


def _same_default(a: Any, b: Any) -> bool:
    if isinstance(a, enum.Enum) or isinstance(b, enum.Enum):
        return getattr(a, "value", a) == getattr(b, "value", b)
    return bool(a == b)


def _compare_signatures(up: Callable[..., Any], ours: Callable[..., Any], where: str) -> list[str]:
    """Problems with calling ``ours`` the way ``up`` may be called."""
    try:
        s_up, s_ours = inspect.signature(up), inspect.signature(ours)
    except (TypeError, ValueError):
        return []
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    up_pos = [p for p in s_up.parameters.values() if p.kind in positional]
    our_pos = [p for p in s_ours.parameters.values() if p.kind in positional]
    ours_by_name = dict(s_ours.parameters)
    problems = []
    for i, p in enumerate(up_pos):
        if i >= len(our_pos) or our_pos[i].name != p.name:
            got = our_pos[i].name if i < len(our_pos) else None
            problems.append(f"{where}: positional #{i} is {p.name!r} upstream, {got!r} here")
            continue
        q = our_pos[i]
        if p.default is not inspect.Parameter.empty and not _same_default(p.default, q.default):
            if f"{where}.{p.name}" not in DIFFERENCES:
                problems.append(f"{where}.{p.name}: default {p.default!r} upstream, {q.default!r}")
    for q in our_pos[len(up_pos) :]:
        if q.default is inspect.Parameter.empty and q.kind is not inspect.Parameter.VAR_POSITIONAL:
            problems.append(f"{where}: extra required positional {q.name!r}")
    for p in s_up.parameters.values():
        if p.kind is inspect.Parameter.KEYWORD_ONLY:
            q = ours_by_name.get(p.name)
            if q is None or q.kind not in (*positional[1:], inspect.Parameter.KEYWORD_ONLY):
                problems.append(f"{where}: keyword {p.name!r} missing")
            elif not _same_default(p.default, q.default):
                problems.append(f"{where}.{p.name}: default {p.default!r} upstream, {q.default!r}")
    for q in s_ours.parameters.values():
        if q.kind is inspect.Parameter.KEYWORD_ONLY and q.name not in s_up.parameters:
            if q.default is inspect.Parameter.empty:
                problems.append(f"{where}: extra required keyword {q.name!r}")
    return problems


def _init_attributes(cls: type) -> set[str]:
    """Public ``self.x = ...`` names of ``cls.__init__`` (upstream's plain attributes)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    except (OSError, TypeError):
        return set()
    names = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AnnAssign):
            targets = [node.target]
        for t in targets:
            if (
                isinstance(t, ast.Attribute)
                and isinstance(t.value, ast.Name)
                and t.value.id == "self"
            ):
                if not t.attr.startswith("_"):
                    names.add(t.attr)
    return names


def _compare_class(up: type, ours: type, where: str, instance: Any) -> list[str]:
    problems: list[str] = []
    if issubclass(up, enum.Enum):
        want = {m.name: m.value for m in up}
        have = {m.name: m.value for m in ours}  # type: ignore[attr-defined]
        if want != have:
            problems.append(f"{where}: members {want} upstream, {have} here")
    if dataclasses.is_dataclass(up):
        up_fields = [(f.name, f.default) for f in dataclasses.fields(up)]
        our_fields = [(f.name, f.default) for f in dataclasses.fields(ours)]
        if our_fields[: len(up_fields)] != up_fields:
            problems.append(f"{where}: fields {up_fields} upstream, {our_fields} here")
    members: dict[str, Any] = {}
    for klass in reversed(up.__mro__):
        if klass.__module__.startswith("lmcache.sdk"):
            members.update(vars(klass))
    for name, member in members.items():
        if name.startswith("_") and name not in ("__init__", "__call__"):
            continue
        key = f"{where}.{name}"
        if key in DIFFERENCES or isinstance(member, enum.Enum):
            continue  # enum members and dataclass fields are compared above
        if isinstance(member, property):
            present = isinstance(getattr(ours, name, None), property) or (
                instance is not None and hasattr(instance, name)
            )
            if not present:
                problems.append(f"{key}: property missing")
            continue
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if not callable(member):
            continue
        if True:
            if not hasattr(ours, name):
                problems.append(f"{key}: method missing")
                continue
            raw = inspect.getattr_static(ours, name)
            target = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
            if isinstance(raw, staticmethod) is not isinstance(
                inspect.getattr_static(up, name), staticmethod
            ):
                problems.append(f"{key}: static in one, a method in the other")
            problems += _compare_signatures(member, target, key)
    if instance is not None:
        for attr in sorted(_init_attributes(up)):
            if f"{where}.{attr}" not in DIFFERENCES and not hasattr(instance, attr):
                problems.append(f"{where}.{attr}: attribute missing")
    return problems


def test_the_comparison_finds_the_old_differences(require_lmcache: None) -> None:
    """Before parity kvdrop's batch.modify took (fn, fmt, width, stream_ids, *, timeout) and its
    StreamPerfMetrics had ttft before tpot: the comparison must report both."""
    from lmcache.sdk.batch import LMCacheBatchedStream
    from lmcache.sdk.request import StreamPerfMetrics

    class OldBatch(kvdrop_sdk.BatchedStream):
        def modify(self, fn, fmt=None, width=80, stream_ids=None, *, timeout=5.0):  # type: ignore[no-untyped-def, override]
            raise NotImplementedError

    @dataclasses.dataclass(frozen=True)
    class OldPerf:
        duration: float = 0.0
        input_tokens: int = 0
        output_tokens: int = 0
        input_tput: float = 0.0
        output_tput: float = 0.0
        ttft: float = 0.0
        tpot: list[float] = dataclasses.field(default_factory=list)

    problems = _compare_class(LMCacheBatchedStream, OldBatch, ".batch:B", None)
    assert any(
        "modify: positional #4 is 'timeout' upstream, 'stream_ids' here" in p for p in problems
    )
    assert _compare_class(StreamPerfMetrics, OldPerf, ".request:P", None)[0].startswith(
        ".request:P: fields"
    )


def test_signatures_match_the_installed_lmcache_sdk(
    kv_server: ServerHandle, require_lmcache: None
) -> None:
    from kvdrop_sdk.layout import CacheLayout

    layout = CacheLayout(2, 2, 16, torch.float32)
    ctx = kvdrop_sdk.kvcache.connect(kv_server.url, kv_server.http_url, "sig-m", 10, layout=layout)
    stream = kvdrop_sdk.create_request([ctx], lambda *a: iter(()), [1, 2, 3])
    instances = {
        "LMCacheSDKContext": ctx,
        "LMCacheRequestStream": stream,
        "LMCacheBatchedStream": kvdrop_sdk.LMCacheBatchedStream(),
    }
    problems: list[str] = []
    try:
        for suffix in MODULES:
            up_mod = importlib.import_module("lmcache.sdk" + suffix)
            our_mod = importlib.import_module("kvdrop_sdk" + suffix)
            for name in sorted(_public(up_mod, suffix)):
                where = f"{suffix}:{name}"
                up_obj = getattr(up_mod, name)
                if not hasattr(our_mod, name):
                    problems.append(f"{where}: missing from kvdrop_sdk{suffix}")
                    continue
                ours = getattr(our_mod, name)
                if isinstance(up_obj, types.ModuleType):
                    if not isinstance(ours, types.ModuleType):
                        problems.append(f"{where}: not a module")
                elif inspect.isclass(up_obj):
                    if not inspect.isclass(ours):
                        problems.append(f"{where}: not a class")
                    else:
                        problems += _compare_class(up_obj, ours, where, instances.get(name))
                elif inspect.isfunction(up_obj):
                    problems += _compare_signatures(up_obj, ours, where)
                elif name == "ModifyFnType":  # a typing alias: same shape of callable
                    normal = str(up_obj).replace("lmcache.sdk.cache_kind.LMCacheSDKCacheKind", "K")
                    assert normal == str(ours).replace("kvdrop_sdk.cache_kind.CacheKind", "K")
    finally:
        ctx.close()
    assert not problems, "\n".join(problems)
