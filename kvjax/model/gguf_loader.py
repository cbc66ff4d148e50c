"""Reads GGUF checkpoints (llama, gemma3) into ``Params`` with the ``gguf`` package.

Dequantizing takes seconds, so the float32 arrays are cached as ``.npy`` files (memory
mapped on load) under ``$KVJAX_CACHE_DIR`` (default ``~/.cache/kvjax``), keyed by the file's
name, size and mtime.

llama.cpp stores the Q and K projections of llama-arch models with their rows permuted
for interleaved (GPT-J) RoPE; ``_unpermute`` restores the half-rotation layout that
``kvjax.model.rope`` uses.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any

import gguf
import jax.numpy as jnp
import numpy as np

from kvjax.model.config import ModelConfig
from kvjax.model.transformer import LayerParams, Params
from kvjax.paths import cache_dir

_LAYER_TENSORS = {
    "attn_norm": "attn_norm",
    "wq": "attn_q",
    "wk": "attn_k",
    "wv": "attn_v",
    "wo": "attn_output",
    "ffn_norm": "ffn_norm",
    "w_gate": "ffn_gate",
    "w_up": "ffn_up",
    "w_down": "ffn_down",
    "q_norm": "attn_q_norm",
    "k_norm": "attn_k_norm",
    "post_attn_norm": "post_attention_norm",
    "post_ffn_norm": "post_ffw_norm",
}
_TRANSPOSED = {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}


def field_value(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's Q/K row permutation. w: [num_heads * head_dim, D] (rows = outputs)."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def model_config_from_gguf(reader: gguf.GGUFReader, name: str) -> ModelConfig:
    arch = field_value(reader, "general.architecture")
    p = f"{arch}."
    num_heads = int(field_value(reader, p + "attention.head_count"))
    d_model = int(field_value(reader, p + "embedding_length"))
    head_dim = int(field_value(reader, p + "attention.key_length", d_model // num_heads))
    common: dict[str, Any] = dict(
        name=name,
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
        d_model=d_model,
        num_layers=int(field_value(reader, p + "block_count")),
        num_heads=num_heads,
        num_kv_heads=int(field_value(reader, p + "attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        ffn_dim=int(field_value(reader, p + "feed_forward_length")),
        rope_theta=float(field_value(reader, p + "rope.freq_base", 10_000.0)),
        rms_eps=float(field_value(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        max_seq_len=int(field_value(reader, p + "context_length", 8192)),
        bos_id=int(field_value(reader, "tokenizer.ggml.bos_token_id", 1)),
        eos_ids=(int(field_value(reader, "tokenizer.ggml.eos_token_id", 2)),),
    )
    if arch == "llama":
        return ModelConfig(**common)
    if arch == "gemma3":
        # The layer pattern (5 local : 1 global) and the local RoPE base are not in the GGUF.
        return ModelConfig(
            **common,
            rope_local_theta=10_000.0,
            sliding_window=int(field_value(reader, p + "attention.sliding_window", 512)),
            global_layer_period=6,
            activation="gelu_tanh",
            qk_norm=True,
            sandwich_norm=True,
            embed_scale=True,
            query_scale=float(field_value(reader, p + "attention.query_pre_attn_scalar", head_dim)) ** -0.5
            if reader.fields.get(p + "attention.query_pre_attn_scalar")
            else head_dim**-0.5,
        )
    raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: 'llama', 'gemma3'")


def _dequantize(tensor: Any) -> np.ndarray:
    """A GGUF tensor as float32 with numpy's (rows = outputs, columns = inputs) layout."""
    shape = tuple(int(n) for n in reversed(tensor.shape))
    return np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)


def _cache_key(path: pathlib.Path) -> str:
    stat = path.stat()
    return f"{path.stem}-{stat.st_size}-{int(stat.st_mtime)}"


def _dequantize_all(path: pathlib.Path, cfg: ModelConfig, arch: str, reader: gguf.GGUFReader) -> dict[str, np.ndarray]:
    tensors = {t.name: t for t in reader.tensors}
    arrays: dict[str, np.ndarray] = {
        "embed": _dequantize(tensors["token_embd.weight"]),
        "final_norm": _dequantize(tensors["output_norm.weight"]),
    }
    for field, stem in _LAYER_TENSORS.items():
        if f"blk.0.{stem}.weight" not in tensors:
            continue
        per_layer = []
        for i in range(cfg.num_layers):
            w = _dequantize(tensors[f"blk.{i}.{stem}.weight"])
            if arch == "llama" and field == "wq":
                w = _unpermute(w, cfg.num_heads)
            elif arch == "llama" and field == "wk":
                w = _unpermute(w, cfg.num_kv_heads)
            per_layer.append(w.T if field in _TRANSPOSED else w)
        arrays[f"layers.{field}"] = np.stack(per_layer)
    return arrays


def load_gguf(path: str | os.PathLike, name: str) -> tuple[ModelConfig, Params, gguf.GGUFReader]:
    """Loads a GGUF file: (config, float32 params, the reader for tokenizer metadata)."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    reader = gguf.GGUFReader(path)
    arch = field_value(reader, "general.architecture")
    cfg = model_config_from_gguf(reader, name)
    folder = cache_dir() / _cache_key(path)
    manifest = folder / "manifest.json"
    if manifest.is_file():
        names = json.loads(manifest.read_text())
        arrays = {n: np.load(folder / f"{n}.npy", mmap_mode="r") for n in names}
    else:
        arrays = _dequantize_all(path, cfg, arch, reader)
        folder.mkdir(parents=True, exist_ok=True)
        for n, a in arrays.items():
            np.save(folder / f"{n}.npy", a)
        manifest.write_text(json.dumps(sorted(arrays)))
    present = [f.name for f in dataclasses.fields(LayerParams) if f"layers.{f.name}" in arrays]
    layers = tuple(
        LayerParams(**{f: jnp.asarray(arrays[f"layers.{f}"][i]) for f in present}) for i in range(cfg.num_layers)
    )
    params = Params(embed=jnp.asarray(arrays["embed"]), layers=layers, final_norm=jnp.asarray(arrays["final_norm"]))
    return cfg, params, reader
