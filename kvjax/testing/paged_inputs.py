"""Random paged-attention inputs with poisoned (NaN) memory wherever a kernel must not look.

Pools are tiny: ``NULL_PAGE`` (page 0) is the null page and a few spare pages are never referenced;
all of them hold NaN. Each block table is a random permutation of real pages; entries
past a sequence's length, and pages that lie wholly outside every query's window, point
at the null page. Slots past the length inside a sequence's last page are NaN as well.
The reference runs on a copy with NaN replaced by zeros (it needs no poison to be right),
so any NaN in a kernel's output is a stray read.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from kvjax.cache import NULL_PAGE
from kvjax.cache.quant import KV_STORAGE_DTYPES, absmax_scale, quantize
from pallas_kernels.common import PagedKV

SPARE_PAGES = 2
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2}
WINDOW_AND_CAP = (
    {"sliding_window": 1},
    {"sliding_window": 3},
    {"sliding_window": 6},
    {"sliding_window": 8},
    {"logit_soft_cap": 2.0},
    {"sliding_window": 5, "logit_soft_cap": 2.0},
)
"""``AttentionSpec`` windows and soft caps every implementation is checked with: windows of one
token, under a page, over a page and of whole pages, a cap alone and with a window."""
HEADS = ((8, 8), (8, 1), (6, 3), (3, 1))
"""(num_heads, num_kv_heads): MHA, MQA, GQA with 2 and 3 query heads per KV head, MQA with 3."""
GRID = (
    *((tokens_per_block, heads, jnp.float32) for tokens_per_block in (4, 8) for heads in HEADS),
    *((8, heads, jnp.bfloat16) for heads in HEADS),
)
"""(tokens_per_block, heads, dtype) of every implementation's main comparison with the reference."""


def grid_id(value: object) -> str:
    """A pytest id for a ``GRID`` field (a dtype by its name)."""
    return jnp.dtype(value).name if isinstance(value, type) else str(value)


def options_id(options: dict) -> str:
    """A pytest id for a ``WINDOW_AND_CAP`` entry, e.g. "sliding_window=5-logit_soft_cap=2.0"."""
    return "-".join(f"{key}={value}" for key, value in options.items())


def grid_seed(tokens_per_block: int, heads: tuple[int, int]) -> int:
    """The seed of a ``GRID`` case: each case its own problem."""
    return tokens_per_block * 100 + heads[0] * 10 + heads[1]


@dataclasses.dataclass(frozen=True)
class PagedInputs:
    """One random problem.

    Attributes:
      q: [num_seqs, num_queries, num_heads, head_dim].
      q_positions: [num_seqs, num_queries] int32 (negative = padding row).
      k_pages, v_pages: [num_pages, tokens_per_block, num_kv_heads, head_dim] with NaN poison.
      clean_k_pages, clean_v_pages: the same with the poison replaced by zeros.
      lengths: [num_seqs] int32.
      page_indices: [num_seqs, pages_per_seq] int32.
    """

    q: jnp.ndarray
    q_positions: jnp.ndarray
    k_pages: jnp.ndarray
    v_pages: jnp.ndarray
    clean_k_pages: jnp.ndarray
    clean_v_pages: jnp.ndarray
    lengths: jnp.ndarray
    page_indices: jnp.ndarray

    @property
    def kv(self) -> PagedKV:
        """The poisoned pages with their lengths and block tables (what a kernel reads)."""
        return PagedKV(self.k_pages, self.v_pages, self.lengths, self.page_indices)

    @property
    def clean_kv(self) -> PagedKV:
        """The clean pages with their lengths and block tables (what the reference reads)."""
        return PagedKV(self.clean_k_pages, self.clean_v_pages, self.lengths, self.page_indices)


def make_inputs(
    seed: int,
    *,
    lengths: list[int],
    num_heads: int,
    num_kv_heads: int,
    tokens_per_block: int,
    pages_per_seq: int,
    head_dim: int = 16,
    dtype=jnp.float32,
    num_queries: int = 1,
    chunked: bool = False,
    sliding_window: int | None = None,
) -> PagedInputs:
    """Builds a problem; ``num_queries == 1`` and not ``chunked`` puts the query at length - 1.

    Args:
      seed: numpy seed.
      lengths: valid slots per sequence (0 = padding sequence), each <= pages_per_seq * tokens_per_block.
      num_heads, num_kv_heads, tokens_per_block, pages_per_seq, head_dim, dtype: geometry.
      num_queries: query rows per sequence.
      chunked: positions are the last ``num_queries`` slots (chunked prefill); otherwise a
        random subset in random order with the newest token and some padding rows.
      sliding_window: pages wholly outside every query's window are released to the null page.
    """
    rng = np.random.default_rng(seed)
    num_seqs = len(lengths)
    num_pages = 1 + num_seqs * pages_per_seq + SPARE_PAGES
    shape = (num_pages, tokens_per_block, num_kv_heads, head_dim)
    k_pages = rng.standard_normal(shape).astype(np.float32)
    v_pages = rng.standard_normal(shape).astype(np.float32)
    poison = np.ones(shape[:2], bool)  # [num_pages, tokens_per_block]
    owned = rng.permutation(np.arange(1, num_pages))[: num_seqs * pages_per_seq]
    table = owned.reshape(num_seqs, pages_per_seq).astype(np.int32)
    positions = np.full((num_seqs, num_queries), -1, np.int32)
    for s, length in enumerate(lengths):
        if length > 0 and chunked:
            chunk = np.arange(max(length - num_queries, 0), length)
            positions[s, : len(chunk)] = chunk
        elif length > 0:
            count = min(length, max(1, num_queries - 1))
            picks = rng.choice(length - 1, size=count - 1, replace=False) if count > 1 else np.zeros(0, int)
            positions[s, :count] = rng.permutation(np.append(picks, length - 1))
        valid = positions[s][positions[s] >= 0]
        first_needed = 0
        if sliding_window is not None and valid.size:
            first_needed = max(int(valid.min()) - sliding_window + 1, 0)
        for j in range(pages_per_seq):
            slots = np.arange(j * tokens_per_block, (j + 1) * tokens_per_block)
            if slots[0] >= length or slots[-1] < first_needed:
                table[s, j] = NULL_PAGE
            else:
                poison[table[s, j]] = slots >= length
    k_pages[poison] = np.nan
    v_pages[poison] = np.nan
    q = rng.standard_normal((num_seqs, num_queries, num_heads, head_dim)).astype(np.float32)
    clean = lambda x: jnp.asarray(np.nan_to_num(x, nan=0.0), dtype)
    return PagedInputs(
        q=jnp.asarray(q, dtype),
        q_positions=jnp.asarray(positions),
        k_pages=jnp.asarray(k_pages, dtype),
        v_pages=jnp.asarray(v_pages, dtype),
        clean_k_pages=clean(k_pages),
        clean_v_pages=clean(v_pages),
        lengths=jnp.asarray(lengths, jnp.int32),
        page_indices=jnp.asarray(table),
    )


def assert_close(actual: jnp.ndarray, expected: jnp.ndarray) -> None:
    """No NaN, and equal within the dtype's tolerance (relative, with the same absolute floor)."""
    actual32 = np.asarray(actual, np.float32)
    assert not np.isnan(actual32).any(), "NaN leaked into the kernel output"
    tol = TOLERANCE[jnp.dtype(actual.dtype).name]
    np.testing.assert_allclose(actual32, np.asarray(expected, np.float32), rtol=tol, atol=tol)


@dataclasses.dataclass(frozen=True)
class QuantizedInputs:
    """A problem's pages quantized, the poison kept: NaN scales (and, for fp8, NaN values)
    wherever the float pages held NaN.

    Attributes:
      k_pages, v_pages: [num_pages, tokens_per_block, num_kv_heads, head_dim] int8 or float8_e4m3fn.
      k_scales, v_scales: [num_pages, tokens_per_block or 1, num_kv_heads] float32.
      dequantized_k_pages, dequantized_v_pages: values * scales in float32, poison replaced
        by zeros (what the reference attends over).
    """

    k_pages: jnp.ndarray
    v_pages: jnp.ndarray
    k_scales: jnp.ndarray
    v_scales: jnp.ndarray
    dequantized_k_pages: jnp.ndarray
    dequantized_v_pages: jnp.ndarray

    def kv(self, inputs: PagedInputs) -> PagedKV:
        """The quantized pages and their scales over ``inputs``' lengths and block tables."""
        return PagedKV(self.k_pages, self.v_pages, inputs.lengths, inputs.page_indices, self.k_scales, self.v_scales)

    def dequantized_kv(self, inputs: PagedInputs) -> PagedKV:
        """The dequantized pages over ``inputs``' lengths and block tables (what the reference reads)."""
        return PagedKV(self.dequantized_k_pages, self.dequantized_v_pages, inputs.lengths, inputs.page_indices)


def quantize_inputs(inputs: PagedInputs, dtype: str, granularity: str) -> QuantizedInputs:
    """Absmax quantization of ``inputs``' pages per (slot, KV head) or per (page, KV head)."""
    storage = KV_STORAGE_DTYPES[dtype]

    def one(pages: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
        raw = np.asarray(pages, np.float32)
        poison = np.isnan(raw)  # [P, t, h, d]
        clean = np.nan_to_num(raw, nan=0.0)
        if granularity == "token":
            scales = np.array(absmax_scale(jnp.asarray(clean), storage))  # [P, t, h]
            scales[poison.any(-1)] = np.nan
        else:
            scales = np.array(
                absmax_scale(jnp.asarray(clean.transpose(0, 2, 1, 3).reshape(*raw.shape[::2], -1)), storage)
            )
            scales = scales[:, None, :]  # [P, 1, h]
            scales[np.asarray(poison.all((1, 3)))[:, None, :]] = np.nan
        values = np.asarray(quantize(jnp.asarray(clean), jnp.asarray(np.nan_to_num(scales, nan=1.0)), storage))
        if storage == jnp.float8_e4m3fn:
            values = values.copy()
            values[poison] = np.nan
        dequantized = np.where(poison, 0.0, values.astype(np.float32) * np.nan_to_num(scales, nan=0.0)[..., None])
        return jnp.asarray(values), jnp.asarray(scales), jnp.asarray(dequantized, jnp.float32)

    k, ks, kd = one(inputs.k_pages)
    v, vs, vd = one(inputs.v_pages)
    return QuantizedInputs(k, v, ks, vs, kd, vd)
