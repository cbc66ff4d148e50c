"""Paged decode kernels (TPU and GPU, in interpret mode) against the XLA reference."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import tpu as pltpu

from kvjax.testing.paged_inputs import assert_close, make_inputs
from pallas_kernels.paged_attention import gpu, tpu
from pallas_kernels.paged_attention.reference import paged_attention_ref

KERNELS = {
    "tpu": functools.partial(tpu.paged_attention, interpret=pltpu.InterpretParams()),
    "gpu": functools.partial(gpu.paged_attention, interpret=True),
}
# (num_heads, num_kv_heads): MHA, MQA, GQA with 3 and 2 heads per group, MQA with 3 heads.
HEADS = [(8, 8), (8, 1), (6, 3), (3, 1)]
PAGES_PER_SEQ = 4


def lengths_for(tokens_per_block: int) -> list[int]:
    """One token, a full page, a page plus one, a full table, and a padding sequence."""
    return [1, tokens_per_block, tokens_per_block + 1, PAGES_PER_SEQ * tokens_per_block, 0]


def run_case(kernel: str, *, seed: int, tokens_per_block: int, heads: tuple[int, int], dtype, **options) -> None:
    num_heads, num_kv_heads = heads
    window = options.get("sliding_window")
    inputs = make_inputs(
        seed, lengths=lengths_for(tokens_per_block), num_heads=num_heads, num_kv_heads=num_kv_heads,
        tokens_per_block=tokens_per_block, pages_per_seq=PAGES_PER_SEQ, dtype=dtype, sliding_window=window,
    )
    sm_scale = inputs.q.shape[-1] ** -0.5
    q = inputs.q[:, 0]
    expected = paged_attention_ref(
        q, inputs.clean_k_pages, inputs.clean_v_pages, inputs.lengths, inputs.page_indices,
        sm_scale=sm_scale, sliding_window=window, logit_soft_cap=options.get("logit_soft_cap"),
    )
    actual = KERNELS[kernel](
        q, inputs.k_pages, inputs.v_pages, inputs.lengths, inputs.page_indices, sm_scale=sm_scale, **options
    )
    assert actual.shape == q.shape and actual.dtype == q.dtype
    assert_close(actual, expected)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize(
    ("tokens_per_block", "heads", "dtype"),
    [*itertools.product([4, 8], HEADS, [jnp.float32]), *itertools.product([8], HEADS, [jnp.bfloat16])],
    ids=lambda value: str(value) if not isinstance(value, type) else jnp.dtype(value).name,
)
def test_matches_reference(kernel, tokens_per_block, heads, dtype):
    run_case(kernel, seed=tokens_per_block * 100 + heads[0] * 10 + heads[1], tokens_per_block=tokens_per_block, heads=heads, dtype=dtype)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize(
    "options",
    [
        {"sliding_window": 1},
        {"sliding_window": 3},
        {"sliding_window": 8},
        {"logit_soft_cap": 2.0},
        {"sliding_window": 5, "logit_soft_cap": 2.0},
    ],
    ids=lambda options: "-".join(f"{key}={value}" for key, value in options.items()),
)
def test_window_and_soft_cap(kernel, options):
    run_case(kernel, seed=7, tokens_per_block=4, heads=(6, 3), dtype=jnp.float32, **options)


@pytest.mark.parametrize(("kernel", "tokens_per_block", "blocking"), [
    ("tpu", 4, {"pages_per_block": 1}),
    ("tpu", 4, {"pages_per_block": 3}),
    ("gpu", 16, {"pages_per_block": 1, "k_splits": 4}),
    ("gpu", 8, {"pages_per_block": 2, "k_splits": 2}),
    ("gpu", 4, {"pages_per_block": 4, "k_splits": 1}),
])
def test_block_sizes(kernel, tokens_per_block, blocking):
    run_case(kernel, seed=11, tokens_per_block=tokens_per_block, heads=(8, 1), dtype=jnp.float32, sliding_window=6, **blocking)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_jits_inside_caller(kernel):
    inputs = make_inputs(0, lengths=[5, 2], num_heads=4, num_kv_heads=2, tokens_per_block=4, pages_per_seq=2)
    q = inputs.q[:, 0]

    @jax.jit
    def step(q, k_pages, v_pages, lengths, page_indices):
        return KERNELS[kernel](q, k_pages, v_pages, lengths, page_indices, sm_scale=0.25)

    expected = paged_attention_ref(
        q, inputs.clean_k_pages, inputs.clean_v_pages, inputs.lengths, inputs.page_indices, sm_scale=0.25
    )
    assert_close(step(q, inputs.k_pages, inputs.v_pages, inputs.lengths, inputs.page_indices), expected)


def test_gpu_rejects_blocks_below_dot_size():
    inputs = make_inputs(0, lengths=[5], num_heads=2, num_kv_heads=1, tokens_per_block=4, pages_per_seq=2)
    with pytest.raises(ValueError, match="pages_per_block=2 times tokens_per_block=4 must be >= 16"):
        gpu.paged_attention(
            inputs.q[:, 0], inputs.k_pages, inputs.v_pages, inputs.lengths, inputs.page_indices,
            sm_scale=1.0, pages_per_block=2, interpret=True,
        )


def test_gpu_rejects_non_power_of_two_pages():
    inputs = make_inputs(0, lengths=[5], num_heads=2, num_kv_heads=1, tokens_per_block=3, pages_per_seq=2)
    with pytest.raises(ValueError, match="tokens_per_block=3 must be a power of two"):
        gpu.paged_attention(
            inputs.q[:, 0], inputs.k_pages, inputs.v_pages, inputs.lengths, inputs.page_indices,
            sm_scale=1.0, interpret=True,
        )


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_rejects_bad_heads(kernel):
    inputs = make_inputs(0, lengths=[5], num_heads=3, num_kv_heads=2, tokens_per_block=4, pages_per_seq=2)
    with pytest.raises(ValueError, match="num_heads=3 must be a multiple of num_kv_heads=2"):
        KERNELS[kernel](
            inputs.q[:, 0], inputs.k_pages, inputs.v_pages, inputs.lengths, inputs.page_indices, sm_scale=1.0
        )
