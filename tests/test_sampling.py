"""Sampling: greedy is argmax, the nucleus equals the sorted-cumulative-mass definition, and
sampled tokens follow the truncated, tempered distribution."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.sampling import nucleus_mask, sample


def mass_before(probs: np.ndarray) -> np.ndarray:
    """Per token, the float64 mass of the tokens sorted before it (most probable first)."""
    p = probs.astype(np.float64)
    order = np.argsort(-p, kind="stable")
    before = np.empty_like(p)
    before[order] = np.cumsum(p[order]) - p[order]
    return before


def nucleus_by_sorting(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Keep a token iff the mass of the tokens sorted before it is < top_p."""
    return mass_before(probs) < top_p


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.5, 0.9, 0.99, 1.0])
def test_nucleus_equals_the_sorted_definition(top_p):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(16, 5000)).astype(np.float32) * rng.uniform(0.5, 4, (16, 1)).astype(np.float32)
    probs = np.asarray(jax.nn.softmax(jnp.asarray(logits), axis=-1))
    got = np.asarray(nucleus_mask(jnp.asarray(probs), jnp.full(16, top_p, jnp.float32)))
    if top_p == 1.0:
        assert got.all()
        return
    for row in range(16):
        before = mass_before(probs[row])
        differ = got[row] != (before < top_p)
        # Only a token whose preceding mass equals top_p up to float32 summation error may differ.
        assert np.all(np.abs(before[differ] - top_p) < 1e-4), before[differ]
        assert differ.sum() <= 1


def test_greedy_rows_are_argmax_also_beside_sampled_rows():
    logits = jax.random.normal(jax.random.key(0), (4, 1000))
    temperature = jnp.array([0.0, 1.0, 0.0, 0.7])
    ones = jnp.ones(4)
    zeros = jnp.zeros(4, jnp.int32)
    tokens = np.asarray(sample(logits, temperature, ones, zeros, zeros))
    argmax = np.asarray(jnp.argmax(logits, -1))
    assert tokens[0] == argmax[0] and tokens[2] == argmax[2]
    all_greedy = np.asarray(sample(logits, jnp.zeros(4), ones, zeros, zeros))
    np.testing.assert_array_equal(all_greedy, argmax)


def test_samples_follow_the_truncated_tempered_distribution():
    """20,000 draws over 6 tokens: frequencies match softmax(logits / T) renormalised over
    the nucleus within 4 standard errors; tokens outside the nucleus never appear."""
    logits = jnp.array([2.0, 1.5, 1.0, 0.0, -1.0, -3.0])
    temperature, top_p, n = 0.8, 0.9, 20_000
    probs = np.asarray(jax.nn.softmax(logits / temperature))
    keep = nucleus_by_sorting(probs, top_p)
    expected = np.where(keep, probs, 0) / probs[keep].sum()
    tokens = np.asarray(
        sample(
            jnp.tile(logits, (n, 1)), jnp.full(n, temperature), jnp.full(n, top_p),
            jnp.arange(n, dtype=jnp.int32), jnp.zeros(n, jnp.int32),
        )
    )
    freq = np.bincount(tokens, minlength=6) / n
    stderr = np.sqrt(expected * (1 - expected) / n)
    assert np.all(freq[~keep] == 0)
    assert np.all(np.abs(freq - expected) <= 4 * stderr + 1e-12), (freq, expected)


def test_same_seed_and_counter_give_the_same_token():
    logits = jax.random.normal(jax.random.key(1), (2, 500))
    args = (jnp.ones(2), jnp.full(2, 0.95), jnp.array([7, 7], jnp.int32), jnp.array([3, 3], jnp.int32))
    a = np.asarray(sample(jnp.tile(logits[:1], (2, 1)), *args))
    assert a[0] == a[1]
