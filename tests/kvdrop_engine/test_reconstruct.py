"""KVzip's reconstruction pass: scores equal a brute-force recomputation, the cache is untouched."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from kvdrop_engine import reconstruct
from kvdrop_engine.connectors.kvdrop import ServerConnector
from kvdrop_engine.engine import Engine
from kvdrop_engine.loading import preset_config
from kvdrop_engine.model import DenseAttention, Transformer, causal_attention
from kvdrop_engine.reconstruct import (
    ReconstructionPass,
    ReconstructionPrompt,
    reconstruction_scores,
)
from kvdrop_sdk import kvcache, qcache
from kvdrop_sdk.testing.server import spawn_server
from kvdrop_sdk.window import retrieve_scores


@pytest.fixture(scope="module")
def model() -> Transformer:
    return Transformer.random(preset_config("tiny"), seed=0)


class _Recording(DenseAttention):
    """A dense cache that also keeps every call's post-RoPE queries, per layer."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.queries: dict[int, torch.Tensor] = {}

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self.queries[layer] = q.clone()
        return super().__call__(layer, q, k, v)


def _brute_force(
    model: Transformer, context: list[int], prompt: ReconstructionPrompt
) -> torch.Tensor:
    """Each chunk run on a fresh dense copy of the cache; scores from full softmax matrices."""
    cfg = model.config
    n = len(context)
    out = torch.zeros(cfg.num_layers, cfg.num_kv_heads, n)
    for start, end in prompt.chunks(n):
        ids = prompt.input_ids(context, start, end)
        dense = _Recording(cfg)
        model(torch.tensor(context), torch.arange(n), dense)
        model(torch.tensor(ids), torch.arange(n, n + len(ids)), dense)
        m, sink = len(ids), min(prompt.n_sink, start)
        for layer in range(cfg.num_layers):
            keys = dense.keys(layer)  # [n + m, Hkv, d]
            cols = [*range(sink), *range(start, end), *range(n, n + m)]
            k = keys[cols].float()
            q = dense.queries[layer].float()  # [m, Hq, d]
            group = cfg.num_heads // cfg.num_kv_heads
            for h in range(cfg.num_heads):
                logits = q[:, h] @ k[:, h // group].T / math.sqrt(cfg.head_dim)
                own = len(cols) - m
                mask = torch.arange(len(cols))[None, :] > (own + torch.arange(m))[:, None]
                probs = torch.softmax(logits.masked_fill(mask, -torch.inf), dim=-1)
                best = probs[:, sink : sink + end - start].amax(dim=0)
                region = out[layer, h // group, start:end]
                out[layer, h // group, start:end] = torch.maximum(region, best)
    out[:, :, : prompt.n_sink] = 1.0
    return out


def test_scores_match_brute_force_over_several_chunks(model: Transformer) -> None:
    gen = torch.Generator().manual_seed(0)
    context = torch.randint(3, 500, (70,), generator=gen).tolist()
    prompt = ReconstructionPrompt((5, 6, 7), (8, 9), (10,), chunk_tokens=32, overlap=4, n_sink=2)
    dense = DenseAttention(model.config)
    model(torch.tensor(context), torch.arange(70), dense)
    before = [dense.keys(layer).clone() for layer in range(model.config.num_layers)]
    scores = reconstruction_scores(model, context, 70, dense.keys, dense.values, prompt)
    assert scores.shape == (model.config.num_layers, model.config.num_kv_heads, 70)
    torch.testing.assert_close(scores, _brute_force(model, context, prompt), rtol=1e-4, atol=1e-6)
    assert dense.length == 70  # the cache is read, never written
    for layer, keys in enumerate(before):
        assert torch.equal(dense.keys(layer), keys)
    assert (scores[:, :, 2:] > 0).all() and (scores <= 1).all()


def test_later_chunks_continue_from_the_previous_chunk() -> None:
    prompt = ReconstructionPrompt((1,), (2,), (3,), chunk_tokens=4, overlap=2)
    context = list(range(10, 20))
    assert prompt.chunks(10) == [(0, 4), (4, 8), (8, 10)]
    assert prompt.input_ids(context, 0, 4) == [1, 3, 10, 11, 12, 13]
    assert prompt.input_ids(context, 4, 8) == [2, 12, 13, 3, 14, 15, 16, 17]


@pytest.mark.parametrize(
    ("field", "value"), [("first", ()), ("chunk_tokens", 0), ("later", (1, -1)), ("n_sink", True)]
)
def test_bad_prompt_is_refused(field: str, value: object) -> None:
    fields: dict[str, object] = {"first": (1,), "later": (2,), field: value}
    with pytest.raises(ValueError, match=field):
        ReconstructionPrompt(**fields)  # type: ignore[arg-type]


def test_pieces_of_a_pass_equal_the_whole_pass(model: Transformer) -> None:
    """A chunk's rows split over pieces (7 rows at a time) give the whole pass's scores."""
    gen = torch.Generator().manual_seed(1)
    context = torch.randint(3, 500, (70,), generator=gen).tolist()
    prompt = ReconstructionPrompt((5, 6, 7), (8, 9), (10,), chunk_tokens=32, overlap=4, n_sink=2)
    dense = DenseAttention(model.config)
    model(torch.tensor(context), torch.arange(70), dense)
    whole = reconstruction_scores(model, context, 70, dense.keys, dense.values, prompt)
    run = ReconstructionPass(model, context, 70, dense.keys, dense.values, prompt)
    pieces = []
    while not run.done:
        pieces.append(run.step(7))
    assert max(pieces) == 7 and sum(pieces) == run.total_rows
    torch.testing.assert_close(run.scores, whole, rtol=1e-5, atol=1e-6)


def test_the_engine_runs_the_pass_between_decode_steps(model: Transformer) -> None:
    """Issue 28 D: a kvzip request's pass runs in pieces under ``max_prefill_tokens``, so a
    decoding stream gets tokens while it runs; the stored scores are the whole pass's."""
    cfg = model.config
    recon = ReconstructionPrompt.synthetic(cfg.vocab_size, chunk_tokens=512)
    prompt = torch.randint(3, 500, (400,), generator=torch.Generator().manual_seed(2)).tolist()
    with spawn_server(enable=["transfer_query"], chunk_size=16, l1_size_gb=0.05) as srv:
        conn = ServerConnector(srv.url, srv.http_url, "pieces")
        eng = Engine(model, connector=conn, reconstruction=recon, max_prefill_tokens=16)
        q_ctx = qcache.connect(srv.url, srv.http_url, "pieces")
        kv_ctx = kvcache.connect(srv.url, srv.http_url, "pieces")
        with eng:
            greedy = {"temperature": 0, "ignore_eos": True, "max_tokens": 3000}
            running = eng.post_completion([5, 6, 7], greedy)
            next(running)
            during: list[int] = []
            stop = threading.Event()

            def read() -> None:
                for event in running:
                    st = eng.stats()
                    if st.reconstruction_seconds > 0 and st.reconstructions == 0:
                        during.append(event.token_id)  # a piece ran, the pass is not done
                    if stop.is_set():
                        return

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            out = eng.generate(prompt, {"temperature": 0, "max_tokens": 1, "reconstruct": True})
            stop.set()
            reader.join(30)
            running.close()
            assert eng.stats().reconstructions == 1 and len(out) == 1
            assert len(during) >= 5, during  # about 412 rows in 16-row pieces: ~26 steps
            found = retrieve_scores(q_ctx, prompt + out, "")
            kv = kv_ctx.retrieve(prompt, "")
        q_ctx.close()
        kv_ctx.close()
        conn.close()
    assert found is not None and kv is not None and kv.shape[2] == 400
    heads = (400, cfg.num_kv_heads, cfg.head_dim)
    want = reconstruction_scores(
        model,
        prompt,
        400,
        lambda layer: kv[0, layer].view(heads),
        lambda layer: kv[1, layer].view(heads),
        recon,
    )
    torch.testing.assert_close(found.scores, want)


def _reference_max_probs(
    q: torch.Tensor, keys: torch.Tensor, sink: int, width: int
) -> torch.Tensor:
    """The scoring rule written plainly: float64 softmax over every key, causal over own rows."""
    m, hq, d = q.shape
    hkv, total = keys.shape[:2]
    group = hq // hkv
    k = keys.double().repeat_interleave(group, dim=0)  # [Hq, K, d]
    logits = torch.einsum("mhd,hkd->hmk", q.double(), k) / math.sqrt(d)
    own = total - m
    hidden = torch.arange(total)[None, :] > (own + torch.arange(m))[:, None]
    probs = logits.masked_fill(hidden[None], -torch.inf).softmax(-1)[..., sink : sink + width]
    return probs.amax(dim=1).view(hkv, group, width).amax(dim=1).float()


@pytest.mark.parametrize("tile_rows", [1, 3, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_scores_equal_the_plain_rule_and_keep_the_same_tokens(
    monkeypatch: pytest.MonkeyPatch, tile_rows: int, dtype: torch.dtype
) -> None:
    """Any tiling (one row a tile up to the whole chunk) gives the plain rule's scores, so the
    kept set of a top-k over them is the same (the fast path's identity on the host)."""
    gen = torch.Generator().manual_seed(tile_rows)
    m, hq, hkv, d, sink, width = 37, 8, 2, 16, 4, 90
    q = torch.randn(m, hq, d, generator=gen).to(dtype)
    keys = torch.randn(hkv, sink + width + m, d, generator=gen).to(dtype)
    monkeypatch.setattr(reconstruct, "SCORE_TILE_BYTES", 4 * hq * keys.shape[1] * tile_rows)
    got = reconstruct._max_probs(q, keys, sink, width)
    want = _reference_max_probs(q.float(), keys.float(), sink, width)
    assert got.dtype == torch.float32 and got.shape == (hkv, width)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    k = width // 4
    for h in range(hkv):
        kept = set(got[h].topk(k).indices.tolist())
        assert len(kept & set(want[h].topk(k).indices.tolist())) / k >= 0.99


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_partial_attention_paths_agree(causal: bool, dtype: torch.dtype) -> None:
    """The host's flash path and the tiled path (a GPU without flash) give the same attention
    and log-normalisers, and equal a plain softmax over the keys (bottom-right causal)."""
    gen = torch.Generator().manual_seed(3)
    m, hq, hkv, d, total = 9, 8, 2, 16, 30
    q = torch.randn(m, hq, d, generator=gen).to(dtype)
    k, v = (torch.randn(hkv, total, d, generator=gen).to(dtype) for _ in range(2))
    out, lse = reconstruct._partial(q, k, v, causal)
    tiled_out, tiled_lse = reconstruct._partial_tiled(q, k, v, causal)
    logits = torch.einsum("mhd,hkd->mhk", q.double(), k.double().repeat_interleave(4, dim=0))
    logits = logits / math.sqrt(d)
    if causal:
        hidden = torch.arange(total)[None, :] > (total - m + torch.arange(m))[:, None]
        logits = logits.masked_fill(hidden[:, None], -torch.inf)
    want_lse = torch.logsumexp(logits, dim=-1).float()
    want = torch.einsum("mhk,hkd->mhd", logits.softmax(-1), v.double().repeat_interleave(4, 0))
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for got_out, got_lse in ((out, lse), (tiled_out, tiled_lse)):
        assert got_lse.shape == (m, hq) and got_lse.dtype == torch.float32
        torch.testing.assert_close(got_lse, want_lse, rtol=1e-5, atol=1e-4 if causal else 2e-2)
        torch.testing.assert_close(got_out.float(), want.float(), **tol)


def test_split_attention_equals_one_softmax_over_cache_and_own() -> None:
    """The cache split into the scored keys and the rest, merged by log-normalisers, is the
    attention over all of them at once (the model's own backend)."""
    gen = torch.Generator().manual_seed(4)
    s, r, m, hq, hkv, d = 50, 12, 5, 8, 2, 16
    kc, vc = (torch.randn(s, hkv, d, generator=gen) for _ in range(2))
    k_own, v_own = (torch.randn(r, hkv, d, generator=gen) for _ in range(2))
    q = torch.randn(m, hq, d, generator=gen)
    out, lse, scored = reconstruct.split_attention(q, kc, vc, k_own, v_own, 20, 35, 4)
    k_all = torch.cat([kc, k_own]).transpose(0, 1)
    v_all = torch.cat([vc, v_own]).transpose(0, 1)
    want = causal_attention(q, k_all, v_all, s + r - m)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    assert scored.shape == (hkv, 4 + 15 + r, d)
    torch.testing.assert_close(lse, reconstruct._partial(q, scored, scored, causal=True)[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_gpu_flash_split_equals_one_softmax(dtype: torch.dtype) -> None:
    """On a GPU in half precision the split runs the flash kernel (bottom-right causal for the
    scored part): its attention, log-normalisers and KVzip scores equal a float64 softmax over
    the whole cache and the own rows, and the float32 tiled path on the same inputs."""
    gen = torch.Generator().manual_seed(5)
    s, r, m, hq, hkv, d, start, end = 700, 40, 24, 16, 4, 128, 300, 500
    kc, vc = (torch.randn(s, hkv, d, generator=gen) for _ in range(2))
    k_own, v_own = (torch.randn(r, hkv, d, generator=gen) for _ in range(2))
    q = torch.randn(m, hq, d, generator=gen)
    cuda = [t.to("cuda", dtype) for t in (q, kc, vc, k_own, v_own)]
    assert reconstruct._flash_lse_ok(cuda[0])
    out, lse, scored = reconstruct.split_attention(*cuda, start, end, 4)
    half = [t.to(dtype).double() for t in (q, kc, vc, k_own, v_own)]
    k_all = torch.cat([half[1], half[3]]).transpose(0, 1)
    v_all = torch.cat([half[2], half[4]]).transpose(0, 1)
    want = causal_attention(half[0], k_all, v_all, s + r - m)
    torch.testing.assert_close(out.double().cpu(), want, rtol=2e-2, atol=2e-2)
    tiled = reconstruct._partial_tiled(cuda[0], scored, scored, causal=True)[1]
    torch.testing.assert_close(lse, tiled, rtol=1e-4, atol=1e-3)
    got = reconstruct.scored_max(cuda[0], scored, 4, end - start, lse).cpu()
    ref = _reference_max_probs(half[0].float(), scored.float().cpu(), 4, end - start)
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=1e-4)
