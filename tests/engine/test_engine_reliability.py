"""One bad request fails alone: validation at submit, per-request failures inside a step,
abort, bounded history with reusable ids, and concurrent callers (tiny model, CPU)."""

from __future__ import annotations

import pathlib
import threading

import numpy as np
import pytest

from kvjax.config import ConfigError, KvCacheConfig, SchedulerConfig
from kvjax.engine import Engine
from kvjax.manager import TieredCacheManager
from kvjax.model.registry import Model
from kvjax.sampling import SamplingParams
from kvjax.testing.tiny import tiny_model

GREEDY = SamplingParams(max_new_tokens=5, ignore_eos=True)
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8], [1, 6, 1, 8, 0, 3]]


@pytest.fixture(scope="module")
def model() -> Model:
    cfg, params = tiny_model(0)
    return Model(config=cfg, params=params, tokenizer=None, path=pathlib.Path("tiny"))


def make_engine(model: Model, **kwargs) -> Engine:
    kv = KvCacheConfig(tokens_per_block=4, max_tokens=512)
    return Engine(model, kv, SchedulerConfig(max_num_tokens=64, prefill_chunk_size=32), max_seq_len=64, **kwargs)


@pytest.fixture(scope="module")
def alone(model) -> list[list[int]]:
    """Each prompt's greedy output on an engine of its own."""
    return [make_engine(model).generate([p], GREEDY)[0].output for p in PROMPTS]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(request_id=""), r"request_id='' must be None or a non-empty str"),
        (dict(request_id=7), r"request_id=7 must be None or a non-empty str"),
        (dict(cache_salt=b"x"), r"cache_salt=b'x' must be None or a non-empty str"),
        (dict(lora_id=True), r"lora_id=True must be None or an int >= 0"),
        (dict(sampling=dict(temperature=1.0)), r"sampling must be a SamplingParams, got dict"),
        (dict(sampling=SamplingParams(stop_token_id=97)), r"sampling.stop_token_id=97 must be in \[0, 97\)"),
        (dict(retention={"decode_retention_priority": True}), r"decode_retention_priority=True must be an int"),
    ],
)
def test_bad_request_fields_are_rejected_at_submit(model, alone, kwargs, message):
    engine = make_engine(model)
    keep = engine.submit(PROMPTS[0], GREEDY)
    with pytest.raises(ValueError, match=message):
        engine.submit(PROMPTS[1], **({"sampling": GREEDY} | kwargs))
    assert list(engine.requests) == [keep] and len(engine.scheduler.waiting) == 1
    [out] = engine.run()
    assert out.output == alone[0] and out.finish_reason == "length"


@pytest.mark.parametrize(
    "prompt,message",
    [
        ([1, 5.7, 3], r"prompt_token_ids\[1\]=5.7 must be an int token id in \[0, 96\]"),
        ([1, "5", 3], r"prompt_token_ids\[1\]='5' must be an int token id in \[0, 96\]"),
        ([1, True, 3], r"prompt_token_ids\[1\]=True must be an int token id in \[0, 96\]"),
        (np.array([1.0, 2.0]), r"prompt_token_ids\[0\]=1.0 must be an int token id in \[0, 96\]"),
        (np.array([[1, 2]]), r"must be a 1-D sequence of token ids, got shape \(1, 2\)"),
        ("hello", r"must be a sequence of int token ids \(a list, tuple or 1-D array\), got str"),
        ({1: 0, 2: 0}, r"must be a sequence of int token ids .*, got dict"),
        ({1, 2, 3}, r"must be a sequence of int token ids .*, got set"),
        ([], r"must not be empty"),
        ([1, 97], r"prompt_token_ids\[1\]=97 must be an int token id in \[0, 96\]"),
        ([-1], r"prompt_token_ids\[0\]=-1 must be an int token id"),
    ],
)
def test_prompt_token_ids_must_be_ints_in_the_vocabulary(model, prompt, message):
    engine = make_engine(model)
    with pytest.raises(ValueError, match=message):
        engine.submit(prompt)
    assert not engine.has_work and not engine.requests


def test_numpy_integer_prompts_are_accepted(model, alone):
    engine = make_engine(model)
    outs = engine.generate([np.asarray(PROMPTS[0], np.int64), [np.int32(t) for t in PROMPTS[1]]], GREEDY)
    assert [o.output for o in outs] == alone[:2]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(seed=2**40), r"seed=1099511627776 must be an int in \[0, 2147483647\]"),
        (dict(seed=-1), r"seed=-1 must be an int in \[0, 2147483647\]"),
        (dict(temperature=float("nan")), r"temperature=nan must be a finite number >= 0"),
        (dict(temperature=float("inf")), r"temperature=inf must be a finite number >= 0"),
        (dict(top_p=0.0), r"top_p=0.0 must be a number in \(0, 1\]"),
        (dict(max_new_tokens=True), r"max_new_tokens=True must be an int >= 1"),
        (dict(ignore_eos=1), r"ignore_eos=1 must be a bool"),
        (dict(stop_token_id=-3), r"stop_token_id=-3 must be None"),
    ],
)
def test_sampling_params_validate_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_a_prefill_that_raises_finishes_alone(model, alone):
    """A forward that raises for one request's prefill finishes that request with an error;
    the others give their solo outputs and the cache stays consistent."""
    poison = 96
    engine = make_engine(model)
    real_forward = engine.runner.context.forward

    def forward(params, pool, tokens, *args, **kwargs):
        if (np.asarray(tokens) == poison).any():
            raise FloatingPointError("injected fault")
        return real_forward(params, pool, tokens, *args, **kwargs)

    engine.runner.context.forward = forward
    ids = [engine.submit(p, GREEDY) for p in PROMPTS[:2]]
    bad = engine.submit([5, poison, 6], GREEDY)
    outs = {o.request_id: o for o in engine.run()}
    assert [outs[i].output for i in ids] == alone[:2]
    assert outs[bad].finish_reason == "error" and outs[bad].error == "FloatingPointError: injected fault"
    assert outs[bad].output == []
    assert not engine.has_work
    engine.manager.check_consistency()


def test_a_decode_that_raises_inside_a_batch_finishes_alone(model, alone):
    """The fault hits the victim's second decode (position 21), inside a decode batch with
    two innocent requests: the batch is retried row by row, the victim finishes with an
    error after its two tokens, the others give their solo outputs."""
    victim = list(range(20, 40))
    [victim_alone] = make_engine(model).generate([victim], GREEDY)
    engine = make_engine(model)
    real_forward = engine.runner.context.forward

    def forward(params, pool, tokens, positions, *args, **kwargs):
        if np.asarray(tokens).shape[1] == 1 and (np.asarray(positions) == 21).any():
            raise FloatingPointError("decode fault")
        return real_forward(params, pool, tokens, positions, *args, **kwargs)

    engine.runner.context.forward = forward
    ids = [engine.submit(p, GREEDY) for p in (PROMPTS[0], victim, PROMPTS[1])]
    outs = {o.request_id: o for o in engine.run()}
    assert [outs[ids[0]].output, outs[ids[2]].output] == alone[:2]
    assert outs[ids[1]].finish_reason == "error" and outs[ids[1]].error == "FloatingPointError: decode fault"
    assert outs[ids[1]].output == victim_alone.output[:2]
    engine.manager.check_consistency()


def test_abort_frees_pages_and_spares_the_others(model, alone):
    engine = make_engine(model)
    free = engine.manager.num_free_pages(0)
    ids = [engine.submit(p, GREEDY) for p in PROMPTS]
    engine.step()
    engine.step()
    assert engine.abort(ids[1]) is True
    assert engine.abort(ids[1]) is False  # already finished
    assert engine.abort("never-submitted") is False
    queued = engine.submit(PROMPTS[0], GREEDY)
    assert engine.abort(queued) is True  # still waiting
    outs = {o.request_id: o for o in engine.run()}
    assert outs[ids[0]].output == alone[0] and outs[ids[2]].output == alone[2]
    aborted = engine.output(ids[1])
    assert aborted.finish_reason == "abort" and aborted.output == alone[1][: len(aborted.output)]
    assert engine.output(queued).finish_reason == "abort" and engine.output(queued).output == []
    engine.manager.check_consistency()
    engine.manager.clear_cache()
    assert engine.manager.num_free_pages(0) == free


def test_finished_history_is_bounded_and_ids_are_reusable(model, alone):
    engine = make_engine(model, max_finished_requests=2)
    for i in range(4):
        engine.generate([PROMPTS[i % 3]], GREEDY)
    assert len(engine.requests) == 2
    with pytest.raises(KeyError, match=r"request_id='req-0' is unknown.*max_finished_requests=2"):
        engine.output("req-0")
    [first] = engine.generate([PROMPTS[0]], GREEDY, request_id="mine")
    [again] = engine.generate([PROMPTS[1]], GREEDY, request_id="mine")  # finished ids are free again
    assert (first.output, again.output) == (alone[0], alone[1])
    live = engine.submit(PROMPTS[2], GREEDY, request_id="live")
    with pytest.raises(ValueError, match="request_id='live' is already in use by a request that has not finished"):
        engine.submit(PROMPTS[2], GREEDY, request_id=live)
    with pytest.raises(ValueError, match="max_finished_requests=0 must be an int >= 1"):
        make_engine(model, max_finished_requests=0)


def test_generate_is_all_or_nothing(model, alone):
    engine = make_engine(model)
    with pytest.raises(ValueError, match="must be an int token id in"):
        engine.generate([PROMPTS[0], [1000]], GREEDY)
    assert not engine.has_work
    assert engine.generate([PROMPTS[1]], GREEDY)[0].output == alone[1]


def test_concurrent_generate_and_submit(model, alone):
    """Two threads calling generate() on one engine, then four threads submitting while one
    thread steps: every request gets its solo output."""
    engine = make_engine(model)
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def generate(i: int) -> None:
        try:
            results[i] = engine.generate([PROMPTS[i]], GREEDY)[0].output
        except BaseException as e:  # collected and re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=generate, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and [results[0], results[1]] == alone[:2]

    submitted: list[tuple[str, int]] = []
    lock = threading.Lock()

    def submit(i: int) -> None:
        for k in range(3):
            rid = engine.submit(PROMPTS[(i + k) % 3], GREEDY)
            with lock:
                submitted.append((rid, (i + k) % 3))

    submitters = [threading.Thread(target=submit, args=(i,)) for i in range(4)]
    for t in submitters:
        t.start()
    while any(t.is_alive() for t in submitters) or engine.has_work:
        engine.step()
    assert len(submitted) == 12
    for rid, p in submitted:
        assert engine.output(rid).output == alone[p]


def test_sizes_beyond_the_machine_are_refused_before_allocating(model):
    with pytest.raises(
        ConfigError, match=r"host_cache_size=1,000,000,000,000,000 needs .* bytes of host memory but .* available"
    ):
        Engine(model, KvCacheConfig(tokens_per_block=4, max_tokens=512, host_cache_size=10**15), max_seq_len=64)
    with pytest.raises(
        ConfigError, match=r"kv_cache_config.free_memory_bytes: the device cache needs .* bytes are free"
    ):
        Engine(model, KvCacheConfig(tokens_per_block=4, free_memory_bytes=10**16), max_seq_len=64)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(max_seq_len=0), r"max_seq_len=0 must be None \(the model's 2048\) or an int in \[1, 2048\]"),
        (dict(max_seq_len=2049), r"max_seq_len=2049 must be None"),
        (
            dict(max_seq_len=64, attn_impl="bogus"),
            r"attn_impl='bogus' must be one of \('auto', 'blocked', 'reference', 'interpret'\)",
        ),
        (dict(max_seq_len=64, compile_unit="scan"), r"compile_unit='scan' must be one of \('auto', 'model', 'layer'\)"),
    ],
)
def test_engine_arguments_are_refused_at_construction(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        Engine(model, KvCacheConfig(tokens_per_block=4, max_tokens=512), **kwargs)


def test_abort_takes_one_request_id(model, alone):
    engine = make_engine(model)
    rid = engine.submit(PROMPTS[0], GREEDY)
    with pytest.raises(ValueError, match=r"request_id=\['x'\] must be a str \(one request per call\)"):
        engine.abort(["x"])
    assert engine.run()[0].output == alone[0] and engine.output(rid).finish_reason == "length"


def test_v2_engines_name_what_they_do_not_support(model):
    from kvjax.blend.chunk_store import ChunkStore

    engine = make_engine_v2(model)
    [out] = engine.generate([PROMPTS[0]], GREEDY)
    # 12 of 13 tokens
    assert engine.manager.num_cached_blocks(0) == 3 and engine.manager.num_cached_blocks(0, "host") == 0
    assert engine.manager.group_windows == engine.layout.group_windows
    assert not isinstance(engine.manager, TieredCacheManager) and not hasattr(engine.manager, "get_kv_cache_events")
    with pytest.raises(ValueError, match=r"a ChunkStore \(CacheBlend chunks\)"
                       r" needs the V1 manager .*KVCacheManagerV2 .*use_kv_cache_manager_v2='false'"):
        ChunkStore(engine, variant="pos0")
    assert engine.generate([PROMPTS[0]], GREEDY)[0].output == out.output


def make_engine_v2(model: Model) -> Engine:
    kv = KvCacheConfig(tokens_per_block=4, max_tokens=512, use_kv_cache_manager_v2="true")
    return Engine(model, kv, SchedulerConfig(max_num_tokens=64, prefill_chunk_size=32), max_seq_len=64)


def test_a_state_pool_beyond_the_machine_names_max_snapshots():
    from kvjax.config import MambaStateConfig
    from kvjax.testing.tiny import init_params, tiny_hybrid_config

    cfg = tiny_hybrid_config()
    hybrid = Model(config=cfg, params=init_params(cfg, 0), tokenizer=None, path=pathlib.Path("tiny-hybrid"))
    kv = KvCacheConfig(tokens_per_block=4, max_tokens=512, mamba_state_config=MambaStateConfig(max_snapshots=10**9))
    with pytest.raises(ConfigError, match=r"mamba_state_config.max_snapshots=1,000,000,000: the recurrent-state pool"):
        Engine(hybrid, kv, max_seq_len=64)
