"""configs/bench_engine.py:tiny on the real model: every row is measured and compared with
its peer figure where one exists, beside the machine's measured limits."""

from __future__ import annotations

import json

import pytest

from configs import bench_engine as bench_engine_config
from experiments import bench_engine

pytestmark = pytest.mark.slow  # an end-to-end run or subprocesses: the full suite, not the fast loop


@pytest.mark.real_model
def test_tiny_bench_writes_every_row(tmp_path):
    config = bench_engine_config.get_config("tiny")
    results = bench_engine.run(config, tmp_path)
    rows = {r["row"]: r for r in results["rows"]}
    assert set(rows) == {
        "cold_128_ttft",
        "repeat_128_ttft",
        "shared_96_ttft",
        "prefill_64",
        "decode_b1",
        "decode_b2",
    } | {f"decode_b{b}_tok_s_{m}" for b in (1, 2) for m in ("v1", "v2_n4")}
    hits = {r["manager"]: r for r in results["hit_rates"]}
    assert set(hits) == {"V1 priority-LRU", "V1 LRU", "V2 LRU"}
    assert all(0 <= r["block_hit_rate"] <= 1 for r in hits.values()) and hits["V2 LRU"]["block_hit_rate"] > 0
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


def _fake_peer(tmp_path, body: str) -> str:
    """An executable standing in for the vLLM venv's python: it ignores its arguments."""
    path = tmp_path / "peer_python"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


def test_peer_result_is_parsed_as_medians(tmp_path):
    config = bench_engine_config.get_config("tiny")
    config.peer_python = _fake_peer(tmp_path, 'echo noise; echo \'VLLM_PEER_RESULT {"decode_b1": [3.0, 1.0, 2.0]}\'')
    assert bench_engine.measure_peer(config, max_seq_len=256) == {"decode_b1": 2.0}


def test_failed_peer_run_is_an_error_with_its_stderr(tmp_path):
    config = bench_engine_config.get_config("tiny")
    config.peer_python = _fake_peer(tmp_path, "echo 'No module named vllm' >&2; exit 3")
    with pytest.raises(RuntimeError, match="(?s)vLLM peer run failed \\(exit 3\\).*No module named vllm"):
        bench_engine.measure_peer(config, max_seq_len=256)
