"""SmolLM2-135M's architecture with random bf16 weights of the real shapes.

The GPU machine can neither fetch the model's package nor receive its weights (270 MB in
bf16, over the call's 64 MiB), and timing needs only the shapes: ``SMOLLM2_135M`` is the
``ModelConfig`` that ``kvjax.model.registry.load_model("smollm2-135m")`` reads from the GGUF
(``tests/experiments/test_device_check.py`` compares them where the weights are cached).
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax.numpy as jnp

from experiments.device_check.sizes import Sizes
from kvjax.model.config import ModelConfig
from kvjax.model.model import Model
from kvjax.testing.tiny import init_params

SMOLLM2_135M = ModelConfig(
    name="smollm2-135m", vocab_size=49152, d_model=576, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
    ffn_dim=1536, rope_theta=100_000.0, rms_eps=1e-5, max_seq_len=8192, bos_id=1, eos_ids=(2,),
)
"""SmolLM2-135M(-Instruct): 30 layers, d_model 576, 9 query / 3 KV heads of 64, SwiGLU 1536, tied embedding."""


def random_model(sizes: Sizes, seed: int = 0) -> Model:
    """SmolLM2-135M's shapes (``sizes.model_layers`` / ``model_vocab`` override the layer count
    and vocabulary in the dry run), random bf16 weights, no tokenizer."""
    overrides = {
        k: v for k, v in (("num_layers", sizes.model_layers), ("vocab_size", sizes.model_vocab)) if v is not None
    }
    config = dataclasses.replace(SMOLLM2_135M, **overrides)
    params = init_params(config, seed, dtype=jnp.bfloat16)
    return Model(config=config, params=params, tokenizer=None, path=pathlib.Path(f"random-{config.name}"))
