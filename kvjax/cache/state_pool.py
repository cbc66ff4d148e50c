"""The recurrent state pool of hybrid models: fixed slots of per-sequence recurrent state.

It sits beside the page pool. A slot holds one sequence's state of every recurrent layer:
a running sequence owns a live slot, which each step reads and writes; a snapshot slot holds
the state at a block boundary of a cached prefix, copied from a live slot while the sequence
was computed (take) and copied back into a new sequence's live slot to resume it (restore).
Which slot holds what is host bookkeeping (``kvjax.manager.state_snapshots``); the ops here
are pure functions over the pool array.

Axis letters are ``kvjax/axes.py``'s; ``num_slots`` counts the pool's slots (the null slot
included). The pool is [R, num_slots, H, d, d] float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

NULL_SLOT = 0
"""Slot 0 is never handed out: padding rows read and write it. Its contents are garbage by
design and no sequence ever resumes from it."""


def state_shape(num_recurrent_layers: int, num_slots: int, num_heads: int, head_dim: int) -> tuple[int, ...]:
    """Shape of the recurrent state of ``num_slots`` slots (or rows): [R, num_slots, H, d, d]."""
    return (num_recurrent_layers, num_slots, num_heads, head_dim, head_dim)


def slot_bytes(num_recurrent_layers: int, num_heads: int, head_dim: int) -> int:
    """Bytes of one slot: R * H * d * d float32."""
    return num_recurrent_layers * num_heads * head_dim * head_dim * 4


def init_state_pool(num_recurrent_layers: int, num_slots: int, num_heads: int, head_dim: int) -> jax.Array:
    """A zeroed pool [R, num_slots, H, d, d] float32 (R >= 1: a hybrid model's recurrent layers)."""
    if not isinstance(num_recurrent_layers, int) or num_recurrent_layers < 1:
        raise ValueError(
            f"num_recurrent_layers={num_recurrent_layers!r} must be an int >= 1: only a model with recurrent "
            "layers needs a state pool"
        )
    if not isinstance(num_slots, int) or num_slots < 2:
        raise ValueError(f"num_slots={num_slots!r} must be an int >= 2 (slot {NULL_SLOT} is the null slot)")
    return jnp.zeros(state_shape(num_recurrent_layers, num_slots, num_heads, head_dim), jnp.float32)


@jax.jit
def read_slots(pool: jax.Array, slots: jax.Array) -> jax.Array:
    """The states of ``slots`` [s] int32: [R, s, H, d, d]."""
    return pool[:, slots]


@functools.partial(jax.jit, donate_argnames=("pool",))
def write_slots(pool: jax.Array, slots: jax.Array, state: jax.Array) -> jax.Array:
    """Writes ``state`` [R, s, H, d, d] into ``slots`` [s] (rows on ``NULL_SLOT`` are padding)."""
    return pool.at[:, slots].set(state)


@functools.partial(jax.jit, donate_argnames=("pool",))
def copy_slots(pool: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    """Copies slot ``src[i]`` to ``dst[i]`` for each i (int32 arrays of one length; pairs
    NULL_SLOT -> NULL_SLOT are padding). Taking a snapshot copies live -> snapshot,
    restoring snapshot -> live."""
    return pool.at[:, dst].set(pool[:, src])


@functools.partial(jax.jit, donate_argnames=("pool",))
def zero_slots(pool: jax.Array, slots: jax.Array) -> jax.Array:
    """Resets ``slots`` (int32) to the zero state of a sequence that has seen no token."""
    return pool.at[:, slots].set(0.0)
