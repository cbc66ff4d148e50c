"""Attention over quantized (int8 / fp8) pages: every implementation, paged decode and partial
attention, per-token and per-page scales, against the reference over the dequantized pages.

The pages carry the usual poison (NaN scales, and NaN fp8 values, wherever the float pages were
NaN), so a kernel that reads a slot it must not see fails on NaN. f32 and bf16 pages on the
same grid are covered by ``test_partial_attention_kernels`` / ``test_paged_attention_kernels``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from kvjax import attention
from kvjax.attention import blocked
from kvjax.cache import QuantizedPages
from kvjax.testing.paged_inputs import assert_close, make_inputs, quantize_inputs
from pallas_kernels.common import AttentionSpec, PagedKV
from pallas_kernels.paged_attention import gpu as paged_gpu
from pallas_kernels.paged_attention import tpu as paged_tpu
from pallas_kernels.paged_attention.reference import paged_attention_ref
from pallas_kernels.partial_attention import gpu as partial_gpu
from pallas_kernels.partial_attention import tpu as partial_tpu
from pallas_kernels.partial_attention.reference import partial_attention_ref

PARTIAL = {
    "tpu": functools.partial(partial_tpu.partial_attention, interpret=pltpu.InterpretParams()),
    "gpu": functools.partial(partial_gpu.partial_attention, interpret=True),
    "blocked": blocked.partial_attention,
    "reference": partial_attention_ref,
}
PAGED = {
    "tpu": functools.partial(paged_tpu.paged_attention, interpret=pltpu.InterpretParams()),
    "gpu": functools.partial(paged_gpu.paged_attention, interpret=True),
    "blocked": blocked.paged_attention,
    "reference": paged_attention_ref,
}
TOKENS_PER_BLOCK = 8
PAGES_PER_SEQ = 4
LENGTHS = [1, TOKENS_PER_BLOCK, 2 * TOKENS_PER_BLOCK + 1, PAGES_PER_SEQ * TOKENS_PER_BLOCK, 0]


@pytest.mark.parametrize("granularity", ["token", "page"])
@pytest.mark.parametrize("dtype", ["int8", "fp8"])
@pytest.mark.parametrize("impl", list(PARTIAL))
def test_partial_attention_dequantizes_inside(impl, dtype, granularity):
    window = 11 if impl in ("tpu", "blocked") else None
    inputs = make_inputs(
        1, lengths=LENGTHS, num_heads=6, num_kv_heads=3, tokens_per_block=TOKENS_PER_BLOCK, pages_per_seq=PAGES_PER_SEQ,
        num_queries=6, sliding_window=window,
    )
    quant = quantize_inputs(inputs, dtype, granularity)
    spec = AttentionSpec(inputs.q.shape[-1] ** -0.5, window)
    expected = partial_attention_ref(inputs.q, inputs.q_positions, quant.dequantized_kv(inputs), spec)
    actual = PARTIAL[impl](inputs.q, inputs.q_positions, quant.kv(inputs), spec)
    assert actual.shape == inputs.q.shape and actual.dtype == inputs.q.dtype
    assert_close(actual, expected)


@pytest.mark.parametrize("granularity", ["token", "page"])
@pytest.mark.parametrize("dtype", ["int8", "fp8"])
@pytest.mark.parametrize("impl", list(PAGED))
def test_paged_attention_dequantizes_inside(impl, dtype, granularity):
    inputs = make_inputs(
        2, lengths=LENGTHS, num_heads=8, num_kv_heads=1, tokens_per_block=TOKENS_PER_BLOCK, pages_per_seq=PAGES_PER_SEQ,
    )
    quant = quantize_inputs(inputs, dtype, granularity)
    spec = AttentionSpec(inputs.q.shape[-1] ** -0.5, logit_soft_cap=5.0)
    q = inputs.q[:, 0]
    expected = paged_attention_ref(q, quant.dequantized_kv(inputs), spec)
    actual = PAGED[impl](q, quant.kv(inputs), spec)
    assert_close(actual, expected)


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_quantization_error_is_bounded_and_visible(dtype):
    """The dequantized pages differ from the float pages by at most half a step (int8) or the
    fp8 grid's relative spacing, and attention over them moves by a small but nonzero amount."""
    inputs = make_inputs(3, lengths=LENGTHS, num_heads=6, num_kv_heads=3, tokens_per_block=TOKENS_PER_BLOCK,
                         pages_per_seq=PAGES_PER_SEQ)
    quant = quantize_inputs(inputs, dtype, "token")
    clean, deq = np.asarray(inputs.clean_k_pages), np.asarray(quant.dequantized_k_pages)
    step = np.nan_to_num(np.asarray(quant.k_scales), nan=0.0)[..., None]
    bound = 0.5 * step if dtype == "int8" else 2.0**-4 * np.abs(clean) + 2.0**-9 * step
    assert np.all(np.abs(deq - clean) <= bound + 1e-7)
    spec = AttentionSpec(inputs.q.shape[-1] ** -0.5)
    exact = paged_attention_ref(inputs.q[:, 0], inputs.clean_kv, spec)
    quantized = paged_attention_ref(inputs.q[:, 0], quant.dequantized_kv(inputs), spec)
    deviation = float(np.max(np.abs(np.asarray(exact) - np.asarray(quantized))))
    assert 0 < deviation < (0.05 if dtype == "int8" else 0.25)


def test_dispatch_takes_quantized_pages():
    inputs = make_inputs(4, lengths=LENGTHS, num_heads=6, num_kv_heads=3, tokens_per_block=TOKENS_PER_BLOCK,
                         pages_per_seq=PAGES_PER_SEQ, num_queries=3)
    quant = quantize_inputs(inputs, "int8", "page")
    k = QuantizedPages(values=quant.k_pages, scales=quant.k_scales)
    v = QuantizedPages(values=quant.v_pages, scales=quant.v_scales)
    spec = AttentionSpec(inputs.q.shape[-1] ** -0.5)
    expected = partial_attention_ref(inputs.q, inputs.q_positions, quant.dequantized_kv(inputs), spec)
    kv = attention.paged_kv(k, v, inputs.lengths, inputs.page_indices)
    for impl in ("reference", "blocked", "interpret"):
        assert_close(attention.partial_attention(inputs.q, inputs.q_positions, kv, spec, impl=impl), expected)
    with pytest.raises(ValueError, match="both be quantized"):
        attention.paged_kv(k, quant.dequantized_v_pages, inputs.lengths, inputs.page_indices)


def test_bad_scales_are_refused_with_their_shape():
    inputs = make_inputs(5, lengths=[TOKENS_PER_BLOCK], num_heads=2, num_kv_heads=1, tokens_per_block=TOKENS_PER_BLOCK,
                         pages_per_seq=2)
    quant = quantize_inputs(inputs, "int8", "token")
    kv = quant.kv(inputs)

    def call(partial, kv: PagedKV) -> None:
        partial(inputs.q, inputs.q_positions, kv, AttentionSpec(1.0))

    with pytest.raises(ValueError, match="given together"):
        call(PARTIAL["gpu"], dataclasses.replace(kv, v_scales=None))
    with pytest.raises(ValueError, match=r"k_scales.shape=\(.*\) must be .* \(per token\) or .* \(per page\)"):
        call(PARTIAL["gpu"], dataclasses.replace(kv, k_scales=quant.k_scales[:, :2]))
    with pytest.raises(ValueError, match="k_scales.dtype=bfloat16 must be float32"):
        call(PARTIAL["gpu"], dataclasses.replace(kv, k_scales=quant.k_scales.astype(jnp.bfloat16)))
    with pytest.raises(ValueError, match="must be int8 or float8_e4m3fn when scales are given"):
        call(PARTIAL["tpu"], dataclasses.replace(inputs.clean_kv, k_scales=quant.k_scales, v_scales=quant.v_scales))
