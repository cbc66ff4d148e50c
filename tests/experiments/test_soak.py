"""The soak (``configs/soak.py:tiny``): 300 steps of the tiny model serving every request kind
while every fault kind arrives, with no violation; and its checks catch what they check."""

from __future__ import annotations

import json

import numpy as np
import pytest

from configs.soak import get_config
from experiments import soak


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("soak")
    return workdir, soak.run(get_config("tiny"), workdir)


def test_every_kind_is_served_and_every_fault_injected_without_a_violation(tiny_run):
    workdir, results = tiny_run
    assert results["violations"] == 0, json.loads((workdir / "violations.json").read_text())[:3]
    assert set(results["served"]) == set(soak.KINDS) and min(results["served"].values()) > 0
    assert set(soak.FAULTS) <= set(results["faults"]), results["faults"]
    assert results["faults"]["snapshot_saved"] > 0 and results["faults"]["preemption"] > 0
    assert set(results["checks"]) == set(soak.CHECKS)
    assert results["checks"]["consistency"] >= results["steps"]
    for name in ("summary.md", "checks.csv", "rss.png", "rss.csv", "violations.json"):
        assert (workdir / name).is_file()
    marked = {row.split(",")[-1] for row in (workdir / "rss.csv").read_text().splitlines()[1:]} - {""}
    assert marked == set(soak.FAULTS)  # each sample after an injected fault names it
    assert set(results["rss_change_by_fault_mib"]) <= set(soak.FAULTS)
    assert all(isinstance(n, int) and n > 0 for n in results["programs_after_warmup"].values())


def test_a_wrong_output_and_a_bad_fault_kind_are_caught(tmp_path, monkeypatch):
    config = get_config("tiny")
    config.minutes = 4 / 60
    config.faults.kinds = ()
    config.checks.quantized_drift_fraction = -1.0  # no int8 request can be this close
    real = soak.Soak._reference
    monkeypatch.setattr(soak.Soak, "_reference", lambda self, p: [*real(self, p), 0])  # one token too many
    results = soak.run(config, tmp_path)
    violations = json.loads((tmp_path / "violations.json").read_text())
    assert results["violations"] == len(violations) > 0
    assert {v["check"] for v in violations} == {"exact_output", "quantized_output"}
    quantized = next(v for v in violations if v["check"] == "quantized_output")
    assert quantized["seen"]["max_logit_difference"] >= 0 and quantized["kind"] == "quantized"
    assert quantized["seen"]["int8_error"] > 0  # int8 rounding moves a logit from float32's
    config.faults.kinds = ("power_cut",)
    with pytest.raises(ValueError, match=r"faults.kinds: unknown \['power_cut'\]; allowed: \('abort_mid_prefill'"):
        soak.run(config, tmp_path)


def test_memory_growth_tells_a_leak_from_compiled_programs_and_faults():
    times = np.arange(10.0)
    programs = np.array([0, 1, 2, 2, 2, 3, 3, 3, 3, 3])
    faults = np.array([0, 0, 0, 0, 0, 0, 0, 1, 1, 1])  # a fault between samples 6 and 7
    compiles = np.array([100, 200, 300, 300, 300, 400, 400, 450, 450, 450], dtype=np.float64)
    growth = soak.memory_growth(times, compiles, programs, faults, 0.3)  # samples 3..9
    assert (growth.total, growth.without_compiles, growth.with_compiles, growth.with_faults) == (150, 0, 100, 50)
    assert (growth.compiling_steps, growth.programs, growth.faults) == (1, 1, 1)
    leak = compiles + 10.0 * times  # 10 MiB every sample besides
    growth = soak.memory_growth(times, leak, programs, faults, 0.3)
    assert (growth.total, growth.without_compiles, growth.with_compiles, growth.with_faults) == (210, 40, 110, 60)
    assert growth.peak_without_compiles == 40  # each quiet step's 10 MiB is new memory
    # a fault hands 200 MiB back (sample 7) and the quiet steps after it refill 150 of it: not new memory
    refill = np.array([100, 200, 300, 300, 300, 400, 400, 200, 275, 350], dtype=np.float64)
    growth = soak.memory_growth(times, refill, programs, faults, 0.3)
    assert (growth.total, growth.without_compiles, growth.with_faults) == (50, 150, -200)
    assert growth.peak_without_compiles == 0
    refill[-1] = 430  # past the mark of 400 by 30
    assert soak.memory_growth(times, refill, programs, faults, 0.3).peak_without_compiles == 30
    with pytest.raises(ValueError, match=r"checks.rss_warmup_fraction=1.0 must be in \[0, 1\)"):
        soak.memory_growth(times, leak, programs, faults, 1.0)
