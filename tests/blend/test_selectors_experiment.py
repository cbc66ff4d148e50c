"""The CacheBlend experiment's real-data path: train/eval prompts of the learned selector are
disjoint, and configs/cacheblend_rag.py:tiny runs end to end on SmolLM2 (gold SQuAD scores,
every policy, the learned scorer, the ratio sweep with intervals, the figures)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from configs import cacheblend_rag
from experiments import cacheblend, cacheblend_eval, cacheblend_report, report
from experiments.cacheblend_report import RECORDS, read_lines
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


def test_development_runs_only_on_the_training_split_without_the_learned_scorer():
    config = cacheblend_rag.get_config("develop")
    assert config.workload.split == "train" and "learned" not in (*config.policies, *config.sweep.policies)
    config.sweep.policies = (*config.sweep.policies, "learned")
    with pytest.raises(ValueError, match="workload.split='train' must be 'eval', or 'train' .* without the 'learned'"):
        cacheblend_eval.build(config)  # refused before the model loads
    config.workload.split = "test"
    with pytest.raises(ValueError, match="workload.split='test' must be"):
        cacheblend_eval.build(config)


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
        assert {"f1", "em", "gold", "gold_ll"} <= set(row) and row["gold"] == row["f1"] and row["gold_ll"] < 0
        assert row["gold_lo"] <= row["gold"] <= row["gold_hi"]
        assert row["speedup_lo"] <= row["speedup"] <= row["speedup_hi"]
    assert rows["full_reuse"]["kl"] > rows["cacheblend"]["kl"] > 0
    assert rows["cacheblend"]["flop_fraction"] < 0.5
    assert rows["cacheblend"]["ttft_mean_s"] < full["ttft_mean_s"]
    timing = results["timing"]
    assert timing["compiles_in_timed"] == 0 and timing["timed_runs"] >= 2 * len(config.policies)
    paired = {(r["policy"], r["metric"], r["baseline"]) for r in results["paired"]}
    for name in config.policies:
        for metric in ("gold_ll", "gold", "f1", "em"):
            assert name == "full_recompute" or (name, metric, "full_recompute") in paired
            assert name == "full_reuse" or (name, metric, "full_reuse") in paired
    assert [h["metric"] for h in results["headline"]] == ["gold_ll", "gold"]
    assert all(set(h["recovered_share"]) == {"cacheblend", "learned"} for h in results["headline"])
    learned = results["learned"]
    assert learned["train_prompts"] == config.learned.train_prompts
    assert set(learned["train_recall"]) >= {"learned", "kv_deviation", "attention"}
    assert all(0.0 <= v <= 1.0 for v in learned["train_recall"].values())
    sweep = {(r["policy"], r["ratio"]): r for r in results["sweep"]}
    assert set(sweep) == {("learned", r) for r in config.sweep.ratios}
    assert sweep[("learned", 0.5)]["kl"] < sweep[("learned", 0.15)]["kl"]
    assert [(b["policy"], b["metric"]) for b in results["budget"]] == [("learned", "gold_ll"), ("learned", "gold")]
    for budget in results["budget"]:
        for share in ("95%", "99%"):
            lo, ratio, hi = (budget[f"ratio_{share}{end}"] for end in ("_lo", "", "_hi"))
            assert 0.0 <= lo <= ratio <= hi <= 1.0 and budget[f"speedup_{share}"] > 0
    for name in (
        "policy_quality",
        "gold_vs_ratio",
        "gold_ll_vs_ratio",
        "kl_vs_ratio",
        "kv_deviation_cdf",
        "pareto_ttft",
        "pareto_flops",
    ):
        assert (tmp_path / f"{name}.png").stat().st_size > 0
    summary = (tmp_path / "summary.md").read_text()
    assert summary.startswith("# CacheBlend selectors vs full recompute (squad_multidoc, smollm2-135m; 2 of 2 prompts)")
    assert "## Headline" in summary and "**gold_ll**: full reuse minus full recompute" in summary
    assert (
        "not significantly different" in summary and "prompts per hour" in summary and "## Recompute ratio" in summary
    )
    assert all(np.isfinite(h["reuse_minus_full"]) for h in results["headline"])
    records = (tmp_path / RECORDS).read_text().splitlines()
    assert len(records) == config.num_prompts

    resumed = cacheblend.run(config, tmp_path)  # every prompt is read back, none run again
    assert resumed["pieces"] == 2 and resumed["timing"]["timed_runs"] == results["timing"]["timed_runs"]
    assert [r["gold"] for r in resumed["policies"]] == [r["gold"] for r in results["policies"]]
    assert [r["ttft_mean_s"] for r in resumed["policies"]] == [r["ttft_mean_s"] for r in results["policies"]]
    summary = (tmp_path / "summary.md").read_text()
    (tmp_path / "summary.md").unlink()
    cacheblend_report.write_folder(tmp_path)
    assert (tmp_path / "summary.md").read_text() == summary  # the report regenerates from the folder alone
    assert "eval split, gold + up to 2 distractor paragraphs" in summary  # the split the config names

    pieces = tmp_path / "pieces"  # the same run in two pieces: the same records
    config.piece.max_prompts = 1
    first = cacheblend.run(config, pieces)
    assert first["num_prompts"] == 1 and first["headline_text"].startswith("1 of 2 prompts")
    config.piece.max_prompts = 0
    assert cacheblend.run(config, pieces)["pieces"] == 2
    quality = ("kl", "top1", "gold_ll", "gold", "answer", "flop_fraction")
    scored = [
        [(k, [v[m] for m in quality]) for k, v in sorted(r["runs"].items())] for r in read_lines(pieces / RECORDS)
    ]
    straight = [
        [(k, [v[m] for m in quality]) for k, v in sorted(r["runs"].items())] for r in read_lines(tmp_path / RECORDS)
    ]
    assert scored == straight
    other = cacheblend_rag.get_config("tiny")
    other.eval.continuation_tokens = 6
    with pytest.raises(ValueError, match=r"another config \(fields \['eval.continuation_tokens'\] differ\)"):
        cacheblend.run(other, tmp_path)
    # a run saved before workload.split existed resumes at split "eval", and only there
    state_path = tmp_path / cacheblend_report.STATE
    state = json.loads(state_path.read_text())
    del state["config"]["workload"]["split"]
    state_path.write_text(json.dumps(state))
    assert len(cacheblend._resume(tmp_path, config)[0]) == config.num_prompts
    config.workload.split = "train"
    with pytest.raises(ValueError, match=r"another config \(fields \['workload.split'\] differ\)"):
        cacheblend._resume(tmp_path, config)


def test_a_piece_commits_its_run_folder_and_nothing_else(tmp_path):
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True, text=True).stdout

    git("init", "-q")
    git("config", "user.email", "t@example.com")
    git("config", "user.name", "t")
    (tmp_path / "other.txt").write_text("not the run's\n")
    run = tmp_path / "docs" / "results" / "run"
    run.mkdir(parents=True)
    (run / "per_prompt.jsonl").write_text('{"index": 0}\n')
    report.commit_folder(run, "Results: piece 0")
    assert git("log", "--format=%s").strip() == "Results: piece 0"
    assert git("show", "--name-only", "--format=").split() == ["docs/results/run/per_prompt.jsonl"]
    with pytest.raises(RuntimeError, match="piece.commit: git commit"):
        report.commit_folder(run, "nothing new")  # nothing to commit: git's message is carried
