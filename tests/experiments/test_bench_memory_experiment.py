"""configs/bench_memory.py:tiny on the real model: the layout formula equals the allocated pool,
a windowed layer group holds only its window's pages, and a host tier keeps more prompts
reusable."""

from __future__ import annotations

import pytest

from configs import bench_memory as bench_memory_config
from experiments import bench_memory

pytestmark = pytest.mark.slow  # an end-to-end run or subprocesses: the full suite, not the fast loop


@pytest.mark.real_model
def test_tiny_preset_writes_every_part(tmp_path):
    config = bench_memory_config.get_config("tiny")
    results = bench_memory.run(config, tmp_path)
    assert all(
        r["allocated_bytes_per_slot"] == pytest.approx(r["bytes_per_token"], abs=1) for r in results["attention"]
    )
    full, windowed = sorted(results["windows"], key=lambda r: r["window"] == "full", reverse=True)
    page = config.windows.tokens_per_block
    assert full["pages_held"] == config.windows.lengths[0] // page
    assert windowed["pages_held"] <= windowed["window"] // page + 1 < full["pages_held"]
    no_host, with_host = sorted(results["offload"], key=lambda r: r["host_multiple"])
    assert with_host["reusable_prompts"] > no_host["reusable_prompts"] > 0
    assert all(r["rerun_reused_tokens"] == r["rerun_estimate"] for r in results["offload"])
    settings = {r["setting"] for r in results["pools"]}
    assert settings == {"equal pages", "avg_seq_len=512", "none (fallback)"}  # SmolLM2: one group takes the budget
    assert all(r["share"] == pytest.approx(1.0) and r["tokens"] == config.pools.max_tokens for r in results["pools"])
    for name in ("memory.md", "memory.png", "attention.csv", "windows.csv", "offload.csv", "pools.csv"):
        assert (tmp_path / name).stat().st_size > 0


def test_unknown_preset_is_an_error():
    with pytest.raises(ValueError, match="unknown preset 'huge'; allowed: '' .default. or 'tiny'"):
        bench_memory_config.get_config("huge")
