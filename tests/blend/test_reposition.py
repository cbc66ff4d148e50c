"""RoPE repositioning: rotated stored keys equal keys computed at the new positions.

Tolerance: float32 RoPE angles at position p carry ~p·eps rad of rounding, so a composed
rotation (p, then delta) and a direct one (p + delta) agree to ~1e-4 absolute at p ~ 1000.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from experiments.blender import make_blender
from kvjax.blend.reposition import reposition_keys
from kvjax.blend.selection import SelectionConfig
from kvjax.model import transformer
from kvjax.testing.blend import random_prompt

TOL = dict(rtol=1e-4, atol=1e-4)


def test_layer0_keys_after_reposition_equal_fresh_keys(tiny):
    cfg, params = tiny
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 50)), jnp.int32)
    x = transformer.embed_tokens(params, cfg, tokens)
    _, k0, _ = transformer.qkv(params.layers[0], cfg, 0, x, jnp.arange(50)[None])
    _, k_new, _ = transformer.qkv(params.layers[0], cfg, 0, x, jnp.arange(50)[None] + 777)
    moved = reposition_keys(k0, jnp.full((1, 50), 777), cfg.rope_theta)
    np.testing.assert_allclose(np.asarray(moved), np.asarray(k_new), **TOL)


def test_store_reposition_matches_full_recompute_layer0(tiny):
    cfg, params = tiny
    prompt = random_prompt(np.random.default_rng(3), cfg.vocab_size, 4, [30, 40], 3)
    blender = make_blender(cfg, params, prompt, variant="pos0")
    reused = blender.run(prompt, SelectionConfig(selector="none", row_bucket=16), num_probes=1).trace
    exact = blender.run(prompt, SelectionConfig(selector="all", row_bucket=16), num_probes=1).trace
    s, e = prompt.roles.prefix_len, prompt.roles.suffix_start
    np.testing.assert_allclose(np.asarray(reused["k"][0, s:e]), np.asarray(exact["k"][0, s:e]), **TOL)
    np.testing.assert_allclose(np.asarray(reused["v"][0, s:e]), np.asarray(exact["v"][0, s:e]), **TOL)
