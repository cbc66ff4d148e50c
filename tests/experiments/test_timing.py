"""The mapping-limit guard of long runs: it drops compiled programs only past its headroom,
their mappings are returned to the kernel, and jitted functions keep working after it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from experiments import timing


def _compile_programs(count: int) -> None:
    for n in range(count):
        jax.jit(lambda x, n=n: jnp.tanh(x @ x.T + n).sum())(jnp.ones((32 + n, 16))).block_until_ready()


@pytest.mark.skipif(timing.memory_mappings() == 0, reason="no /proc/self/maps on this platform")
def test_release_executables_returns_the_mappings_of_dropped_programs(monkeypatch):
    square = jax.jit(lambda x: x * x)
    assert float(square(3.0)) == 9.0
    monkeypatch.setattr(timing, "MAPPINGS_HEADROOM", 1.0)
    assert not timing.release_executables()  # no process holds more than the limit
    _compile_programs(20)
    held = timing.memory_mappings()
    monkeypatch.setattr(timing, "MAPPINGS_HEADROOM", 0.0)
    assert timing.release_executables()
    assert timing.memory_mappings() < held
    assert float(square(4.0)) == 16.0  # recompiled on its next call
