"""Token sampling: greedy, temperature and nucleus (top-p), batched and jitted."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

MAX_SEED = 2**31 - 1
"""Largest sampling seed: seeds travel to the device as int32."""


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingParams:
    """How a request generates.

    Attributes:
      max_new_tokens: tokens to generate, >= 1.
      temperature: 0 = greedy; > 0 scales logits before sampling.
      top_p: nucleus mass in (0, 1]; 1 = no truncation.
      seed: per-request sampling seed (the i-th token uses fold_in(seed, i)).
      stop_token_id: the token that ends generation; None = the model's EOS.
      ignore_eos: generate exactly max_new_tokens.
      return_logits: keep each generated position's logits [V] (float32) on the host.
      prompt_logits: keep the logits [V] (float32) of the last this many prompt positions
        that the request's prefill computes (vLLM's ``prompt_logprobs``, as logits): positions
        served from the cache are not computed and have none (teacher forcing: submit the
        fed tokens behind a cached prompt). 0 = none. A blended request's prompt logits come
        from ``chunks.num_prompt_logits`` instead.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_token_id: int | None = None
    ignore_eos: bool = False
    return_logits: bool = False
    prompt_logits: int = 0

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r} must be an int >= 1")
        if not (_is_number(self.temperature) and 0 <= self.temperature < math.inf):
            raise ValueError(f"temperature={self.temperature!r} must be a finite number >= 0 (0 = greedy)")
        if not (_is_number(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p={self.top_p!r} must be a number in (0, 1]")
        if not (_is_int(self.seed) and 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed={self.seed!r} must be an int in [0, {MAX_SEED}] (an int32 key)")
        if self.stop_token_id is not None and not (_is_int(self.stop_token_id) and self.stop_token_id >= 0):
            raise ValueError(f"stop_token_id={self.stop_token_id!r} must be None (the model's EOS) or a token id >= 0")
        if not _is_int(self.prompt_logits) or self.prompt_logits < 0:
            raise ValueError(f"prompt_logits={self.prompt_logits!r} must be an int >= 0 (0 = none)")
        for name in ("ignore_eos", "return_logits"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")


def _is_int(value: object) -> bool:
    """An integer (Python or NumPy) that is not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_number(value: object) -> bool:
    """A real number (Python or NumPy, not a bool) that is not NaN."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        return False
    return not math.isnan(value)


NUCLEUS_BISECTION_STEPS = 32
"""Bisection steps of the nucleus threshold: the probability interval shrinks to 2^-32."""


def nucleus_mask(probs: jax.Array, top_p: jax.Array) -> jax.Array:
    """The nucleus of each row: the most probable tokens whose mass first reaches ``top_p``.

    A token is kept iff the mass of the tokens strictly more probable than it is < top_p
    (the smallest set sorted by probability whose mass reaches top_p; tied tokens are kept
    or dropped together). Found by bisecting the probability threshold, O(V) per step,
    instead of sorting the vocabulary.

    Args:
      probs: [S, V] float32 probabilities.
      top_p: [S] float32 in (0, 1].

    Returns:
      [S, V] bool.
    """

    def mass_above(threshold: jax.Array) -> jax.Array:  # [S] -> [S]
        return jnp.sum(jnp.where(probs > threshold[:, None], probs, 0.0), axis=-1)

    def bisect(_: int, bounds: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = bounds  # invariant: mass_above(lo) >= top_p > mass_above(hi)
        mid = 0.5 * (lo + hi)
        below = mass_above(mid) < top_p
        return jnp.where(below, lo, mid), jnp.where(below, mid, hi)

    hi = jnp.max(probs, axis=-1)
    lo = jnp.zeros_like(hi)
    _, hi = jax.lax.fori_loop(0, NUCLEUS_BISECTION_STEPS, bisect, (lo, hi))
    keep = probs >= hi[:, None]
    return keep | (top_p[:, None] >= 1.0)


def probabilities(logits: jax.Array, temperature: jax.Array, top_p: jax.Array) -> jax.Array:
    """The distribution ``sample`` draws each row from.

    softmax(logits / temperature) restricted to the nucleus (``nucleus_mask``) and
    renormalised; a row with temperature 0 is one-hot at its argmax.

    Args:
      logits: [S, V] float32.
      temperature, top_p: [S] float32.

    Returns:
      [S, V] float32, each row summing to 1.
    """
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    probs = jax.nn.softmax(scaled, axis=-1)
    kept = jnp.where(nucleus_mask(probs, top_p), probs, 0.0)
    kept = kept / jnp.sum(kept, axis=-1, keepdims=True)
    greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return jnp.where((temperature > 0)[:, None], kept, greedy)


def token_key(seed: jax.Array, index: jax.Array, stream: int = 0) -> jax.Array:
    """The PRNG key of a request's ``index``-th generated token: fold_in(key(seed), index),
    and for ``stream`` > 0 a further fold_in (speculative decoding draws several independent
    values per token: the draft, the acceptance test, the resample)."""
    key = jax.random.fold_in(jax.random.key(seed), index)
    return jax.random.fold_in(key, stream) if stream else key


@jax.jit
def sample(
    logits: jax.Array, temperature: jax.Array, top_p: jax.Array, seeds: jax.Array, counters: jax.Array
) -> jax.Array:
    """One token per row.

    A step whose rows are all greedy costs one argmax; otherwise sampling is O(V) per row
    (no sort of the vocabulary, see ``nucleus_mask``).

    Args:
      logits: [S, V] float32.
      temperature, top_p: [S] float32 (temperature 0 -> greedy).
      seeds, counters: [S] int32; row i samples with key fold_in(key(seeds[i]), counters[i]).

    Returns:
      [S] int32 token ids.
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw() -> jax.Array:
        scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
        keep = nucleus_mask(jax.nn.softmax(scaled, axis=-1), top_p)
        keys = jax.vmap(token_key)(seeds, counters)
        sampled = jax.vmap(jax.random.categorical)(keys, jnp.where(keep, scaled, -jnp.inf)).astype(jnp.int32)
        return jnp.where(temperature > 0, sampled, greedy)

    return jax.lax.cond(jnp.any(temperature > 0), draw, lambda: greedy)
