"""Two local processes join one JAX job (gloo collectives on CPU), build the engine over a mesh of
both processes' devices (``Engine(mesh=...)``: weights and page pool sharded across the two), and
generate exactly the tokens one process on one device generates; a killed process ends the run with an error naming it,
not a hang."""

from __future__ import annotations

import time

import pytest

from configs import multihost as multihost_config
from experiments import multihost

pytestmark = pytest.mark.slow


def test_two_processes_generate_the_tokens_of_one_device(tmp_path):
    config = multihost_config.get_config()
    summary = multihost.run(config, tmp_path)
    assert summary["all_equal"]
    assert len(set(summary["reference_tokens"])) > 3  # a real continuation, not one repeated token
    assert [p["global_devices"] for p in summary["processes"]] == [4, 4]
    assert [p["local_devices"] for p in summary["processes"]] == [2, 2]
    assert {tuple(p["mesh"].values()) for p in summary["processes"]} == {(2, 2)}
    assert all(p["pool_sharded"] for p in summary["processes"])  # no process holds the whole pool


def test_a_killed_process_ends_the_run_with_a_clear_error(tmp_path):
    config = multihost_config.get_config()
    config.update(kill_process=1, kill_after_s=2.0, new_tokens=4000 // 8, num_pages=1024, timeout_s=120)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"process 1 of 2 exited with code -9; the others were stopped"):
        multihost.launch(config, tmp_path)
    assert time.monotonic() - start < 60
