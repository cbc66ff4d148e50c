"""Shared fixtures: the real SmolLM2 model and the HF transformers reference outputs; the
``real_model`` mark of the tests that use the model."""

from __future__ import annotations

import os
import pathlib

import jax
import numpy as np
import pytest

FIXTURES = pathlib.Path(__file__).parent / "fixtures"

# Compiled XLA executables persist across processes (notebook kernels, subprocess tests,
# reruns): the environment variables reach child processes, jax.config this one.
_XLA_CACHE = pathlib.Path(os.environ.get("KVJAX_CACHE_DIR", pathlib.Path.home() / ".cache" / "kvjax")) / "xla"
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_XLA_CACHE))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops JAX's in-memory compiled programs after each test module. Kept for the whole
    run, ~400 tests' executables made jaxlib 0.10 segfault inside a later compile (three runs,
    at different tests; each test passes in a fresh process); the persistent cache makes the
    recompiles cheap."""
    yield
    jax.clear_caches()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks every test that uses the ``smollm2`` fixture (directly or through another fixture)
    ``real_model``, so ``pytest -m "not real_model"`` is the fast loop; tests that load a model
    themselves carry the mark in their own module."""
    for item in items:
        if "smollm2" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.real_model)


@pytest.fixture(scope="session")
def smollm2():
    from kvjax.model.registry import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def hf_reference() -> dict[str, np.ndarray]:
    """Outputs of HF transformers on the same GGUF (see tests/fixtures/README.md)."""
    with np.load(FIXTURES / "smollm2_transformers_reference.npz") as z:
        return {k: z[k] for k in z}


@pytest.fixture(scope="session")
def reference_text() -> str:
    return (FIXTURES / "reference_text.txt").read_text()
