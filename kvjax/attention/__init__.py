"""One entry point per attention op; picks the Pallas kernel or the blocked XLA implementation by backend.

The ops: ``partial_attention`` (query rows at positions over paged KV: prefill, chunked
prefill, verification), ``paged_attention`` (decode) and ``row_attention`` (query rows over
one sequence's contiguous KV: the blended prefill). Every choice of implementation is made
here (``_choose``), for the engine and the blended prefill alike.

``impl``:
  "auto"       the TPU kernel on TPU, the GPU kernel on GPU, the blocked XLA implementation
               elsewhere (CPU). On a Hopper GPU, decode runs the Mosaic GPU kernel
               (``pallas_kernels/paged_attention/mosaic_gpu.py``) when it takes the pages
               (bf16 / f16, ``tokens_per_block`` a multiple of 8, ``head_dim`` a multiple of 16, float
               pages) and the installed jax has its API; the Triton kernel otherwise.
  "blocked"    the blocked, flash-style XLA implementation
               (``kvjax/attention/blocked.py``): online softmax over key
               blocks, work proportional to the sequence's length.
  "reference"  the plain-jnp reference (``pallas_kernels/*/reference.py``).
  "interpret"  a Pallas kernel in interpret mode (runs on CPU; slow, for tests):
               ``interpret_kernel="gpu"`` (default, the faster to interpret) runs the Triton
               kernel under the generic interpreter, ``"tpu"`` the TPU kernel under
               ``pltpu.InterpretParams`` (simulated DMAs and semaphores, raises on
               out-of-bounds reads).

Both functions are jittable; ``impl``, ``interpret_kernel`` and ``mesh`` are Python values
fixed at trace time.

Over a device mesh (``mesh`` given, axes ``PAGES_AXIS`` x ``KV_AXIS``, pools sharded as
``(pages, -, kv, -)``), the chosen implementation runs per device under ``jax.shard_map``,
so the Pallas kernels run sharded too (a custom call the SPMD partitioner cannot split):
each device attends with its own KV heads; when the pages axis has more than one device,
each first gathers its own pages of every sequence (others read as zeros) and one
all-reduce over ``pages`` assembles each sequence's K/V run, which the kernel then reads
through an identity block table. The pool itself is never all-gathered.

Every op takes its queries, the keys and values (``PagedKV``: pages, lengths, block tables)
and an ``AttentionSpec`` (scale, window, soft cap), documented and checked by
``pallas_kernels.common.check_inputs``. Quantized pools: ``paged_kv`` makes the ``PagedKV`` of
``kvjax.cache.QuantizedPages`` (int8 or float8_e4m3fn values with per-token or per-page
scales); the chosen implementation dequantizes inside attention. Over a mesh only float pages
are supported for now.

Axis letters and names are ``kvjax/axes.py``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import Mesh, PartitionSpec

from kvjax.attention import blocked, rows
from kvjax.cache.quant import QuantizedPages
from pallas_kernels.common import AttentionSpec, PagedKV
from pallas_kernels.paged_attention import gpu as paged_gpu
from pallas_kernels.paged_attention import mosaic_gpu as paged_mosaic_gpu
from pallas_kernels.paged_attention import tpu as paged_tpu
from pallas_kernels.paged_attention.reference import paged_attention_ref
from pallas_kernels.partial_attention import gpu as partial_gpu
from pallas_kernels.partial_attention import tpu as partial_tpu
from pallas_kernels.partial_attention.reference import partial_attention_ref

Impl = Literal["auto", "blocked", "reference", "interpret"]
IMPLS = ("auto", "blocked", "reference", "interpret")
Kernel = Literal["tpu", "gpu"]
KERNELS = ("tpu", "gpu")
GPU_PLATFORMS = ("gpu", "cuda", "rocm")
PAGES_AXIS = "pages"
"""Mesh axis over the page dimension of every pool."""
KV_AXIS = "kv"
"""Mesh axis over the KV heads (and, consistently, the query heads)."""


def _choose(impl: str, interpret_kernel: str) -> tuple[str, bool | pltpu.InterpretParams]:
    """Resolves ``impl`` to ("blocked" | "reference" | "tpu" | "gpu", the kernels' ``interpret`` value)."""
    if impl not in IMPLS:
        raise ValueError(f"attention impl={impl!r} must be one of {IMPLS}")
    if interpret_kernel not in KERNELS:
        raise ValueError(f"{interpret_kernel=} must be one of {KERNELS}")
    if impl in ("reference", "blocked"):
        return impl, False
    if impl == "interpret":
        return interpret_kernel, pltpu.InterpretParams() if interpret_kernel == "tpu" else True
    backend = jax.default_backend()
    if backend == "tpu":
        return "tpu", False
    if backend in GPU_PLATFORMS:
        return "gpu", False
    return "blocked", False


def paged_kv(
    k_pages: jax.Array | QuantizedPages,
    v_pages: jax.Array | QuantizedPages,
    lengths: jax.Array,
    page_indices: jax.Array,
) -> PagedKV:
    """One layer's pages as the attention ops read them: float pages as they are, quantized
    pages (``QuantizedPages``) as their values with their scales.

    Args:
      k_pages, v_pages: [num_pages, tokens_per_block, num_kv_heads, head_dim] arrays, or both
        ``QuantizedPages``; lengths: [s] int32; page_indices: [s, p] int32 block tables.

    Raises:
      ValueError: one of ``k_pages`` / ``v_pages`` quantized and the other not.
    """
    if isinstance(k_pages, QuantizedPages) and isinstance(v_pages, QuantizedPages):
        return PagedKV(k_pages.values, v_pages.values, lengths, page_indices, k_pages.scales, v_pages.scales)
    if isinstance(k_pages, QuantizedPages) or isinstance(v_pages, QuantizedPages):
        raise ValueError("k_pages and v_pages must both be quantized (QuantizedPages) or both be arrays")
    return PagedKV(k_pages, v_pages, lengths, page_indices)


_IMPLEMENTATIONS: dict[str, dict[str, Callable[..., jax.Array]]] = {
    "partial": {"tpu": partial_tpu.partial_attention, "gpu": partial_gpu.partial_attention,
                "blocked": blocked.partial_attention, "reference": partial_attention_ref},
    "paged": {"tpu": paged_tpu.paged_attention, "gpu": paged_gpu.paged_attention,
              "blocked": blocked.paged_attention, "reference": paged_attention_ref},
}
"""Per op, the implementation of each resolved ``impl`` (``_choose``)."""


def _attend(
    op: str,
    q: jax.Array,
    q_positions: jax.Array | None,
    kv: PagedKV,
    spec: AttentionSpec,
    *,
    impl: Impl,
    interpret_kernel: Kernel,
    mesh: Mesh | None,
) -> jax.Array:
    """The one dispatcher of both ops: ``op`` ("partial" with ``q_positions``, or "paged")
    through the implementation ``impl`` resolves to, per device when ``mesh`` is given."""
    kernel, interpret = _choose(impl, interpret_kernel)
    if mesh is not None:
        if kv.scales:
            raise ValueError(
                "quantized KV pages (int8 / fp8) over a device mesh are not supported; use a float KV dtype"
            )

        def local(
            q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, lengths: jax.Array, table: jax.Array, *rest: jax.Array
        ) -> jax.Array:
            local_kv = PagedKV(k_pages, v_pages, lengths, table)
            positions = rest[0] if rest else None
            return _attend(op, q, positions, local_kv, spec, impl=impl, interpret_kernel=interpret_kernel, mesh=None)

        rest = () if q_positions is None else (q_positions,)
        return _over_mesh(local, mesh, q, kv.k_pages, kv.v_pages, kv.lengths, kv.page_indices, *rest)
    implementation = _IMPLEMENTATIONS[op][kernel]
    options: dict[str, Any] = {"interpret": interpret} if kernel in ("tpu", "gpu") else {}
    if op == "paged" and kernel == "gpu" and interpret is False:
        implementation = paged_gpu_kernel(q, kv.k_pages, quantized=bool(kv.scales))
    queries = (q,) if q_positions is None else (q, q_positions)
    return implementation(*queries, kv, spec, **options)


def paged_gpu_kernel(q: jax.Array, k_pages: jax.Array, *, quantized: bool) -> Callable[..., jax.Array]:
    """The compiled GPU decode kernel for these arguments: Mosaic GPU on a Hopper GPU whose jax
    has its API, when it takes the pages' dtype and sizes (``mosaic_gpu.supports``); Triton otherwise.

    Args:
      q: [num_seqs, num_heads, head_dim] decode queries.
      k_pages: [num_pages, tokens_per_block, num_kv_heads, head_dim] page values.
      quantized: the pages come with scales (int8 / fp8; Triton only).
    """
    _, tokens_per_block, num_kv_heads, head_dim = k_pages.shape
    group = q.shape[-2] // num_kv_heads
    if paged_mosaic_gpu.available() and paged_mosaic_gpu.supports(
        k_pages.dtype, tokens_per_block, head_dim, group, quantized
    ):
        return paged_mosaic_gpu.paged_attention
    return paged_gpu.paged_attention


def partial_attention(
    q: jax.Array,
    q_positions: jax.Array,
    kv: PagedKV,
    spec: AttentionSpec,
    *,
    impl: Impl = "auto",
    interpret_kernel: Kernel = "gpu",
    mesh: Mesh | None = None,
) -> jax.Array:
    """Query rows at absolute positions over paged KV.

    The attention arguments are ``pallas_kernels.common.check_inputs``'s (``paged_kv`` builds
    ``kv`` from quantized pages too); ``impl``, ``interpret_kernel`` and ``mesh`` are the
    module docstring's.
    """
    return _attend("partial", q, q_positions, kv, spec, impl=impl, interpret_kernel=interpret_kernel, mesh=mesh)


def paged_attention(
    q: jax.Array,
    kv: PagedKV,
    spec: AttentionSpec,
    *,
    impl: Impl = "auto",
    interpret_kernel: Kernel = "gpu",
    mesh: Mesh | None = None,
) -> jax.Array:
    """Decode attention, one query per sequence; arguments as in ``partial_attention``, less ``q_positions``."""
    return _attend("paged", q, None, kv, spec, impl=impl, interpret_kernel=interpret_kernel, mesh=mesh)


def row_attention(
    q: jax.Array,
    q_positions: jax.Array,
    k: jax.Array,
    v: jax.Array,
    length: jax.Array,
    spec: AttentionSpec,
    *,
    tokens_per_block: int,
    impl: Impl = "auto",
    interpret_kernel: Kernel = "gpu",
) -> jax.Array:
    """Query rows at absolute positions over one sequence's contiguous K/V (slot i holds
    position i): the blended prefill's attention. Where ``impl`` resolves to the blocked XLA
    implementation the arrays are read as they are (``kvjax.attention.rows``); the kernels and
    the reference see them as pages 0, 1, ... of ``partial_attention``. Both mask exactly by position.

    Args:
      q: [q, H, d]; q_positions: [q] int32 (negative = padding row, output zero).
      k, v: [T, h, d], T a multiple of ``tokens_per_block``; length: [] int32 valid slots.
      spec: scale, window and soft cap.

    Returns:
      [q, H, d] in q's dtype.
    """
    kernel, _ = _choose(impl, interpret_kernel)
    if kernel == "blocked":
        return rows.row_attention(q, q_positions, k, v, length, spec)
    t = k.shape[0]
    pages = (t // tokens_per_block, tokens_per_block, *k.shape[1:])
    table = jnp.arange(t // tokens_per_block, dtype=jnp.int32)[None]
    kv = PagedKV(k.reshape(pages), v.reshape(pages), length[None], table)
    return partial_attention(q[None], q_positions[None], kv, spec, impl=impl, interpret_kernel=interpret_kernel)[0]


def _over_mesh(
    attend: Callable[..., jax.Array],
    mesh: Mesh,
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    lengths: jax.Array,
    page_indices: jax.Array,
    *rest: jax.Array,
) -> jax.Array:
    """``attend(q, k_pages, v_pages, lengths, page_indices, *rest)`` per device of ``mesh``.

    Args:
      q: [..., num_heads, head_dim], heads split over ``KV_AXIS`` like the pools' KV heads.
      k_pages, v_pages: [num_pages, tokens_per_block, num_kv_heads, head_dim], sharded
        ``(PAGES_AXIS, -, KV_AXIS, -)``.
      lengths [s], page_indices [s, p] (global page ids), rest (e.g. query positions):
        replicated.

    Returns:
      Like q, heads split over ``KV_AXIS``.
    """
    heads = PartitionSpec(*([None] * (q.ndim - 2)), KV_AXIS, None)
    pool = PartitionSpec(PAGES_AXIS, None, KV_AXIS, None)
    num_page_shards = mesh.shape[PAGES_AXIS]

    def local(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, lengths: jax.Array, table: jax.Array,
              *rest: jax.Array) -> jax.Array:
        if num_page_shards > 1:
            k_pages, v_pages, table = _assemble_runs(k_pages, v_pages, table)
        return attend(q, k_pages, v_pages, lengths, table, *rest)

    replicated = (PartitionSpec(),) * (2 + len(rest))
    return jax.shard_map(
        local, mesh=mesh, in_specs=(heads, pool, pool, *replicated), out_specs=heads, check_vma=False,
    )(q, k_pages, v_pages, lengths, page_indices, *rest)


def _assemble_runs(k_pages: jax.Array, v_pages: jax.Array, table: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Inside ``shard_map`` over a split page axis: every sequence's pages gathered from the
    devices that hold them (one all-reduce over ``PAGES_AXIS``) as a pool of ``num_seqs *
    pages_per_seq`` pages with an identity block table.

    Args:
      k_pages, v_pages: this device's [num_local_pages, tokens_per_block, kv_heads_local, head_dim].
      table: [num_seqs, pages_per_seq] global page ids.

    Returns:
      (k, v [num_seqs * pages_per_seq, tokens_per_block, kv_heads_local, head_dim],
      table [num_seqs, pages_per_seq]).
    """
    num_local = k_pages.shape[0]
    local_ids = table - jax.lax.axis_index(PAGES_AXIS) * num_local
    mine = ((local_ids >= 0) & (local_ids < num_local))[..., None, None, None]
    safe = jnp.clip(local_ids, 0, num_local - 1)

    def run(pages: jax.Array) -> jax.Array:
        gathered = jnp.where(mine, pages[safe], jnp.zeros((), pages.dtype))  # [s, p, t, h, d]
        return jax.lax.psum(gathered, PAGES_AXIS).reshape(-1, *pages.shape[1:])

    identity = jnp.arange(table.size, dtype=table.dtype).reshape(table.shape)
    return run(k_pages), run(v_pages), identity
