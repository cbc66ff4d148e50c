"""The CacheBlend experiment's evaluation logic without a model: chunk splitting, answer
extraction, the gold-answer likelihood, the ratio a selector needs for a share of full
reuse's loss or a relative drop, significance with a tolerance, bootstrap statistics, and
timing that never includes a compilation."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import types

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from configs import cacheblend_rag
from experiments import cacheblend_eval as ev
from experiments import cacheblend_report, report, statistics
from experiments.timing import compilations_during
from experiments.workloads.rag import RagExample
from kvjax import metrics
from kvjax.testing.byte_tokenizer import byte_tokenizer


def example(chunk_lengths: tuple[int, ...], suffix: int = 20, facts: tuple[int, ...] = (1,)) -> RagExample:
    chunks = tuple(tuple(range(10 * i, 10 * i + n)) for i, n in enumerate(chunk_lengths))
    return RagExample(task="squad_multidoc", prefix=(1, 2, 3), chunks=chunks, suffix=tuple(range(suffix)), answer="a",
                      fact_chunks=facts, question="q", gold_answers=("a",))


def test_long_chunks_are_split_into_near_equal_pieces_keeping_every_token():
    ex = example((100, 250, 30), facts=(1,))
    split, cut = ev.split_long_chunks(ex, 100)
    assert cut == 1
    assert [len(c) for c in split.chunks] == [100, 83, 84, 83, 30]
    assert sum(split.chunks, ()) == sum(ex.chunks, ())
    assert split.fact_chunks == (1, 2, 3)  # the gold paragraph's pieces
    same, none = ev.split_long_chunks(ex, 250)
    assert none == 0 and same == ex


def test_answer_log_likelihood_is_the_mean_log_probability_of_each_answer_token():
    logits = np.log(np.asarray([[0.5, 0.25, 0.25], [0.1, 0.8, 0.1]]))
    assert metrics.answer_log_likelihood(logits, [0, 1]) == pytest.approx((np.log(0.5) + np.log(0.8)) / 2)
    assert metrics.answer_log_likelihood(logits + 7.0, [2, 0]) == pytest.approx((np.log(0.25) + np.log(0.1)) / 2)
    with pytest.raises(ValueError, match="one row per answer token"):
        metrics.answer_log_likelihood(logits, [0])


def test_answers_skip_leading_newlines_and_stop_at_the_next_stop_token():
    tok = byte_tokenizer(chat=False)
    newline = tok.encode("\n", add_bos=False)[0]
    ids = [newline, newline, *tok.encode(" Paris", add_bos=False), newline, *tok.encode("junk", add_bos=False)]
    text, length = ev.answer_text(tok, ids, (newline,))
    assert text == "Paris" and length == 9  # two newlines, " Paris", the stop
    assert ev.answer_text(tok, [newline] * 3, (newline,)) == ("", 3)


def test_ratio_at_goal_interpolates_between_sweep_points():
    ratios = [0.05, 0.15, 0.3, 0.5]
    gold = np.asarray([[0.2, 0.2], [0.5, 0.5], [0.8, 0.8], [1.0, 1.0]])
    reuse, full = np.zeros(2), np.ones(2)
    assert ev.ratio_at_goal(ratios, gold, reuse, full, 0.99) == pytest.approx(0.3 + 0.19 / 0.2 * 0.2)
    assert ev.ratio_at_goal(ratios, gold, np.ones(2), full, 0.99) == 0.0  # full reuse already reaches it
    never = np.full((4, 2), 0.5)
    assert ev.ratio_at_goal(ratios, never, reuse, full, 0.99) == pytest.approx(0.5 + 0.49 / 0.5 * 0.5)
    assert np.isnan(ev.ratio_at_goal(ratios, never, reuse, full, 1.5))  # not even full recompute reaches it
    batched = ev.ratio_at_goal(ratios, np.stack([gold, never]), np.stack([reuse, reuse]), np.stack([full, full]),
                               np.asarray([0.99, 0.99]))
    np.testing.assert_allclose(batched, [0.49, 0.99])


def test_goals_are_a_share_of_the_loss_or_a_relative_drop():
    assert ev.goal("gold", 0.2, 0.6, recovered=0.95) == pytest.approx(0.58)
    assert ev.goal("gold", 0.2, 0.6) == pytest.approx(0.594)
    # gold_ll (nats per token, <= 0): 1% less per-token probability than full recompute's
    assert np.exp(ev.goal(ev.LIKELIHOOD, -2.0, -1.0)) == pytest.approx(0.99 * np.exp(-1.0))
    np.testing.assert_allclose(
        ev.goal(ev.LIKELIHOOD, np.asarray([-2.0, -3.0]), np.asarray([-1.0, -1.0]), recovered=0.5), [-1.5, -2.0]
    )


def test_budget_rows_read_each_share_and_the_relative_drop_on_the_sweep():
    prompts, ratios = 6, (0.1, 0.3)
    full = [{"gold_ll": -1.0, "gold": 1.0, "ttft_s": 1.0} for _ in range(prompts)]
    reuse = [{"gold_ll": -2.0, "gold": 0.0, "ttft_s": 0.2} for _ in range(prompts)]
    sweep = {("cacheblend", r): [{"gold_ll": -2.0 + 2 * r, "gold": 2 * r, "ttft_s": 0.2 + r} for _ in range(prompts)]
             for r in ratios}
    rows = ev.budget_rows(sweep, {"full_recompute": full, "full_reuse": reuse}, 200, 0)
    assert [(r["policy"], r["metric"]) for r in rows] == [("cacheblend", "gold_ll"), ("cacheblend", "gold")]
    for row in rows:  # the curve: 0 -> 0, 0.1 -> 0.2, 0.3 -> 0.6, 1 -> 1 (as a share of the loss)
        assert row["ratio_95%"] == pytest.approx(0.3 + 0.35 / 0.4 * 0.7)
        assert row["ratio_95%_lo"] == pytest.approx(row["ratio_95%"])  # identical prompts: no spread
        ttft = np.interp(row["ratio_95%"], [0, 0.1, 0.3, 1], [0.2, 0.3, 0.5, 1.0])
        assert row["speedup_95%"] == pytest.approx(1.0 / ttft)
    gold_ll, gold = rows
    assert gold["ratio_1% drop"] == pytest.approx(0.3 + 0.39 / 0.4 * 0.7)
    share = (np.log(0.99) + 1.0) / 1.0  # gold_ll goal -1 + log(0.99), reached on the last segment
    assert gold_ll["ratio_1% drop"] == pytest.approx(0.3 + (share - 0.6) / 0.4 * 0.7)


def test_budget_differences_pair_our_selectors_with_the_published_ones():
    """query_impact reaches each quality at 0.6 x CacheBlend's ratio on every prompt, plus noise
    the prompts share: the paired difference is ours minus theirs, its interval from the same
    resamples, and only (ours, published) pairs are listed (random is a control)."""
    rng = np.random.default_rng(0)
    prompts, ratios = 40, (0.1, 0.3, 0.5)
    noise = rng.normal(scale=0.3, size=prompts)
    full = [{"gold_ll": -1.0 + n, "ttft_s": 1.0} for n in noise]
    reuse = [{"gold_ll": -2.0 + n, "ttft_s": 0.2} for n in noise]

    def curve(speed: float) -> list[list[dict]]:  # share of the loss recovered: min(1, r / speed)
        return [[{"gold_ll": -2.0 + min(1.0, r / speed) + n, "ttft_s": 0.5} for n in noise] for r in ratios]

    sweep = {}
    for name, speed in (("cacheblend", 0.5), ("query_impact", 0.3), ("random", 0.9)):
        sweep.update({(name, r): results for r, results in zip(ratios, curve(speed))})
    per_policy = {"full_recompute": full, "full_reuse": reuse}
    rows = ev.budget_differences(sweep, per_policy, 300, 0)
    assert [(r["policy"], r["minus"]) for r in rows] == [("query_impact", "cacheblend")]
    (row,) = rows
    budgets = {r["policy"]: r for r in ev.budget_rows(sweep, per_policy, 300, 0, keys=("gold_ll",))}
    for label in ("95%", "99%"):
        want = budgets["query_impact"][f"ratio_{label}"] - budgets["cacheblend"][f"ratio_{label}"]
        assert row[f"difference_{label}"] == pytest.approx(want)
        assert row[f"difference_{label}_lo"] <= row[f"difference_{label}"] <= row[f"difference_{label}_hi"] < 0
    assert row["difference_95%"] == pytest.approx(0.95 * 0.3 - 0.95 * 0.5, abs=0.02)


def _saved_run(folder: pathlib.Path, config: ml_collections.ConfigDict, speeds: dict[str, float],
               noise: np.ndarray) -> None:
    """A run folder of ``config`` whose selectors recover min(1, r / speed) of full reuse's loss."""
    folder.mkdir()
    report.write_config(folder, config)
    lines = []
    for i, n in enumerate(noise):
        runs = {"full_recompute": {"gold_ll": -1.0 + n, "ttft_s": 1.0},
                "full_reuse": {"gold_ll": -2.0 + n, "ttft_s": 0.2}}
        runs.update({f"{name}@{r:g}": {"gold_ll": -2.0 + min(1.0, r / speed) + n, "ttft_s": 0.2 + 0.8 * r}
                     for name, speed in speeds.items() for r in config.sweep.ratios})
        lines.append(json.dumps({"index": i, "num_tokens": 500 + i, "reference_answer": f"a{i}", "runs": runs}) + "\n")
    (folder / cacheblend_report.RECORDS).write_text("".join(lines))


def test_a_selector_run_later_is_paired_with_the_published_ones_on_the_same_prompts(tmp_path):
    """query_impact, swept in a folder of its own, reaches each quality at 0.6 x CacheBlend's
    ratio (swept in the base run, on 40 prompts; the new run scored the first 30): the pairing
    uses the 30 shared prompts, base's goals, and refuses runs of another config or prompt."""
    noise = np.random.default_rng(0).normal(scale=0.3, size=40)
    config = cacheblend_rag.get_config("paper")
    config.sweep.ratios = (0.1, 0.3, 0.5)
    config.eval.bootstrap = 300
    config.sweep.policies = ("cacheblend", "random")
    _saved_run(tmp_path / "base", config, {"cacheblend": 0.5, "random": 0.9}, noise)
    config.sweep.policies = ("query_impact",)
    config.policies = ("full_recompute", "full_reuse", "query_impact")
    _saved_run(tmp_path / "new", config, {"query_impact": 0.3}, noise[:30])
    out = cacheblend_report.write_against(tmp_path / "new", tmp_path / "base")
    assert out["prompts"] == 30 and out["likelihood_gap"] == 0.0
    (row,) = out["budget_differences"]
    assert (row["policy"], row["minus"], row["prompts"]) == ("query_impact", "cacheblend", 30)
    assert row["difference_95%"] == pytest.approx(0.95 * 0.3 - 0.95 * 0.5, abs=0.02)
    assert row["difference_95%_lo"] <= row["difference_95%"] <= row["difference_95%_hi"] < 0
    budgets = {(b["policy"], b["metric"]): b for b in out["budget"]}
    assert set(budgets) == {("query_impact", "gold_ll"), ("cacheblend", "gold_ll")}  # random is no published selector
    speedup = budgets[("query_impact", "gold_ll")]["speedup_95%"]
    assert speedup == pytest.approx(1.0 / (0.2 + 0.8 * 0.95 * 0.3), rel=0.02)
    summary = (tmp_path / "new" / "against-base.md").read_text()
    assert "on the 30 prompts both scored (indices 0-29)" in summary
    assert (tmp_path / "new" / "against-base-differences.csv").is_file()

    records = (tmp_path / "new" / cacheblend_report.RECORDS).read_text().replace('"num_tokens": 503', '"num_tokens": 9')
    (tmp_path / "new" / cacheblend_report.RECORDS).write_text(records)
    with pytest.raises(ValueError, match=r"prompt 3 differs: 9 tokens answered 'a3' in .*, 503 answered 'a3' in"):
        cacheblend_report.write_against(tmp_path / "new", tmp_path / "base")
    config.seed = 1
    report.write_config(tmp_path / "new", config)
    with pytest.raises(ValueError, match=r"ran other configs \(fields \['seed'\] differ\)"):
        cacheblend_report.write_against(tmp_path / "new", tmp_path / "base")


def test_significance_needs_the_interval_and_a_difference_above_the_tolerance():
    per_policy = {
        "full_recompute": [{"kl": 0.0, "gold": g} for g in (1.0, 0.0, 1.0, 1.0)],
        "prefix_caching": [{"kl": 1e-11 * (1 + i), "gold": g} for i, g in enumerate((1.0, 0.0, 1.0, 1.0))],
        "full_reuse": [{"kl": 0.5 + 0.1 * i, "gold": 0.0} for i in range(4)],
    }
    rows = {(r["policy"], r["metric"]): r for r in ev.paired_rows(per_policy, "full_recompute", ("kl", "gold"), 300, 0)}
    assert rows[("prefix_caching", "kl")]["lo"] > 0 and not rows[("prefix_caching", "kl")]["significant"]
    assert rows[("full_reuse", "kl")]["significant"] and rows[("full_reuse", "kl")]["tolerance"] == ev.TOLERANCE["kl"]
    assert not rows[("prefix_caching", "gold")]["significant"]


def test_bootstrap_statistic_of_a_ratio_of_means():
    a, b = np.asarray([1.0, 2.0, 3.0, 4.0]), np.full(4, 2.0)
    value, lo, hi = statistics.bootstrap_statistic((a, b), lambda x, y: x.mean(-1) / y.mean(-1), num=500)
    assert value == pytest.approx(1.25) and lo < value < hi
    assert statistics.bootstrap_statistic((a, a), lambda x, y: x.mean(-1) / y.mean(-1), num=100) == (1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="same prompts"):
        statistics.bootstrap_statistic((a, b[:3]), lambda x, y: x.mean(-1))


def test_recovered_share_has_an_interval_and_speedup_is_a_ratio_of_total_ttft():
    per_policy = {
        "full_recompute": [{"gold": g, "ttft_s": 1.0} for g in (1.0, 1.0, 0.0, 1.0)],
        "full_reuse": [{"gold": g, "ttft_s": 0.2} for g in (0.0, 0.0, 0.0, 1.0)],
        "cacheblend": [{"gold": g, "ttft_s": t} for g, t in ((1.0, 0.2), (0.0, 0.6), (0.0, 0.2), (1.0, 0.2))],
    }
    headline = ev.recovery(per_policy, 500, 0, "gold")
    share, lo, hi = headline["recovered_share"]["cacheblend"]
    assert share == pytest.approx(0.5) and lo <= share <= hi
    speed = ev.speed_row(per_policy["cacheblend"], per_policy["full_recompute"], 500, 0)
    assert speed["speedup"] == pytest.approx(4.0 / 1.2) and speed["time_fraction"] == pytest.approx(0.3)
    rows = ev.paired_rows(per_policy, "full_reuse", ("gold",), 500, 0)
    assert {r["policy"] for r in rows} == {"full_recompute", "cacheblend"} and all("significant" in r for r in rows)


def test_compilations_are_counted_and_named():
    def triple_plus_one(x):
        return x * 3 + 1

    f = jax.jit(triple_plus_one)
    _, first = compilations_during(lambda: f(jnp.ones(5)).block_until_ready())
    _, again = compilations_during(lambda: f(jnp.ones(5)).block_until_ready())
    assert first.programs >= 1 and first.seconds > 0
    assert len(first.functions) == first.programs and "triple_plus_one" in first.functions
    assert again.programs == 0 and again.functions == ()


class _CompilingBlender:
    """Stands in for a Blender whose every run compiles a new program (shapes that never repeat)."""

    def __init__(self, compiles_left: int) -> None:
        self.compiles_left, self.calls = compiles_left, 0

    def run(self, prompt, pol, **_):
        self.calls += 1
        if self.compiles_left:
            self.compiles_left -= 1
            jax.jit(lambda x: x + self.calls)(jnp.ones(self.calls + 7)).block_until_ready()
        return types.SimpleNamespace(ttft_s=0.5)


def test_timed_runs_again_until_nothing_compiles_and_refuses_shapes_that_never_repeat():
    log = ev.TimingLog()
    setup = types.SimpleNamespace(blender=_CompilingBlender(compiles_left=2))
    ev.timed(setup, None, "full_recompute", log)
    assert setup.blender.calls == 3 and dataclasses.astuple(log) == (1, 2, 1.0, 0)
    never = types.SimpleNamespace(blender=_CompilingBlender(compiles_left=10**6))
    with pytest.raises(RuntimeError, match=r"compiled \d+ programs in each of 3 runs"):
        ev.timed(never, None, "full_recompute", log)
    assert log.compiles_in_timed >= 1


@pytest.mark.real_model
def test_reference_kv_read_from_the_full_recompute_pages_equals_the_all_rows_blended_path():
    from configs import cacheblend_rag

    config = cacheblend_rag.get_config("tiny")
    config.workload.max_tokens, config.workload.num_distractors = 1024, 3
    config.runtime.token_bucket, config.policies, config.sweep.policies = 1024, ("full_recompute", "full_reuse"), ()
    setup = ev.build(config)
    example_ = max(setup.examples, key=lambda e: len(e.prefix) + sum(map(len, e.chunks)) + len(e.suffix))
    prompt = setup.prompts[setup.examples.index(example_)]
    n = prompt.roles.num_tokens
    assert n >= 512
    for chunk in prompt.chunks:
        setup.store.put(chunk)
    sel = ev.selection_config(config, 0.15)
    log = ev.TimingLog()
    traced = ev.reference(setup, prompt, sel, config, log, detailed=True)
    paged = ev.reference(setup, prompt, sel, config, log, detailed=False)
    covered = n // config.runtime.tokens_per_block * config.runtime.tokens_per_block
    assert covered >= prompt.roles.suffix_start  # every chunk token lies in a full block
    scale = np.abs(traced.k).max()
    assert np.abs(paged.k[:, :covered] - traced.k[:, :covered]).max() <= 1e-4 * scale
    assert np.abs(paged.v[:, :covered] - traced.v[:, :covered]).max() <= 1e-4 * np.abs(traced.v).max()
    selectable, _ = prompt.roles.masks(n)
    np.testing.assert_allclose(paged.true_dev[:, selectable], traced.true_dev[:, selectable], rtol=1e-3, atol=1e-4)
    assert (paged.true_dev[:, covered:] == 0).all()  # the suffix's tail: the reused run's KV
    assert np.isnan(paged.last_logit_error) and traced.last_logit_error <= 1e-3
    assert paged.answer == traced.answer and (paged.continuation == traced.continuation).all()
    setup.engine.manager.clear_cache()
    with pytest.raises(RuntimeError, match="were evicted"):
        setup.blender.cached_kv(paged.run)
