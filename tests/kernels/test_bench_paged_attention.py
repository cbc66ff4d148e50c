"""The paged-attention benchmark runs end to end on its ``tiny`` preset and writes its three files."""

from __future__ import annotations

import json

from configs.bench_paged_attention import get_config
from experiments.bench_paged_attention import run


def test_bench_writes_results(tmp_path):
    config = get_config("tiny")
    results = run(config, tmp_path)
    assert config.experiment == "bench_paged_attention"
    assert [row["context_len"] for row in results["rows"]] == [32, 64]
    assert all(row["max_abs_diff"] < 1e-5 for row in results["rows"])
    assert json.loads((tmp_path / "results.json").read_text())["rows"] == results["rows"]
    assert "| 64 | paged |" in (tmp_path / "summary.md").read_text()
    assert (tmp_path / "bandwidth.png").stat().st_size > 0
