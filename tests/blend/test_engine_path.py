"""CacheBlend through the engine on the real SmolLM2-135M: chunks as manager blocks, fused KV
in the request's pages, decoding batched with ordinary requests (float32, 3 x 128-token chunks)."""

from __future__ import annotations

import numpy as np
import pytest

from experiments.workloads.rag import make_examples
from kvjax.blend import selection
from kvjax.blend.blender import BlendPrompt
from kvjax.blend.engine_blend import submit_blended
from kvjax.blend.managed_store import ManagedChunkStore
from kvjax.config import KvCacheConfig, SchedulerConfig
from kvjax.engine import Engine
from kvjax.sampling import SamplingParams

pytestmark = pytest.mark.real_model
PAGE = 16
GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True, return_logits=True)
FULL = selection.SelectionConfig(recompute_ratio=1.0)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def make_engine(model, *, max_tokens: int, host_pages: int = 0, max_seq_len: int = 1024) -> Engine:
    bytes_per_page = 2 * model.config.num_layers * model.config.num_kv_heads * model.config.head_dim * 4 * PAGE
    kv = KvCacheConfig(tokens_per_block=PAGE, max_tokens=max_tokens, host_cache_size=host_pages * bytes_per_page,
                       event_buffer_max_size=10_000)
    return Engine(model, kv, SchedulerConfig(prefill_chunk_size=512), max_seq_len=max_seq_len)


@pytest.fixture(scope="module")
def setup(smollm2):
    ex = make_examples(smollm2.tokenizer, num=1, seed=5, tasks=("cross_chunk_binding",), num_chunks=(3, 3), chunk_tokens=(128, 128))[0]
    prompt = BlendPrompt(ex.prefix, ex.chunks, ex.suffix)
    engine = make_engine(smollm2, max_tokens=4096)
    store = ManagedChunkStore(engine, variant="system", prefix_tokens=ex.prefix)
    exact = engine.generate([prompt.tokens.tolist()], GREEDY)[0]
    engine.manager.get_kv_cache_events()
    return smollm2, prompt, engine, store, exact


def test_chunks_are_blocks_of_the_manager(setup):
    _, prompt, engine, store, _ = setup
    before = engine.manager.num_cached_blocks(0)
    for chunk in prompt.chunks:
        assert store.put(chunk) == store.num_storable(len(chunk))
    stored = {e.block_key for e in engine.manager.get_kv_cache_events() if e.kind == "stored"}
    for chunk in prompt.chunks:
        keys = store.block_keys(chunk)
        assert keys and set(keys) <= stored
        assert not set(keys) & set(engine.manager.prompt_block_keys(prompt.tokens.tolist()))  # own scope
        assert store.num_cached(chunk) == store.num_storable(len(chunk))
    assert engine.manager.num_cached_blocks(0) > before
    computed = store.stats.computed
    store.put(prompt.chunks[0])
    assert store.stats.computed == computed  # already cached: not computed again


def test_ratio_one_reproduces_generate(setup):
    _, prompt, engine, store, exact = setup
    report = submit_blended(store, prompt, FULL, GREEDY)
    out = engine.run()[0]
    assert out.request_id == report.request_id
    assert report.num_tail == sum(len(c) - store.num_storable(len(c)) for c in prompt.chunks) > 0
    assert report.chunk_hit == sum(store.num_storable(len(c)) for c in prompt.chunks)
    assert report.prefix_hit == len(prompt.prefix)  # full blocks + the partial one (copied)
    assert out.output == exact.output
    assert rel_err(out.logits[0], exact.logits[0]) <= 1e-5
    assert max(rel_err(a, b) for a, b in zip(out.logits, exact.logits)) <= 1e-4


def test_blended_blocks_never_serve_exact_requests(setup):
    _, prompt, engine, store, _ = setup
    swapped = BlendPrompt(prompt.prefix, prompt.chunks[::-1], prompt.suffix)
    report = submit_blended(store, swapped, selection.SelectionConfig(recompute_ratio=0.15), GREEDY)
    engine.run()
    salt = engine.requests[report.request_id].sched.cache_salt
    tokens = swapped.tokens.tolist()
    assert engine.manager.estimate_reusable_tokens(tokens, cache_salt=salt) >= len(tokens) - PAGE
    exact = engine.generate([tokens], SamplingParams(max_new_tokens=1))[0]
    assert exact.num_reused_tokens < len(prompt.prefix) + PAGE


def test_blend_decodes_alongside_a_normal_request(setup, smollm2):
    _, prompt, engine, store, exact = setup
    other = engine.submit(smollm2.tokenizer.encode("The capital of France is"), SamplingParams(max_new_tokens=8, ignore_eos=True))
    engine.step()
    report = submit_blended(store, prompt, selection.SelectionConfig(recompute_ratio=0.15), GREEDY)
    together = 0
    while engine.has_work:
        emitted = {rid for rid, _ in engine.step()}
        together += {other, report.request_id} <= emitted
    blended = engine.output(report.request_id)
    assert together >= 4
    assert len(blended.output) == GREEDY.max_new_tokens and engine.output(other).finish_reason == "length"
    assert rel_err(blended.logits[0], exact.logits[0]) > 1e-6  # approximate, yet a valid distribution
    assert np.all(np.isfinite(blended.logits[0]))


def test_offloaded_chunks_are_onboarded(setup, smollm2):
    _, prompt, _, _, exact = setup
    engine = make_engine(smollm2, max_tokens=640, host_pages=96, max_seq_len=512)
    store = ManagedChunkStore(engine, variant="system", prefix_tokens=prompt.prefix)
    for chunk in prompt.chunks:
        store.put(chunk)
    filler = np.random.default_rng(0).integers(3, 10_000, 480).tolist()
    engine.generate([filler], SamplingParams(max_new_tokens=1))
    assert engine.manager.num_cached_blocks(0, "host") > 0
    report = submit_blended(store, prompt, FULL, GREEDY)
    out = engine.run()[0]
    assert report.onboarded_pages > 0
    assert report.chunk_hit == sum(store.num_storable(len(c)) for c in prompt.chunks)
    assert out.output == exact.output
    assert rel_err(out.logits[0], exact.logits[0]) <= 1e-5
    engine.manager.check_consistency()
