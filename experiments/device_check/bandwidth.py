"""Stage "bandwidth": paged decode's achieved HBM bytes/s against the device's copy bandwidth.

One pool per page dtype (bf16; int8 and fp8 with per-token float32 scales) of
``sizes.bw_max_tokens`` tokens, random values made on the device; each point (batch x context
up to that) reads ``batch`` sequences of ``context`` tokens through a block table of distinct,
randomly permuted pages, through the Triton kernel and, for bf16 pages where it can run,
the Mosaic GPU kernel. Bytes
counted: the K and V pages (and scales) the sequences own, read once; the copy ceiling is
``x + 1`` over ``sizes.copy_elements`` bf16 values, bytes read + written. At one point
(``sizes.bw_sweep_point``, bf16) the Triton kernel also runs at other (pages_per_block, k_splits),
and the XLA reference (gather, then attend) and contiguous attention run for comparison.
Times are the mean over ``sizes.bw_calls`` calls dispatched back to back (two untimed calls
first); ``first_call_s`` is the first call alone, compilation included.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench_paged_attention import contiguous_decode
from experiments.device_check.correctness import MOSAIC_PATH, PAGED_PATH, mosaic_skip_reason
from experiments.device_check.stages import SKIPPED, Context, Table, error_text
from kvjax.cache.quant import KV_STORAGE_DTYPES
from pallas_kernels.common import AttentionSpec, PagedKV
from pallas_kernels.paged_attention import gpu as paged_gpu
from pallas_kernels.paged_attention import mosaic_gpu as paged_mosaic
from pallas_kernels.paged_attention.reference import paged_attention_ref


def timed(fn: Callable[[], jax.Array], calls: int) -> tuple[float, float]:
    """(seconds of the first call, compilation included; mean seconds per call of ``calls`` more)."""
    start = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - start
    jax.block_until_ready(fn())
    start = time.perf_counter()
    for _ in range(calls):
        result = fn()
    jax.block_until_ready(result)
    return first, (time.perf_counter() - start) / calls


def copy_bandwidth(elements: int, calls: int) -> float:
    """Device copy bandwidth in bytes/s: ``x + 1`` over ``elements`` bf16 values, read + written."""
    x = jnp.zeros((elements,), jnp.bfloat16)
    add_one = jax.jit(lambda x: x + jnp.ones((), x.dtype))
    _, seconds = timed(lambda: add_one(x), calls)
    return 2 * x.nbytes / seconds


def make_pool(key: jax.Array, shape: tuple[int, ...], kv_dtype: str) -> tuple[jax.Array, jax.Array | None]:
    """Random pages [num_pages, tokens_per_block, num_kv_heads, head_dim] of ``kv_dtype``, and
    per-token scales [num_pages, tokens_per_block, num_kv_heads] float32 (None for float pages)."""
    storage = KV_STORAGE_DTYPES[kv_dtype]
    values_key, scales_key = jax.random.split(key)
    if storage == jnp.int8:
        values = jax.random.randint(values_key, shape, -127, 128, jnp.int8)
    else:
        values = jax.random.normal(values_key, shape, jnp.float32).astype(storage)
    if kv_dtype not in ("int8", "fp8"):
        return values, None
    return values, jax.random.uniform(scales_key, shape[:3], jnp.float32, 0.005, 0.02)


def measure_point(
    context: Context,
    kernel: str,
    kv_dtype: str,
    batch: int,
    context_len: int,
    fn: Callable[[], jax.Array],
    token_bytes: int,
    ceiling: float,
) -> dict:
    """One row: ``fn`` timed, its K/V bytes per second against ``ceiling`` (bytes/s); any error recorded."""
    row = dict(kernel=kernel, kv_dtype=kv_dtype, batch=batch, context=context_len, first_call_s=float("nan"),
               us=float("nan"), tokens_per_s=float("nan"), gb_per_s=float("nan"), of_copy=float("nan"), error="")
    if context.out_of_time:
        row["error"] = SKIPPED
        return row
    try:
        first, seconds = timed(fn, context.sizes.bw_calls)
        kv_bytes = batch * context_len * token_bytes
        row.update(
            first_call_s=first,
            us=1e6 * seconds,
            tokens_per_s=batch / seconds,
            gb_per_s=kv_bytes / seconds / 1e9,
            of_copy=kv_bytes / seconds / ceiling,
        )
    except Exception as error:
        row["error"] = error_text(error)
    if kernel.startswith("pallas"):
        context.record_path(MOSAIC_PATH if "mosaic" in kernel else PAGED_PATH, row["error"] or None)
    return row


def dtype_rows(context: Context, kv_dtype: str, ceiling: float, permuted: np.ndarray) -> list[dict]:
    """Every point of one page dtype (and, for bf16, the sweep and the XLA baselines); the
    pools are freed on return."""
    sizes = context.sizes
    num_heads, num_kv_heads = sizes.bw_heads
    head_dim, tokens_per_block, sm_scale = sizes.bw_head_dim, sizes.bw_tokens_per_block, sizes.bw_head_dim**-0.5
    shape = (1 + len(permuted), tokens_per_block, num_kv_heads, head_dim)
    k_pages, k_scales = make_pool(jax.random.key(1), shape, kv_dtype)
    v_pages, v_scales = make_pool(jax.random.key(2), shape, kv_dtype)
    quantized = k_scales is not None
    token_bytes = 2 * num_kv_heads * (head_dim * k_pages.dtype.itemsize + (4 if quantized else 0))
    spec = AttentionSpec(sm_scale)

    def problem(batch: int, context_len: int) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q [batch, num_heads, head_dim] bf16, lengths [batch], block table [batch, context_len / tokens_per_block]."""
        pages = context_len // tokens_per_block
        return (jnp.ones((batch, num_heads, head_dim), jnp.bfloat16), jnp.full((batch,), context_len, jnp.int32),
                jnp.asarray(permuted[: batch * pages].reshape(batch, pages)))

    def kernel(q: jax.Array, lengths: jax.Array, table: jax.Array, **blocking: int) -> jax.Array:
        kv = PagedKV(k_pages, v_pages, lengths, table, k_scales, v_scales)
        return paged_gpu.paged_attention(q, kv, spec, interpret=sizes.interpret, **blocking)

    def mosaic(q: jax.Array, lengths: jax.Array, table: jax.Array) -> jax.Array:
        kv = PagedKV(k_pages, v_pages, lengths, table)
        return paged_mosaic.paged_attention(q, kv, spec, interpret=sizes.interpret)

    with_mosaic = not quantized and mosaic_skip_reason(sizes.interpret) is None and paged_mosaic.supports(
        k_pages.dtype, tokens_per_block, head_dim, num_heads // num_kv_heads, False)
    rows = []
    for batch in sizes.bw_batches:
        for context_len in (c for c in sizes.bw_contexts if batch * c <= sizes.bw_max_tokens):
            args = problem(batch, context_len)
            rows.append(
                measure_point(
                    context,
                    "pallas triton (tuned)",
                    kv_dtype,
                    batch,
                    context_len,
                    lambda args=args: kernel(*args),
                    token_bytes,
                    ceiling,
                )
            )
            if with_mosaic:
                rows.append(measure_point(context, "pallas mosaic gpu (tuned)", kv_dtype, batch, context_len,
                                          lambda args=args: mosaic(*args), token_bytes, ceiling))
    if kv_dtype != "bfloat16":
        return rows
    batch, context_len = sizes.bw_sweep_point
    q, lengths, table = problem(batch, context_len)
    for pages_per_block, k_splits in sizes.bw_sweep:
        rows.append(
            measure_point(
                context,
                f"pallas triton P={pages_per_block} k_splits={k_splits}",
                kv_dtype,
                batch,
                context_len,
                lambda p=pages_per_block, s=k_splits: kernel(q, lengths, table, pages_per_block=p, k_splits=s),
                token_bytes,
                ceiling,
            )
        )
    reference = jax.jit(lambda q, k, v, n, t: paged_attention_ref(q, PagedKV(k, v, n, t), spec))
    rows.append(measure_point(context, "xla reference (gather)", kv_dtype, batch, context_len,
                              lambda: reference(q, k_pages, v_pages, lengths, table), token_bytes, ceiling))
    owned = 1 + batch * context_len // tokens_per_block
    k_contig = k_pages[1:owned].reshape(batch, context_len, num_kv_heads, head_dim)
    v_contig = v_pages[1:owned].reshape(batch, context_len, num_kv_heads, head_dim)
    contiguous = jax.jit(lambda q, k, v, n: contiguous_decode(q, k, v, n, sm_scale))
    rows.append(measure_point(context, "xla contiguous", kv_dtype, batch, context_len,
                              lambda: contiguous(q, k_contig, v_contig, lengths), token_bytes, ceiling))
    return rows


def run(context: Context) -> list[Table]:
    sizes = context.sizes
    ceiling = copy_bandwidth(sizes.copy_elements, sizes.bw_calls)
    num_pages = 1 + sizes.bw_max_tokens // sizes.bw_tokens_per_block  # page 0 is the null page
    permuted = np.random.default_rng(0).permutation(np.arange(1, num_pages)).astype(np.int32)
    rows = [row for kv_dtype in sizes.bw_dtypes for row in dtype_rows(context, kv_dtype, ceiling, permuted)]
    note = (
        f"Paged decode, heads {sizes.bw_heads[0]}/{sizes.bw_heads[1]}, head_dim {sizes.bw_head_dim}, tokens_per_block "
        f"{sizes.bw_tokens_per_block}, bf16 queries; device copy {ceiling / 1e9:.0f} GB/s (read + written); GB/s "
        f"counts "
        f"the K and V bytes (and scales) read once; mean of {sizes.bw_calls} back-to-back calls."
    )
    return [Table("Paged decode bandwidth", note, rows)]
