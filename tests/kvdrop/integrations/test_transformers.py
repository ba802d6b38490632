"""kvdrop policies inside transformers against the engine path on the same weights: a tiny
random Llama saved by transformers and loaded by the reference engine; the same prompt keeps the
same tokens whichever runs it, and generate continues from the smaller cache."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import kvdrop
from kvdrop.integrations.transformers import KVDropPress
from kvdrop_engine.loading import load_checkpoint
from kvdrop_engine.model import DenseAttention, Transformer
from kvdrop_engine.reconstruct import ReconstructionPrompt
from kvdrop_sdk import CacheKind
from kvdrop_sdk.edit import EditContext

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)
PROMPT_TOKENS = 300


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def hf_model(folder: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine_model(folder: Path) -> Transformer:
    return load_checkpoint(folder)


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return torch.randint(
        3, 300, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(1)
    ).tolist()


class CapturingAttention(DenseAttention):
    """The engine's dense attention, keeping every layer's post-RoPE queries."""

    def __init__(self, model: Transformer) -> None:
        super().__init__(model.config, capacity=PROMPT_TOKENS)
        self.queries: dict[int, torch.Tensor] = {}

    def __call__(self, layer: int, q: Any, k: Any, v: Any) -> torch.Tensor:
        self.queries[layer] = q.reshape(q.shape[0], -1)
        return super().__call__(layer, q, k, v)


def engine_kept(model: Transformer, tokens: list[int], policy: kvdrop.Policy) -> list[int]:
    """What the policy keeps of the engine's own prefill KV and queries (the drop path's
    inputs: ``[2, L, T, D]``, ``[1, L, T, Dq]``, an edit context at positions 0..T-1)."""
    attn = CapturingAttention(model)
    with torch.inference_mode():
        model(torch.tensor(tokens), torch.arange(len(tokens)), attn)
    layers = model.config.num_layers
    kv = torch.stack(
        [torch.stack([attn.keys(i).flatten(1), attn.values(i).flatten(1)]) for i in range(layers)],
        dim=1,
    )
    query = torch.stack([attn.queries[i] for i in range(layers)]).unsqueeze(0)
    context = EditContext(
        positions=torch.arange(len(tokens)),
        rope=model.config.rope.to_json(),
        prompt_tokens=len(tokens),
        head_dim=model.config.head_dim,
    )
    _, index = policy.select_indices(
        {CacheKind.KV: kv, CacheKind.QUERY: query}, tokens, context=context
    )
    return index.tolist()


@pytest.mark.parametrize(
    "spec",
    ["snapkv", "h2o", "tova", "rkv", "knorm", "streaming+snapkv", "chunk-halving"],
)
def test_transformers_keeps_what_the_engine_path_keeps(
    spec: str, hf_model: Any, engine_model: Transformer, prompt: list[int]
) -> None:
    params = (
        {"keep_ratio": 0.25, "chunk_size": 1} if spec != "chunk-halving" else {"chunk_size": 16}
    )
    press = KVDropPress(spec, **params)
    ids = torch.tensor([prompt])
    done = press.compress(hf_model, ids)
    expected = engine_kept(engine_model, prompt[: done.prefilled], kvdrop.get(spec, **params))
    assert done.kept == expected
    assert 0 < len(done.kept) < done.prefilled
    assert done.cache.get_seq_length() == len(done.kept)
    assert done.input_ids[0].tolist() == [prompt[i] for i in done.kept] + prompt[done.prefilled :]


def test_kept_keys_are_rerotated_to_contiguous_positions(hf_model: Any, prompt: list[int]) -> None:
    """The rebuilt cache holds the kept keys as if prefilled at positions 0..k-1: the keys of a
    prompt of the kept tokens alone match in layer 0 (its keys depend on the token only)."""
    done = KVDropPress("snapkv", keep_ratio=0.25, chunk_size=1).compress(
        hf_model, torch.tensor([prompt])
    )
    kept_ids = torch.tensor([[prompt[i] for i in done.kept]])
    fresh = KVDropPress("snapkv", keep_ratio=1.0).compress(hf_model, kept_ids).cache
    fresh_keys = fresh.layers[0].keys  # the kept prompt but its last token (the tail)
    kept_keys = done.cache.layers[0].keys[:, :, : fresh_keys.shape[2]]
    torch.testing.assert_close(kept_keys, fresh_keys, rtol=1e-4, atol=1e-4)


def test_generate_continues_from_the_smaller_cache(hf_model: Any, prompt: list[int]) -> None:
    ids = torch.tensor([prompt])
    greedy = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    plain = hf_model.generate(ids, **greedy)
    with KVDropPress("snapkv", keep_ratio=1.0, chunk_size=1)(hf_model):  # nothing dropped
        same = hf_model.generate(ids, **greedy)
    assert same.tolist() == plain.tolist()
    with warnings.catch_warnings():
        warnings.simplefilter("error", kvdrop.PolicyWarning)  # the RoPE came from the config
        with KVDropPress("snapkv", keep_ratio=0.25, chunk_size=1)(hf_model):
            dropped = hf_model.generate(ids, **greedy)
    assert dropped.shape == (1, PROMPT_TOKENS + 6) and dropped[0, :PROMPT_TOKENS].tolist() == prompt
    assert "generate" not in vars(hf_model)  # restored after the block


def test_bad_arguments_say_what_is_wrong(hf_model: Any) -> None:
    with pytest.raises(ValueError, match="tail must be"):
        KVDropPress("snapkv", tail=0)
    with pytest.raises(ValueError, match=r"\[1, N\]"):
        KVDropPress("snapkv").compress(hf_model, torch.tensor([[1, 2], [3, 4]]))
    with pytest.raises(kvdrop.PolicyParamError, match="keep_ratio"):
        KVDropPress("snapkv", keep_ratio=2.0)


#: Fixed reconstruction ids for the random-weight model (its vocabulary has no words), three
#: chunks over the 299 prefilled tokens.
SYNTHETIC = {"first": (5, 6, 7), "later": (8, 9), "suffix": (10,), "chunk_tokens": 128}


def test_kvzip_keeps_what_the_engine_pass_keeps(
    hf_model: Any, engine_model: Transformer, prompt: list[int]
) -> None:
    """The reconstruction pass run with the transformers model scores like the engine's own
    pass over the same weights and prompt, so the kept set is the same."""
    from kvdrop_engine.model import DenseAttention
    from kvdrop_engine.reconstruct import ReconstructionPrompt, reconstruction_scores

    recon = ReconstructionPrompt(**SYNTHETIC)
    press = KVDropPress("kvzip", keep_ratio=0.25, reconstruction=recon)
    done = press.compress(hf_model, torch.tensor([prompt]))
    context = prompt[: done.prefilled]
    dense = DenseAttention(engine_model.config, capacity=PROMPT_TOKENS + 200)
    with torch.inference_mode():
        engine_model(torch.tensor(context), torch.arange(len(context)), dense)
        scores = reconstruction_scores(
            engine_model, context, len(context), dense.keys, dense.values, recon
        )
    assert done.token_scores is not None
    torch.testing.assert_close(done.token_scores, scores, rtol=1e-4, atol=1e-5)
    policy = kvdrop.get("kvzip", keep_ratio=0.25, chunk_size=1)
    context_ = EditContext(positions=torch.arange(len(context)), token_scores=scores)
    _, index = policy.select_indices({CacheKind.KV: _engine_kv(engine_model, context)}, context,
                                     context=context_)  # fmt: skip
    assert done.kept == index.tolist()
    assert len(done.kept) == int(0.25 * done.prefilled)


def _engine_kv(model: Transformer, tokens: list[int]) -> torch.Tensor:
    attn = DenseAttention(model.config, capacity=PROMPT_TOKENS)
    with torch.inference_mode():
        model(torch.tensor(tokens), torch.arange(len(tokens)), attn)
    layers = range(model.config.num_layers)
    return torch.stack(
        [torch.stack([attn.keys(i).flatten(1), attn.values(i).flatten(1)]) for i in layers], 1
    )


def test_presses_select_from_one_shared_prefill(hf_model: Any, prompt: list[int]) -> None:
    """prefill() once, select() per press: the same cache and tokens as each press's own
    compress(), and a press reading token scores refuses a prefill made without them."""
    recon = ReconstructionPrompt(**SYNTHETIC)
    ids = torch.tensor([prompt])
    shared = KVDropPress("kvzip", keep_ratio=0.25, reconstruction=recon).prefill(hf_model, ids)
    for spec, params in (("kvzip", {"reconstruction": recon}), ("snapkv", {}), ("knorm", {})):
        press = KVDropPress(spec, keep_ratio=0.25, **params)
        alone, picked = press.compress(hf_model, ids), press.select(hf_model, shared)
        assert picked.kept == alone.kept and picked.input_ids.tolist() == alone.input_ids.tolist()
        torch.testing.assert_close(picked.cache.layers[1].keys, alone.cache.layers[1].keys)
    plain = KVDropPress("snapkv", keep_ratio=0.25).prefill(hf_model, ids)
    assert plain.token_scores is None
    with pytest.raises(ValueError, match="reads token scores"):
        KVDropPress("kvzip", keep_ratio=0.25, reconstruction=recon).select(hf_model, plain)
    with pytest.raises(ValueError, match="tail=2"):
        KVDropPress("snapkv", keep_ratio=0.25, tail=2).select(hf_model, plain)


def test_kvzip_without_a_prompt_says_what_to_pass() -> None:
    with pytest.raises(ValueError, match="tokenizer="):
        KVDropPress("kvzip", keep_ratio=0.25)


def test_keep_ratio_is_kept_to_the_token_by_default(hf_model: Any, prompt: list[int]) -> None:
    """No store chunks in a dense cache: the default chunk is 1, so a 200-token prompt keeps a
    quarter (49 of 199 prefilled), not one whole 256-token chunk, and nothing warns."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", kvdrop.PolicyWarning)
        done = KVDropPress("snapkv", keep_ratio=0.25).compress(
            hf_model, torch.tensor([prompt[:200]])
        )
        half = KVDropPress("snapkv", keep_ratio=0.5).compress(
            hf_model, torch.tensor([prompt[:200]])
        )
    assert (len(done.kept), len(half.kept)) == (49, 99)
    chunked = KVDropPress("snapkv", keep_ratio=0.25, chunk_size=128)  # asked for
    with pytest.warns(kvdrop.PolicyWarning, match="kept_fraction"):
        assert len(chunked.compress(hf_model, torch.tensor([prompt[:200]])).kept) == 128


def _tiny(kind: str, **extra: Any) -> Any:
    sizes = {
        "vocab_size": 300, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    }  # fmt: skip
    torch.manual_seed(0)
    if kind == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(**sizes, **extra)).eval()
    config = transformers.Qwen2Config(**sizes, **extra)
    return transformers.Qwen2ForCausalLM(config).eval()


def test_sliding_window_layers_work_within_the_window_and_are_refused_past_it(
    prompt: list[int],
) -> None:
    mistral = _tiny("mistral", sliding_window=128)
    ids = torch.tensor([prompt[:100]])
    done = KVDropPress("snapkv", keep_ratio=0.5).compress(mistral, ids)  # fits the window
    assert len(done.kept) == 49 and done.cache.get_seq_length() == 49
    with pytest.raises(
        kvdrop.PolicyInputError, match=r"sliding window of 128 tokens.*prefills 299"
    ):
        KVDropPress("snapkv", keep_ratio=0.5).compress(mistral, torch.tensor([prompt]))
    mixed = _tiny("qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=1)
    with pytest.raises(kvdrop.PolicyInputError, match=r"layer 1 has a sliding window of 64"):
        KVDropPress("snapkv", keep_ratio=0.5).compress(mixed, ids)
    with pytest.raises(kvdrop.PolicyInputError, match="reconstruction pass runs past it"):
        KVDropPress("kvzip", reconstruction=_prompt()).compress(mistral, ids[:, :20])


def _prompt() -> Any:
    from kvdrop_engine.reconstruct import ReconstructionPrompt

    return ReconstructionPrompt(**SYNTHETIC)


def test_presses_refuse_to_nest_and_restore_what_they_patched(
    hf_model: Any, prompt: list[int]
) -> None:
    calls: list[int] = []
    own = hf_model.generate

    def wrapper(input_ids: torch.Tensor, **kw: Any) -> torch.Tensor:  # a user's own wrapper
        calls.append(input_ids.shape[1])
        return own(input_ids, **kw)

    hf_model.generate = wrapper
    try:
        press = KVDropPress("snapkv", keep_ratio=0.25)
        with press(hf_model):
            with pytest.raises(RuntimeError, match=r"already active.*do not nest"):
                with KVDropPress("knorm", keep_ratio=0.5)(hf_model):
                    pass
            out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=2, do_sample=False,
                                    pad_token_id=0)  # fmt: skip
        assert out.shape == (1, PROMPT_TOKENS + 2)
        assert calls == [int(0.25 * (PROMPT_TOKENS - 1)) + 1]  # the wrapper got the kept ids
        assert hf_model.generate is wrapper  # the user's wrapper is back, not deleted
        with pytest.raises(KeyError), press(hf_model):
            raise KeyError("inside the block")
        assert hf_model.generate is wrapper
    finally:
        del hf_model.generate
    with press(hf_model):
        pass
    assert "generate" not in vars(hf_model)


@pytest.mark.parametrize("name", kvdrop.available())
def test_every_registered_policy_runs_in_transformers(
    name: str, hf_model: Any, prompt: list[int]
) -> None:
    """What docs/transformers.md says: every registered policy (built-ins, combinators, the
    installed plugins) compresses a transformers cache at its example parameters."""
    info = kvdrop.describe(name)
    params = dict(info.example)
    if "head_dim" in {p.name for p in info.params}:
        params["head_dim"] = hf_model.config.head_dim
    press = KVDropPress(name, reconstruction=_prompt(), **params)
    with warnings.catch_warnings():
        warnings.simplefilter("error", kvdrop.PolicyWarning)  # RoPE known, chunk 1: no warning
        done = press.compress(hf_model, torch.tensor([prompt[:120]]))
    assert 0 < len(done.kept) < done.prefilled
    assert done.cache.get_seq_length() == len(done.kept)
