"""Verification of draft tokens against the target model's logits, on device.

A speculative decode step feeds each sequence its last emitted token followed by its drafts
(a of them: q = 1 + a input tokens); the target's logits at input i predict the token after it::

    inputs   | t0 | d1 | d2 | ... | d_a |        (t0: last emitted token, KV not yet written)
    logits   | p0 | p1 | p2 | ... | p_a |        p_i: target distribution of the token after input i
    verdict  |    d1 ~ p0   d2 ~ p1  ...  d_a ~ p_(a-1) | next ~ residual at the first rejection, else p_a

Greedy rows (temperature 0) accept a draft iff it equals the target's argmax, and the token
after the accepted run is the argmax there: exactly the tokens non-speculative greedy decoding
emits. Sampled rows use speculative rejection sampling (Leviathan et al. 2023, Chen et al.
2023): draft i is accepted with probability min(1, p(d)/q(d)); at the first rejection the
next token is drawn from the normalised residual max(0, p - q); if all drafts are accepted a
bonus token is drawn from p_a. Each emitted token is then distributed exactly as ``sample``
would draw it from the target (``kvjax.sampling.probabilities``: temperature and nucleus).

Axis letters are ``kvjax/axes.py``'s.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.sampling import probabilities, token_key

ACCEPT_STREAM = 1
"""PRNG stream (``token_key``) of the acceptance test of a draft."""
RESAMPLE_STREAM = 2
"""PRNG stream of the token drawn after the accepted run (residual or bonus)."""
DRAFT_STREAM = 3
"""PRNG stream a sampling drafter draws its draft from."""


def _leading_true(flags: jax.Array) -> jax.Array:
    """[s, a] bool -> [s] int32: length of each row's leading run of True."""
    return jnp.sum(jnp.cumprod(flags.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


@jax.jit
def verify(
    logits: jax.Array,
    drafts: jax.Array,
    num_drafts: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    seeds: jax.Array,
    counters: jax.Array,
    draft_probs: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Accepts a leading run of each row's drafts and picks the token after it.

    Args:
      logits: [s, q, v] float32 target logits at the step's inputs (t0, d1, ..., d_a; q = 1 + a).
      drafts: [s, a] int32 draft tokens (entries past ``num_drafts`` are ignored).
      num_drafts: [s] int32 in [0, a], valid drafts per row.
      temperature, top_p: [s] float32 sampling parameters of each row.
      seeds, counters: [s] int32; draft i of row j is output token ``counters[j] + i`` of
        its request, keyed ``token_key(seeds[j], counters[j] + i, stream)``.
      draft_probs: [s, a, v] float32, the distribution q each draft was drawn from;
        None = point masses at the drafts (a deterministic drafter such as prompt lookup).

    Returns:
      (num_accepted [s] int32 in [0, num_drafts], next_token [s] int32): the row emits
      ``drafts[:num_accepted] + [next_token]``.
    """
    s, t, v = logits.shape
    k = t - 1
    valid = jnp.arange(k)[None, :] < num_drafts[:, None]  # [s, a]
    greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [s, q]
    greedy_accepted = _leading_true(valid & (drafts == greedy_tokens[:, :k]))
    greedy_next = jnp.take_along_axis(greedy_tokens, greedy_accepted[:, None], axis=1)[:, 0]
    rows = jnp.arange(s)

    def rejection_sampling() -> tuple[jax.Array, jax.Array]:
        temp_t = jnp.repeat(temperature, t)
        top_p_t = jnp.repeat(top_p, t)
        p = probabilities(logits.reshape(s * t, v), temp_t, top_p_t).reshape(s, t, v)
        p_draft = jnp.take_along_axis(p[:, :k], drafts[:, :, None], axis=2)[:, :, 0]  # [s, a]
        if draft_probs is None:
            q_draft = jnp.ones_like(p_draft)
            q = jax.nn.one_hot(drafts, v, dtype=jnp.float32)  # [s, a, v]
        else:
            q_draft = jnp.take_along_axis(draft_probs, drafts[:, :, None], axis=2)[:, :, 0]
            q = draft_probs
        index = counters[:, None] + jnp.arange(k)[None, :]  # [s, a]
        u = jax.vmap(jax.vmap(jax.random.uniform))(_acceptance_keys(seeds, index))  # [s, a] in [0, 1)
        accepted = _leading_true(valid & (u * q_draft < p_draft))
        p_next = p[rows, accepted]  # [s, v]
        q_next = jnp.where((accepted < num_drafts)[:, None], q[rows, jnp.minimum(accepted, k - 1)], 0.0)
        residual = jnp.maximum(p_next - q_next, 0.0)
        residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_next)
        next_keys = jax.vmap(lambda seed, i: token_key(seed, i, RESAMPLE_STREAM))(seeds, counters + accepted)
        drawn = jax.vmap(jax.random.categorical)(next_keys, jnp.log(residual)).astype(jnp.int32)
        sampled = temperature > 0
        return jnp.where(sampled, accepted, greedy_accepted), jnp.where(sampled, drawn, greedy_next)

    return jax.lax.cond(jnp.any(temperature > 0), rejection_sampling, lambda: (greedy_accepted, greedy_next))


def _acceptance_keys(seeds: jax.Array, index: jax.Array) -> jax.Array:
    """[s] seeds, [s, a] token indices -> [s, a] acceptance keys."""
    return jax.vmap(lambda seed, row: jax.vmap(lambda i: token_key(seed, i, ACCEPT_STREAM))(row))(seeds, index)
