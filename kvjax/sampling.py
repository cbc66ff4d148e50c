"""Token sampling: greedy, temperature and nucleus (top-p), batched and jitted."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


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
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_token_id: int | None = None
    ignore_eos: bool = False
    return_logits: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r} must be an int >= 1")
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise ValueError(f"temperature={self.temperature!r} must be >= 0 (0 = greedy)")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")


@jax.jit
def sample(
    logits: jax.Array, temperature: jax.Array, top_p: jax.Array, seeds: jax.Array, counters: jax.Array
) -> jax.Array:
    """One token per row.

    Args:
      logits: [S, V] float32.
      temperature, top_p: [S] float32 (temperature 0 -> greedy).
      seeds, counters: [S] int32; row i samples with key fold_in(key(seeds[i]), counters[i]).

    Returns:
      [S] int32 token ids.
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each token
    sorted_logits = jnp.where(before < top_p[:, None], sorted_logits, -jnp.inf)
    keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds, counters)
    picked = jax.vmap(jax.random.categorical)(keys, sorted_logits)
    sampled = jnp.take_along_axis(order, picked[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)
