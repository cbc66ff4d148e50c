"""Stage "correctness": the Pallas Triton kernels against the plain-jnp references.

Every case of ``sizes.grid`` runs paged decode and partial (chunked-prefill) attention, each
plain and with a sliding window (and a logit soft cap for decode), over NaN-poisoned pools
and permuted block tables (``kvjax.testing.paged_inputs``); decode runs the Triton kernel and,
where it can run (``mosaic_skip_reason``) and takes the pages, the Mosaic GPU kernel; every case of
``sizes.quantized_grid`` runs both ops over int8 and fp8 pages with per-token and per-page
scales against the reference over the dequantized pages. A case that fails to lower or run
records its error and the grid goes on. Tolerance: max |actual - expected| / (|expected| + 1)
<= 1e-5 (float32 queries) or 1e-2 (bfloat16).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np

from experiments.device_check.sizes import GridCase
from experiments.device_check.stages import SKIPPED, Context, Table, error_text
from kvjax.testing.paged_inputs import TOLERANCE, make_inputs, quantize_inputs
from pallas_kernels.common import AttentionSpec
from pallas_kernels.paged_attention import gpu as paged_gpu
from pallas_kernels.paged_attention import mosaic_gpu as paged_mosaic
from pallas_kernels.paged_attention.reference import paged_attention_ref
from pallas_kernels.partial_attention import gpu as partial_gpu
from pallas_kernels.partial_attention.reference import partial_attention_ref

PAGED_PATH = "paged decode, Pallas Triton"
PARTIAL_PATH = "partial attention, Pallas Triton"
MOSAIC_PATH = "paged decode, Pallas Mosaic GPU"
paged_ref = jax.jit(paged_attention_ref, static_argnames="spec")
partial_ref = jax.jit(partial_attention_ref, static_argnames="spec")
"""The references, jitted: one program per shape instead of one per operation."""
VARIANTS = ((None, None, 1), (100, 30.0, 1), (None, None, 48), (70, None, 48))
"""(sliding_window, logit_soft_cap, queries per sequence): one query is decode, 48 a prefill chunk."""


def max_rel_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """max |actual - expected| / (|expected| + 1) in float32; NaN when ``actual`` holds NaN."""
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    if np.isnan(actual).any():
        return float("nan")
    return float(np.max(np.abs(actual - expected) / (np.abs(expected) + 1.0)))


def mosaic_skip_reason(interpret: bool) -> str | None:
    """None when the Mosaic GPU decode kernel can run here (compiled on a Hopper GPU whose jax
    has its API, or under the Mosaic GPU interpreter), else why not."""
    if not paged_mosaic.has_mosaic_gpu_api():
        return "this jax lacks the Mosaic GPU API the kernel uses"
    if interpret:
        return None if paged_mosaic.InterpretGPUParams is not None else "this jax has no Mosaic GPU interpreter"
    return None if paged_mosaic.available() else f"needs a Hopper GPU (sm_90), not {jax.devices()[0].device_kind}"


def _lengths(tokens_per_block: int, pages_per_seq: int) -> list[int]:
    """Sequence lengths that hit every edge: 1, one page, one page + 1, a full table, padding, ragged."""
    t = tokens_per_block
    return [1, t, t + 1, pages_per_seq * t, 0, min(5 * t - 3, pages_per_seq * t)]


def check_case(context: Context, case: GridCase, window: int | None, cap: float | None, num_queries: int,
               kv_dtype: str | None = None, granularity: str = "token", mosaic: bool = False) -> dict:
    """One kernel call against its reference; ``kv_dtype`` "int8" / "fp8" quantizes the pages;
    ``mosaic`` runs decode's Mosaic GPU kernel instead of the Triton one."""
    tokens_per_block, (num_heads, num_kv_heads), head_dim, dtype = case
    op = "decode" if num_queries == 1 else "partial"
    path = MOSAIC_PATH if mosaic else PAGED_PATH if op == "decode" else PARTIAL_PATH
    row = dict(
        kernel="mosaic gpu" if mosaic else "triton",
        op=op,
        tokens_per_block=tokens_per_block,
        heads=f"{num_heads}/{num_kv_heads}",
        head_dim=head_dim,
        q_dtype=dtype,
        kv_dtype=kv_dtype or dtype,
        scales=granularity if kv_dtype else "-",
        window=window,
        soft_cap=cap,
        max_rel_err=float("nan"),
        ok=False,
        error="",
    )
    if context.out_of_time:
        row["error"] = SKIPPED
        return row
    try:
        inputs = make_inputs(
            tokens_per_block + head_dim, lengths=_lengths(tokens_per_block, context.sizes.pages_per_seq),
            num_heads=num_heads, num_kv_heads=num_kv_heads, tokens_per_block=tokens_per_block,
            pages_per_seq=context.sizes.pages_per_seq, head_dim=head_dim, dtype=jnp.dtype(dtype),
            num_queries=num_queries, chunked=num_queries > 1, sliding_window=window,
        )
        spec = AttentionSpec(head_dim**-0.5, window, cap)
        kv, clean = inputs.kv, inputs.clean_kv
        if kv_dtype is not None:
            quant = quantize_inputs(inputs, kv_dtype, granularity)
            kv, clean = quant.kv(inputs), quant.dequantized_kv(inputs)
        if op == "decode":
            q = inputs.q[:, 0]
            expected = paged_ref(q, clean, spec)
            kernel = paged_mosaic.paged_attention if mosaic else paged_gpu.paged_attention
            actual = kernel(q, kv, spec, interpret=context.sizes.interpret)
        else:
            args = (inputs.q, inputs.q_positions)
            expected = partial_ref(*args, clean, spec)
            actual = partial_gpu.partial_attention(*args, kv, spec, interpret=context.sizes.interpret)
        row["max_rel_err"] = max_rel_error(actual, expected)
        row["ok"] = row["max_rel_err"] <= TOLERANCE[dtype]
    except Exception as error:
        row["error"] = error_text(error)
    context.record_path(path, row["error"] or None)
    return row


def run(context: Context) -> list[Table]:
    """The three families of cases (Triton over float pages, Mosaic GPU decode, quantized
    pages) interleaved, so that a stage budget spent early still leaves every family checked."""
    sizes = context.sizes
    triton = [dict(case=case, window=w, cap=c, num_queries=n) for case in sizes.grid for w, c, n in VARIANTS]
    mosaic = []
    reason = mosaic_skip_reason(sizes.interpret)
    if reason is None:
        mosaic = [
            dict(case=case, window=w, cap=c, num_queries=1, mosaic=True)
            for case in sizes.grid
            for w, c, n in VARIANTS
            if n == 1 and paged_mosaic.supports(jnp.dtype(case[3]), case[0], case[2], case[1][0] // case[1][1], False)
        ]
    else:
        context.skip_path(MOSAIC_PATH, reason)
    quantized = [dict(case=case, window=None, cap=None, num_queries=n, kv_dtype=kv_dtype, granularity=granularity)
                 for case in sizes.quantized_grid for kv_dtype in ("int8", "fp8") for granularity in ("token", "page")
                 for n in (1, 48)]
    order = [spec for group in itertools.zip_longest(triton, mosaic, quantized) for spec in group if spec is not None]
    rows = [check_case(context, **spec) for spec in order]
    skipped = sum(r["error"] == SKIPPED for r in rows)
    rows = [r for r in rows if r["error"] != SKIPPED]
    passed = sum(r["ok"] for r in rows)
    note = (
        f"{passed}/{len(rows)} within tolerance (1e-5 float32, 1e-2 bfloat16 queries; max |a - e| / (|e| + 1)); "
        f"Pallas kernels {'interpreted on the CPU' if sizes.interpret else 'compiled for the device'}, NaN-poisoned "
        f"pools"
        + (f"; {skipped} more cases skipped ({SKIPPED})." if skipped else ".")
    )
    return [Table("Kernel correctness against the references", note, rows)]
