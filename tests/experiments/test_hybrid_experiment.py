"""The hybrid_reuse experiment on its tiny preset: every cell runs, the counts add up, and the
orderings that follow from the snapshot rules hold."""

from __future__ import annotations

import pytest

from configs import hybrid_reuse as hybrid_reuse_config
from experiments import hybrid_reuse

pytestmark = pytest.mark.slow  # an end-to-end run or subprocesses: the full suite, not the fast loop


def test_hybrid_reuse_tiny(tmp_path):
    config = hybrid_reuse_config.get_config("tiny")
    results = hybrid_reuse.run(config, tmp_path)
    cells = {c["cell"]: c for c in results["cells"]}
    expected = {f"{p}/{i}" for p in config.policies for i in config.intervals} | {
        f"vllm-like block {config.vllm_block_tokens}"
    }
    assert set(cells) == expected
    for c in cells.values():
        assert c["reused_tokens"] + c["recomputed_tokens"] == c["prompt_tokens"]
        assert 0.0 <= c["hit_rate"] <= c["attention_hit_rate"] <= 1.0
        assert c["peak_snapshots"] <= config.max_snapshots
    # all_reusable cells snapshot only periodically: no interval, no reuse; interval 64 reuses
    assert cells["all_reusable/0"]["hit_rate"] == 0.0 and cells["all_reusable/64"]["hit_rate"] > 0.0
    # per_conversation resumes each later turn at the previous prompt's end, whatever the interval
    assert cells["per_conversation/0"]["later_turn_hit_rate"] > 0.5
    assert cells["per_conversation/0"]["reused_tokens"] == cells["per_conversation/64"]["reused_tokens"]
    # every prompt is shorter than the vLLM-like block: nothing is reused
    assert cells[f"vllm-like block {config.vllm_block_tokens}"]["hit_rate"] == 0.0
    assert (tmp_path / "cells.csv").read_text().count("\n") == len(expected) + 1
    assert "| per_conversation/64 |" in (tmp_path / "summary.md").read_text()
