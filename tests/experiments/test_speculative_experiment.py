"""configs/spec_decode.py:tiny on the real model: every speed row and hit-rate row is
written, speculative greedy outputs equal the non-speculative ones, and hit rates with
speculation on equal the rates with it off."""

from __future__ import annotations

import pytest

from configs import spec_decode as spec_decode_config
from experiments import spec_decode

pytestmark = pytest.mark.slow  # an end-to-end run or subprocesses: the full suite, not the fast loop


@pytest.mark.real_model
def test_tiny_preset_runs_and_speculation_changes_neither_outputs_nor_hits(tmp_path):
    config = spec_decode_config.get_config("tiny")
    results = spec_decode.run(config, tmp_path)
    speed = results["speed"]
    assert {(r["workload"], r["batch"], r["drafter"]) for r in speed} == {
        (w, 1, d) for w in ("rag", "chat") for d in ("off", "ngram", "early_exit")
    }
    assert all(r["tokens_per_s"] > 0 and r["mean_accepted_length"] >= 1.0 for r in speed)
    assert results["all_outputs_equal"] and results["hit_rates_equal"]
    assert any(r["block_hit_rate"] > 0 for r in results["hit_rates"] if r["workload"] == "prefix_reuse")
    assert any(r["block_hit_rate_off"] > 0 for r in results["eviction_trace"])
    assert (tmp_path / "speedup_vs_k.png").exists() and "Speedup vs k" in (tmp_path / "summary.md").read_text()


def test_unknown_preset_is_an_error():
    with pytest.raises(ValueError, match="unknown preset 'huge'; allowed: '' \\(default\\) or 'tiny'"):
        spec_decode_config.get_config("huge")
