"""One entry point per attention op; picks the Pallas kernel or the XLA reference by backend.

``impl``:
  "auto"       the TPU kernel on TPU, the GPU kernel on GPU, the blocked XLA
               implementation elsewhere (CPU).
  "blocked"    the blocked, flash-style XLA implementation
               (``pallas_kernels/partial_attention/blocked.py``): online softmax over key
               blocks, work proportional to the sequence's length.
  "reference"  the plain-jnp reference (``pallas_kernels/*/reference.py``).
  "interpret"  a Pallas kernel in interpret mode (runs on CPU; slow, for tests):
               ``interpret_kernel="gpu"`` (default, the faster to interpret) runs the Triton
               kernel under the generic interpreter, ``"tpu"`` the TPU kernel under
               ``pltpu.InterpretParams`` (simulated DMAs and semaphores, raises on
               out-of-bounds reads).

Both functions are jittable; ``impl`` and ``interpret_kernel`` are Python values fixed at
trace time.

Shapes follow the glossary in ``pallas_kernels/__init__.py``.
"""

from __future__ import annotations

from typing import Literal

import jax
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.paged_attention import gpu as paged_gpu
from pallas_kernels.partial_attention import blocked
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
    interpret_kernel: Kernel = "gpu",
) -> jax.Array:
    """Query rows at absolute positions over paged KV; see ``partial_attention_ref`` for shapes."""
    kernel, interpret = _choose(impl, interpret_kernel)
    options = dict(sm_scale=sm_scale, sliding_window=sliding_window, logit_soft_cap=logit_soft_cap)
    args = (q, q_positions, k_pages, v_pages, lengths, page_indices)
    if kernel == "tpu":
        return partial_tpu.partial_attention(*args, **options, interpret=interpret)
    if kernel == "gpu":
        return partial_gpu.partial_attention(*args, **options, interpret=interpret)
    if kernel == "blocked":
        return blocked.partial_attention(*args, **options)
    return partial_attention_ref(*args, **options)


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
    interpret_kernel: Kernel = "gpu",
) -> jax.Array:
    """Decode attention, one query per sequence; see ``paged_attention_ref`` for shapes."""
    kernel, interpret = _choose(impl, interpret_kernel)
    options = dict(sm_scale=sm_scale, sliding_window=sliding_window, logit_soft_cap=logit_soft_cap)
    args = (q, k_pages, v_pages, lengths, page_indices)
    if kernel == "tpu":
        return paged_tpu.paged_attention(*args, **options, interpret=interpret)
    if kernel == "gpu":
        return paged_gpu.paged_attention(*args, **options, interpret=interpret)
    if kernel == "blocked":
        return blocked.paged_attention(*args, **options)
    return paged_attention_ref(*args, **options)
