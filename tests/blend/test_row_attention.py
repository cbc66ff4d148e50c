"""Row attention over one sequence's contiguous K/V (``kvjax/attention/rows.py``)
against the paged reference with an identity block table: scattered, unsorted and padding
rows, GQA/MQA, sliding windows, soft-cap, NaN past the length, one and several query / key
blocks; and the dispatch (``attention.row_attention``) on both of its paths."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import attention
from kvjax.attention.rows import row_attention
from pallas_kernels.common import AttentionSpec, PagedKV
from pallas_kernels.partial_attention.reference import partial_attention_ref

PAGE = 8
SLOTS = 6 * PAGE


def make_case(seed: int, heads: tuple[int, int], num_rows: int, length: int, head_dim: int = 16):
    """Rows at random distinct positions (unsorted) below ``length`` plus two padding rows;
    slots at and past ``length`` hold NaN."""
    rng = np.random.default_rng(seed)
    num_heads, num_kv_heads = heads
    q = rng.standard_normal((num_rows + 2, num_heads, head_dim)).astype(np.float32)
    positions = np.full(num_rows + 2, -1, np.int32)
    positions[:num_rows] = rng.choice(length, num_rows, replace=False)
    positions = positions[rng.permutation(num_rows + 2)]
    k = rng.standard_normal((SLOTS, num_kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((SLOTS, num_kv_heads, head_dim)).astype(np.float32)
    k[length:], v[length:] = np.nan, np.nan
    return q, positions, k, v


def spec_of(q: np.ndarray, **options) -> AttentionSpec:
    return AttentionSpec(q.shape[-1] ** -0.5, **options)


def reference(q, positions, k, v, length, **options) -> np.ndarray:
    pages = (SLOTS // PAGE, PAGE, *k.shape[1:])
    kv = PagedKV(k.reshape(pages), v.reshape(pages), jnp.asarray([length]), jnp.arange(SLOTS // PAGE)[None])
    return np.asarray(partial_attention_ref(q[None], positions[None], kv, spec_of(q, **options))[0])


OPTIONS = [{}, {"sliding_window": 7}, {"logit_soft_cap": 2.0}]
# (block_q, block_k, heads): one block each; several query and key blocks (uneven splits).
GRID = [(256, 256, (6, 3)), (3, 8, (4, 1)), (4, 5, (6, 3)), (4, 5, (4, 4))]


@pytest.mark.parametrize(("block_q", "block_k", "heads"), GRID)
@pytest.mark.parametrize("options", OPTIONS, ids=["causal", "window", "softcap"])
def test_matches_paged_reference(block_q, block_k, heads, options):
    length = SLOTS - 5
    q, positions, k, v = make_case(block_q * 7 + block_k + heads[0] * heads[1], heads, num_rows=13, length=length)
    expected = reference(q, positions, np.nan_to_num(k), np.nan_to_num(v), length, **options)
    actual = np.asarray(row_attention(
        jnp.asarray(q), jnp.asarray(positions), jnp.asarray(k), jnp.asarray(v), jnp.int32(length),
        spec_of(q, **options), block_q=block_q, block_k=block_k,
    ))
    assert actual.shape == q.shape and np.isfinite(actual).all()
    assert not actual[positions < 0].any(), "padding rows must be zero"
    np.testing.assert_allclose(actual, expected, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize(("num_rows", "length"), [(1, 1), (SLOTS, SLOTS), (5, 17)])
def test_edge_lengths(num_rows, length):
    q, positions, k, v = make_case(num_rows + length, (6, 3), num_rows=num_rows, length=length)
    expected = reference(q, positions, np.nan_to_num(k), np.nan_to_num(v), length)
    for block_q, block_k in itertools.product((2, 64), (4, 64)):
        actual = row_attention(
            jnp.asarray(q), jnp.asarray(positions), jnp.asarray(k), jnp.asarray(v), jnp.int32(length),
            spec_of(q), block_q=block_q, block_k=block_k,
        )
        np.testing.assert_allclose(np.asarray(actual), expected, rtol=2e-5, atol=2e-6)


def test_all_padding_rows_are_zero():
    _, _, k, v = make_case(0, (6, 3), num_rows=1, length=SLOTS)
    q = jnp.ones((4, 6, 16), jnp.float32)
    padding = jnp.full(4, -1, jnp.int32)
    out = row_attention(q, padding, jnp.asarray(k), jnp.asarray(v), jnp.int32(SLOTS), AttentionSpec(0.25))
    assert not np.asarray(out).any()


def test_bad_shapes_name_the_field():
    q = jnp.zeros((4, 5, 16))
    k = jnp.zeros((SLOTS, 2, 16))
    with pytest.raises(ValueError, match="num_heads=5 must be a multiple of num_kv_heads=2"):
        row_attention(q, jnp.zeros(4, jnp.int32), k, k, jnp.int32(1), AttentionSpec(1.0))
    with pytest.raises(ValueError, match=r"q_positions.shape=\(3,\)"):
        row_attention(jnp.zeros((4, 4, 16)), jnp.zeros(3, jnp.int32), k, k, jnp.int32(1), AttentionSpec(1.0))
    with pytest.raises(ValueError, match="block_q=0"):
        row_attention(jnp.zeros((4, 4, 16)), jnp.zeros(4, jnp.int32), k, k, jnp.int32(1), AttentionSpec(1.0), block_q=0)


@pytest.mark.parametrize("attn_impl", ["auto", "blocked", "reference"])
def test_dispatch_matches_reference(attn_impl):
    """``attention.row_attention`` gives the reference result on the contiguous-K/V path and the paged path."""
    length = SLOTS - 3
    q, positions, k, v = make_case(3, (6, 3), num_rows=20, length=length)
    k, v = np.nan_to_num(k), np.nan_to_num(v)
    expected = reference(q, positions, k, v, length, sliding_window=9)
    actual = attention.row_attention(
        jnp.asarray(q), jnp.asarray(positions), jnp.asarray(k), jnp.asarray(v), jnp.int32(length),
        spec_of(q, sliding_window=9), tokens_per_block=PAGE, impl=attn_impl,
    )
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=2e-5, atol=2e-6)
