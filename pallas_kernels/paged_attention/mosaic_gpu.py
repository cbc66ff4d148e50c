"""Paged decode attention: Pallas Mosaic GPU kernel for Hopper (wgmma, TMA page gathers).

Same arguments, reference and split-KV merge as the Triton kernel (``gpu.py``). Grid
``(num_seqs, num_kv_heads, k_splits)``, one warpgroup per program. A program takes the query
heads of one KV head, padded to ``rows`` (a multiple of 64, wgmma's M), and one contiguous
share of the sequence's block table. Each loop step gathers ``pages_per_block`` pages of K and
of V from the pool into shared memory, one TMA copy per page (the page id is read from the
block table in GMEM), double-buffered: the copies of step ``b + 1`` are in flight while step
``b`` computes::

    table[s]   |-- split 0 --|-- split 1 --|                 each split: (acc, m, l)
    split k    | block b | block b+1 | ...                   block = pages_per_block pages
    SMEM slot  |    0    |     1     |  0  | ...             K and V slots, one barrier each
    step b     S = q @ k^T (wgmma, [rows, block_k]) -> mask, soft cap, online softmax
               acc += p @ v (wgmma, p in registers)

Slots outside ``[kv_start, length)`` may hold NaN (the null page, slots past the length, pages
the window released): their logits are replaced by ``MASK_VALUE`` and, in the blocks that
have such slots, their V rows are zeroed in shared memory before ``p @ v`` (``0 * NaN``).

Hardware limits, checked by ``check_mosaic_shapes``: bf16 or f16 pages (wgmma takes p from
registers only in 16-bit types; f32 would run as TF32), no quantized pages,
``tokens_per_block`` a multiple of 8 (a page fills whole 8-row SMEM tiles), ``head_dim`` a
multiple of 16, ``pages_per_block * tokens_per_block`` (``block_k``) a multiple of 64 and at
most 256 (the V tile's register layout and wgmma's N), and q plus two K and two V slots within
227 KiB of shared memory. ``available()`` says whether this kernel can run here (a Hopper GPU
and a jax with the Mosaic GPU API); the dispatcher in ``kvjax.attention`` falls back to the
Triton kernel otherwise.

``interpret=True`` runs the kernel on CPU under the Mosaic GPU interpreter (simulated GMEM,
SMEM, barriers and TMA copies). That interpreter (jax 0.10.2) has no rule for ``layout_cast``
("MLIR translation rule for primitive 'layout_cast' not found for platform cpu") and runs
wgmma only on two SMEM operands without transforms other than slicing (``transpose_ref``:
"'TransposeTransform' object has no attribute 'indices'"), so there the two products are
``jnp.dot`` of the SMEM tiles and the layout hints are left out; everything else (the page
gathers, barriers, slots, masks, softmax and V zeroing) is the compiled kernel's code.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import common
from pallas_kernels.paged_attention.gpu import choose_k_splits
from pallas_kernels.tuned_sizes import block_sizes

try:
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # a jax without Mosaic GPU
    plgpu = None  # type: ignore[assignment]  # checked by available()
try:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
except ImportError:  # a jax without the GPU interpreter
    InterpretGPUParams = None  # type: ignore[assignment,misc]  # checked before use

WGMMA_ROWS = 64
"""wgmma's M: query rows are padded to a multiple of this."""
TILE_ROWS = 8
"""Rows of one swizzled SMEM tile: a page must fill whole tiles."""
MAX_BLOCK_K = 256
"""wgmma's largest N (the logits tile is [rows, block_k])."""
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
HOPPER_MAJOR = 9
"""Compute capability major of Hopper (sm_90a): wgmma exists there only (not on Blackwell)."""
NUM_SLOTS = 2
"""SMEM buffers per operand: the next block's copies overlap this block's compute."""
SMEM_BYTES = 227 * 1024
"""Shared memory one Hopper block may use (H100 / H200)."""
_NEEDED_API = ("kernel", "wgmma", "copy_gmem_to_smem", "copy_smem_to_gmem", "barrier_wait",
               "Barrier", "ACC", "SMEM", "Layout", "layout_cast", "commit_smem",
               "wait_smem_to_gmem", "TilingTransform", "SwizzleTransform", "transpose_ref", "find_swizzle")


def has_mosaic_gpu_api() -> bool:
    """True when the installed jax has every Mosaic GPU function this kernel uses."""
    return plgpu is not None and all(hasattr(plgpu, name) for name in _NEEDED_API)


def available() -> bool:
    """True when the default backend is a Hopper GPU and jax has the Mosaic GPU API."""
    if jax.default_backend() not in ("gpu", "cuda") or not has_mosaic_gpu_api():
        return False
    capability = getattr(jax.devices()[0], "compute_capability", None)
    if capability is None:
        return False
    return int(str(capability).split(".")[0]) == HOPPER_MAJOR


def query_rows(group: int) -> int:
    """Rows of a program's query tile: its ``group`` query heads padded to wgmma's M."""
    return pl.cdiv(group, WGMMA_ROWS) * WGMMA_ROWS


def smem_bytes(rows: int, block_k: int, head_dim: int, itemsize: int) -> int:
    """Shared memory of one program: q, the K and V slots (page dtype) and the f32 outputs."""
    return (rows + 2 * NUM_SLOTS * block_k) * head_dim * itemsize + (rows * head_dim + 2 * rows) * 4


def check_mosaic_shapes(
    dtype: jnp.dtype, tokens_per_block: int, head_dim: int, pages_per_block: int, group: int, quantized: bool
) -> None:
    """Raises ValueError unless the Mosaic GPU kernel can run these sizes (module docstring);
    ``group`` is the query heads per KV head."""
    if quantized:
        raise ValueError("quantized pages (k_scales / v_scales) are not supported by the Mosaic GPU kernel")
    if jnp.dtype(dtype) not in DTYPES:
        raise ValueError(
            f"page dtype={jnp.dtype(dtype)} must be one of {[d.name for d in DTYPES]} for the Mosaic GPU kernel"
        )
    if tokens_per_block % TILE_ROWS:
        raise ValueError(f"{tokens_per_block=} must be a multiple of {TILE_ROWS} for the Mosaic GPU kernel")
    if head_dim % 16:
        raise ValueError(f"{head_dim=} must be a multiple of 16 for the Mosaic GPU kernel")
    block_k = pages_per_block * tokens_per_block
    if block_k % WGMMA_ROWS or block_k > MAX_BLOCK_K:
        raise ValueError(
            f"{pages_per_block=} times {tokens_per_block=} must be a multiple of {WGMMA_ROWS} "
            f"and <= {MAX_BLOCK_K} for the Mosaic GPU kernel"
        )
    needed = smem_bytes(query_rows(group), block_k, head_dim, jnp.dtype(dtype).itemsize)
    if needed > SMEM_BYTES:
        raise ValueError(
            f"{pages_per_block=} x {tokens_per_block=} slots of {head_dim=} for {group=} query heads need "
            f"{needed} bytes of shared memory, more than {SMEM_BYTES}; use fewer pages per block"
        )


def supports(dtype: jnp.dtype, tokens_per_block: int, head_dim: int, group: int, quantized: bool) -> bool:
    """True when ``check_mosaic_shapes`` accepts these sizes with the tuned ``pages_per_block``."""
    try:
        check_mosaic_shapes(dtype, tokens_per_block, head_dim, default_pages_per_block(tokens_per_block), group,
                            quantized)
    except ValueError:
        return False
    return True


def default_pages_per_block(tokens_per_block: int) -> int:
    """The tuned ``block_tokens`` in pages, raised so that ``block_k`` is a multiple of 64."""
    tuned = block_sizes("gpu", "decode").pages_per_block(tokens_per_block)
    step = WGMMA_ROWS // math.gcd(WGMMA_ROWS, tokens_per_block)
    return pl.cdiv(tuned, step) * step


def _smem_tile(shape: tuple[int, ...], dtype: jnp.dtype) -> pl.MemoryRef:
    """An SMEM buffer swizzled and tiled as wgmma reads it (minor dim = head_dim)."""
    swizzle = plgpu.find_swizzle(shape[-1] * jnp.finfo(dtype).bits, "head_dim")
    tiling = plgpu.TilingTransform((TILE_ROWS, swizzle * 8 // jnp.finfo(dtype).bits))
    return plgpu.SMEM(shape, dtype, transforms=(tiling, plgpu.SwizzleTransform(swizzle)))


def _logits_mma(q_smem, k_tile) -> jax.Array:
    """q @ k^T with wgmma: [rows, head_dim] x [block_k, head_dim] SMEM -> [rows, block_k] float32."""
    def scope(logits_ref):
        plgpu.wgmma(logits_ref, q_smem, plgpu.transpose_ref(k_tile, (1, 0)))
        return logits_ref[...]

    return pl.run_scoped(scope, plgpu.ACC((q_smem.shape[0], k_tile.shape[0]), jnp.float32))


def _pv_mma(p: jax.Array, v_tile) -> jax.Array:
    """p @ v with wgmma, p from registers: [rows, block_k] x [block_k, head_dim] SMEM -> float32."""
    def scope(pv_ref):
        plgpu.wgmma(pv_ref, p.astype(v_tile.dtype), v_tile)
        return pv_ref[...]

    return pl.run_scoped(scope, plgpu.ACC((p.shape[0], v_tile.shape[1]), jnp.float32))


def _logits_interpreted(q_smem, k_tile) -> jax.Array:
    """``_logits_mma`` as the GPU interpreter runs it: a dot of the loaded SMEM tiles."""
    return jnp.dot(q_smem[...], k_tile[...].T, preferred_element_type=jnp.float32)


def _pv_interpreted(p: jax.Array, v_tile) -> jax.Array:
    """``_pv_mma`` as the GPU interpreter runs it: a dot with the loaded SMEM tile."""
    return jnp.dot(p.astype(v_tile.dtype), v_tile[...], preferred_element_type=jnp.float32)


def _kernel(
    q_ref,  # GMEM [num_seqs, num_kv_heads, rows, head_dim]
    k_pages_ref,  # GMEM [num_pages, tokens_per_block, num_kv_heads, head_dim]
    v_pages_ref,  # GMEM [num_pages, tokens_per_block, num_kv_heads, head_dim]
    table_ref,  # GMEM [num_seqs, k_splits * pages_per_split] int32
    lengths_ref,  # GMEM [num_seqs] int32
    acc_out_ref,  # GMEM [k_splits, num_seqs, num_kv_heads, rows, head_dim] float32
    m_out_ref,  # GMEM [k_splits, num_seqs, num_kv_heads, rows] float32
    l_out_ref,  # GMEM [k_splits, num_seqs, num_kv_heads, rows] float32
    q_smem,  # SMEM [rows, head_dim]
    k_smem,  # SMEM [NUM_SLOTS, block_k, head_dim]
    v_smem,  # SMEM [NUM_SLOTS, block_k, head_dim]
    acc_smem,  # SMEM [rows, head_dim] float32
    m_smem,  # SMEM [rows] float32
    l_smem,  # SMEM [rows] float32
    q_barrier,  # 1 arrival
    k_barriers,  # [NUM_SLOTS], pages_per_block arrivals each
    v_barriers,  # [NUM_SLOTS], pages_per_block arrivals each
    *,
    pages_per_block: int,
    pages_per_split: int,
    spec: common.AttentionSpec,
    hardware: bool,
):
    # hardware: True when compiling for the GPU: the products are wgmma and the loop's register
    # arrays get wgmma's layout. False under the GPU interpreter, which has no rule for
    # ``layout_cast`` and runs wgmma only on two SMEM operands without ``transpose_ref``: the
    # products are then ``jnp.dot`` of the SMEM tiles and the layout hints (no-ops on values) go.
    seq, head, split = lax.axis_index("seqs"), lax.axis_index("kv_heads"), lax.axis_index("splits")
    rows, head_dim = q_smem.shape
    tokens_per_block = k_pages_ref.shape[1]
    block_k = pages_per_block * tokens_per_block
    split_start = split * pages_per_split * tokens_per_block  # first key slot of this split
    length = lengths_ref[seq]
    kv_start = 0 if spec.sliding_window is None else jnp.maximum(length - spec.sliding_window, 0)
    first_block = jnp.maximum(kv_start - split_start, 0) // block_k
    end_block = jnp.clip(pl.cdiv(length - split_start, block_k), first_block, pages_per_split // pages_per_block)

    def fetch(kv_block, slot):
        """Starts the TMA copies of block ``kv_block``'s K and V pages into ``slot``."""
        first_page = split * pages_per_split + kv_block * pages_per_block
        for p in range(pages_per_block):
            page = table_ref[seq, first_page + p]
            rows_of_page = pl.ds(p * tokens_per_block, tokens_per_block)
            plgpu.copy_gmem_to_smem(k_pages_ref.at[page, :, head], k_smem.at[slot, rows_of_page], k_barriers.at[slot])
            plgpu.copy_gmem_to_smem(v_pages_ref.at[page, :, head], v_smem.at[slot, rows_of_page], v_barriers.at[slot])

    plgpu.copy_gmem_to_smem(q_ref.at[seq, head], q_smem, q_barrier)

    @pl.when(first_block < end_block)
    def _():
        fetch(first_block, 0)

    plgpu.barrier_wait(q_barrier)
    wgmma = plgpu.Layout.WGMMA
    cast = plgpu.layout_cast if hardware else lambda x, layout: x
    logits_of, pv_of = (_logits_mma, _pv_mma) if hardware else (_logits_interpreted, _pv_interpreted)

    def iota(shape: tuple[int, int], dimension: int) -> jax.Array:
        return cast(lax.broadcasted_iota(jnp.int32, shape, dimension), wgmma)

    m = cast(jnp.full((rows,), common.MASK_VALUE, jnp.float32), wgmma.reduce(1))
    l = cast(jnp.zeros((rows,), jnp.float32), wgmma.reduce(1))
    acc = cast(jnp.zeros((rows, head_dim), jnp.float32), wgmma)

    def body(kv_block, carry):
        m, l, acc = carry
        slot = lax.rem(kv_block - first_block, NUM_SLOTS)

        @pl.when(kv_block + 1 < end_block)
        def _():
            fetch(kv_block + 1, lax.rem(kv_block + 1 - first_block, NUM_SLOTS))

        block_start = split_start + kv_block * block_k
        plgpu.barrier_wait(k_barriers.at[slot])

        logits = logits_of(q_smem, k_smem.at[slot]) * spec.sm_scale  # [rows, block_k]
        if spec.logit_soft_cap is not None:
            logits = spec.logit_soft_cap * jnp.tanh(logits / spec.logit_soft_cap)
        key_pos = block_start + iota((rows, block_k), 1)
        live = (key_pos >= kv_start) & (key_pos < length)  # [rows, block_k]: decode rows share one position
        logits = jnp.where(live, logits, common.MASK_VALUE)
        m_next = jnp.maximum(m, logits.max(axis=1))  # [rows]
        alpha = jnp.exp(m - m_next)  # [rows]
        p = jnp.where(live, jnp.exp(logits - lax.broadcast_in_dim(m_next, logits.shape, [0])), 0.0)
        l_next = alpha * l + p.sum(axis=1)
        plgpu.barrier_wait(v_barriers.at[slot])

        @pl.when((block_start < kv_start) | (block_start + block_k > length))
        def _():
            # Dead slots may hold NaN, and p @ v would turn their p = 0 into NaN: zero their V rows.
            slot_pos = block_start + iota((block_k, head_dim), 0)
            v = v_smem[slot]
            v_smem[slot] = jnp.where((slot_pos >= kv_start) & (slot_pos < length), v, jnp.zeros((), v.dtype))
            plgpu.commit_smem()

        pv = pv_of(p, v_smem.at[slot])  # [rows, head_dim]
        return m_next, l_next, acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv

    m, l, acc = lax.fori_loop(first_block, end_block, body, (m, l, acc))
    acc_smem[...] = acc
    m_smem[...] = m
    l_smem[...] = l
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(acc_smem, acc_out_ref.at[split, seq, head])
    plgpu.copy_smem_to_gmem(m_smem, m_out_ref.at[split, seq, head])
    plgpu.copy_smem_to_gmem(l_smem, l_out_ref.at[split, seq, head])
    plgpu.wait_smem_to_gmem(0)


def interpret_params(interpret: bool | object) -> object | None:
    """``paged_attention``'s ``interpret`` as ``plgpu.kernel`` takes it: None (compile), or
    the GPU interpreter's parameters (``True`` = the defaults)."""
    if interpret is False:
        return None
    if InterpretGPUParams is None:
        raise ValueError("interpret mode needs a jax with the Mosaic GPU interpreter (jax >= 0.10)")
    return InterpretGPUParams() if interpret is True else interpret


@functools.partial(jax.jit, static_argnames=("spec", "pages_per_block", "k_splits", "interpret"))
def paged_attention(
    q: jax.Array,
    kv: common.PagedKV,
    spec: common.AttentionSpec,
    *,
    pages_per_block: int | None = None,
    k_splits: int | None = None,
    interpret: bool | object = False,
) -> jax.Array:
    """Decode attention on a Hopper GPU: the newest token of each sequence over its pages.

    Args:
      q, kv, spec: the attention arguments of decode (``pallas_kernels.common.check_inputs``);
        quantized pages (scales given) are rejected (``check_mosaic_shapes``).
      pages_per_block: pages gathered per loop step; None = the tuned table, raised to a
        multiple of 64 slots (``default_pages_per_block``).
      k_splits: shares each table is split into; None = enough for the tuned ``min_programs``.
      interpret: False (compile for the GPU), True or an ``InterpretGPUParams``: run on CPU under
        the Mosaic GPU interpreter (simulated SMEM, barriers and TMA copies).

    Returns:
      [num_seqs, num_heads, head_dim] in q's dtype.
    """
    common.check_inputs(q, None, kv)
    k_pages, page_indices = kv.k_pages, kv.page_indices
    if plgpu is None or not has_mosaic_gpu_api():
        raise ValueError(f"jax {jax.__version__} lacks the Mosaic GPU API this kernel needs ({', '.join(_NEEDED_API)})")
    num_seqs, num_heads, head_dim = q.shape
    _, tokens_per_block, num_kv_heads, _ = k_pages.shape
    pages_per_seq = page_indices.shape[1]
    if pages_per_block is None:
        pages_per_block = default_pages_per_block(tokens_per_block)
    group = num_heads // num_kv_heads
    check_mosaic_shapes(k_pages.dtype, tokens_per_block, head_dim, pages_per_block, group, bool(kv.scales))
    num_blocks = pl.cdiv(pages_per_seq, pages_per_block)
    if k_splits is None:
        k_splits = choose_k_splits(num_seqs, num_kv_heads, num_blocks, block_sizes("gpu", "decode").min_programs)
    if k_splits < 1:
        raise ValueError(f"{k_splits=} must be >= 1")
    pages_per_split = pl.cdiv(num_blocks, k_splits) * pages_per_block
    rows = query_rows(group)

    q_rows = common.to_rows(q[:, None], num_kv_heads, rows, 1).astype(k_pages.dtype)  # [s, h, rows, d]
    table = common.pad_page_table(page_indices, k_splits * pages_per_split)  # [s, k_splits * pages_per_split]
    partial_shape = (k_splits, num_seqs, num_kv_heads, rows)
    kernel = plgpu.kernel(
        functools.partial(
            _kernel,
            pages_per_block=pages_per_block,
            pages_per_split=pages_per_split,
            spec=spec,
            hardware=interpret is False,
        ),
        out_type=(
            jax.ShapeDtypeStruct((*partial_shape, head_dim), jnp.float32),
            jax.ShapeDtypeStruct(partial_shape, jnp.float32),
            jax.ShapeDtypeStruct(partial_shape, jnp.float32),
        ),
        scratch_types=(
            _smem_tile((rows, head_dim), k_pages.dtype),
            _smem_tile((NUM_SLOTS, pages_per_block * tokens_per_block, head_dim), k_pages.dtype),
            _smem_tile((NUM_SLOTS, pages_per_block * tokens_per_block, head_dim), k_pages.dtype),
            plgpu.SMEM((rows, head_dim), jnp.float32),
            plgpu.SMEM((rows,), jnp.float32),
            plgpu.SMEM((rows,), jnp.float32),
            plgpu.Barrier(),
            plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=NUM_SLOTS),
            plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=NUM_SLOTS),
        ),
        grid=(num_seqs, num_kv_heads, k_splits),
        grid_names=("seqs", "kv_heads", "splits"),
        interpret=interpret_params(interpret),
    )
    acc, m, l = kernel(q_rows, k_pages, kv.v_pages, table, kv.lengths)

    m_all = jnp.max(m, axis=0)  # [s, h, rows]
    weight = jnp.exp(m - m_all)  # [k_splits, s, h, rows]
    l_all = jnp.sum(weight * l, axis=0)[..., None]  # [s, h, rows, 1]
    acc_all = jnp.sum(weight[..., None] * acc, axis=0)  # [s, h, rows, d]
    out = common.finish(l_all, acc_all).astype(q.dtype)
    return common.from_rows(out, 1, group, rows)[:, 0]
