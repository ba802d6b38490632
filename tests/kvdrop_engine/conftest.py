"""Fixtures of the engine tests: ``write_gguf`` writes a model as llama.cpp's converter would."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvdrop_engine.model import Transformer

#: ``write_gguf(path, model, arch, q8_names=())``
WriteGGUF = Callable[..., None]


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


@pytest.fixture
def write_gguf() -> WriteGGUF:
    """Write a model as a GGUF file (llama.cpp's names and Q/K row order; Q8_0 for ``q8_names``)."""
    pytest.importorskip("gguf")
    return _write_gguf
