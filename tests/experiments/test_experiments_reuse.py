"""The reuse experiments (prefix_reuse, eviction, bench_manager) on their ``tiny`` presets: each
writes its tables and plot, and its numbers satisfy what they claim.

The presets' engine runs share one cache layout (32 tokens/block, 8 pages, max_seq_len 256)
and keep every sequence within 128 tokens, so the few jitted step shapes compile once for the
whole file; 8 pages also put the eviction check under memory pressure.
"""

from __future__ import annotations

import json

import pytest

from configs import bench_manager as bench_manager_config
from configs import eviction as eviction_config
from configs import prefix_reuse as prefix_reuse_config
from experiments import bench_manager, eviction, prefix_reuse


@pytest.mark.real_model
def test_prefix_reuse_warm_beats_cold_and_agrees(tmp_path):
    config = prefix_reuse_config.get_config("tiny")
    results = prefix_reuse.run(config, tmp_path)
    rows = results["rows"]
    assert len(rows) == 5
    assert results["outputs_agree"] and results["max_logits_rel_err"] < 1e-4
    assert 0.0 < results["token_hit_rate"] < 1.0 and 0.0 < results["block_hit_rate"] < 1.0
    hits = [r for r in rows if r["reused_tokens"] >= 64]
    assert len(hits) >= 3  # questions 2 and 3 of the shared prompt, chat turn 2
    assert results["median_ttft_warm_hits_s"] < results["median_ttft_cold_hits_s"]
    assert all(r["reused_tokens"] < r["prompt_tokens"] for r in rows)
    assert (tmp_path / "ttft.png").stat().st_size > 0
    assert "| shared-system |" in (tmp_path / "summary.md").read_text()
    assert (tmp_path / "requests.csv").read_text().count("\n") == len(rows) + 1


@pytest.mark.real_model
def test_eviction_orders_policies_and_engine_matches_simulation(tmp_path):
    config = eviction_config.get_config("tiny")
    results = eviction.run(config, tmp_path)
    by = {(r["policy"], r["host_pages"], r["disk_pages"]): r for r in results["simulation"]}
    for tiers in ((0, 0), (64, 0), (64, 256)):
        prio, lru, opt = (by[(p, *tiers)]["block_hit_rate"] for p in ("priority-LRU", "LRU", "Belady (offline)"))
        assert 0.0 <= lru <= prio <= opt <= 1.0, (tiers, lru, prio, opt)
        assert lru > 0.0 and by[("LRU", *tiers)]["device_evictions"] > 0  # reuse and memory pressure
    assert by[("LRU", 64, 0)]["offloaded_MB"] > 0 and by[("LRU", 64, 0)]["onboarded_MB"] > 0
    assert by[("priority-LRU", 64, 0)]["block_hit_rate"] >= by[("priority-LRU", 0, 0)]["block_hit_rate"]
    with_disk = by[("priority-LRU", 64, 256)]
    assert with_disk["spilled_MB"] > 0 and with_disk["disk_onboarded_MB"] > 0
    assert with_disk["block_hit_rate"] > by[("priority-LRU", 64, 0)]["block_hit_rate"]
    assert all(by[("LRU", 0, 0)][f"us_per_{k}_block"] > 0 for k in eviction.OP_KINDS)
    engine_rows = results["engine"]
    assert len(engine_rows) == 4
    for r in engine_rows:
        assert r["block_hit_rate"] == r["sim_block_hit_rate"] and r["token_hit_rate"] == r["sim_token_hit_rate"]
        assert r["offloaded_MB"] == r["sim_offloaded_MB"] and r["onboarded_MB"] == r["sim_onboarded_MB"]
    assert any(r["offloaded_MB"] > 0 for r in engine_rows if r["host_pages"] > 0)
    assert (tmp_path / "hit_rates.png").stat().st_size > 0
    assert "Belady (offline)" in (tmp_path / "summary.md").read_text()
    assert (tmp_path / "engine.csv").exists() and (tmp_path / "simulation.csv").exists()


@pytest.mark.parametrize("config_module", [prefix_reuse_config, eviction_config, bench_manager_config])
def test_unknown_preset_is_an_error(config_module):
    with pytest.raises(ValueError, match="unknown preset 'huge'; allowed: '' .default. or 'tiny'"):
        config_module.get_config("huge")


def test_belady_is_optimal_on_a_known_sequence():
    a, b, c = (bytes([i]) * 32 for i in range(3))
    # capacity 2: MIN keeps a and b, bypasses c, and hits a, b, a
    accesses = [(a, True), (b, True), (c, True), (a, True), (b, True), (a, True)]
    assert eviction.belady_hit_rate(accesses, 2) == pytest.approx(3 / 6)
    assert eviction.belady_hit_rate(accesses, 0) == 0.0


@pytest.mark.real_model
def test_bench_manager_host_cost_is_far_below_the_model_step(tmp_path):
    config = bench_manager_config.get_config("tiny")
    results = bench_manager.run(config, tmp_path)
    for row in results["ops"]:
        assert all(row[f"us_per_{k}_block"] > 0 and row[f"{k}_blocks"] > 0 for k in eviction.OP_KINDS)
        assert 0.0 < row["block_hit_rate"] < 1.0
    assert all(r["steps"] > 0 and r["us_per_request"] > 0 for r in results["scheduler"])
    steps = results["model_steps"]
    assert steps["prefill_step_ms"] > 0 and steps["decode_step_ms"] > 0
    assert all(r["host_share_pct"] < 50 for r in results["host_vs_model"])
    assert (tmp_path / "bench_manager.png").stat().st_size > 0
    assert json.loads(json.dumps(results["ops"][0]))["host_pages"] == 0
    assert "Host bookkeeping vs model" in (tmp_path / "summary.md").read_text()
