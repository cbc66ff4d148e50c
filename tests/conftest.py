"""Shared fixtures: the real SmolLM2 model and the HF transformers reference outputs; the
``real_model`` mark of the tests that use the model; a tiny manager (``make``: 4 tokens per
page) on a fake clock for the manager and scheduler tests."""

from __future__ import annotations

import dataclasses
import gc
import os
import pathlib
import resource
import time

import jax
import numpy as np
import psutil
import pytest
from xdist.scheduler import LoadFileScheduling

from kvjax.cache import CacheLayout
from kvjax.config import KvCacheConfig
from kvjax.heap import release_free_heap
from kvjax.manager import KVCacheManager
from kvjax.model.registry import load_model
from kvjax.testing.memory_log import SUFFIX, RssSampler

FIXTURES = pathlib.Path(__file__).parent / "fixtures"

# Compiled XLA executables persist across processes (notebook kernels, subprocess tests,
# reruns): the environment variables reach child processes, jax.config this one.
_XLA_CACHE = pathlib.Path(os.environ.get("KVJAX_CACHE_DIR", pathlib.Path.home() / ".cache" / "kvjax")) / "xla"
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_XLA_CACHE))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1")


@pytest.fixture(autouse=True, scope="module")
def _release_between_modules(request: pytest.FixtureRequest):
    """After each test module: drops JAX's in-memory compiled programs and the loaded models
    (``load_model``'s cache; the ``smollm2`` fixture is per module too), collects, and hands
    the freed heap back to the system (``malloc_trim``), so a worker's memory is what its
    current module needs, not the sum of what every earlier one loaded. Kept for the whole run,
    ~400 tests' executables also made jaxlib 0.10 segfault inside a later compile (three runs,
    at different tests; each test passes in a fresh process); the persistent cache makes the
    recompiles cheap. With ``KVJAX_TEST_MEMORY_LOG`` the worker's RSS after the release is
    logged as a row ``<module>::(released)``: what the next module starts from."""
    yield
    jax.clear_caches()
    load_model.cache_clear()
    gc.collect()
    release_free_heap()
    _log_memory(f"{request.node.nodeid}::(released)")


def _worker() -> str:
    return os.environ.get("PYTEST_XDIST_WORKER", "main")


@pytest.fixture(autouse=True, scope="session")
def _memory_samples():
    """With ``KVJAX_TEST_MEMORY_LOG=<folder>``, samples the worker's resident memory four times
    a second into ``<folder>/<worker>.samples.csv`` (``kvjax.testing.memory_log``: ``python -m
    kvjax.testing.memory_log <folder>`` adds the workers up over time)."""
    folder = os.environ.get("KVJAX_TEST_MEMORY_LOG")
    if not folder:
        yield
        return
    sampler = RssSampler(pathlib.Path(folder) / f"{_worker()}{SUFFIX}").start()
    yield
    sampler.stop()


@pytest.fixture(autouse=True)
def _memory_log(request: pytest.FixtureRequest):
    """With ``KVJAX_TEST_MEMORY_LOG=<folder>``, appends each test's resident memory to
    ``<folder>/<worker>.csv``: the test id, the worker's RSS after the test, its children's
    (subprocess tests), the worker's peak so far, in MiB, and the time (Unix seconds): which
    module needed what (``_memory_samples`` holds the curve between tests too)."""
    yield
    _log_memory(request.node.nodeid)


def _log_memory(row: str) -> None:
    folder = os.environ.get("KVJAX_TEST_MEMORY_LOG")
    if not folder:
        return
    process = psutil.Process()
    children = sum(child.memory_info().rss for child in process.children(recursive=True))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    path = pathlib.Path(folder) / f"{_worker()}.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as out:
        rss = process.memory_info().rss / 2**20
        out.write(f"{row},{rss:.0f},{children / 2**20:.0f},{peak:.0f},{time.time():.0f}\n")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks every test that uses the ``smollm2`` fixture (directly or through another fixture)
    ``real_model``, so ``pytest -m "not real_model"`` is the fast loop; tests that load a model
    themselves carry the mark in their own module."""
    for item in items:
        if "smollm2" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.real_model)


HEAVY_MODULES = frozenset({
    "tests/blend/test_real_model.py",
    "tests/blend/test_selectors_experiment.py",
    "tests/cache/test_kv_quant.py",
    "tests/engine/test_manager_v2_engine.py",
    "tests/model/test_gemma3.py",
    "tests/model/test_model.py",
    "tests/model/test_tokenizer_parity.py",
    "tests/speculative/test_speculative_models.py",
    "tests/test_distributed.py",
})
"""Test modules whose worker, with its child processes, holds 3.3 GiB or more at its peak
(``KVJAX_TEST_MEMORY_LOG``; 3.3 to 5.3 GiB on a 2-core EPYC; ``test_distributed``'s SmolLM2
over eight host devices runs in a 3.8 GiB child): one xdist work unit, run one after another
on one worker, so that two of them never run at the same time (about 14 of the suite's 42
worker-minutes)."""


def work_unit(nodeid: str) -> str:
    """The xdist work unit of a test: its module, or one unit for all of ``HEAVY_MODULES``."""
    module = nodeid.split("::", 1)[0]
    return "heavy modules" if module in HEAVY_MODULES else module


class HeavyModulesTogether(LoadFileScheduling):
    """``--dist loadfile`` by ``work_unit``."""

    def _split_scope(self, nodeid: str) -> str:
        return work_unit(nodeid)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log) -> LoadFileScheduling | None:
    """Schedules ``--dist loadfile`` runs by ``HeavyModulesTogether``; other modes as asked."""
    return HeavyModulesTogether(config, log) if config.getoption("dist") == "loadfile" else None


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def hf_reference() -> dict[str, np.ndarray]:
    """Outputs of HF transformers on the same GGUF (see tests/fixtures/README.md)."""
    with np.load(FIXTURES / "smollm2_transformers_reference.npz") as z:
        return {k: z[k] for k in z}


@pytest.fixture(scope="session")
def reference_text() -> str:
    return (FIXTURES / "reference_text.txt").read_text()


@dataclasses.dataclass
class FakeClock:
    """Seconds; advance it by hand."""

    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def _tiny_layout(num_device_pages: int = 8, windows: tuple[int, ...] = (64,), host: int = 0, disk: int = 0,
                max_seq_len: int = 64, head_dim: int = 1, tokens_per_block: int = 4) -> CacheLayout:
    """A float32 layout with one KV head: one layer per window (windows capped at max_seq_len),
    ``num_device_pages`` device pages per group; a page of a group of n layers is
    2 · tokens_per_block · head_dim · 4 · n bytes."""
    windows = tuple(min(w, max_seq_len) for w in windows)
    return CacheLayout(
        layer_windows=windows,
        num_pages=(num_device_pages,) * len(dict.fromkeys(windows)),
        tokens_per_block=tokens_per_block,
        num_kv_heads=1,
        head_dim=head_dim,
        max_seq_len=max_seq_len,
        num_host_pages=host,
        num_disk_pages=disk,
    )


@pytest.fixture
def tiny_layout():
    """The ``CacheLayout`` builder the ``make`` fixture uses (same arguments and defaults)."""
    return _tiny_layout


@pytest.fixture
def make(clock):
    """make(num_device_pages=8, windows=(64,), host=0, disk=0, max_seq_len=64, head_dim=1, **config)
    -> KVCacheManager on ``tiny_layout`` (4 tokens per page unless config sets tokens_per_block)."""

    def _make(num_device_pages: int = 8, windows: tuple[int, ...] = (64,), host: int = 0, disk: int = 0,
              max_seq_len: int = 64, head_dim: int = 1, **config) -> KVCacheManager:
        config.setdefault("tokens_per_block", 4)
        config.setdefault("event_buffer_max_size", 1000)
        layout = _tiny_layout(num_device_pages, windows, host, disk, max_seq_len, head_dim, config["tokens_per_block"])
        return KVCacheManager(KvCacheConfig(**config), layout, clock=clock)

    return _make
