"""The CacheBlend experiment's real-data path: train/eval prompts of the learned selector are
disjoint, and configs/cacheblend_rag.py:tiny runs end to end on SmolLM2 (gold SQuAD scores,
every policy, the learned scorer, the ratio sweep with intervals, the figures)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from configs import cacheblend_rag
from experiments import cacheblend, cacheblend_eval
from kvjax.testing.byte_tokenizer import byte_tokenizer

pytestmark = pytest.mark.slow  # an end-to-end run or subprocesses: the full suite, not the fast loop


@pytest.mark.parametrize("name", ["squad_multidoc", "synthetic"])
def test_training_and_evaluation_prompts_are_disjoint(name):
    config = cacheblend_rag.get_config("tiny")
    config.workload.name = name
    config.workload.max_tokens = 4096
    config.workload.chunk_tokens = (512, 512)  # the byte tokenizer: one token per byte
    config.workload.num_chunks = (3, 3)
    tok = byte_tokenizer(chat=True)
    evaluation = cacheblend_eval.workload_examples(config, tok, split="eval", num=4)
    train = cacheblend_eval.workload_examples(config, tok, split="train", num=4)
    cacheblend_eval.check_disjoint(train, evaluation)
    assert not {c for e in train for c in e.chunks} & {c for e in evaluation for c in e.chunks}
    assert not {e.question for e in train} & {e.question for e in evaluation}
    with pytest.raises(ValueError, match="question and answers shared: True"):
        cacheblend_eval.check_disjoint([evaluation[2]], evaluation)
    with pytest.raises(ValueError, match="training prompt 0 shares"):
        cacheblend_eval.check_disjoint([dataclasses.replace(train[0], chunks=(evaluation[1].chunks[0],))], evaluation)


def test_unknown_preset_and_workload_are_errors():
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        cacheblend_rag.get_config("huge")
    config = cacheblend_rag.get_config("tiny")
    config.workload.name = "trivia"
    with pytest.raises(ValueError, match="workload.name='trivia' must be one of"):
        cacheblend_eval.workload_examples(config, byte_tokenizer(chat=True), split="eval", num=1)


@pytest.mark.real_model
def test_tiny_preset_runs_every_policy_on_real_squad_and_resumes(tmp_path):
    config = cacheblend_rag.get_config("tiny")
    results = cacheblend.run(config, tmp_path)
    rows = {r["policy"]: r for r in results["policies"]}
    assert set(rows) == set(config.policies)
    full = rows["full_recompute"]
    assert full["kl"] == pytest.approx(0.0, abs=1e-6) and full["top1"] == 1.0 and full["flop_fraction"] == 1.0
    assert full["speedup"] == 1.0
    for row in rows.values():
        assert {"f1", "em", "gold"} <= set(row) and row["gold"] == row["f1"]
        assert row["gold_lo"] <= row["gold"] <= row["gold_hi"]
        assert row["speedup_lo"] <= row["speedup"] <= row["speedup_hi"]
    assert rows["full_reuse"]["kl"] > rows["cacheblend"]["kl"] > 0
    assert rows["cacheblend"]["flop_fraction"] < 0.5
    assert rows["cacheblend"]["ttft_mean_s"] < full["ttft_mean_s"]
    timing = results["timing"]
    assert timing["compiles_in_timed"] == 0 and timing["timed_runs"] >= 2 * len(config.policies)
    paired = {(r["policy"], r["metric"], r["baseline"]) for r in results["paired"]}
    for name in config.policies:
        for metric in ("gold", "f1", "em"):
            assert name == "full_recompute" or (name, metric, "full_recompute") in paired
            assert name == "full_reuse" or (name, metric, "full_reuse") in paired
    assert set(results["headline"]["recovered_share"]) == {"cacheblend", "learned"}
    learned = results["learned"]
    assert learned["train_prompts"] == config.learned.train_prompts
    assert set(learned["train_recall"]) >= {"learned", "kv_deviation", "attention"}
    assert all(0.0 <= v <= 1.0 for v in learned["train_recall"].values())
    sweep = {(r["policy"], r["ratio"]): r for r in results["sweep"]}
    assert set(sweep) == {("learned", r) for r in config.sweep.ratios}
    assert sweep[("learned", 0.5)]["kl"] < sweep[("learned", 0.15)]["kl"]
    [budget] = results["budget"]
    assert budget["policy"] == "learned" and 0.0 <= budget["lo"] <= budget["ratio_at_99"] <= budget["hi"] <= 1.0
    for name in ("policy_quality", "gold_vs_ratio", "kl_vs_ratio", "kv_deviation_cdf", "pareto_ttft", "pareto_flops"):
        assert (tmp_path / f"{name}.png").stat().st_size > 0
    summary = (tmp_path / "summary.md").read_text()
    assert "## Headline" in summary and "full reuse minus full recompute, gold" in summary
    assert "not significantly different" in summary and "prompts per hour" in summary
    assert np.isfinite(results["headline"]["reuse_minus_full"])
    records = (tmp_path / cacheblend.RECORDS).read_text().splitlines()
    assert len(records) == config.num_prompts

    resumed = cacheblend.run(config, tmp_path)  # every prompt is read back, none run again
    assert resumed["timing"]["timed_runs"] == 0  # the controller's measurements are read back from the cache too
    assert [r["gold"] for r in resumed["policies"]] == [r["gold"] for r in results["policies"]]
    assert [r["ttft_mean_s"] for r in resumed["policies"]] == [r["ttft_mean_s"] for r in results["policies"]]
    other = cacheblend_rag.get_config("tiny")
    other.eval.continuation_tokens = 6
    with pytest.raises(ValueError, match=r"holds results of another config \(fields \['eval'\] differ\)"):
        cacheblend.run(other, tmp_path)
