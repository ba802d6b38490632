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
