"""configs/bench_engine.py:tiny on the real model: every row is measured and compared with
its peer figure where one exists, beside the machine's measured limits."""

from __future__ import annotations

import json

import pytest

from configs import bench_engine as bench_engine_config
from experiments import bench_engine


@pytest.mark.real_model
def test_tiny_bench_writes_every_row(tmp_path):
    config = bench_engine_config.get_config("tiny")
    results = bench_engine.run(config, tmp_path)
    rows = {r["row"]: r for r in results["rows"]}
    assert set(rows) == {"cold_128_ttft", "repeat_128_ttft", "shared_96_ttft", "prefill_64", "decode_b1", "decode_b2"}
    assert all(r["kvjax"] > 0 for r in rows.values())
    assert rows["decode_b1"]["kvjax_over_vllm"] == pytest.approx(rows["decode_b1"]["kvjax"] / 18.7)
    limits = results["machine"]
    assert limits["matmul_2048_gflops"] > 0 and limits["copy_gb_s"] > 0
    assert json.loads(json.dumps(results["rows"]))  # plain JSON
    summary = (tmp_path / "summary.md").read_text()
    assert "GFLOP/s" in summary and "| decode_b1 | ms/token |" in summary
    assert (tmp_path / "engine.csv").exists()


def test_unknown_preset_is_an_error():
    with pytest.raises(ValueError, match="unknown preset 'huge'; allowed: '' \\(default\\) or 'tiny'"):
        bench_engine_config.get_config("huge")
