"""CacheBlend through the engine on the real SmolLM2-135M: chunks as manager blocks (tails
included), blended requests scheduled, batched and preempted like ordinary ones (float32,
3 x 128-token chunks)."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.blend import selection
from kvjax.blend.chunk_store import ChunkStore
from kvjax.blend.prompt import BlendPrompt
from kvjax.config import KvCacheConfig, SchedulerConfig
from kvjax.engine import Engine
from kvjax.manager import KeyExtras
from kvjax.sampling import SamplingParams
from kvjax.testing.blend import submit_blended

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
def setup(smollm2, rag_example):
    ex = rag_example(seed=5, chunk_tokens=128)
    prompt = BlendPrompt(ex.prefix, ex.chunks, ex.suffix)
    engine = make_engine(smollm2, max_tokens=4096)
    store = ChunkStore(engine, variant="system", prefix_tokens=ex.prefix)
    exact = engine.generate([prompt.tokens.tolist()], GREEDY)[0]
    engine.manager.get_kv_cache_events()
    return smollm2, prompt, engine, store, exact


def test_chunks_are_blocks_of_the_manager(setup):
    _, prompt, engine, store, _ = setup
    before = engine.manager.num_cached_blocks(0)
    for chunk in prompt.chunks:
        assert store.put(chunk) == len(chunk)
    stored = {e.block_key for e in engine.manager.get_kv_cache_events() if e.kind == "stored"}
    for chunk in prompt.chunks:
        keys = store.block_keys(chunk)
        assert keys and set(keys) <= stored
        assert not set(keys) & set(engine.manager.prompt_block_keys(prompt.tokens.tolist()))  # own scope
        assert store.num_cached(chunk) == len(chunk)  # the tail is stored too
    assert engine.manager.num_cached_blocks(0) > before
    computed = store.stats.computed
    store.put(prompt.chunks[0])
    assert store.stats.computed == computed  # already cached: not computed again


def test_ratio_one_reproduces_generate(setup):
    _, prompt, engine, store, exact = setup
    rid = submit_blended(store, prompt, FULL, GREEDY)
    out = engine.run()[0]
    report = out.blend_report
    assert out.request_id == rid
    assert report.num_missed == 0
    assert report.chunk_hit == sum(len(c) for c in prompt.chunks)
    assert report.prefix_hit == len(prompt.prefix)  # from chunk 0's stored blocks
    assert out.output == exact.output
    assert rel_err(out.logits[0], exact.logits[0]) <= 1e-5
    assert max(rel_err(a, b) for a, b in zip(out.logits, exact.logits)) <= 1e-4


def test_blended_blocks_never_serve_exact_requests(setup):
    _, prompt, engine, store, _ = setup
    swapped = BlendPrompt(prompt.prefix, prompt.chunks[::-1], prompt.suffix)
    rid = submit_blended(store, swapped, selection.SelectionConfig(recompute_ratio=0.15), GREEDY)
    engine.run()
    salt = engine.requests[rid].sched.extras.cache_salt
    tokens = swapped.tokens.tolist()
    assert engine.manager.estimate_reusable_tokens(tokens, extras=KeyExtras(cache_salt=salt)) >= len(tokens) - PAGE
    exact = engine.generate([tokens], SamplingParams(max_new_tokens=1))[0]
    assert exact.num_reused_tokens < len(prompt.prefix) + PAGE


def test_blend_decodes_alongside_a_normal_request(setup, smollm2):
    _, prompt, engine, store, exact = setup
    other = engine.submit(
        smollm2.tokenizer.encode("The capital of France is"), SamplingParams(max_new_tokens=8, ignore_eos=True)
    )
    engine.step()
    rid = submit_blended(store, prompt, selection.SelectionConfig(recompute_ratio=0.15, seed=1), GREEDY)
    together = 0
    while engine.has_work:
        emitted = {r for r, _ in engine.step()}
        together += {other, rid} <= emitted
    blended = engine.output(rid)
    assert together >= 4
    assert len(blended.output) == GREEDY.max_new_tokens and engine.output(other).finish_reason == "length"
    assert rel_err(blended.logits[0], exact.logits[0]) > 1e-6  # approximate, yet a valid distribution
    assert np.all(np.isfinite(blended.logits[0]))


def test_offloaded_chunks_are_onboarded(setup, smollm2):
    _, prompt, _, _, exact = setup
    engine = make_engine(smollm2, max_tokens=1024, host_pages=96, max_seq_len=512)
    store = ChunkStore(engine, variant="system", prefix_tokens=prompt.prefix)
    for chunk in prompt.chunks:
        store.put(chunk)
    for seed in (0, 1):  # two fillers push the chunk blocks to the host tier
        filler = np.random.default_rng(seed).integers(3, 10_000, 480).tolist()
        engine.generate([filler], SamplingParams(max_new_tokens=1))
    assert engine.manager.num_cached_blocks(0, "host") > 0
    tiers = [store.tiers(chunk) for chunk in prompt.chunks]  # where each chunk block is before the lookup
    assert [len(t) for t in tiers] == [-(-(len(prompt.prefix) + len(c)) // PAGE) - len(prompt.prefix) // PAGE
                                       for c in prompt.chunks]
    found = {tier for t in tiers for tier in t}
    assert "host" in found and "miss" not in found
    host_blocks = sum(t.count("host") for t in tiers)
    submit_blended(store, prompt, FULL, GREEDY)
    out = engine.run()[0]
    report = out.blend_report
    assert report.onboarded_pages >= host_blocks > 0
    assert all(set(store.tiers(chunk)) == {"device"} for chunk in prompt.chunks)
    assert report.chunk_hit == sum(len(c) for c in prompt.chunks)
    assert out.output == exact.output
    assert rel_err(out.logits[0], exact.logits[0]) <= 1e-5
    engine.manager.check_consistency()


def test_blended_and_plain_requests_under_memory_pressure_match_running_alone(setup, smollm2):
    _, prompt, _, _, _ = setup
    sampling = SamplingParams(max_new_tokens=40, ignore_eos=True)
    config = selection.SelectionConfig(recompute_ratio=0.15)
    rng = np.random.default_rng(7)
    plain = [rng.integers(3, 10_000, 250).tolist() for _ in range(2)]

    def fresh(max_tokens: int) -> tuple[Engine, ChunkStore]:
        engine = make_engine(smollm2, max_tokens=max_tokens, host_pages=128, max_seq_len=512)
        store = ChunkStore(engine, variant="system", prefix_tokens=prompt.prefix)
        for chunk in prompt.chunks:
            store.put(chunk)
        return engine, store

    engine, store = fresh(4096)
    alone = [engine.generate([p], sampling)[0].output for p in plain]
    submit_blended(store, prompt, config, sampling)
    alone.insert(1, engine.run()[0].output)

    # 64 device pages: the blended prefill finds its chunks (30 pages) beside its own 27; then
    # both plain requests evict the chunk blocks (27 + 2 x 16 pages fit) and, decoding, no
    # longer fit (30 + 2 x 19 pages): the newest is preempted and resumed.
    engine, store = fresh(1024)
    rids = [submit_blended(store, prompt, config, sampling)]
    engine.step()
    assert engine.requests[rids[0]].blend_report.num_missed == 0
    rids += [engine.submit(p, sampling) for p in plain]
    outs = engine.run()
    assert [o.output for o in outs] == [alone[1], alone[0], alone[2]]
    assert sum(engine.requests[r].num_preemptions for r in rids) > 0
    engine.manager.check_consistency()
