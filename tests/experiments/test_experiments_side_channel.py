"""The timing side-channel experiment on its tiny preset: structure and cache reuse only (no
timing assertions, which would flake on a shared machine)."""

from __future__ import annotations

import numpy as np
import pytest

from configs import side_channel as side_channel_config
from experiments import side_channel

pytestmark = pytest.mark.slow  # an end-to-end run or subprocesses: the full suite, not the fast loop


def test_side_channel_salts_hide_the_victims_cache_from_the_attacker(tmp_path):
    config = side_channel_config.get_config("tiny")
    results = side_channel.run(config, tmp_path)
    cells = {(c["setting"], c["secret_tokens"]): c for c in results["cells"]}
    assert set(cells) == {(s, n) for s in side_channel.SETTINGS for n in config.secret_tokens}
    for n in config.secret_tokens:
        shared, tenant = cells[("shared", n)], cells[("per-tenant", n)]
        assert shared["probes"] == tenant["probes"] == config.probes
        assert shared["mean_reused_tokens_hit"] == min(n, shared["probe_tokens"] - 1)  # the whole secret
        assert shared["mean_reused_tokens_miss"] == 0 and shared["reuse_auc"] == 1.0
        assert tenant["max_reused_tokens"] == 0 and tenant["reuse_auc"] == 0.5
        for c in (shared, tenant):
            assert 0.0 <= c["auc"] <= 1.0 and 0.0 <= c["auc_ci_low"] <= c["auc_ci_high"] <= 1.0
            assert c["median_ttft_hit_ms"] > 0 and c["median_ttft_miss_ms"] > 0
    assert sum(r["cached"] for r in results["rows"]) == len(results["rows"]) // 2
    assert np.isfinite(results["runtime_s"])
    assert (tmp_path / "ttft.png").stat().st_size > 0
    assert "| per-tenant |" in (tmp_path / "summary.md").read_text()
    assert (tmp_path / "probes.csv").read_text().count("\n") == len(results["rows"]) + 1
