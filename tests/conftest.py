"""Shared fixtures: the real SmolLM2 model and the HF transformers reference outputs."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

FIXTURES = pathlib.Path(__file__).parent / "fixtures"


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
