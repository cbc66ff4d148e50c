"""Manager V2 in the engine: the same outputs as V1 (decode on the device, several steps per
dispatch, stops and length limits there), reuse through the hashed block index, running out
of pages mid-dispatch, and the use_kv_cache_manager_v2 auto / true / false semantics (Gemma 3's
two layer groups: ``tests/model/test_gemma3.py``, one model per module)."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest

from kvjax.config import ConfigError, KvCacheConfig, KvCacheRetentionConfig, SchedulerConfig, SpeculativeConfig
from kvjax.engine import Engine
from kvjax.engine.manager_v2 import KVCacheManagerV2
from kvjax.manager import KVCacheManager
from kvjax.model.model import Model
from kvjax.sampling import SamplingParams
from kvjax.testing.tiny import init_params, tiny_hybrid_config, tiny_model

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [2, 7, 1, 8, 2, 8], [1, 6, 1, 8, 0, 3, 3, 9, 8, 8, 7, 4, 9, 8, 9]]


@pytest.fixture(scope="module")
def tiny() -> Model:
    cfg, params = tiny_model(0)
    return Model(config=cfg, params=params, tokenizer=None, path=pathlib.Path("tiny"))


def engine(model: Model, v2: str, steps: int = 8, max_tokens: int = 512, max_seq_len: int = 128, **kv) -> Engine:
    config = KvCacheConfig(tokens_per_block=4, max_tokens=max_tokens, use_kv_cache_manager_v2=v2, **kv)
    sched = SchedulerConfig(
        max_num_tokens=64, prefill_chunk_size=32, max_batch_size=4, num_decode_steps_per_dispatch=steps
    )
    return Engine(model, config, sched, max_seq_len=max_seq_len)


def outputs(e: Engine, prompts: list[list[int]], sampling: SamplingParams) -> list[list[int]]:
    return [o.output for o in e.generate(prompts, sampling)]


def test_v2_greedy_equals_v1_with_multi_step_dispatch(tiny):
    greedy = SamplingParams(max_new_tokens=40, ignore_eos=True)
    v1 = outputs(engine(tiny, "false"), PROMPTS, greedy)
    for steps in (1, 8):
        e = engine(tiny, "true", steps=steps)
        assert isinstance(e.manager, KVCacheManagerV2) and e.device_decode is not None
        assert outputs(e, PROMPTS, greedy) == v1
        assert e.timings["decode_dispatches"] > 0
        assert e.timings["decode_steps"] <= e.timings["decode_dispatches"] * steps
        e.manager.check_consistency()


def test_stop_token_and_lengths_handled_on_device(tiny):
    free = outputs(engine(tiny, "false"), PROMPTS, SamplingParams(max_new_tokens=30, ignore_eos=True))
    stop = free[0][7]
    sampling = SamplingParams(max_new_tokens=30, stop_token_id=stop)
    lengths = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (3, 17, 30)]
    v1, v2 = engine(tiny, "false"), engine(tiny, "true", steps=16)
    got = v2.generate(PROMPTS, sampling)
    assert [o.output for o in got] == outputs(v1, PROMPTS, sampling)
    assert got[0].output[-1] == stop and got[0].finish_reason == "stop" and len(got[0].output) <= 8
    for prompt, sp in zip(PROMPTS, lengths):
        [o] = v2.generate([prompt], sp)
        assert o.output == v1.generate([prompt], sp)[0].output and len(o.output) == sp.max_new_tokens
        assert o.finish_reason == "length"
    v2.manager.check_consistency()


def test_sampled_rows_match_v1(tiny):
    sampling = SamplingParams(max_new_tokens=20, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    assert outputs(engine(tiny, "true"), PROMPTS, sampling) == outputs(engine(tiny, "false"), PROMPTS, sampling)


def test_reuse_through_the_index_gives_cold_outputs(tiny):
    prefix = [5, 2, 7, 3, 1, 1, 4, 8, 6, 0, 2, 9, 3, 3, 7, 1]
    greedy = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prompts = [prefix + [4, 2], prefix + [8, 8, 1]]
    cold = [outputs(engine(tiny, "false"), [p], greedy)[0] for p in prompts]
    e = engine(tiny, "true")
    first = e.generate([prompts[0]], greedy)[0]
    second = e.generate([prompts[1]], greedy)[0]
    assert [first.output, second.output] == cold
    assert first.num_reused_tokens == 0 and second.num_reused_tokens == len(prefix)
    assert e.manager.stats.reused_blocks == len(prefix) // 4
    e.manager.check_consistency()


def test_running_out_of_pages_mid_dispatch_preempts_and_keeps_outputs(tiny):
    greedy = SamplingParams(max_new_tokens=40, ignore_eos=True)
    v1 = outputs(engine(tiny, "false"), PROMPTS, greedy)
    e = engine(tiny, "true", steps=32, max_tokens=64, max_seq_len=64)  # 16 pages for 3 sequences of up to 55 tokens
    assert outputs(e, PROMPTS, greedy) == v1
    assert sum(r.num_preemptions for r in e.requests.values()) > 0
    e.manager.check_consistency()


def test_auto_follows_the_model_preference(tiny):
    assert isinstance(engine(tiny, "auto").manager, KVCacheManager)
    assert isinstance(engine(tiny, "false").manager, KVCacheManager)
    prefers = dataclasses.replace(tiny, config=dataclasses.replace(tiny.config, prefers_kv_cache_manager_v2=True))
    assert isinstance(engine(prefers, "auto").manager, KVCacheManagerV2)
    assert isinstance(engine(prefers, "false").manager, KVCacheManager)
    assert isinstance(engine(prefers, "auto", host_cache_size=1 << 16).manager, KVCacheManager)  # needs V1: falls back


@pytest.mark.parametrize(
    ("kv", "field"),
    [
        (dict(host_cache_size=1 << 16), "host_cache_size=65536"),
        (dict(host_cache_size=1 << 16, disk_cache_size=1 << 16), "disk_cache_size"),
        (dict(event_buffer_max_size=8), "event_buffer_max_size=8"),
    ],
)
def test_true_with_a_v1_feature_is_a_config_error(tiny, kv, field):
    with pytest.raises(ConfigError, match=rf"use_kv_cache_manager_v2='true' is not supported with .*{field}"):
        engine(tiny, "true", **kv)


def test_true_with_speculation_or_recurrent_layers_is_a_config_error(tiny):
    config = KvCacheConfig(tokens_per_block=4, max_tokens=512, use_kv_cache_manager_v2="true")
    with pytest.raises(ConfigError, match="speculative"):
        Engine(tiny, config, max_seq_len=64, speculative=SpeculativeConfig())
    cfg = tiny_hybrid_config()
    hybrid = Model(config=cfg, params=init_params(cfg, seed=1), tokenizer=None, path=pathlib.Path("tiny-hybrid"))
    with pytest.raises(ConfigError, match="recurrent layers"):
        Engine(hybrid, config, max_seq_len=64)


def test_v1_only_request_features_are_refused_at_submit(tiny):
    e = engine(tiny, "true")
    retention = KvCacheRetentionConfig(decode_retention_priority=80)
    with pytest.raises(ValueError, match=r"retention \(per-request retention priorities\)"
                       r" needs the V1 manager .*KVCacheManagerV2 .*use_kv_cache_manager_v2='false'"):
        e.submit(PROMPTS[0], retention=retention)
    assert not e.has_work
    e.submit(PROMPTS[0], retention=KvCacheRetentionConfig())  # the default policy is fine
    e.run()


@pytest.fixture(scope="module")
def long_prompts(smollm2, reference_text) -> list[list[int]]:
    ids = smollm2.tokenizer.encode(reference_text)
    assert len(ids) >= 540
    return [ids[:540], ids[100:420], ids[50:150], ids[:520]]


def real_engine(model: Model, v2: str, steps: int = 16) -> Engine:
    config = KvCacheConfig(tokens_per_block=32, max_tokens=8192, use_kv_cache_manager_v2=v2)
    return Engine(model, config, SchedulerConfig(num_decode_steps_per_dispatch=steps), max_seq_len=1024)


def test_smollm2_v2_equals_v1_on_a_batch_and_reuses_prefixes(smollm2, long_prompts):
    greedy = SamplingParams(max_new_tokens=64, ignore_eos=True)
    v1 = real_engine(smollm2, "false")
    v2 = real_engine(smollm2, "true")
    expected = v1.generate(long_prompts, greedy)
    got = v2.generate(long_prompts, greedy)
    assert [o.output for o in got] == [o.output for o in expected]
    assert all(len(o.output) == 64 for o in got)
    assert v2.timings["decode_dispatches"] < v2.timings["decode_steps"]
    again = v2.generate([long_prompts[0]], greedy)[0]  # the whole prompt's full blocks are indexed
    assert again.num_reused_tokens == (540 - 1) // 32 * 32
    assert again.output == expected[0].output
    v2.manager.check_consistency()
    assert v2.manager.stats.reused_tokens == sum(o.num_reused_tokens for o in [*got, again])
