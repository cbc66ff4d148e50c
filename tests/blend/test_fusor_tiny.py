"""Blended-prefill identities on a tiny random model, every policy an engine request: r=1 is
full recompute, r=0 is full KV reuse, a chunk at its stored position is exact, prefix caching
is exact, and teacher forcing behind the prompt equals greedy decoding."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from experiments.blender import FULL_RECOMPUTE, make_blender
from kvjax.blend.engine_blend import ChunkReuse
from kvjax.blend.selection import SelectionConfig, target_count
from kvjax.sampling import SamplingParams
from kvjax.testing.blend import random_prompt, submit_blended

RTOL = 1e-5
ALL = SelectionConfig(selector="all", row_bucket=16)
NONE = SelectionConfig(selector="none", row_bucket=16)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.fixture(scope="module")
def setup(tiny):
    cfg, params = tiny
    prompt = random_prompt(np.random.default_rng(0), cfg.vocab_size, 7, [40, 33, 50], 9)
    blender = make_blender(cfg, params, prompt)
    full = blender.run(prompt, FULL_RECOMPUTE, max_new_tokens=6)
    return cfg, prompt, blender, full


def test_select_all_equals_full_recompute(setup):
    _, prompt, blender, full = setup
    run = blender.run(prompt, ALL, num_probes=2)
    assert rel_err(run.logits[-1], full.logits[0]) < RTOL
    assert run.report.num_missed == 0 and run.report.chunk_hit == sum(len(c) for c in prompt.chunks)


def test_cacheblend_ratio_one_equals_full_recompute(setup):
    _, prompt, blender, full = setup
    config = SelectionConfig(recompute_ratio=1.0, check_layers=(1, 2), budgets=(1.0, 1.0), row_bucket=16)
    assert rel_err(blender.run(prompt, config).logits[-1], full.logits[0]) < RTOL


def test_ratio_zero_equals_full_kv_reuse(setup):
    _, prompt, blender, full = setup
    reuse = blender.run(prompt, NONE).logits[-1]
    config = SelectionConfig(recompute_ratio=0.0, check_layers=(1, 2), budgets=(1.0, 1.0), row_bucket=16)
    assert rel_err(blender.run(prompt, config).logits[-1], reuse) < RTOL
    assert rel_err(reuse, full.logits[0]) > 1e-3  # the chunks really miss cross-attention


def test_gradual_filtering_keeps_suffix_and_target_count(setup):
    _, prompt, blender, _ = setup
    config = SelectionConfig(recompute_ratio=0.2, check_layers=(1, 2), budgets=(2.0, 1.0), row_bucket=8)
    rec = np.asarray(blender.run(prompt, config, num_probes=4).trace["recomputed"])  # [L, T]
    roles = prompt.roles
    target = target_count(roles, 0.2)
    assert rec[0, roles.prefix_len : roles.num_tokens].all()
    assert rec[1].sum() == roles.num_forced + 2 * target
    assert rec[2].sum() == rec[3].sum() == roles.num_forced + target
    assert rec[:, roles.suffix_start : roles.num_tokens].all()
    assert not rec[1:, : roles.prefix_len].any()
    assert (rec[2] <= rec[1]).all()  # sets only narrow


def test_single_chunk_at_stored_position_is_exact(tiny):
    cfg, params = tiny
    rng = np.random.default_rng(1)
    for variant, prefix_len in (("pos0", 0), ("system", 6)):
        prompt = random_prompt(rng, cfg.vocab_size, prefix_len, [60], 5)
        blender = make_blender(cfg, params, prompt, variant=variant)
        full = blender.run(prompt, FULL_RECOMPUTE).logits[0]
        for config in (NONE, SelectionConfig(selector="random", recompute_ratio=0.3, row_bucket=16)):
            assert rel_err(blender.run(prompt, config).logits[-1], full) < RTOL, variant


def test_prefix_caching_is_exact(setup):
    _, prompt, blender, full = setup
    run = blender.run(prompt, SelectionConfig(selector="prefix", row_bucket=16), num_probes=1)
    assert rel_err(run.logits[-1], full.logits[0]) < RTOL
    rec = np.asarray(run.trace["recomputed"])
    assert not rec[:, : blender.exact_prefix_len(prompt)].any()  # the system prompt and chunk 0 are reused


def test_teacher_forcing_behind_the_prompt_matches_decode(setup):
    _, prompt, blender, full = setup
    forced = blender.run(prompt, ALL, feed=full.tokens[:-1])
    assert forced.logits.shape[0] == len(full.tokens)
    assert rel_err(forced.logits, full.logits) < 1e-4


def test_the_selection_plan_ignores_fed_tokens(setup):
    _, prompt, blender, full = setup
    config = SelectionConfig(recompute_ratio=0.2, check_layers=(1, 2), budgets=(2.0, 1.0), row_bucket=8)
    alone = blender.run(prompt, config, num_probes=1)
    fed = blender.run(prompt, config, feed=full.tokens[:3], num_probes=1)
    n = prompt.roles.num_tokens
    np.testing.assert_array_equal(np.asarray(fed.trace["recomputed"])[:, : prompt.roles.suffix_start],
                                  np.asarray(alone.trace["recomputed"])[:, : prompt.roles.suffix_start])
    assert rel_err(fed.logits[0], alone.logits[-1]) < 1e-4
    assert np.asarray(fed.trace["k"]).shape[1] == n + 3
    assert dataclasses.replace(config, selector="none") != config


@pytest.mark.parametrize("config", [NONE, ALL], ids=["none", "all"])
def test_blend_scope_match_attends_over_the_cached_fused_kv(setup, config):
    """A second blended request of the same scope matches the first one's blocks (num_cached > 0)
    and must attend over their fused KV from its own pages: same logits as the first."""
    _, prompt, blender, _ = setup
    store, engine = blender.store, blender.engine
    sampling = SamplingParams(max_new_tokens=1, ignore_eos=True, return_logits=True)
    outputs = []
    for _ in range(2):
        rid = submit_blended(store, prompt, config, sampling)
        while not engine.requests[rid].finished:
            engine.step()
        outputs.append(engine.output(rid))
    assert outputs[0].blend_report.num_cached == 0 and outputs[1].blend_report.num_cached > 0
    assert rel_err(outputs[1].prompt_logits[-1], outputs[0].prompt_logits[-1]) < RTOL


def test_an_untraced_run_reports_the_rows_each_layer_recomputed(setup):
    _, prompt, blender, _ = setup
    n = prompt.roles.num_tokens
    config = SelectionConfig(recompute_ratio=0.2, check_layers=(1, 2), budgets=(2.0, 1.0), row_bucket=8)
    traced, plain = blender.run(prompt, config, num_probes=4), blender.run(prompt, config)
    assert plain.trace is None and plain.report.recomputed.shape == (traced.trace["recomputed"].shape[0], n)
    np.testing.assert_array_equal(plain.report.recomputed, np.asarray(traced.trace["recomputed"])[:, :n])
    np.testing.assert_array_equal(plain.logits, traced.logits)
    assert plain.report.recomputed[:, prompt.roles.suffix_start:].all()  # the suffix, in every layer


def test_a_user_request_id_never_names_an_internal_request(tiny):
    """A user's request id equal to the chunk store's internal one keeps its own output."""
    cfg, params = tiny
    prompt = random_prompt(np.random.default_rng(3), cfg.vocab_size, 7, [40, 33], 9)
    blender = make_blender(cfg, params, prompt)
    engine, store = blender.engine, blender.store
    name = f"{store.salt}/store-{store.stats.puts}"
    rid = engine.submit(prompt.tokens[:20].tolist(), SamplingParams(max_new_tokens=2, ignore_eos=True), request_id=name)
    engine.run()
    before = engine.output(rid)
    store.put(prompt.tokens[40:60].tolist())
    assert engine.output(name).output == before.output and engine.output(name).finish_reason == "length"


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(selection=SelectionConfig(selector="cacheblend", check_layers=(1, 9), budgets=(2.0, 1.0))),
         r"chunks.selection.check_layers=\(1, 9\) must be < num_layers=4"),
        (dict(selection=SelectionConfig(selector="oracle"), scores=np.ones((1, 1))),
         r"chunks.scores has shape \(1, 1\); the oracle needs \[num_layers=4, >= 139 tokens\]"),
        (dict(selection=SelectionConfig(selector="oracle"), scores=np.full((4, 139), np.nan)),
         r"chunks.scores must be finite over the prompt's 139 tokens"),
    ],
)
def test_chunk_fields_that_cannot_run_are_refused_at_submit(setup, change, message):
    _, prompt, blender, _ = setup
    chunks = dataclasses.replace(ChunkReuse(blender.store, prompt.roles.chunk_spans), **change)
    with pytest.raises(ValueError, match=message):
        blender.engine.submit(prompt.tokens.tolist(), SamplingParams(max_new_tokens=1), chunks=chunks)
    assert not blender.engine.has_work
