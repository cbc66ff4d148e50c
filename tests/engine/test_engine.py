"""The engine end to end on the real model: batching, prefix reuse, offload/onboard,
preemption under memory pressure, bad input."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from kvjax.config import KvCacheConfig, SchedulerConfig
from kvjax.engine import MIN_TABLE_WIDTH, Engine, table_width
from kvjax.engine.manager_v2 import KVCacheManagerV2
from kvjax.manager import KVCacheManager
from kvjax.sampling import SamplingParams

GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True, return_logits=True)


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.fixture(scope="module")
def prompts(smollm2, reference_text):
    ids = smollm2.tokenizer.encode(reference_text)
    return [ids[:150], ids[100:230], ids[200:300]]


def make_engine(model, max_seq_len: int = 512, **kv) -> Engine:
    kv = {"tokens_per_block": 16, "max_tokens": 2048, **kv}
    scheduler = SchedulerConfig(max_num_tokens=512, prefill_chunk_size=128)
    return Engine(model, KvCacheConfig(**kv), scheduler, max_seq_len=max_seq_len)


def test_table_width_gathers_at_most_a_quarter_past_the_longest_sequence():
    widths = [table_width(pages) for pages in range(300)]
    assert widths[:9] == [4, 4, 4, 4, 4, 5, 6, 7, 8]
    assert widths == sorted(widths)
    assert all(w >= max(p, MIN_TABLE_WIDTH) for p, w in enumerate(widths))
    assert all(w - p < p / 4 for p, w in enumerate(widths) if p > MIN_TABLE_WIDTH)
    assert sorted({w for w in widths if 32 < w <= 64}) == [40, 48, 56, 64]  # four widths per doubling


def test_batched_equals_one_at_a_time(smollm2, prompts):
    batched = make_engine(smollm2, enable_block_reuse=False).generate(prompts, GREEDY)
    for prompt, out in zip(prompts, batched):
        [alone] = make_engine(smollm2, enable_block_reuse=False).generate([prompt], GREEDY)
        assert out.output == alone.output
        assert rel_err(np.stack(out.logits), np.stack(alone.logits)) < 1e-4


def test_prefix_reuse_gives_cold_logits(smollm2, prompts):
    engine = make_engine(smollm2)
    [cold] = engine.generate([prompts[0]], GREEDY)
    [warm] = engine.generate([prompts[0] + [13, 14]], GREEDY)
    [fresh] = make_engine(smollm2).generate([prompts[0] + [13, 14]], GREEDY)
    assert cold.num_reused_tokens == 0
    assert warm.num_reused_tokens == 144  # 9 full blocks of 16 of the 150-token prompt
    assert warm.output == fresh.output
    assert rel_err(np.stack(warm.logits), np.stack(fresh.logits)) < 1e-5


def test_whole_prompt_hit_computes_one_token_in_the_decode_shape(smollm2, reference_text):
    # A repeated block-aligned prompt reuses all but its last token, which runs as a one-row,
    # one-token step (the decode step's shape and paged decode attention), past 512 positions.
    prompt = smollm2.tokenizer.encode(reference_text)[:512]
    assert len(prompt) == 512
    engine = make_engine(smollm2, max_seq_len=600)
    [cold] = engine.generate([prompt], GREEDY)
    [warm] = engine.generate([prompt], GREEDY)
    assert warm.num_reused_tokens == 511
    assert warm.output == cold.output
    assert rel_err(np.stack(warm.logits), np.stack(cold.logits)) < 1e-5


def test_offload_and_onboard_keep_logits(smollm2, prompts):
    # 20 device pages of 16 tokens: the second and third prompts evict the first one's
    # blocks, which go to the host tier and come back when the first prompt repeats.
    page_bytes = smollm2.config.num_layers * 2 * 16 * 3 * 64 * 4
    engine = make_engine(smollm2, max_seq_len=256, max_tokens=16 * 20, host_cache_size=64 * page_bytes)
    [first] = engine.generate([prompts[0]], GREEDY)
    engine.generate([prompts[1]], GREEDY)
    engine.generate([prompts[2]], GREEDY)
    stats = engine.manager.stats
    assert stats.offloaded_pages > 0
    [again] = engine.generate([prompts[0]], GREEDY)
    assert engine.manager.stats.onboarded_pages > 0
    assert again.num_reused_tokens > 0
    assert again.output == first.output
    assert rel_err(np.stack(again.logits), np.stack(first.logits)) < 1e-5


def test_disk_tier_round_trip_keeps_logits(smollm2, prompts, tmp_path):
    # 20 device pages and 2 host pages: the first prompt's blocks go device -> host -> disk
    # while the others run, and come back from the disk file when it repeats.
    page_bytes = smollm2.config.num_layers * 2 * 16 * 3 * 64 * 4
    engine = make_engine(smollm2, max_seq_len=256, max_tokens=16 * 20, host_cache_size=2 * page_bytes,
                         disk_cache_size=64 * page_bytes, disk_cache_dir=str(tmp_path))
    [first] = engine.generate([prompts[0]], GREEDY)
    engine.generate([prompts[1]], GREEDY)
    engine.generate([prompts[2]], GREEDY)
    assert engine.manager.stats.spilled_pages > 0
    assert engine.manager.num_cached_blocks(0, "disk") > 0
    assert [p.name for p in tmp_path.iterdir()] and all(p.name.startswith("kvjax-disk-") for p in tmp_path.iterdir())
    [again] = engine.generate([prompts[0]], GREEDY)
    assert engine.manager.stats.disk_onboarded_pages > 0
    assert again.num_reused_tokens == 144
    assert again.output == first.output
    assert rel_err(np.stack(again.logits), np.stack(first.logits)) < 1e-5
    folder = next(tmp_path.iterdir())
    del engine
    gc.collect()
    assert not folder.exists()


def test_preemption_under_memory_pressure_keeps_outputs(smollm2, prompts):
    sampling = SamplingParams(max_new_tokens=40, ignore_eos=True)
    roomy = make_engine(smollm2, enable_block_reuse=False).generate(prompts, sampling)
    tight = make_engine(smollm2, max_seq_len=256, enable_block_reuse=False, max_tokens=16 * 20)
    outs = tight.generate(prompts, sampling)
    assert sum(tight.requests[o.request_id].num_preemptions for o in outs) > 0
    assert [o.output for o in outs] == [o.output for o in roomy]


def test_bad_input_is_rejected_without_side_effects(smollm2):
    engine = make_engine(smollm2)
    with pytest.raises(ValueError, match="must not be empty"):
        engine.submit([])
    with pytest.raises(ValueError, match=r"prompt_token_ids\[2\]=49152 must be an int token id in \[0, 49151\]"):
        engine.submit([1, 2, 49152])
    with pytest.raises(ValueError, match="exceeds max_seq_len=512"):
        engine.submit([1] * 500, SamplingParams(max_new_tokens=20))
    with pytest.raises(ValueError, match="max_new_tokens=0 must be an int >= 1"):
        SamplingParams(max_new_tokens=0)
    rid = engine.submit([1, 2, 3], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.submit([4, 5], request_id=rid)
    assert [r.request_id for r in engine.scheduler.waiting] == [rid]
    [out] = engine.run()
    assert len(out.output) == 2


def test_stream_yields_the_generated_tokens(smollm2, prompts):
    engine = make_engine(smollm2)
    streamed = list(engine.stream(prompts[2], SamplingParams(max_new_tokens=5, ignore_eos=True)))
    [rid] = list(engine.requests)
    assert streamed == engine.output(rid).output


def test_forced_manager_v2_is_a_clear_error(smollm2):
    from kvjax.config import ConfigError

    with pytest.raises(ConfigError, match="use_kv_cache_manager_v2='true' is not supported with .*host_cache_size"):
        make_engine(smollm2, use_kv_cache_manager_v2=True, host_cache_size=1 << 20)
    assert isinstance(make_engine(smollm2, use_kv_cache_manager_v2="auto").manager, KVCacheManager)
    assert isinstance(make_engine(smollm2, use_kv_cache_manager_v2=True).manager, KVCacheManagerV2)


def test_prompt_logits_are_the_computed_rows_of_the_last_prompt_positions(smollm2, reference_text):
    ids = smollm2.tokenizer.encode(reference_text)[:540]
    engine = make_engine(smollm2, max_seq_len=1024, max_tokens=4096)
    one = SamplingParams(max_new_tokens=1, ignore_eos=True, return_logits=True)
    [cold] = engine.generate([ids], SamplingParams(max_new_tokens=1, ignore_eos=True, prompt_logits=5))
    assert cold.prompt_logits.shape == (5, smollm2.config.vocab_size) and cold.num_reused_tokens == 0
    for row, end in zip(cold.prompt_logits, range(len(ids) - 4, len(ids) + 1)):
        fresh = make_engine(smollm2, max_seq_len=1024, max_tokens=4096)
        [alone] = fresh.generate([ids[:end]], one)  # the logits after ids[:end], from its own prefill
        assert rel_err(row, alone.logits[0]) <= 1e-4
    # A cache hit serves all but the last partial page (540 = 33 pages of 16 + 12): only those rows are computed.
    [warm] = engine.generate([ids], SamplingParams(max_new_tokens=1, ignore_eos=True, prompt_logits=40))
    assert warm.num_reused_tokens == 528 and warm.prompt_logits.shape[0] == 12
    assert rel_err(warm.prompt_logits[-5:], cold.prompt_logits) <= 1e-4
    with pytest.raises(ValueError, match="prompt_logits=-1 must be an int >= 0"):
        SamplingParams(prompt_logits=-1)


def test_short_prefills_of_one_bucket_run_as_one_forward_with_their_logits_alone(smollm2, reference_text):
    # Continuations of one cached 528-token prompt (the evaluation's teacher forcing): the
    # step prefills the tails of one token bucket in one batched forward (12, 14 and 3 tokens:
    # bucket 16; 20 tokens: bucket 32, apart), and each one's prompt logits equal those of
    # its prefill alone.
    ids = smollm2.tokenizer.encode(reference_text)[:546]
    assert len(ids) == 546
    base, tails = ids[:528], [ids[528:540], ids[532:546], [7, 8, 9], [*ids[528:546], 5, 6]]
    sampling = SamplingParams(max_new_tokens=1, ignore_eos=True, prompt_logits=3)
    engine = make_engine(smollm2, max_seq_len=1024, max_tokens=4096)
    engine.generate([base], SamplingParams(max_new_tokens=1, ignore_eos=True))
    steps = engine.timings["prefill_steps"]
    together = engine.generate([base + t for t in tails], sampling)
    assert engine.timings["prefill_steps"] - steps == 2  # one forward per bucket
    for tail, out in zip(tails, together):
        alone = make_engine(smollm2, max_seq_len=1024, max_tokens=4096)
        alone.generate([base], SamplingParams(max_new_tokens=1, ignore_eos=True))
        [one] = alone.generate([base + tail], sampling)
        assert out.num_reused_tokens == one.num_reused_tokens == 528
        assert out.output == one.output and rel_err(out.prompt_logits, one.prompt_logits) <= 1e-5


def test_pop_output_forgets_a_finished_request_only(smollm2, prompts):
    engine = make_engine(smollm2)
    rid = engine.submit(prompts[0], SamplingParams(max_new_tokens=3, ignore_eos=True))
    with pytest.raises(ValueError, match="has not finished"):
        engine.pop_output(rid)
    engine.run()
    out = engine.pop_output(rid)
    assert len(out.output) == 3 and rid not in engine.requests
    with pytest.raises(KeyError, match="unknown"):
        engine.pop_output(rid)
    [again] = engine.generate([prompts[0]], SamplingParams(max_new_tokens=3, ignore_eos=True), request_id=rid)
    assert again.output == out.output and again.num_reused_tokens > 0  # the blocks stayed cached
