"""Tiny random models for fast tests (no checkpoint needed)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.model.config import ModelConfig
from kvjax.model.transformer import LayerParams, Params


def tiny_config(**overrides) -> ModelConfig:
    """A 2-layer GQA Llama (embed 32, 4 heads, 2 KV heads); fields can be overridden."""
    base = dict(
        name="tiny", vocab_size=97, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, ffn_dim=64, rope_theta=10_000.0, max_seq_len=2048,
    )
    return ModelConfig(**{**base, **overrides})


def init_params(cfg: ModelConfig, seed: int = 0, dtype: jnp.dtype = jnp.float32) -> Params:
    """Random weights scaled so activations stay O(1)."""
    key = jax.random.key(seed)

    def normal(key: jax.Array, shape: tuple[int, ...], fan_in: int) -> jax.Array:
        return (jax.random.normal(key, shape) / fan_in**0.5).astype(dtype)

    def norm_weight(key: jax.Array, n: int) -> jax.Array:
        return (1.0 + 0.1 * jax.random.normal(key, (n,))).astype(dtype)

    d, hd = cfg.d_model, cfg.head_dim
    layers: list[LayerParams] = []
    for layer_key in jax.random.split(key, cfg.num_layers):
        ks = jax.random.split(layer_key, 13)
        optional: dict[str, jax.Array] = {}
        if cfg.qk_norm:
            optional.update(q_norm=norm_weight(ks[9], hd), k_norm=norm_weight(ks[10], hd))
        if cfg.sandwich_norm:
            optional.update(post_attn_norm=norm_weight(ks[11], d), post_ffn_norm=norm_weight(ks[12], d))
        kv_heads = cfg.num_kv_heads
        if cfg.is_recurrent(len(layers)):  # keys and values per head; decays a in ~(0.9, 0.99)
            kv_heads = cfg.num_heads
            dk = jax.random.split(jax.random.fold_in(layer_key, 7), 3)
            optional.update(
                decay_w=(0.1 * jax.random.normal(dk[0], (d, cfg.num_heads)) / d**0.5).astype(dtype),
                decay_bias=jax.random.uniform(dk[1], (cfg.num_heads,), minval=-4.5, maxval=-2.3).astype(dtype),
                state_norm=norm_weight(dk[2], hd),
            )
        layers.append(
            LayerParams(
                attn_norm=norm_weight(ks[0], d),
                wq=normal(ks[1], (d, cfg.num_heads * hd), d),
                wk=normal(ks[2], (d, kv_heads * hd), d),
                wv=normal(ks[3], (d, kv_heads * hd), d),
                wo=normal(ks[4], (cfg.num_heads * hd, d), cfg.num_heads * hd),
                ffn_norm=norm_weight(ks[5], d),
                w_gate=normal(ks[6], (d, cfg.ffn_dim), d),
                w_up=normal(ks[7], (d, cfg.ffn_dim), d),
                w_down=normal(ks[8], (cfg.ffn_dim, d), cfg.ffn_dim),
                **optional,
            )
        )
    ek, nk = jax.random.split(jax.random.fold_in(key, 1))
    return Params(embed=normal(ek, (cfg.vocab_size, d), 1), layers=tuple(layers), final_norm=norm_weight(nk, d))


def tiny_hybrid_config(**overrides) -> ModelConfig:
    """A 4-layer hybrid: recurrent, recurrent, recurrent, attention (embed 32, 4 heads of 16)."""
    base = dict(name="tiny-hybrid", num_layers=4, layer_types=("recurrent", "recurrent", "recurrent", "attention"))
    return tiny_config(**{**base, **overrides})


def tiny_model(seed: int = 0, **overrides) -> tuple[ModelConfig, Params]:
    cfg = tiny_config(**overrides)
    return cfg, init_params(cfg, seed)

