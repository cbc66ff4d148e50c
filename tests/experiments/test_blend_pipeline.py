"""configs/blend_pipeline.py:tiny on the real model: every placement and mode runs, pipelined
and serial onboarding give the same logits (same KL), only pipelined runs onboard layer by
layer, and the run folder holds the tables, the timeline and the plots."""

from __future__ import annotations

import pytest

from configs import blend_pipeline as blend_pipeline_config
from experiments import blend_pipeline

pytestmark = pytest.mark.slow  # an end-to-end run: the full suite, not the fast loop


@pytest.mark.real_model
def test_tiny_preset_runs_every_cell(tmp_path):
    config = blend_pipeline_config.get_config("tiny")
    blend_pipeline.run(config, tmp_path)
    rows = (tmp_path / "pipeline.csv").read_text().splitlines()
    header = rows[0].split(",")
    records = [dict(zip(header, line.split(","))) for line in rows[1:]]
    cells = {(r["tier"], r["mode"]) for r in records}
    assert cells == {
        ("-", "-"),
        ("device", "-"),
        ("host", "pipelined"),
        ("host", "serial"),
        ("disk", "pipelined"),
        ("disk", "serial"),
    }
    by_cell = {(r["tier"], r["mode"], r["policy"]): r for r in records}

    def same_kl(a: dict, b: dict) -> bool:
        return float(a["kl"]) == pytest.approx(float(b["kl"]), rel=1e-4, abs=1e-6)

    for tier in ("host", "disk"):
        for policy in ("full_reuse", "cacheblend@0.15", "auto"):
            piped, serial = by_cell[tier, "pipelined", policy], by_cell[tier, "serial", policy]
            assert int(piped["layerwise_pages"]) > 0 and int(serial["layerwise_pages"]) == 0
            if policy != "auto":
                assert same_kl(piped, serial) and same_kl(piped, by_cell["device", "-", policy])
        # "auto": the floor where nothing hides the recompute (device tier, serial onboarding);
        # pipelined, at least the floor (the measured load decides)
        auto, serial = by_cell[tier, "pipelined", "auto"], by_cell[tier, "serial", "auto"]
        assert float(serial["ratio"]) == float(by_cell["device", "-", "auto"]["ratio"]) == config.min_ratio
        assert same_kl(serial, by_cell["device", "-", "cacheblend@0.15"]) and float(auto["ratio"]) >= config.min_ratio
    timeline = (tmp_path / "timeline.csv").read_text()
    assert "load" in timeline and "compute" in timeline
    for name in ("summary.md", "validation.csv", "ttft_vs_bandwidth.png", "timeline.png"):
        assert (tmp_path / name).stat().st_size > 0


def test_unknown_preset_is_an_error():
    with pytest.raises(ValueError, match="unknown preset 'huge'; allowed: '' .default. or 'tiny'"):
        blend_pipeline_config.get_config("huge")
