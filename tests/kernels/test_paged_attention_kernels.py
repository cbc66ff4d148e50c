"""Paged decode kernels (TPU, Triton GPU and Mosaic GPU, in interpret mode) against the XLA reference.

The Mosaic GPU kernel takes bf16 / f16 pages of a multiple of 8 tokens only
(``mosaic_gpu.check_mosaic_shapes``): it skips the grid's other cases and runs the shared
window, soft-cap and jit cases at ``GEOMETRY["mosaic_gpu"]``. Under the GPU interpreter its
two products are ``jnp.dot`` of the SMEM tiles (the interpreter has no ``layout_cast`` and
runs wgmma only on untransposed SMEM operands); ``test_mosaic_gpu_lowers_for_cuda`` lowers
the wgmma form for CUDA on CPU and ``test_mosaic_gpu_on_hopper`` runs it on a Hopper GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import tpu as pltpu

from kvjax import attention
from kvjax.testing.paged_inputs import GRID, WINDOW_AND_CAP, assert_close, grid_id, grid_seed, make_inputs, options_id
from pallas_kernels.common import AttentionSpec, PagedKV
from pallas_kernels.paged_attention import gpu, mosaic_gpu, tpu
from pallas_kernels.paged_attention.reference import paged_attention_ref

KERNELS = {
    "tpu": functools.partial(tpu.paged_attention, interpret=pltpu.InterpretParams()),
    "gpu": functools.partial(gpu.paged_attention, interpret=True),
    "mosaic_gpu": functools.partial(mosaic_gpu.paged_attention, interpret=True),
}
GEOMETRY = {"tpu": (4, jnp.float32), "gpu": (4, jnp.float32), "mosaic_gpu": (8, jnp.bfloat16)}
"""(tokens_per_block, dtype) of each kernel's window, soft-cap and jit cases: the smallest it takes."""
PAGES_PER_SEQ = 4


def lengths_for(tokens_per_block: int) -> list[int]:
    """One token, a full page, a page plus one, a full table, and a padding sequence."""
    return [1, tokens_per_block, tokens_per_block + 1, PAGES_PER_SEQ * tokens_per_block, 0]


def taken(kernel: str, tokens_per_block: int, dtype) -> bool:
    """Whether ``kernel`` takes pages of this size and dtype (Mosaic GPU refuses f32 pages and
    pages of 4 tokens by design; ``test_mosaic_gpu_rejects_what_hopper_cannot_run`` checks the refusals)."""
    return kernel != "mosaic_gpu" or mosaic_gpu.supports(dtype, tokens_per_block, 16, 1, False)


def spec_and_blocking(sm_scale: float, options: dict) -> tuple[AttentionSpec, dict]:
    """``options`` split into the ``AttentionSpec`` (window, soft cap) and the kernel's blocking."""
    blocking = {key: value for key, value in options.items() if key not in ("sliding_window", "logit_soft_cap")}
    return AttentionSpec(sm_scale, options.get("sliding_window"), options.get("logit_soft_cap")), blocking


def run_case(kernel: str, *, seed: int, tokens_per_block: int, heads: tuple[int, int], dtype, **options) -> None:
    num_heads, num_kv_heads = heads
    inputs = make_inputs(
        seed, lengths=lengths_for(tokens_per_block), num_heads=num_heads, num_kv_heads=num_kv_heads,
        tokens_per_block=tokens_per_block, pages_per_seq=PAGES_PER_SEQ, dtype=dtype,
        sliding_window=options.get("sliding_window"),
    )
    spec, blocking = spec_and_blocking(inputs.q.shape[-1] ** -0.5, options)
    q = inputs.q[:, 0]
    expected = paged_attention_ref(q, inputs.clean_kv, spec)
    actual = KERNELS[kernel](q, inputs.kv, spec, **blocking)
    assert actual.shape == q.shape and actual.dtype == q.dtype
    assert_close(actual, expected)


@pytest.mark.parametrize(
    ("kernel", "tokens_per_block", "heads", "dtype"),
    [(kernel, *case) for kernel in sorted(KERNELS) for case in GRID if taken(kernel, case[0], case[2])],
    ids=grid_id,
)
def test_matches_reference(kernel, tokens_per_block, heads, dtype):
    run_case(kernel, seed=grid_seed(tokens_per_block, heads), tokens_per_block=tokens_per_block, heads=heads,
             dtype=dtype)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("options", WINDOW_AND_CAP, ids=options_id)
def test_window_and_soft_cap(kernel, options):
    tokens_per_block, dtype = GEOMETRY[kernel]
    run_case(kernel, seed=7, tokens_per_block=tokens_per_block, heads=(6, 3), dtype=dtype, **options)


@pytest.mark.parametrize(("kernel", "tokens_per_block", "dtype", "blocking"), [
    ("tpu", 4, jnp.float32, {"pages_per_block": 1}),
    ("tpu", 4, jnp.float32, {"pages_per_block": 3}),
    ("gpu", 16, jnp.float32, {"pages_per_block": 1, "k_splits": 4}),
    ("gpu", 8, jnp.float32, {"pages_per_block": 2, "k_splits": 2}),
    ("gpu", 4, jnp.float32, {"pages_per_block": 4, "k_splits": 1}),
    # Two blocks per split (both SMEM slots, each block's copies in flight during the one
    # before); the last: one block, so two of the three splits are empty.
    ("mosaic_gpu", 32, jnp.bfloat16, {"pages_per_block": 2, "k_splits": 1}),
    ("mosaic_gpu", 64, jnp.bfloat16, {"pages_per_block": 1, "k_splits": 2}),
    ("mosaic_gpu", 16, jnp.bfloat16, {"pages_per_block": 4, "k_splits": 3}),
], ids=lambda value: jnp.dtype(value).name if isinstance(value, type) else None)
def test_block_sizes(kernel, tokens_per_block, dtype, blocking):
    run_case(
        kernel, seed=11, tokens_per_block=tokens_per_block, heads=(8, 1), dtype=dtype, sliding_window=6, **blocking
    )


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_jits_inside_caller(kernel):
    tokens_per_block, dtype = GEOMETRY[kernel]
    inputs = make_inputs(0, lengths=[5, 2], num_heads=4, num_kv_heads=2, tokens_per_block=tokens_per_block,
                         pages_per_seq=2, dtype=dtype)
    q = inputs.q[:, 0]

    @jax.jit
    def step(q, kv):
        return KERNELS[kernel](q, kv, AttentionSpec(0.25))

    expected = paged_attention_ref(q, inputs.clean_kv, AttentionSpec(0.25))
    assert_close(step(q, inputs.kv), expected)


def test_gpu_rejects_blocks_below_dot_size():
    inputs = make_inputs(0, lengths=[5], num_heads=2, num_kv_heads=1, tokens_per_block=4, pages_per_seq=2)
    with pytest.raises(ValueError, match="pages_per_block=2 times tokens_per_block=4 must be >= 16"):
        gpu.paged_attention(inputs.q[:, 0], inputs.kv, AttentionSpec(1.0), pages_per_block=2, interpret=True)


def test_gpu_rejects_non_power_of_two_pages():
    inputs = make_inputs(0, lengths=[5], num_heads=2, num_kv_heads=1, tokens_per_block=3, pages_per_seq=2)
    with pytest.raises(ValueError, match="tokens_per_block=3 must be a power of two"):
        gpu.paged_attention(inputs.q[:, 0], inputs.kv, AttentionSpec(1.0), interpret=True)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_rejects_bad_heads(kernel):
    inputs = make_inputs(0, lengths=[5], num_heads=3, num_kv_heads=2, tokens_per_block=4, pages_per_seq=2)
    with pytest.raises(ValueError, match="num_heads=3 must be a multiple of num_kv_heads=2"):
        KERNELS[kernel](inputs.q[:, 0], inputs.kv, AttentionSpec(1.0))


@pytest.mark.parametrize(
    ("geometry", "message"),
    [
        ({"tokens_per_block": 8, "dtype": jnp.float32}, "page dtype=float32 must be one of"),
        ({"tokens_per_block": 4, "dtype": jnp.bfloat16}, "tokens_per_block=4 must be a multiple of 8"),
        (
            {"tokens_per_block": 8, "dtype": jnp.bfloat16, "pages_per_block": 4},
            "pages_per_block=4 times tokens_per_block=8 must be a multiple of 64",
        ),
        ({"tokens_per_block": 8, "dtype": jnp.bfloat16, "head_dim": 24}, "head_dim=24 must be a multiple of 16"),
        (
            {"tokens_per_block": 128, "dtype": jnp.bfloat16, "head_dim": 128, "pages_per_block": 2},
            "need 311808 bytes of shared memory, more than 232448",
        ),
    ],
)
def test_mosaic_gpu_rejects_what_hopper_cannot_run(geometry, message):
    pages_per_block = geometry.pop("pages_per_block", None)
    inputs = make_inputs(0, lengths=[5], num_heads=2, num_kv_heads=1, pages_per_seq=2, **geometry)
    with pytest.raises(ValueError, match=message):
        mosaic_gpu.paged_attention(
            inputs.q[:, 0], inputs.kv, AttentionSpec(1.0), pages_per_block=pages_per_block, interpret=True
        )


def test_mosaic_gpu_rejects_quantized_pages():
    inputs = make_inputs(0, lengths=[5], num_heads=2, num_kv_heads=1, tokens_per_block=8, pages_per_seq=2)
    pages = inputs.k_pages.astype(jnp.int8)
    scales = jnp.ones(pages.shape[:3], jnp.float32)
    kv = PagedKV(pages, pages, inputs.lengths, inputs.page_indices, scales, scales)
    with pytest.raises(ValueError, match="quantized pages"):
        mosaic_gpu.paged_attention(inputs.q[:, 0], kv, AttentionSpec(1.0), interpret=True)


@pytest.mark.parametrize(("tokens_per_block", "head_dim", "heads", "dtype", "options"), [
    (8, 16, (8, 8), jnp.bfloat16, {}),
    (16, 128, (8, 1), jnp.float16, {"k_splits": 2}),
    (64, 64, (6, 3), jnp.bfloat16, {"pages_per_block": 2, "sliding_window": 5, "logit_soft_cap": 2.0}),
    (16, 128, (128, 1), jnp.bfloat16, {}),
])
def test_mosaic_gpu_lowers_for_cuda(tokens_per_block, head_dim, heads, dtype, options):
    """The compiled form (wgmma, layout hints, TMA page copies) passes Mosaic GPU's lowering,
    which checks wgmma's operand shapes, swizzles, tiles and register layouts, with no GPU."""
    inputs = make_inputs(0, lengths=[1, 9, 4 * tokens_per_block], num_heads=heads[0], num_kv_heads=heads[1],
                         tokens_per_block=tokens_per_block, pages_per_seq=4, head_dim=head_dim, dtype=dtype)
    spec, blocking = spec_and_blocking(0.125, options)
    decode = functools.partial(mosaic_gpu.paged_attention, spec=spec, **blocking)
    lowered = jax.jit(decode).trace(inputs.q[:, 0], inputs.kv).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in lowered


def test_mosaic_gpu_unavailable_off_hopper_and_dispatch_falls_back(monkeypatch):
    """Off a Hopper GPU the Mosaic kernel is unavailable (on one, available); the dispatch takes it
    exactly when it is available and takes the pages, Triton otherwise."""
    inputs = make_inputs(0, lengths=[5], num_heads=2, num_kv_heads=1, tokens_per_block=8, pages_per_seq=2,
                         dtype=jnp.bfloat16)
    q, pages = inputs.q[:, 0], inputs.k_pages
    assert mosaic_gpu.has_mosaic_gpu_api()
    if jax.default_backend() == "cpu":
        assert not mosaic_gpu.available()
    monkeypatch.setattr(mosaic_gpu, "available", lambda: False)
    assert attention.paged_gpu_kernel(q, pages, quantized=False) is gpu.paged_attention
    monkeypatch.setattr(mosaic_gpu, "available", lambda: True)
    assert attention.paged_gpu_kernel(q, pages, quantized=False) is mosaic_gpu.paged_attention
    assert attention.paged_gpu_kernel(q, pages, quantized=True) is gpu.paged_attention
    assert attention.paged_gpu_kernel(q, pages.astype(jnp.float32), quantized=False) is gpu.paged_attention
    assert attention.paged_gpu_kernel(q, pages[:, :4], quantized=False) is gpu.paged_attention


@pytest.mark.skipif(not mosaic_gpu.available(), reason="needs a Hopper GPU (sm_90) and a jax with Mosaic GPU")
@pytest.mark.parametrize(("tokens_per_block", "head_dim", "heads", "options"), [
    (16, 128, (8, 1), {}),
    (16, 128, (32, 8), {"sliding_window": 40, "k_splits": 2}),
    (64, 64, (6, 3), {"logit_soft_cap": 30.0, "pages_per_block": 2}),
])
def test_mosaic_gpu_on_hopper(tokens_per_block, head_dim, heads, options):
    """The wgmma form, compiled and run: what interpret mode replaces by ``jnp.dot``."""
    inputs = make_inputs(5, lengths=[1, tokens_per_block + 1, 4 * tokens_per_block, 0], num_heads=heads[0],
                         num_kv_heads=heads[1], tokens_per_block=tokens_per_block, pages_per_seq=4,
                         head_dim=head_dim, dtype=jnp.bfloat16, sliding_window=options.get("sliding_window"))
    spec, blocking = spec_and_blocking(head_dim**-0.5, options)
    q = inputs.q[:, 0]
    expected = paged_attention_ref(q, inputs.clean_kv, spec)
    actual = mosaic_gpu.paged_attention(q, inputs.kv, spec, **blocking)
    assert_close(actual, expected)
