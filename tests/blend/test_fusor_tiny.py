"""Fusor identities on a tiny random model: r=1 is full recompute, r=0 is full KV reuse,
a chunk at its stored position is exact, and every tier loads the same KV."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.blend import selection
from kvjax.testing.blend import make_blender, random_prompt

RTOL = 1e-5


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.fixture(scope="module")
def setup(tiny):
    cfg, params = tiny
    prompt = random_prompt(np.random.default_rng(0), cfg.vocab_size, 7, [40, 33, 50], 9)
    blender = make_blender(cfg, params, prompt)
    full = np.asarray(blender.full_recompute(prompt))
    full_kv = [np.asarray(a) for a in blender.kv(prompt.roles.num_tokens)]
    return cfg, params, prompt, blender, full, full_kv


def test_select_all_equals_full_recompute(setup):
    cfg, _, prompt, blender, full, full_kv = setup
    logits, _ = blender.blend(prompt, selection.select_all(prompt.roles, 64))
    assert rel_err(logits, full) < RTOL
    k, v = blender.kv(prompt.roles.num_tokens)
    assert rel_err(k, full_kv[0]) < RTOL and rel_err(v, full_kv[1]) < RTOL


def test_cacheblend_ratio_one_equals_full_recompute(setup):
    cfg, _, prompt, blender, full, _ = setup
    config = selection.SelectionConfig(recompute_ratio=1.0, check_layers=(1, 2), budgets=(1.0, 1.0), row_bucket=16)
    logits, _ = blender.blend(prompt, selection.select_cacheblend(prompt.roles, config, blender.padded(prompt.roles.num_tokens), cfg.num_layers))
    assert rel_err(logits, full) < RTOL


def test_ratio_zero_equals_full_kv_reuse(setup):
    cfg, _, prompt, blender, full, _ = setup
    reuse, _ = blender.blend(prompt, selection.select_none(prompt.roles, 64))
    config = selection.SelectionConfig(recompute_ratio=0.0, check_layers=(1, 2), budgets=(1.0, 1.0), row_bucket=16)
    blend0, _ = blender.blend(prompt, selection.select_cacheblend(prompt.roles, config, blender.padded(prompt.roles.num_tokens), cfg.num_layers))
    assert rel_err(blend0, reuse) < RTOL
    assert rel_err(reuse, full) > 1e-3  # the chunks really miss cross-attention


def test_gradual_filtering_keeps_suffix_and_target_count(setup):
    cfg, _, prompt, blender, _, _ = setup
    config = selection.SelectionConfig(recompute_ratio=0.2, check_layers=(1, 2), budgets=(2.0, 1.0), row_bucket=8)
    sel = selection.select_cacheblend(prompt.roles, config, blender.padded(prompt.roles.num_tokens), cfg.num_layers)
    _, trace = blender.blend(prompt, sel, num_probes=4)
    rec = np.asarray(trace["recomputed"])  # [L, T]
    roles = prompt.roles
    target = selection.target_count(roles, 0.2)
    assert rec[0, : roles.num_tokens].all()
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
        full = np.asarray(blender.full_recompute(prompt))
        for sel in (selection.select_none(prompt.roles, 16), selection.select_random(prompt.roles, 0.3, rng, 16)):
            logits, _ = blender.blend(prompt, sel)
            assert rel_err(logits, full) < RTOL, variant


def test_prefix_caching_is_exact(setup):
    _, _, prompt, blender, full, _ = setup
    assert rel_err(blender.prefix_caching(prompt), full) < RTOL


def test_tiers_load_identical_kv(tiny, tmp_path):
    cfg, params = tiny
    prompt = random_prompt(np.random.default_rng(2), cfg.vocab_size, 5, [20, 30], 4)
    loaded = []
    for tier in ("device", "host", "disk"):
        blender = make_blender(cfg, params, prompt, tier=tier, tmp_path=tmp_path / tier)
        loaded.append([np.asarray(a) for a in blender.reused_kv(prompt, 64)])
    for other in loaded[1:]:
        np.testing.assert_array_equal(other[0], loaded[0][0])
        np.testing.assert_array_equal(other[1], loaded[0][1])


def test_teacher_forcing_after_exact_blend_matches_decode(setup):
    _, _, prompt, blender, full, _ = setup
    n = prompt.roles.num_tokens
    blender.full_recompute(prompt)
    cont, ref = blender.decode(int(np.argmax(full)), n, 6)
    blender.blend(prompt, selection.select_all(prompt.roles, 64))
    forced = np.asarray(blender.teacher_force(n, np.asarray([int(np.argmax(full)), *cont])))
    assert rel_err(forced, ref[:6]) < RTOL


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_pipelined_blend_equals_blend(tiny, tmp_path, tier):
    from kvjax.blend.pipeline import pipelined_blend

    cfg, params = tiny
    prompt = random_prompt(np.random.default_rng(5), cfg.vocab_size, 6, [30, 25, 40], 5)
    blender = make_blender(cfg, params, prompt, tier=tier, tmp_path=tmp_path)
    config = selection.SelectionConfig(recompute_ratio=0.25, check_layers=(1, 2), budgets=(2.0, 1.0), row_bucket=8)
    sel = selection.select_cacheblend(prompt.roles, config, blender.padded(prompt.roles.num_tokens), cfg.num_layers)
    ref, _ = blender.blend(prompt, sel)
    ref_kv = [np.asarray(a) for a in blender.kv(prompt.roles.num_tokens)]
    logits, report = pipelined_blend(blender, prompt, sel)
    assert rel_err(logits, ref) < RTOL
    kv = blender.kv(prompt.roles.num_tokens)
    assert rel_err(kv[0], ref_kv[0]) < RTOL and rel_err(kv[1], ref_kv[1]) < RTOL
    assert 0.0 <= report.overlap <= 1.0 and report.load_total > 0 and report.compute_total > 0
