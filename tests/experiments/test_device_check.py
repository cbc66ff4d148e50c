"""The device check (``experiments/device_check.sh``) as it will run on the lent GPU machine.

That machine reaches no package registry and holds only ``machine.DEVICE_DISTRIBUTIONS``
plus the wheels the check carries (``experiments/device_check/wheels.txt``). The dry run
runs every stage on the CPU in a subprocess where every other installed distribution cannot
be imported (a ``sys.meta_path`` finder installed by a ``sitecustomize``), so a new import
of, say, ``ml_collections`` fails here rather than there.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
from packaging.requirements import Requirement

from experiments.device_check import machine
from experiments.device_check.correctness import MOSAIC_PATH, PAGED_PATH, PARTIAL_PATH
from experiments.device_check.random_model import SMOLLM2_135M
from experiments.device_check.sizes import DRY_RUN, FULL
from experiments.device_check.stages import STAGES
from pallas_kernels.gpu_common import MIN_DOT_ROWS, is_power_of_two

ROOT = pathlib.Path(__file__).resolve().parents[2]
REPO_PACKAGES = {"kvjax", "pallas_kernels", "experiments", "configs"}
DEVICE_MARKERS = {"python_version": "3.12", "python_full_version": machine.DEVICE_PYTHON, "extra": ""}


def allowed_distributions() -> set[str]:
    return set(machine.DEVICE_DISTRIBUTIONS) | set(machine.carried_wheels())


def absent_on_device() -> list[str]:
    """Top-level modules installed here whose every distribution is missing on the machine."""
    allowed = allowed_distributions()
    return sorted(
        module for module, dists in importlib.metadata.packages_distributions().items()
        if module not in REPO_PACKAGES and not any(machine.normalize(d) in allowed for d in dists)
    )


def guard(tmp_path: pathlib.Path) -> dict[str, str]:
    """Environment variables that make a child Python refuse the modules the machine lacks."""
    site = tmp_path / "device_guard"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import importlib.abc
        import sys

        ABSENT = frozenset({absent_on_device()!r})

        class AbsentOnDevice(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if path is None and name in ABSENT:
                    raise ModuleNotFoundError(f"No module named {{name!r}} (not on the GPU machine)", name=name)
                return None

        sys.meta_path.insert(0, AbsentOnDevice())
    """))
    return {**os.environ, "PYTHONPATH": str(site), "PYTHON": sys.executable, "JAX_PLATFORMS": "cpu"}


def test_the_carried_wheels_need_only_what_the_machine_holds():
    carried = machine.carried_wheels()
    assert carried, "wheels.txt pins no wheel"
    for name, version in carried.items():
        assert name not in machine.DEVICE_DISTRIBUTIONS, (
            f"{name} is on the machine already; carry it only for another version"
        )
        assert importlib.metadata.version(name) == version, (
            f"the dry run here imports {name} {importlib.metadata.version(name)}, wheels.txt pins {version}"
        )
        for line in importlib.metadata.requires(name) or ():
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate(DEVICE_MARKERS):
                assert machine.normalize(requirement.name) in allowed_distributions(), (
                    f"{name} needs {requirement}, not on the machine"
                )


def test_the_guard_refuses_what_the_machine_lacks(tmp_path):
    assert "ml_collections" in absent_on_device()
    env = guard(tmp_path)
    done = subprocess.run([sys.executable, "-c", "import numpy, jax, blake3\nimport ml_collections"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "No module named 'ml_collections' (not on the GPU machine)" in done.stderr, (
        done.stderr[-2000:]
    )


@pytest.mark.parametrize("sizes", [FULL, DRY_RUN], ids=["full", "dry_run"])
def test_the_sizes_fit_the_kernels_and_the_budget(sizes):
    assert [name for name, _ in sizes.stage_budget_s] == list(STAGES)
    assert sum(budget for _, budget in sizes.stage_budget_s) <= sizes.budget_s <= 450  # ~8 minutes with the start
    pool_elements = (
        (1 + sizes.bw_max_tokens // sizes.bw_tokens_per_block)
        * sizes.bw_tokens_per_block
        * sizes.bw_heads[1]
        * sizes.bw_head_dim
    )
    assert pool_elements < 2**31, "Triton's int32 offsets into the pool would overflow"
    assert all(c % sizes.bw_tokens_per_block == 0 for c in sizes.bw_contexts)
    assert sizes.bw_sweep_point[0] * sizes.bw_sweep_point[1] <= sizes.bw_max_tokens
    for tokens_per_block, (num_heads, num_kv_heads), head_dim, _ in sizes.grid + sizes.quantized_grid:
        assert is_power_of_two(tokens_per_block) and is_power_of_two(head_dim) and num_heads % num_kv_heads == 0
    for pages_per_block, _ in sizes.bw_sweep:
        assert pages_per_block * sizes.bw_tokens_per_block >= MIN_DOT_ROWS


@pytest.mark.real_model
def test_the_random_model_has_smollm2s_shapes():
    from kvjax.model.registry import load_model

    real = load_model("smollm2-135m").config
    assert dataclasses.replace(real, rms_eps=SMOLLM2_135M.rms_eps) == SMOLLM2_135M  # the GGUF stores 1e-5 as float32


@pytest.mark.slow
def test_the_dry_run_runs_every_stage_with_the_machines_packages(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(ROOT / "experiments" / "device_check.sh"), "--dry-run"],
                          env={**guard(tmp_path), "OUT": str(out)}, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    report = json.loads((out / "device_check.json").read_text())
    assert [s["name"] for s in report["stages"]] == list(STAGES)
    assert all(s["status"] == "ok" for s in report["stages"]), [(s["name"], s["error"]) for s in report["stages"]]
    [correctness], [bandwidth] = report["stages"][0]["tables"], report["stages"][1]["tables"]
    assert correctness["rows"] and all(row["ok"] for row in correctness["rows"]), correctness["rows"]
    assert {row["kv_dtype"] for row in bandwidth["rows"]} >= {"bfloat16", "int8", "fp8"}
    assert not [row for row in bandwidth["rows"] if row["error"]]
    assert {p["path"]: p["ok"] > 0 and p["failed"] == 0 for p in report["kernel_paths"]} == {
        PAGED_PATH: True, PARTIAL_PATH: True, MOSAIC_PATH: True,
        "engine, attn_impl='interpret'": True, "blend, attn_impl='interpret'": True,
    }
    markdown = (out / "device_check.md").read_text()
    for title in ("Engine TTFT", "Engine decode", "CacheBlend against full recompute"):
        assert f"## {title}" in markdown
