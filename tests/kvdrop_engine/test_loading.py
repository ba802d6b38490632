"""Loading: configs from HF config.json / GGUF metadata / presets, GGUF round trip, load_model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvdrop_engine.errors import EngineSetupError
from kvdrop_engine.loading import (
    ModelSpec,
    config_from_hf,
    load_checkpoint,
    load_model,
    preset_config,
)
from kvdrop_engine.model import DenseAttention, Transformer
from kvdrop_rope import RopeConfig

HF_TINY: dict[str, Any] = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)


def test_presets_and_config_validation() -> None:
    q = preset_config("qwen3-8b")
    assert (q.num_layers, q.num_heads, q.num_kv_heads, q.head_dim, q.qk_norm) == (
        36,
        32,
        8,
        128,
        True,
    )
    with pytest.raises(ValueError, match="unknown model preset"):
        preset_config("gpt-5")
    good = {**HF_TINY, "model_type": "llama"}
    with pytest.raises(ValueError, match="model_type"):
        config_from_hf({**good, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="num_hidden_layers"):
        config_from_hf({k: v for k, v in good.items() if k != "num_hidden_layers"})
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        config_from_hf({**good, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="mlp_bias"):
        config_from_hf({**good, "mlp_bias": True})
    with pytest.raises(ValueError, match="sliding_window"):
        config_from_hf({**good, "model_type": "qwen2", "use_sliding_window": True})
    with pytest.raises(ValueError, match="hidden_act"):
        config_from_hf({**good, "hidden_act": "gelu"})


def test_config_from_hf_builds_the_rope_the_model_rotates_with() -> None:
    scaling = {"rope_type": "linear", "factor": 2.0}
    cfg = config_from_hf({**HF_TINY, "rope_theta": 5e5, "rope_scaling": scaling})
    assert isinstance(cfg.rope, RopeConfig)
    assert cfg.rope == RopeConfig(
        head_dim=16, theta=5e5, scaling=scaling, max_position_embeddings=128
    )
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (3, 4, 2, 16)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gguf_roundtrip_gives_the_same_model(
    arch: str, tmp_path: Path, write_gguf: Callable[..., None]
) -> None:
    cfg = preset_config("tiny")
    cfg.qk_norm = arch == "qwen3"
    cfg.tie_word_embeddings = arch == "llama"
    model = Transformer.random(cfg, seed=4)
    with torch.no_grad():  # norms away from 1 so a mix-up would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.2)
    write_gguf(tmp_path / "m.gguf", model, arch)
    loaded = load_checkpoint(tmp_path / "m.gguf")
    lc = loaded.config
    assert (lc.num_layers, lc.num_heads, lc.num_kv_heads, lc.head_dim) == (2, 4, 2, 16)
    assert lc.qk_norm == (arch == "qwen3") and lc.tie_word_embeddings == (arch == "llama")
    assert lc.eos_token_ids == (2,) and lc.bos_token_id == 1
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    ids = torch.arange(30) * 11 % cfg.vocab_size
    with torch.no_grad():
        ref = model(ids, torch.arange(30), DenseAttention(cfg))
        got = loaded(ids, torch.arange(30), DenseAttention(lc))
    assert torch.equal(ref, got)


def test_load_model_random_preset() -> None:
    model, tokenizer, name = load_model(ModelSpec(random_preset="tiny", seed=3))
    assert tokenizer is None and name == "random-tiny"
    ref = Transformer.random(preset_config("tiny"), seed=3)
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)


def test_load_model_refuses_specs_that_cannot_work() -> None:
    with pytest.raises(EngineSetupError, match="unknown model preset 'gpt-5'"):
        load_model(ModelSpec(random_preset="gpt-5"))
    with pytest.raises(EngineSetupError, match="--dtype 'int8'"):
        load_model(ModelSpec(random_preset="tiny", dtype="int8"))
    with pytest.raises(EngineSetupError, match="--device 'nonsense'"):
        load_model(ModelSpec(random_preset="tiny", device="nonsense"))
