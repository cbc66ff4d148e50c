"""Speculative decoding on tiny models: config errors, prompt lookup, verification (greedy
exactness, rejection-sampling distribution), draft slots that never evict, rollback, the
tree and events untouched by drafts, the early-exit drafter's KV, preemption."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache import CacheLayout, init_pool
from kvjax.cache.pool import read_pages
from kvjax.config import ConfigError, KvCacheConfig, SchedulerConfig, SpeculativeConfig
from kvjax.engine import Engine
from kvjax.manager import KVCacheManager
from kvjax.model.registry import Model
from kvjax.model.transformer import forward
from kvjax.sampling import SamplingParams, probabilities
from kvjax.speculative import NgramDrafter, verify
from kvjax.testing.paged import single_group_layout
from kvjax.testing.tiny import tiny_model

NGRAM = SpeculativeConfig("ngram", num_draft_tokens=4, ngram_sizes=(1, 3))
EARLY_EXIT = SpeculativeConfig("early_exit", num_draft_tokens=3, exit_layer=2)


@pytest.fixture(scope="module")
def model() -> Model:
    cfg, params = tiny_model(0, num_layers=3)
    return Model(config=cfg, params=params, tokenizer=None, path=pathlib.Path("tiny"))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    base = rng.integers(1, 97, 40).tolist()
    return [base + base[:20], rng.integers(1, 97, 70).tolist(), base[:10] * 5]


def make_engine(
    model: Model, speculative: SpeculativeConfig | None, max_tokens: int = 2048, max_seq_len: int = 256
) -> Engine:
    kv_config = KvCacheConfig(tokens_per_block=8, max_tokens=max_tokens, event_buffer_max_size=100_000)
    scheduler = SchedulerConfig(max_num_tokens=256, prefill_chunk_size=64)
    return Engine(model, kv_config, scheduler, max_seq_len=max_seq_len, speculative=speculative)


def stored_blocks(engine: Engine) -> list[tuple[bytes, tuple[int, ...]]]:
    return [(e.block_key, e.token_ids) for e in engine.manager.get_kv_cache_events() if e.kind == "stored"]


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(method="eagle"), r"method='eagle' must be one of \('ngram', 'early_exit'\)"),
        (dict(num_draft_tokens=0), r"num_draft_tokens=0 must be an int in \[1, 16\]"),
        (dict(num_draft_tokens=True), r"num_draft_tokens=True must be an int"),
        (dict(ngram_sizes=(3, 2)), r"ngram_sizes=\(3, 2\) must be two ints \(min n, max n\) with 1 <= min <= max"),
        (dict(ngram_sizes=5), r"ngram_sizes=5 must be a list of two ints"),
        (dict(exit_layer=0), r"exit_layer=0 must be an int >= 1"),
    ],
)
def test_config_errors_name_the_field_and_range(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        SpeculativeConfig(**kwargs)


def test_engine_checks_exit_layer_against_the_model(model):
    with pytest.raises(ConfigError, match=r"exit_layer=3 must be in \[1, 2\] for a model of 3 layers"):
        make_engine(model, SpeculativeConfig("early_exit", exit_layer=3))
    with pytest.raises(ValueError, match="speculative must be None or a SpeculativeConfig, got dict"):
        make_engine(model, {"method": "ngram"})


# ---------------------------------------------------------------- prompt lookup


def test_prompt_lookup_continues_the_latest_longest_match():
    drafter = NgramDrafter((1, 3))
    #          0  1  2  3  4  5  6  7  8  9 10 11
    context = [5, 6, 7, 1, 2, 5, 6, 9, 4, 5, 6, 7]
    # the 3-gram (5, 6, 7) occurs at 0 only -> continue with 1, 2, 5
    assert drafter.lookup(context, 3) == [1, 2, 5]
    # (9, 5, 6) never occurred before; the 2-gram (5, 6) occurred at 0 and 5: the latest wins
    assert drafter.lookup([5, 6, 7, 1, 2, 5, 6, 9, 4, 9, 5, 6], 2) == [9, 4]
    assert drafter.lookup([1, 2, 3, 4], 4) == []  # 4 never occurred before
    assert drafter.lookup([3, 1, 3], 5) == [1, 3]  # the continuation runs to the context's end
    assert NgramDrafter((2, 2)).lookup([4, 1, 2, 1], 3) == []  # (2, 1) is new; n = 1 not allowed


# ---------------------------------------------------------------- verification


def test_greedy_verification_accepts_the_argmax_run():
    v = 11
    target = np.array([[3, 4, 5, 6], [3, 4, 5, 6], [3, 4, 5, 6], [3, 4, 5, 6]])  # argmax at each input
    logits = jax.nn.one_hot(target, v) * 5.0
    drafts = np.array([[3, 4, 5], [3, 9, 5], [8, 4, 5], [3, 4, 5]])
    num_drafts = np.array([3, 3, 3, 1])
    zeros = jnp.zeros(4)
    accepted, following = verify(
        logits, jnp.asarray(drafts), jnp.asarray(num_drafts), zeros, jnp.ones(4), jnp.zeros(4, jnp.int32),
        jnp.zeros(4, jnp.int32),
    )
    # all accepted + bonus 6; reject at 1 -> argmax 4 there; reject at 0 -> 3; 1 draft -> bonus 4
    assert np.asarray(accepted).tolist() == [3, 1, 0, 1]
    assert np.asarray(following).tolist() == [6, 4, 3, 4]


def _logits(params, cfg, tokens: np.ndarray, exit_layer: int | None) -> np.ndarray:
    """[T, V] logits of one sequence through the whole model or its first ``exit_layer`` layers."""
    layout = single_group_layout(cfg, num_pages=4, tokens_per_block=8)
    t = len(tokens)
    logits, _ = forward(
        params, init_pool(layout), jnp.asarray(tokens[None], jnp.int32), jnp.arange(t, dtype=jnp.int32)[None],
        (jnp.asarray([[1, 2, 3]], jnp.int32),), jnp.asarray([t], jnp.int32), cfg=cfg, layout=layout,
        logits_mode="all", exit_layer=exit_layer,
    )
    return np.asarray(logits[0])


@pytest.fixture(scope="module")
def tiny_distributions(model):
    """Target logits [2, V] of the tiny model at a context's last two positions, and its
    early-exit (1 layer) logits there."""
    tokens = np.array([5, 17, 33, 2, 61, 8, 40])
    return _logits(model.params, model.config, tokens, None)[-2:], _logits(model.params, model.config, tokens, 1)[-2:]


def _emitted_frequencies(target_logits, draft_probs, drafts, temperature, top_p):
    """Verifies one draft per row for len(drafts) seeds; returns (first emitted token's
    frequencies, second emitted token's frequencies among rows that accepted the draft,
    that row count)."""
    n, v = len(drafts), target_logits.shape[-1]
    logits = jnp.broadcast_to(jnp.asarray(target_logits)[None], (n, 2, v))
    probs = None if draft_probs is None else jnp.broadcast_to(jnp.asarray(draft_probs)[None, None], (n, 1, v))
    accepted, following = verify(
        logits, jnp.asarray(drafts, jnp.int32)[:, None], jnp.ones(n, jnp.int32), jnp.full(n, temperature),
        jnp.full(n, top_p), jnp.arange(n, dtype=jnp.int32), jnp.zeros(n, jnp.int32), probs,
    )
    accepted, following = np.asarray(accepted), np.asarray(following)
    first = np.where(accepted == 1, drafts, following)
    second = following[accepted == 1]
    return np.bincount(first, minlength=v) / n, np.bincount(second, minlength=v) / max(len(second), 1), len(second)


@pytest.mark.parametrize("drafter, top_p", [("point mass", 1.0), ("early exit", 0.9)])
def test_rejection_sampling_emits_the_target_distribution(tiny_distributions, drafter, top_p):
    """200k draws at temperature 5: each emitted token's frequencies equal the target's
    probabilities within 0.6 percentage points (about 5 standard errors at p = 0.5), and a
    shift of 2 points of mass would exceed that bound (checked below)."""
    target_logits, early_logits = tiny_distributions
    temperature, n = 5.0, 200_000
    dist = lambda logits: np.asarray(probabilities(jnp.asarray(logits), jnp.full(2, temperature), jnp.full(2, top_p)))
    p, q = dist(target_logits), dist(early_logits)
    assert 0.1 < 0.5 * np.abs(p[0] - q[0]).sum() < 0.5  # the drafter differs from the target
    if drafter == "point mass":  # prompt lookup: always the likeliest token, q = 1 there
        drafts, draft_probs = np.full(n, np.argmax(p[0])), None
    else:  # drafts drawn from the early-exit distribution q
        drafts, draft_probs = np.random.default_rng(1).choice(len(q[0]), size=n, p=q[0] / q[0].sum()), q[0]
    first, second, num_second = _emitted_frequencies(target_logits, draft_probs, drafts, temperature, top_p)
    bound = 0.006
    assert np.max(np.abs(first - p[0])) < bound
    assert 0.5 * n < num_second < n  # most drafts accepted, some rejected
    assert np.max(np.abs(second - p[1])) < bound * np.sqrt(n / num_second)
    shifted = p[0].copy()
    order = np.argsort(p[0])
    shifted[order[-1]] -= 0.02
    shifted[order[-2]] += 0.02
    assert np.max(np.abs(first - shifted)) > bound


# ---------------------------------------------------------------- manager: draft slots


def test_draft_slots_come_from_free_pages_only_and_roll_back():
    layout = CacheLayout(
        layer_windows=(64,), num_pages=(5,), tokens_per_block=4, num_kv_heads=1, head_dim=1, max_seq_len=64
    )
    mgr = KVCacheManager(KvCacheConfig(tokens_per_block=4, event_buffer_max_size=100), layout)
    mgr.add_request("old", list(range(1, 9)))
    mgr.allocate("old", 8)
    mgr.commit_tokens("old", list(range(1, 9)))
    mgr.free_request("old")  # 2 cached blocks (pages 1, 2); pages 3, 4 free
    mgr.add_request("a", [50, 51, 52])
    mgr.allocate("a", 3)
    mgr.commit_tokens("a", [50, 51, 52])
    mgr.allocate("a", 4)  # the decode's input token: page 3 holds slots 0..3
    assert mgr.allocate_drafts("a", 4 + 8) == 8  # one free page (4) left: slots up to 8
    assert mgr.block_table("a", 0) == [3, 4]
    assert mgr.num_cached_blocks(0) == 2  # nothing evicted for the drafts
    assert mgr.allocate_drafts("a", 12) == 8  # still no free page
    mgr.commit_tokens("a", [53])  # the input token; every draft rejected
    mgr.rollback("a", 8 - 4)
    assert mgr.block_table("a", 0) == [3]  # page 4 held only rejected drafts: free again
    assert mgr.num_free_pages(0) == 3  # page 4 + the 2 cached blocks
    assert [e.token_ids for e in mgr.get_kv_cache_events() if e.kind == "stored"] == [(1, 2, 3, 4), (5, 6, 7, 8),
                                                                                       (50, 51, 52, 53)]
    mgr.check_consistency()
    with pytest.raises(ValueError, match=r"num_total_tokens=65 must be an int in \[0, 64\]"):
        mgr.allocate_drafts("a", 65)


# ---------------------------------------------------------------- engine


@pytest.fixture(scope="module")
def greedy_reference(model, prompts):
    engine = make_engine(model, None)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=60, ignore_eos=True))
    return [o.output for o in outs], stored_blocks(engine), engine.manager.stats


@pytest.mark.parametrize("spec", [NGRAM, EARLY_EXIT], ids=["ngram", "early_exit"])
def test_greedy_outputs_tree_and_events_equal_non_speculative(model, prompts, greedy_reference, spec):
    outputs, stored, stats = greedy_reference
    engine = make_engine(model, spec)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=60, ignore_eos=True))
    assert [o.output for o in outs] == outputs
    t = engine.timings
    assert t["spec_drafted"] > t["spec_accepted"] > 0  # some drafts were rejected and rolled back
    assert t["decode_steps"] < 59  # fewer steps than one token at a time
    assert sorted(stored_blocks(engine)) == sorted(stored)  # no block of rejected drafts, none missing
    assert engine.manager.stats.reused_blocks == stats.reused_blocks
    engine.manager.check_consistency()
    assert all(engine.manager.num_free_pages(g) == engine.layout.num_pages[g] - 1 for g in range(1))


def test_early_exit_kv_in_cached_blocks_is_the_full_models(model, prompts):
    """The pages of every block the early-exit run stored hold the same K/V, in every layer,
    as the non-speculative run's: the drafter's partial-layer K/V was rewritten before commit."""
    runs = {}
    for name, spec in (("plain", None), ("early_exit", EARLY_EXIT)):
        engine = make_engine(model, spec)
        engine.generate([prompts[1]], SamplingParams(max_new_tokens=40, ignore_eos=True))
        pool = engine.manager.pools[0]
        pages = {key: block.page for key, block in pool.tree.blocks.items()}
        kv = np.asarray(read_pages(engine.pool, engine.layout, 0, jnp.asarray(list(pages.values()), jnp.int32)))
        runs[name] = dict(zip(pages, np.moveaxis(kv, 2, 0)))
    assert runs["plain"].keys() == runs["early_exit"].keys() and len(runs["plain"]) == (70 + 39) // 8
    for key, kv in runs["plain"].items():
        np.testing.assert_allclose(runs["early_exit"][key], kv, rtol=1e-4, atol=1e-5)


def test_preemption_during_speculation_keeps_outputs(model, prompts, greedy_reference):
    outputs, _, _ = greedy_reference
    engine = make_engine(model, NGRAM, max_tokens=8 * 20, max_seq_len=136)  # 3 requests of up to 17 pages
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=60, ignore_eos=True))
    assert sum(engine.requests[o.request_id].num_preemptions for o in outs) > 0
    assert [o.output for o in outs] == outputs
    engine.manager.check_consistency()


def test_sampled_speculation_is_seeded_and_stops_at_the_limit(model, prompts):
    sampling = SamplingParams(
        max_new_tokens=30, temperature=0.8, top_p=0.9, seed=7, return_logits=True, ignore_eos=True
    )
    runs = [make_engine(model, spec).generate(prompts[:2], sampling) for spec in (EARLY_EXIT, EARLY_EXIT)]
    assert [o.output for o in runs[0]] == [o.output for o in runs[1]]
    for out in runs[0]:
        assert len(out.output) == 30 and len(out.logits) == 30
        assert all(0 <= t < 97 for t in out.output)
