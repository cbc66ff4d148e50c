"""Hugging Face checkpoint folders: ``load_hf`` reads one into ``ModelConfig`` and ``Params``;
``save_hf`` writes a loaded model as one (HF tensor names and layout).

A folder holds ``config.json``, the weights as ``model.safetensors`` or shards listed in
``model.safetensors.index.json``, and the tokenizer (``tokenizer.json``,
``tokenizer_config.json``; read by ``kvjax.model.tokenizer.tokenizer_from_hf``). Tensors are
read one at a time from memory-mapped safetensors files (the ``safetensors`` package), so a
checkpoint is never held in memory twice.

Architectures (``config.json``'s ``architectures[0]``) and what each brings:

| architecture        | families                     | quirks read                                  |
|---------------------|------------------------------|----------------------------------------------|
| LlamaForCausalLM    | Llama 2/3.x, SmolLM2         | RoPE scaling (linear, llama3), tied or not   |
| MistralForCausalLM  | Mistral                      | a sliding window on every layer (or none)    |
| Qwen2ForCausalLM    | Qwen2, Qwen2.5               | q/k/v projection biases                      |
| Qwen3ForCausalLM    | Qwen3                        | per-head RMSNorm of queries and keys         |
| Gemma3ForCausalLM   | Gemma 3 (text)               | 5 local : 1 global layers, local RoPE base,  |
|                     |                              | sandwich norms, (1 + w) norms, GeGLU         |

HF's q/k projections use the same half-rotation RoPE layout as ``kvjax.model.rope``, so no
row permutation is needed (unlike llama.cpp's GGUF). Anything a family adds that kvjax does
not implement (another RoPE type, an output bias, logit soft-capping, Qwen2's per-layer
sliding window) is refused with the field and the supported values, never loaded wrong.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tokenizers
from safetensors import safe_open
from safetensors.numpy import save_file

from kvjax.model.config import ModelConfig
from kvjax.model.rope import ROPE_SCALINGS, RopeScaling
from kvjax.model.tokenizer import CHATML_TEMPLATE, Tokenizer
from kvjax.model.transformer import LayerParams, Params

log = logging.getLogger(__name__)

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM")
"""``config.json`` architectures ``load_hf`` reads."""
PARAM_DTYPES = ("float32", "bfloat16")
"""Weight dtypes ``load_hf`` can give (``param_dtype``)."""

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "wq": "self_attn.q_proj",
    "wk": "self_attn.k_proj",
    "wv": "self_attn.v_proj",
    "wo": "self_attn.o_proj",
    "w_gate": "mlp.gate_proj",
    "w_up": "mlp.up_proj",
    "w_down": "mlp.down_proj",
    "q_norm": "self_attn.q_norm",
    "k_norm": "self_attn.k_norm",
}
"""kvjax field -> HF module of every family (weights ``<module>.weight``)."""
_NORMS_BY_FAMILY = {
    "gemma3": {"post_attn_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
               "post_ffn_norm": "post_feedforward_layernorm"},
    "other": {"ffn_norm": "post_attention_layernorm"},
}
"""The norms whose HF names differ by family (Llama's ``post_attention_layernorm`` is the norm
before the MLP; Gemma 3's is the sandwich norm after attention)."""
_BIASES = {"bq": "self_attn.q_proj", "bk": "self_attn.k_proj", "bv": "self_attn.v_proj"}
_PROJECTIONS = {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}
"""HF stores linear weights [out, in]; kvjax multiplies activations by [in, out]."""


def read_config(folder: pathlib.Path) -> dict[str, Any]:
    """``config.json`` of a checkpoint folder; raises naming the missing or broken file."""
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} does not exist: a Hugging Face checkpoint folder needs config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(path)!r} is not valid JSON: {e}") from e


def _field(hf: Mapping[str, Any], key: str, default: Any = None, *, required: bool = False) -> Any:
    if key in hf and hf[key] is not None:
        return hf[key]
    if required:
        raise ValueError(f"config.json has no {key!r}, which this architecture needs")
    return default


def _rope(hf: Mapping[str, Any], kind: str = "full_attention") -> tuple[float, RopeScaling | None]:
    """(RoPE base, scaling) from ``rope_theta`` + ``rope_scaling`` or from ``rope_parameters``
    (newer transformers; per layer type for Gemma 3)."""
    params = hf.get("rope_parameters")
    if isinstance(params, Mapping) and kind in params and isinstance(params[kind], Mapping):
        params = params[kind]
    if isinstance(params, Mapping):
        theta = float(params.get("rope_theta", _field(hf, "rope_theta", 10_000.0)))
        scaling = params
    else:
        theta = float(_field(hf, "rope_theta", 10_000.0))
        scaling = hf.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type not in ROPE_SCALINGS:
        raise ValueError(
            f"config.json rope_scaling.rope_type={rope_type!r} is not supported; supported: 'default', "
            + ", ".join(repr(k) for k in ROPE_SCALINGS)
        )
    if rope_type == "linear":
        return theta, RopeScaling("linear", float(scaling["factor"]))
    return theta, RopeScaling(
        "llama3", float(scaling["factor"]), float(scaling.get("low_freq_factor", 1.0)),
        float(scaling.get("high_freq_factor", 4.0)), int(scaling.get("original_max_position_embeddings", 8192)),
    )


def _eos_ids(hf: Mapping[str, Any], folder: pathlib.Path) -> tuple[int, ...]:
    """The model's end-of-sequence ids: ``generation_config.json``'s ``eos_token_id``, else
    ``config.json``'s, else (as transformers does) the id of ``tokenizer_config.json``'s
    ``eos_token`` in ``tokenizer.json``, which is logged.

    Raises:
      ValueError: none of the three names an eos token.
    """
    eos = _field(hf, "eos_token_id")
    generation = folder / "generation_config.json"
    if generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id", eos)
    if eos is None:
        eos = _tokenizer_eos_id(folder)
    if eos is None:
        raise ValueError(
            "no eos token: config.json and generation_config.json have no eos_token_id, and tokenizer_config.json "
            "names no eos_token that tokenizer.json holds"
        )
    return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))


def _tokenizer_eos_id(folder: pathlib.Path) -> int | None:
    """The id of ``tokenizer_config.json``'s ``eos_token`` (a string or ``{"content": ...}``) in
    ``tokenizer.json``; None when either file or the token is missing."""
    settings_path, tokenizer_path = folder / "tokenizer_config.json", folder / "tokenizer.json"
    if not settings_path.is_file() or not tokenizer_path.is_file():
        return None
    token = json.loads(settings_path.read_text()).get("eos_token")
    token = token.get("content") if isinstance(token, Mapping) else token
    if not isinstance(token, str):
        return None
    eos = tokenizers.Tokenizer.from_file(str(tokenizer_path)).token_to_id(token)
    if eos is not None:
        log.info("%s: no eos_token_id in config.json or generation_config.json; using tokenizer_config.json's "
                 "eos_token %r (id %d)", folder, token, eos)
    return eos


def model_config_from_hf(hf: Mapping[str, Any], folder: pathlib.Path, name: str) -> ModelConfig:
    """The ``ModelConfig`` of a ``config.json``; raises ``ValueError`` naming the unsupported field."""
    architecture = (hf.get("architectures") or [None])[0]
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"config.json architectures={hf.get('architectures')!r} is not supported; supported: {ARCHITECTURES}"
        )
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(key) is not None:
            raise ValueError(f"config.json {key}={hf[key]!r} is not supported (no logit soft-capping); it must be null")
    if hf.get("mlp_bias"):
        raise ValueError("config.json mlp_bias=true is not supported (MLP projections without bias only)")
    num_heads = int(_field(hf, "num_attention_heads", required=True))
    d_model = int(_field(hf, "hidden_size", required=True))
    theta, scaling = _rope(hf)
    common: dict[str, Any] = dict(
        name=name,
        vocab_size=int(_field(hf, "vocab_size", required=True)),
        d_model=d_model,
        num_layers=int(_field(hf, "num_hidden_layers", required=True)),
        num_heads=num_heads,
        num_kv_heads=int(_field(hf, "num_key_value_heads", num_heads)),
        head_dim=int(_field(hf, "head_dim", d_model // num_heads)),
        ffn_dim=int(_field(hf, "intermediate_size", required=True)),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_eps=float(_field(hf, "rms_norm_eps", 1e-6)),
        max_seq_len=int(_field(hf, "max_position_embeddings", 8192)),
        bos_id=int(_field(hf, "bos_token_id", 1)),
        eos_ids=_eos_ids(hf, folder),
    )
    if architecture == "Gemma3ForCausalLM":
        return _gemma3_config(hf, common)
    activation = _field(hf, "hidden_act", "silu")
    if activation != "silu":
        raise ValueError(
            f"config.json hidden_act={activation!r} is not supported for {architecture}; supported: 'silu'"
        )
    if architecture == "Qwen2ForCausalLM" and hf.get("use_sliding_window"):
        raise ValueError(
            "config.json use_sliding_window=true is not supported for Qwen2ForCausalLM (per-layer windows)"
        )
    window = hf.get("sliding_window") if architecture == "MistralForCausalLM" else None
    return ModelConfig(**common, sliding_window=None if window is None else int(window),
                       qk_norm=architecture == "Qwen3ForCausalLM")


def _gemma3_config(hf: Mapping[str, Any], common: dict) -> ModelConfig:
    """Gemma 3's text config: a global layer every ``period`` layers, the rest windowed."""
    layer_types = hf.get("layer_types")
    if layer_types:
        globals_at = [i for i, t in enumerate(layer_types) if t == "full_attention"]
        period = globals_at[0] + 1 if globals_at else None
        expected = ["full_attention" if period and (i + 1) % period == 0 else "sliding_attention"
                    for i in range(len(layer_types))]
        if layer_types != expected:
            raise ValueError(
                f"config.json layer_types={layer_types!r} is not supported: kvjax needs a global layer every P "
                "layers (P-1 sliding, then one full), as Gemma 3 has"
            )
    else:
        period = int(_field(hf, "sliding_window_pattern", 6))
    activation = _field(hf, "hidden_activation", _field(hf, "hidden_act", "gelu_pytorch_tanh"))
    if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"config.json hidden_activation={activation!r} is not supported for Gemma3ForCausalLM")
    local_theta, local_scaling = _rope(hf, "sliding_attention")
    if hf.get("rope_parameters") is None:
        local_theta = float(_field(hf, "rope_local_base_freq", 10_000.0))
    elif local_scaling is not None:
        raise ValueError("config.json rope_parameters.sliding_attention: scaled RoPE on local layers is not supported")
    head_dim = common["head_dim"]
    return ModelConfig(
        **common,
        rope_local_theta=local_theta,
        sliding_window=int(_field(hf, "sliding_window", 512)),
        global_layer_period=period,
        activation="gelu_tanh",
        qk_norm=True,
        sandwich_norm=True,
        embed_scale=True,
        query_scale=float(_field(hf, "query_pre_attn_scalar", head_dim)) ** -0.5,
    )


def _weight_files(folder: pathlib.Path) -> dict[str, pathlib.Path]:
    """Tensor name -> the safetensors file holding it (one file, or an index of shards)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = {name: folder / shard for name, shard in weight_map.items()}
        missing = sorted({str(p.name) for p in files.values() if not p.is_file()})
        if missing:
            raise FileNotFoundError(f"{str(index)!r} lists shard(s) {missing} that are not in {str(folder)!r}")
        return files
    single = folder / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{str(folder)!r} has neither model.safetensors nor model.safetensors.index.json")
    return {name: single for name in _open(single).keys()}  # noqa: SIM118 (a safetensors handle, not a dict)


def _open(path: pathlib.Path):
    try:
        return safe_open(path, framework="numpy")
    except Exception as e:  # a truncated or foreign file: safetensors raises its own error types
        raise ValueError(f"{str(path)!r} is not a readable safetensors file: {type(e).__name__}: {e}") from e


class _Tensors:
    """Reads named tensors from a checkpoint's safetensors files, one at a time."""

    def __init__(self, folder: pathlib.Path) -> None:
        self.files = _weight_files(folder)
        self._handles: dict[pathlib.Path, Any] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str) -> np.ndarray:
        if name not in self.files:
            raise ValueError(f"the checkpoint has no tensor {name!r}")
        path = self.files[name]
        if path not in self._handles:
            self._handles[path] = _open(path)
        try:
            return self._handles[path].get_tensor(name)
        except Exception as e:
            raise ValueError(f"tensor {name!r} of {str(path)!r} cannot be read: {type(e).__name__}: {e}") from e


def default_param_dtype() -> str:
    """float32 on CPU (XLA:CPU is slow at bfloat16 matmuls), the checkpoint's own dtype elsewhere."""
    return "float32" if jax.default_backend() == "cpu" else ""


def load_hf(
    folder: str | os.PathLike, *, name: str | None = None, param_dtype: str | None = None
) -> tuple[ModelConfig, Params]:
    """Loads a Hugging Face checkpoint folder.

    Args:
      folder: the checkpoint folder (config.json and safetensors weights).
      name: the model's name in its config (default: the folder's name).
      param_dtype: "float32" | "bfloat16" | None (``default_param_dtype``: float32 on CPU,
        the checkpoint's dtype on accelerators).

    Returns:
      (config, params) with every weight in ``param_dtype``.
    """
    folder = pathlib.Path(folder).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {str(folder)!r} does not exist")
    if param_dtype is not None and param_dtype not in PARAM_DTYPES:
        raise ValueError(f"param_dtype={param_dtype!r} must be None or one of {PARAM_DTYPES}")
    hf = read_config(folder)
    cfg = model_config_from_hf(hf, folder, name or folder.name)
    tensors = _Tensors(folder)
    dtype = param_dtype if param_dtype is not None else default_param_dtype()
    gemma = hf["architectures"][0] == "Gemma3ForCausalLM"

    def load(tensor_name: str, *, transpose: bool = False, norm: bool = False) -> jax.Array:
        a = tensors.get(tensor_name)
        if norm and gemma:  # Gemma's RMSNorm scales by (1 + weight)
            a = a.astype(np.float32) + 1.0
        a = a.T if transpose else a
        return jnp.asarray(a, dtype=dtype or a.dtype)

    fields = {**_LAYER_TENSORS, **_NORMS_BY_FAMILY["gemma3" if gemma else "other"]}
    layers = []
    for i in range(cfg.num_layers):
        prefix = f"model.layers.{i}."
        if f"{prefix}self_attn.o_proj.bias" in tensors:
            raise ValueError(f"tensor {prefix}self_attn.o_proj.bias: an output-projection bias is not supported")
        weights = {
            field: load(f"{prefix}{module}.weight", transpose=field in _PROJECTIONS, norm=field.endswith("norm"))
            for field, module in fields.items()
            if field not in ("q_norm", "k_norm") or cfg.qk_norm
        }
        weights.update(
            {
                field: load(f"{prefix}{module}.bias")
                for field, module in _BIASES.items()
                if f"{prefix}{module}.bias" in tensors
            }
        )
        layers.append(LayerParams(**weights))
    tied = hf.get("tie_word_embeddings", gemma) or "lm_head.weight" not in tensors
    params = Params(
        embed=load("model.embed_tokens.weight"),
        layers=tuple(layers),
        final_norm=load("model.norm.weight", norm=True),
        lm_head=None if tied else load("lm_head.weight"),
    )
    _check_shapes(cfg, params)
    return cfg, params


def _check_shapes(cfg: ModelConfig, params: Params) -> None:
    """Raises ``ValueError`` when a tensor's shape disagrees with config.json."""
    d, q, kv = cfg.d_model, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    expected = {"wq": (d, q), "wk": (d, kv), "wv": (d, kv), "wo": (q, d), "w_gate": (d, cfg.ffn_dim),
                "w_up": (d, cfg.ffn_dim), "w_down": (cfg.ffn_dim, d), "bq": (q,), "bk": (kv,), "bv": (kv,)}
    if params.embed.shape != (cfg.vocab_size, d):
        raise ValueError(
            f"model.embed_tokens.weight has shape {params.embed.shape}; config.json says {(cfg.vocab_size, d)}"
        )
    for i, lp in enumerate(params.layers):
        for field, shape in expected.items():
            a = getattr(lp, field)
            if a is not None and a.shape != shape:
                raise ValueError(f"layer {i} {field} has shape {a.shape}; config.json says {shape}")


def _architecture(cfg: ModelConfig, params: Params) -> str:
    """The HF architecture a ``ModelConfig`` is written as."""
    if cfg.is_hybrid:
        raise ValueError(f"model {cfg.name!r} has recurrent layers: no Hugging Face architecture holds them")
    if cfg.sandwich_norm:
        return "Gemma3ForCausalLM"
    if cfg.qk_norm:
        return "Qwen3ForCausalLM"
    if params.layers[0].bq is not None:
        return "Qwen2ForCausalLM"
    if cfg.sliding_window is not None:
        if cfg.global_layer_period is not None:
            raise ValueError(
                f"model {cfg.name!r}: local and global layers without sandwich norms have no HF architecture"
            )
        return "MistralForCausalLM"
    return "LlamaForCausalLM"


def _config_json(cfg: ModelConfig, params: Params, architecture: str) -> dict[str, Any]:
    hf: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                       "Qwen3ForCausalLM": "qwen3", "Gemma3ForCausalLM": "gemma3_text"}[architecture],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_seq_len, "bos_token_id": cfg.bos_id,
        "eos_token_id": list(cfg.eos_ids) if len(cfg.eos_ids) > 1 else cfg.eos_ids[0],
        "tie_word_embeddings": params.lm_head is None, "torch_dtype": str(params.embed.dtype),
    }
    scaling = cfg.rope_scaling
    if scaling is not None:
        hf["rope_scaling"] = {"rope_type": scaling.kind, "factor": scaling.factor} | (
            {"low_freq_factor": scaling.low_freq_factor, "high_freq_factor": scaling.high_freq_factor,
             "original_max_position_embeddings": scaling.original_max_positions} if scaling.kind == "llama3" else {}
        )
    if architecture == "Gemma3ForCausalLM":
        hf.update(hidden_activation="gelu_pytorch_tanh", rope_local_base_freq=cfg.rope_local_theta,
                  sliding_window=cfg.sliding_window, sliding_window_pattern=cfg.global_layer_period,
                  query_pre_attn_scalar=round(cfg.sm_scale**-2, 6))
    else:
        hf["hidden_act"] = "silu"
    if architecture == "MistralForCausalLM":
        hf["sliding_window"] = cfg.sliding_window
    return hf


def save_hf(cfg: ModelConfig, params: Params, tokenizer: Tokenizer | None, folder: str | os.PathLike) -> pathlib.Path:
    """Writes a model as a Hugging Face checkpoint folder ``load_hf`` (and transformers) reads.

    Args:
      cfg, params: the model (a Llama, Mistral, Qwen2, Qwen3 or Gemma 3 shape).
      tokenizer: written as ``tokenizer.json`` and ``tokenizer_config.json`` (None = none).
      folder: created if missing; its files are overwritten.

    Returns:
      The folder.
    """
    folder = pathlib.Path(folder).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    architecture = _architecture(cfg, params)
    gemma = architecture == "Gemma3ForCausalLM"

    def host(array: jax.Array, *, transpose: bool = False, norm: bool = False) -> np.ndarray:
        a = np.asarray(array)
        if norm and gemma:
            a = a - np.asarray(1.0, a.dtype)
        return np.ascontiguousarray(a.T if transpose else a)

    fields = {**_LAYER_TENSORS, **_NORMS_BY_FAMILY["gemma3" if gemma else "other"]}
    tensors = {"model.embed_tokens.weight": host(params.embed), "model.norm.weight": host(params.final_norm, norm=True)}
    if params.lm_head is not None:
        tensors["lm_head.weight"] = host(params.lm_head)
    for i, lp in enumerate(params.layers):
        prefix = f"model.layers.{i}."
        for field, module in fields.items():
            if getattr(lp, field) is not None:
                tensors[f"{prefix}{module}.weight"] = host(getattr(lp, field), transpose=field in _PROJECTIONS,
                                                           norm=field.endswith("norm"))
        for field, module in _BIASES.items():
            if getattr(lp, field) is not None:
                tensors[f"{prefix}{module}.bias"] = host(getattr(lp, field))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(_config_json(cfg, params, architecture), indent=2))
    if tokenizer is not None:
        tokenizer.backend.save(str(folder / "tokenizer.json"))
        settings: dict[str, Any] = {
            "add_bos_token": tokenizer.add_bos,
            "eos_token": tokenizer.backend.id_to_token(cfg.eos_ids[0]),
        }
        if tokenizer.chat_format == "chatml":
            settings["chat_template"] = CHATML_TEMPLATE
        (folder / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
    return folder
