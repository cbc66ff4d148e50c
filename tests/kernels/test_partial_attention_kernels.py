"""Partial-token attention kernels (TPU and GPU, in interpret mode) against the XLA reference."""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from kvjax.testing.paged_inputs import GRID, WINDOW_AND_CAP, assert_close, grid_id, grid_seed, make_inputs, options_id
from pallas_kernels.common import AttentionSpec
from pallas_kernels.partial_attention import gpu, tpu
from pallas_kernels.partial_attention.reference import partial_attention_ref

KERNELS = {
    "tpu": functools.partial(tpu.partial_attention, interpret=pltpu.InterpretParams()),
    "gpu": functools.partial(gpu.partial_attention, interpret=True),
}
PAGES_PER_SEQ = 4


def run_case(
    kernel: str,
    *,
    seed: int,
    tokens_per_block: int,
    heads: tuple[int, int],
    dtype=jnp.float32,
    num_queries: int = 6,
    chunked: bool = False,
    lengths: list[int] | None = None,
    **options,
) -> None:
    num_heads, num_kv_heads = heads
    window = options.get("sliding_window")
    if lengths is None:
        lengths = [1, tokens_per_block, 2 * tokens_per_block + 1, PAGES_PER_SEQ * tokens_per_block, 0]
    inputs = make_inputs(
        seed, lengths=lengths, num_heads=num_heads, num_kv_heads=num_kv_heads, tokens_per_block=tokens_per_block,
        pages_per_seq=PAGES_PER_SEQ, dtype=dtype, num_queries=num_queries, chunked=chunked,
        sliding_window=window,
    )
    spec = AttentionSpec(inputs.q.shape[-1] ** -0.5, window, options.pop("logit_soft_cap", None))
    options.pop("sliding_window", None)
    expected = partial_attention_ref(inputs.q, inputs.q_positions, inputs.clean_kv, spec)
    actual = KERNELS[kernel](inputs.q, inputs.q_positions, inputs.kv, spec, **options)
    assert actual.shape == inputs.q.shape and actual.dtype == inputs.q.dtype
    padding_rows = np.asarray(inputs.q_positions) < 0
    assert not np.asarray(actual, np.float32)[padding_rows].any(), "padding rows must be zero"
    assert_close(actual, expected)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize(("tokens_per_block", "heads", "dtype"), GRID, ids=grid_id)
def test_scattered_rows_match_reference(kernel, tokens_per_block, heads, dtype):
    run_case(kernel, seed=grid_seed(tokens_per_block, heads), tokens_per_block=tokens_per_block, heads=heads,
             dtype=dtype)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("num_queries", [1, 5, 16])
def test_chunked_prefill(kernel, num_queries):
    run_case(kernel, seed=num_queries, tokens_per_block=4, heads=(6, 3), num_queries=num_queries, chunked=True)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("options", WINDOW_AND_CAP, ids=options_id)
def test_window_and_soft_cap(kernel, options):
    run_case(kernel, seed=5, tokens_per_block=4, heads=(8, 1), **options)


@pytest.mark.parametrize(("kernel", "blocking"), [
    ("tpu", {"block_q": 8, "pages_per_block": 1}),
    ("tpu", {"block_q": 4, "pages_per_block": 3}),
    ("gpu", {"block_q": 2, "pages_per_block": 4}),
    ("gpu", {"block_q": 8, "pages_per_block": 8}),
])
def test_block_sizes(kernel, blocking):
    run_case(kernel, seed=3, tokens_per_block=4, heads=(6, 3), num_queries=12, sliding_window=7, **blocking)


def test_tpu_rejects_unaligned_row_blocks():
    inputs = make_inputs(
        0, lengths=[5], num_heads=3, num_kv_heads=1, tokens_per_block=4, pages_per_seq=2, num_queries=4
    )
    with pytest.raises(ValueError, match="block_q=2 times group=3 must be a multiple of 8"):
        tpu.partial_attention(inputs.q, inputs.q_positions, inputs.kv, AttentionSpec(1.0), block_q=2, interpret=True)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_rejects_bad_positions_dtype(kernel):
    inputs = make_inputs(
        0, lengths=[5], num_heads=2, num_kv_heads=1, tokens_per_block=4, pages_per_seq=2, num_queries=2
    )
    with pytest.raises(ValueError, match="q_positions.dtype=float32 must be int32"):
        KERNELS[kernel](inputs.q, inputs.q_positions.astype(jnp.float32), inputs.kv, AttentionSpec(1.0))


def test_tpu_interpreter_raises_on_out_of_bounds_page():
    inputs = make_inputs(
        0, lengths=[5], num_heads=2, num_kv_heads=1, tokens_per_block=4, pages_per_seq=2, num_queries=2
    )
    bad_table = inputs.page_indices.at[0, 0].set(inputs.k_pages.shape[0])
    kv = dataclasses.replace(inputs.kv, page_indices=bad_table)
    try:
        with pytest.raises(Exception, match="(?i)out.of.bounds"):
            tpu.partial_attention(
                inputs.q, inputs.q_positions, kv, AttentionSpec(1.0), interpret=pltpu.InterpretParams()
            ).block_until_ready()
    finally:
        pltpu.reset_tpu_interpret_mode_state()
