"""CacheBlend identities on the real SmolLM2-135M with 256-token chunks (float32)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from experiments.workloads.rag import make_examples
from kvjax.blend import selection
from kvjax.blend.blender import Blender, BlendPrompt
from kvjax.blend.chunk_store import ChunkStore
from kvjax.blend.reposition import reposition_keys

pytestmark = pytest.mark.real_model
RTOL = 1e-5


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.fixture(scope="module")
def setup(smollm2):
    ex = make_examples(smollm2.tokenizer, num=1, seed=3, tasks=("cross_chunk_binding",), num_chunks=(3, 3), chunk_tokens=(256, 256))[0]
    prompt = BlendPrompt(ex.prefix, ex.chunks, ex.suffix)
    store = ChunkStore(smollm2.params, smollm2.config, variant="system", prefix_tokens=ex.prefix, tier="device", device_capacity=2048)
    for chunk in prompt.chunks:
        store.put(chunk)
    blender = Blender(smollm2.params, smollm2.config, store, ex.prefix, max_tokens=1024)
    full = np.asarray(blender.full_recompute(prompt))
    return smollm2, prompt, blender, full


def test_ratio_one_reproduces_full_recompute(setup):
    model, prompt, blender, full = setup
    config = selection.SelectionConfig(recompute_ratio=1.0)
    sel = selection.select_cacheblend(prompt.roles, config, blender.padded(prompt.roles.num_tokens), model.config.num_layers)
    logits, _ = blender.blend(prompt, sel)
    assert rel_err(logits, full) <= RTOL


def test_ratio_zero_equals_full_kv_reuse(setup):
    model, prompt, blender, full = setup
    reuse, _ = blender.blend(prompt, selection.select_none(prompt.roles, 64))
    config = selection.SelectionConfig(recompute_ratio=0.0)
    sel = selection.select_cacheblend(prompt.roles, config, blender.padded(prompt.roles.num_tokens), model.config.num_layers)
    blend0, _ = blender.blend(prompt, sel)
    assert rel_err(blend0, reuse) <= RTOL
    assert rel_err(reuse, full) > 1e-3


def test_single_chunk_at_position_zero_is_exact(smollm2):
    ex = make_examples(smollm2.tokenizer, num=1, seed=4, tasks=("single_chunk",), num_chunks=(3, 3), chunk_tokens=(256, 256))[0]
    prompt = BlendPrompt((), ex.chunks[:1], ex.suffix)
    store = ChunkStore(smollm2.params, smollm2.config, variant="pos0", tier="host")
    store.put(prompt.chunks[0])
    blender = Blender(smollm2.params, smollm2.config, store, (), max_tokens=512)
    full = np.asarray(blender.full_recompute(prompt))
    logits, _ = blender.blend(prompt, selection.select_none(prompt.roles, 64))
    assert rel_err(logits, full) <= RTOL


def test_reposition_equals_layer0_keys_at_new_positions(setup):
    model, prompt, blender, _ = setup
    n = prompt.roles.num_tokens
    padded = blender.padded(n)
    k_stored, _ = blender.reused_kv(prompt, padded)
    moved = reposition_keys(k_stored[0], jnp.asarray(blender.deltas(prompt, padded)), model.config.rope_theta)
    blender.full_recompute(prompt)
    k_full, _ = blender.kv(n)
    s, e = prompt.roles.chunk_spans[1][0], prompt.roles.suffix_start
    np.testing.assert_allclose(np.asarray(moved[s:e]), np.asarray(k_full[0, s:e]), rtol=1e-4, atol=1e-4)


def test_prompt_past_max_tokens_is_refused(setup):
    model, prompt, blender, _ = setup
    n = prompt.roles.num_tokens
    small = Blender(model.params, model.config, blender.store, prompt.prefix, max_tokens=len(prompt.prefix) + 64)
    with pytest.raises(ValueError, match=rf"holds {n} tokens .* max_tokens={len(prompt.prefix) + 64}"):
        small.blend(prompt, selection.select_none(prompt.roles, 64))
    with pytest.raises(ValueError, match=rf"max_tokens={len(prompt.prefix) + 64}"):
        small.full_recompute(prompt)
