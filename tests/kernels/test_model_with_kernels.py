"""The tiny model gives the same logits and greedy tokens with the kernel (interpreted) as with the reference."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.testing.paged import chunked_logits
from kvjax.testing.tiny import tiny_model

MODELS = {
    "llama_gqa": dict(num_heads=4, num_kv_heads=2),
    "gemma_window_mqa": dict(
        num_layers=3, num_kv_heads=1, sliding_window=8, global_layer_period=3, rope_local_theta=10_000.0,
        rope_theta=1_000_000.0, qk_norm=True, sandwich_norm=True, embed_scale=True, activation="gelu_tanh",
        query_scale=0.2,
    ),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_prefill_and_decode_match_reference(name):
    cfg, params = tiny_model(seed=3, **MODELS[name])
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, 30)
    chunks = [21, 1, 1, 7]  # chunked prefill, two decode steps, one more chunk
    expected, _, _ = chunked_logits(params, cfg, tokens, chunks, tokens_per_block=4, attn_impl="reference")
    actual, _, _ = chunked_logits(params, cfg, tokens, chunks, tokens_per_block=4, attn_impl="interpret")
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(actual.argmax(-1), expected.argmax(-1))
