"""The blocked (flash-style) XLA attention against the reference, on the kernels' grid:
scattered and chunked rows, GQA/MQA, windows, soft-cap, NaN in unused pages, several query
and key blocks, decode wrapper, bf16."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.attention import blocked
from kvjax.testing.paged_inputs import GRID, WINDOW_AND_CAP, assert_close, grid_id, grid_seed, make_inputs
from pallas_kernels.common import AttentionSpec
from pallas_kernels.paged_attention.reference import paged_attention_ref
from pallas_kernels.partial_attention.reference import partial_attention_ref

PAGES_PER_SEQ = 4
# (block_q, block_k): one block each; several query blocks; several key blocks of one and two pages.
BLOCKS = [(256, 256), (2, 8), (3, 4)]


def run_case(*, seed: int, tokens_per_block: int, heads: tuple[int, int], block_q: int, block_k: int,
             dtype=jnp.float32, num_queries: int = 6, chunked: bool = False, **options) -> None:
    inputs = make_inputs(
        seed, lengths=[1, tokens_per_block, 2 * tokens_per_block + 1, PAGES_PER_SEQ * tokens_per_block, 0],
        num_heads=heads[0], num_kv_heads=heads[1], tokens_per_block=tokens_per_block, pages_per_seq=PAGES_PER_SEQ,
        dtype=dtype, num_queries=num_queries, chunked=chunked, sliding_window=options.get("sliding_window"),
    )
    spec = AttentionSpec(inputs.q.shape[-1] ** -0.5, **options)
    expected = partial_attention_ref(inputs.q, inputs.q_positions, inputs.clean_kv, spec)
    actual = blocked.partial_attention(inputs.q, inputs.q_positions, inputs.kv, spec, block_q=block_q, block_k=block_k)
    assert actual.shape == inputs.q.shape and actual.dtype == inputs.q.dtype
    assert not np.asarray(actual, np.float32)[np.asarray(inputs.q_positions) < 0].any(), "padding rows must be zero"
    assert_close(actual, expected)


@pytest.mark.parametrize(("block_q", "block_k"), BLOCKS)
@pytest.mark.parametrize(("tokens_per_block", "heads", "dtype"), GRID, ids=grid_id)
def test_scattered_rows_match_reference(tokens_per_block, heads, dtype, block_q, block_k):
    run_case(
        seed=grid_seed(tokens_per_block, heads),
        tokens_per_block=tokens_per_block,
        heads=heads,
        dtype=dtype,
        block_q=block_q,
        block_k=block_k,
    )


@pytest.mark.parametrize(("block_q", "block_k"), BLOCKS)
@pytest.mark.parametrize("num_queries", [1, 5, 16])
def test_chunked_prefill(num_queries, block_q, block_k):
    run_case(seed=num_queries, tokens_per_block=4, heads=(6, 3), num_queries=num_queries, chunked=True,
             block_q=block_q, block_k=block_k)


@pytest.mark.parametrize(("block_q", "block_k"), BLOCKS)
@pytest.mark.parametrize("options", WINDOW_AND_CAP)
def test_windows_and_soft_cap(options, block_q, block_k):
    run_case(
        seed=7,
        tokens_per_block=4,
        heads=(8, 1),
        num_queries=8,
        chunked=True,
        block_q=block_q,
        block_k=block_k,
        **options,
    )


@pytest.mark.parametrize("block_q", [2, 3])
@pytest.mark.parametrize("options", [{}, {"sliding_window": 12}, {"sliding_window": 8}, {"logit_soft_cap": 2.0}])
def test_blocks_every_row_sees_whole_run_unmasked(options, block_q):
    # Every sequence is deep into its context, so the key blocks below the lowest query
    # position (and inside the highest one's window) take the path without a mask; a
    # padding sequence and NaN in unused pages ride along.
    inputs = make_inputs(11, lengths=[16, 15, 16, 0], num_heads=6, num_kv_heads=3, tokens_per_block=4,
                         pages_per_seq=4, num_queries=3, chunked=True, sliding_window=options.get("sliding_window"))
    spec = AttentionSpec(inputs.q.shape[-1] ** -0.5, **options)
    expected = partial_attention_ref(inputs.q, inputs.q_positions, inputs.clean_kv, spec)
    actual = blocked.partial_attention(inputs.q, inputs.q_positions, inputs.kv, spec, block_q=block_q, block_k=4)
    assert_close(actual, expected)
    assert not np.asarray(actual)[3].any()  # the padding sequence


@pytest.mark.parametrize("window,soft_cap", [(None, None), (5, None), (None, 2.0), (3, 2.0)])
def test_decode_matches_paged_reference(window, soft_cap):
    inputs = make_inputs(3, lengths=[5, 16, 1, 0, 9], num_heads=6, num_kv_heads=2, tokens_per_block=4, pages_per_seq=4,
                         sliding_window=window)
    q = inputs.q[:, 0]
    spec = AttentionSpec(0.25, window, soft_cap)
    expected = paged_attention_ref(q, inputs.clean_kv, spec)
    actual = blocked.paged_attention(q, inputs.kv, spec)
    assert_close(actual, expected)
    assert not np.asarray(actual)[3].any()  # the padding sequence (length 0)


def test_rejects_bad_heads():
    inputs = make_inputs(0, lengths=[5], num_heads=3, num_kv_heads=2, tokens_per_block=4, pages_per_seq=2)
    with pytest.raises(ValueError, match="num_heads=3 must be a multiple of num_kv_heads=2"):
        blocked.paged_attention(inputs.q[:, 0], inputs.kv, AttentionSpec(1.0))
