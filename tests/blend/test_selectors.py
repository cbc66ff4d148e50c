"""The successors' selectors on a tiny random model, each checked against a host-side
reference of what it should pick: cacheblend_single (top-k key difference at layer 1, frozen),
epic (first tokens of each chunk), query_aware (attention from the question rows), fused,
query_impact (attention times deviation) and the learned scorer (features, training, the MLP
layout)."""

from __future__ import annotations

import numpy as np
import pytest

from experiments.blender import FULL_RECOMPUTE, make_blender
from kvjax.blend import scorer
from kvjax.blend.scoring import FEATURES, mlp_score, received_attention
from kvjax.blend.selection import SCHEDULE_SELECTORS, Roles, SelectionConfig, plan, row_capacity, target_count
from kvjax.config import ConfigError
from kvjax.testing.blend import random_prompt

RATIO = 0.2


@pytest.fixture(scope="module")
def setup(tiny):
    cfg, params = tiny
    prompt = random_prompt(np.random.default_rng(3), cfg.vocab_size, 6, [40, 35, 47], 11)
    blender = make_blender(cfg, params, prompt)
    n = prompt.roles.num_tokens
    exact = blender.run(prompt, SelectionConfig(selector="all", row_bucket=16), num_probes=1).trace
    reused = blender.run(prompt, SelectionConfig(selector="none", row_bucket=16), num_probes=1).trace
    kv = {
        name: (np.asarray(t["k"])[:, :n], np.asarray(t["v"])[:, :n])
        for name, t in (("exact", exact), ("reused", reused))
    }
    return cfg, prompt, blender, kv


def chosen(run, prompt) -> np.ndarray:
    """Chunk tokens recomputed in the last layer."""
    rec = np.asarray(run.trace["recomputed"])[-1, : prompt.roles.num_tokens]
    selectable, _ = prompt.roles.masks(prompt.roles.num_tokens)
    return np.flatnonzero(rec & selectable)


def test_cacheblend_single_is_top_k_key_difference_at_layer_1_frozen(setup):
    _, prompt, blender, kv = setup
    run = blender.run(
        prompt, SelectionConfig(selector="cacheblend_single", recompute_ratio=RATIO, row_bucket=8), num_probes=2
    )
    rec = np.asarray(run.trace["recomputed"])
    assert (rec[2:] == rec[2]).all()  # frozen after the check
    # layer 1 runs every token, so its fresh keys are the full-recompute keys
    k_dev = np.square(kv["exact"][0][1] - kv["reused"][0][1]).sum(axis=(-2, -1))
    selectable, _ = prompt.roles.masks(prompt.roles.num_tokens)
    ids = np.flatnonzero(selectable)
    expected = np.sort(ids[np.argsort(-k_dev[ids])[: target_count(prompt.roles, RATIO)]])
    np.testing.assert_array_equal(chosen(run, prompt), expected)
    assert rec[2, prompt.roles.suffix_start : prompt.roles.num_tokens].all()


def test_epic_recomputes_the_first_tokens_of_every_chunk(setup):
    _, prompt, blender, _ = setup
    run = blender.run(prompt, SelectionConfig(selector="epic", recompute_ratio=RATIO, row_bucket=8), num_probes=1)
    expected = np.concatenate([np.arange(s, s + int(np.ceil(RATIO * (e - s)))) for s, e in prompt.roles.chunk_spans])
    np.testing.assert_array_equal(chosen(run, prompt), expected)
    rec = np.asarray(run.trace["recomputed"])
    assert (rec == rec[0]).all()


def test_received_attention_matches_a_numpy_reference():
    rng = np.random.default_rng(0)
    m, t, kh, g, d = 12, 20, 2, 3, 8
    q = rng.normal(size=(m, kh * g, d)).astype(np.float32)
    keys = rng.normal(size=(t, kh, d)).astype(np.float32)
    key_pos = np.where(np.arange(t) < 18, np.arange(t), -1).astype(np.int32)
    query_pos = np.full(m, -1, np.int32)
    query_pos[[2, 5, 9]] = [10, 14, 17]
    got = np.asarray(received_attention(q, query_pos, keys, key_pos, 0.3, query_rows=2))
    want = np.zeros(t)
    for row in (5, 9):  # the last two query rows by position
        for h in range(kh * g):
            logits = 0.3 * keys[:, h // g] @ q[row, h]
            mask = (key_pos >= 0) & (key_pos <= query_pos[row])
            p = np.exp(logits - logits[mask].max()) * mask
            want += p / p.sum()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert got.sum() == pytest.approx(2 * kh * g, rel=1e-5)


def test_trace_features_hold_the_layer_1_deviations(setup):
    _, prompt, blender, kv = setup
    run = blender.run(
        prompt, SelectionConfig(selector="query_aware", recompute_ratio=RATIO, row_bucket=8), num_probes=1
    )
    feats = np.asarray(run.trace["features"])
    assert feats.shape[1] == len(FEATURES)
    selectable, _ = prompt.roles.masks(prompt.roles.num_tokens)
    ids = np.flatnonzero(selectable)
    for col, arrays in ((0, 0), (1, 1)):
        dev = np.square(kv["exact"][arrays][1] - kv["reused"][arrays][1]).sum(axis=(-2, -1))[ids]
        np.testing.assert_allclose(feats[ids, col], np.log(dev / dev.mean() + 1e-6), rtol=1e-3, atol=1e-3)
    # attention is relative to its mean over the candidates; positions are positions
    np.testing.assert_allclose(np.exp(feats[ids, 2]).mean(), 1.0, rtol=1e-3)
    np.testing.assert_allclose(feats[ids, 4], ids / prompt.roles.num_tokens, rtol=1e-6)
    # the query-aware selection is the top of the attention feature
    expected = np.sort(ids[np.argsort(-feats[ids, 2])[: target_count(prompt.roles, RATIO)]])
    one_check = blender.run(prompt, SelectionConfig(selector="query_aware", recompute_ratio=RATIO, check_layers=(1,),
                                                    budgets=(1.0,), row_bucket=8), num_probes=1)
    np.testing.assert_array_equal(chosen(one_check, prompt), expected)


def test_query_impact_ranks_by_attention_times_the_deviation_norm(setup):
    """One check at layer 1: the rows kept are the top of (relative attention) x sqrt(mean of the
    relative K and V deviations), not of their sum: a row no question row attends to is never
    worth more than one it does, however stale."""
    _, prompt, blender, _ = setup
    feats = np.asarray(
        blender.run(prompt, SelectionConfig(selector="query_aware", recompute_ratio=RATIO, row_bucket=8),
                    num_probes=1).trace["features"]
    )
    selectable, _ = prompt.roles.masks(prompt.roles.num_tokens)
    ids = np.flatnonzero(selectable)
    impact = np.exp(feats[ids, 2]) * np.sqrt((np.exp(feats[ids, 0]) + np.exp(feats[ids, 1])) / 2)
    fused = np.exp(feats[ids, 2]) + (np.exp(feats[ids, 0]) + np.exp(feats[ids, 1])) / 2
    count = target_count(prompt.roles, RATIO)
    expected = np.sort(ids[np.argsort(-impact)[:count]])
    assert not np.array_equal(expected, np.sort(ids[np.argsort(-fused)[:count]]))  # the product is another rule
    run = blender.run(prompt, SelectionConfig(selector="query_impact", recompute_ratio=RATIO, check_layers=(1,),
                                              budgets=(1.0,), row_bucket=8), num_probes=1)
    np.testing.assert_array_equal(chosen(run, prompt), expected)


@pytest.mark.parametrize("selector", ["query_aware", "query_aware_fused", "query_impact", "cacheblend_single"])
def test_new_schedules_at_ratio_one_equal_full_recompute(setup, selector):
    _, prompt, blender, _ = setup
    full = blender.run(prompt, FULL_RECOMPUTE).logits[0]
    got = blender.run(
        prompt, SelectionConfig(selector=selector, recompute_ratio=1.0, budgets=(1.0, 1.0, 1.0), row_bucket=16)
    ).logits[-1]
    assert np.max(np.abs(got - full)) / np.max(np.abs(full)) < 1e-5


def test_learned_selector_runs_the_mlp_on_the_features(setup):
    _, prompt, blender, _ = setup
    h = 3
    rng = np.random.default_rng(1)
    weights = tuple(float(w) for w in rng.normal(size=h * (len(FEATURES) + 2) + 1))
    config = SelectionConfig(selector="learned", recompute_ratio=RATIO, scorer=weights, row_bucket=8)
    run = blender.run(prompt, config, num_probes=1)
    selectable, _ = prompt.roles.masks(prompt.roles.num_tokens)
    ids = np.flatnonzero(selectable)
    scores = np.asarray(mlp_score(weights, np.asarray(run.trace["features"])[ids]))
    expected = np.sort(ids[np.argsort(-scores)[: target_count(prompt.roles, RATIO)]])
    np.testing.assert_array_equal(chosen(run, prompt), expected)


def test_train_scorer_learns_a_separable_rule_and_folds_the_standardisation():
    rng = np.random.default_rng(0)
    n = 600
    x = rng.normal(size=(n, len(FEATURES))).astype(np.float32) * [1.0, 5.0, 0.2, 3.0, 1.0] + [0.0, 2.0, -1.0, 4.0, 0.5]
    signal = x[:, 2] / 0.2 + 0.5 * x[:, 0]
    labels = signal > np.quantile(signal, 0.85)
    data = scorer.TrainingSet(x.astype(np.float32), labels, np.repeat(np.arange(6), n // 6).astype(np.int32))
    weights = scorer.train_scorer(data, hidden=4, steps=300, seed=0)
    scores = np.asarray(mlp_score(weights, data.features))
    assert scorer.top_k_recall(data, scores) > 0.85
    assert scorer.top_k_recall(data, rng.normal(size=n)) < 0.4


def test_oracle_labels_take_the_top_ratio(setup):
    _, prompt, _, kv = setup
    dev = np.square(kv["exact"][0] - kv["reused"][0]).sum(axis=(-2, -1))
    labels = scorer.oracle_labels(prompt.roles, dev, RATIO)
    assert labels.sum() == target_count(prompt.roles, RATIO)


def test_selection_config_checks_the_scorer():
    with pytest.raises(ConfigError, match="selector 'learned' needs"):
        SelectionConfig(selector="learned")
    with pytest.raises(ConfigError, match="only selector 'learned'"):
        SelectionConfig(selector="cacheblend", scorer=(0.0,) * 15)
    with pytest.raises(ConfigError, match="query_rows"):
        SelectionConfig(query_rows=0)
    with pytest.raises(ConfigError, match="selector="):
        SelectionConfig(selector="first_k")
    assert set(SCHEDULE_SELECTORS) == {
        "cacheblend", "cacheblend_single", "query_aware", "query_aware_fused", "query_impact", "learned",
    }


def test_schedule_capacities_follow_one_unit_and_hold_every_kept_row():
    """Check capacities are row_capacity(budget x unit), the unit the rows kept at budget 1:
    prompts whose counts differ but round to one unit compile one check phase."""
    config = SelectionConfig(recompute_ratio=0.15, check_layers=(1, 2, 3), budgets=(2.0, 1.5, 1.0), row_bucket=16)
    shapes = set()
    for suffix in (30, 35, 40):  # the suffix (forced rows) moves every count (234 to 244 at layer 1), not the unit
        roles = Roles(num_tokens=700 + suffix, prefix_len=20, chunk_spans=((20, 700),), suffix_start=700)
        sel = plan(roles, config, padded=1024, num_layers=30)
        unit = row_capacity(suffix + target_count(roles, 0.15), 16)
        assert unit == 160
        assert [cap for _, cap in sel.checks] == [row_capacity(320, 16), row_capacity(240, 16), 160]
        assert all(cap >= count for (_, cap), count in zip(sel.checks, sel.counts))
        shapes.add(sel.checks)
    assert len(shapes) == 1
