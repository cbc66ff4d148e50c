"""Fixtures of the blend tests: a tiny random model (prompt and Blender helpers live in
``kvjax.testing.blend``)."""

from __future__ import annotations

import pytest

from kvjax.testing.tiny import tiny_model


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(0, num_layers=4)
