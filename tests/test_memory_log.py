"""The suite's memory log: workers' samples added up over time, not their separate peaks, and
each module's peak from the samples within its tests' span."""

from __future__ import annotations

import pathlib
import time

import pytest

from kvjax.testing.memory_log import SUFFIX, TESTS, RssSampler, combined_peak, module_peaks


def test_workers_are_added_up_at_each_moment_not_at_their_own_peaks(tmp_path):
    # gw0 peaks at t=2 (5 GiB), gw1 at t=4 (4 GiB); together they hold most at t=4: 3 + 4,
    # not the 9 GiB of their separate peaks.
    (tmp_path / f"gw0{SUFFIX}").write_text("1,1024,0\n2,5120,0\n3,3072,0\n5,1024,0\n")
    (tmp_path / f"gw1{SUFFIX}").write_text("1.5,1024,0\n3,3072,512\n4,4096,0\n")
    peak = combined_peak(tmp_path)
    assert (peak.peak_mib, peak.at) == (7168.0, 4.0)
    assert peak.by_worker == {"gw0": 3072.0, "gw1": 4096.0}
    assert peak.worker_peaks == {"gw0": 5120.0, "gw1": 4096.0}
    assert peak.seconds == 4.0


def test_a_worker_counts_nothing_after_its_last_sample(tmp_path):
    (tmp_path / f"gw0{SUFFIX}").write_text("1,4096,0\n2,4096,0\n")
    (tmp_path / f"gw1{SUFFIX}").write_text("3,1024,0\n")
    assert combined_peak(tmp_path).peak_mib == 4096.0


def test_a_module_peaks_within_its_span_children_and_commas_included(tmp_path):
    # samples: a.py holds 2 GiB at t=11, b.py's child 3 GiB at t=21; the spans reach a second
    # either side of the rows (whole seconds), so b.py's first sample after a.py's release at
    # t=13 counts for b.py, not for a.py
    (tmp_path / f"gw0{SUFFIX}").write_text("10,500,0\n11,2048,0\n15,900,0\n21,1024,3072\n30,700,0\n")
    (tmp_path / f"gw0{TESTS}").write_text(
        "tests/a.py::test_x[1, 2],2048,0,2048,11\ntests/a.py::(released),600,0,2048,13\n"
        "tests/b.py::test_y,1024,3072,2048,21\ntests/b.py::(released),700,0,2048,22\n"
    )
    assert module_peaks(tmp_path) == {"tests/b.py": 4096.0, "tests/a.py": 2048.0}
    (tmp_path / f"gw0{TESTS}").unlink()
    with pytest.raises(ValueError, match="holds no per-test rows"):
        module_peaks(tmp_path)


def test_the_sampler_writes_and_an_empty_folder_is_an_error(tmp_path):
    sampler = RssSampler(tmp_path / "logs" / f"main{SUFFIX}", interval_s=0.01).start()
    time.sleep(0.1)
    sampler.stop()
    peak = combined_peak(tmp_path / "logs")
    assert peak.peak_mib > 0 and set(peak.by_worker) == {"main"}
    with pytest.raises(ValueError, match="holds no worker samples"):
        combined_peak(tmp_path)
    with pytest.raises(ValueError, match="interval_s=0 must be > 0"):
        RssSampler(tmp_path / "x", interval_s=0)


def test_the_heavy_modules_exist_and_are_one_work_unit(pytestconfig):
    path = str(pathlib.Path(__file__).with_name("conftest.py"))
    conftest = next(p for p in pytestconfig.pluginmanager.get_plugins() if getattr(p, "__file__", None) == path)
    assert all((pytestconfig.rootpath / module).is_file() for module in conftest.HEAVY_MODULES), conftest.HEAVY_MODULES
    assert {conftest.work_unit(f"{module}::test_a") for module in conftest.HEAVY_MODULES} == {"heavy modules"}
    assert conftest.work_unit("tests/test_config.py::TestA::test_a") == "tests/test_config.py"
