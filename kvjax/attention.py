"""One entry point per attention op; picks the Pallas kernel or the XLA reference by backend.

``impl``:
  "auto"       the TPU kernel on TPU, the GPU kernel on GPU, the XLA reference elsewhere.
  "reference"  the plain-jnp reference (``pallas_kernels/*/reference.py``).
  "interpret"  the Pallas kernel in interpret mode (runs on CPU; slow, for tests).

Shapes follow the glossary in ``pallas_kernels/__init__.py``.
"""

from __future__ import annotations

from typing import Literal

import jax

from pallas_kernels.paged_attention.reference import paged_attention_ref
from pallas_kernels.partial_attention.reference import partial_attention_ref

Impl = Literal["auto", "reference", "interpret"]
IMPLS = ("auto", "reference", "interpret")


def _check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"attention impl={impl!r} must be one of {IMPLS}")


def partial_attention(
    q: jax.Array,
    q_positions: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    lengths: jax.Array,
    page_indices: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    logit_soft_cap: float | None = None,
    impl: Impl = "auto",
) -> jax.Array:
    """Query rows at absolute positions over paged KV; see ``partial_attention_ref`` for shapes."""
    _check_impl(impl)
    return partial_attention_ref(
        q, q_positions, k_pages, v_pages, lengths, page_indices,
        sm_scale=sm_scale, sliding_window=sliding_window, logit_soft_cap=logit_soft_cap,
    )


def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    lengths: jax.Array,
    page_indices: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    logit_soft_cap: float | None = None,
    impl: Impl = "auto",
) -> jax.Array:
    """Decode attention, one query per sequence; see ``paged_attention_ref`` for shapes."""
    _check_impl(impl)
    return paged_attention_ref(
        q, k_pages, v_pages, lengths, page_indices,
        sm_scale=sm_scale, sliding_window=sliding_window, logit_soft_cap=logit_soft_cap,
    )
