"""How a blended prefill scores the rows it narrows at a check layer, on the device: the
fresh-minus-reused K/V deviation, the attention the question rows give, their sum ("fused")
or their product ("impact"), or a small learned MLP over cheap per-token features
(``FEATURES``); ``narrow`` keeps the top rows.
The selectors that choose between them live in ``kvjax.blend.selection``.

Axis letters are ``kvjax/axes.py``'s.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

Deviation = Literal["k", "v", "kv"]
DEVIATIONS = ("k", "v", "kv")
ScoreKind = Literal["deviation", "attention", "fused", "impact", "learned"]
SCORE_KINDS = ("deviation", "attention", "fused", "impact", "learned")
FEATURES = ("log_k_deviation", "log_v_deviation", "log_attention", "log_stored_position", "prompt_fraction")
"""Per-token features of a check layer (``check_features``), the learned scorer's inputs."""


@dataclasses.dataclass(frozen=True)
class CheckScore:
    """How a check layer scores the rows it narrows (static: part of the compiled prefill).

    Attributes:
      kind: "deviation" (fresh-minus-reused K/V, ``deviation``), "attention" (received from
        the question rows), "fused" (both, each over its mean, added), "impact" (the attention
        times the deviation's norm), "learned" (MLP of ``FEATURES``).
      deviation: "k", "v" or "kv" for the "deviation", "fused" and "impact" kinds.
      query_rows: how many of the last suffix rows are the attending queries.
      weights: flat MLP parameters of the "learned" kind.
    """

    kind: ScoreKind = "deviation"
    deviation: Deviation = "kv"
    query_rows: int = 64
    weights: tuple[float, ...] = ()


def token_deviation(
    k_new: jax.Array, v_new: jax.Array, k_old: jax.Array, v_old: jax.Array, kind: Deviation
) -> jax.Array:
    """Squared L2 deviation per token, summed over KV heads and head_dim.

    Args:
      k_new, v_new, k_old, v_old: [..., h, d].

    Returns:
      [...] float32.
    """
    dk = jnp.sum(jnp.square((k_new - k_old).astype(jnp.float32)), axis=(-2, -1))
    dv = jnp.sum(jnp.square((v_new - v_old).astype(jnp.float32)), axis=(-2, -1))
    return {"k": dk, "v": dv, "kv": dk + dv}[kind]


def narrow(
    deviation: jax.Array, forced: jax.Array, eligible: jax.Array, count: jax.Array, capacity: int
) -> tuple[jax.Array, jax.Array]:
    """Keeps the ``count`` highest-scoring rows (forced rows first) in ``capacity`` slots.

    Args:
      deviation: [M] score of each current row.
      forced: [M] rows always kept (the suffix).
      eligible: [M] rows that may be kept at all (valid chunk or suffix rows).
      count: [] int32 rows to keep.
      capacity: static number of output slots (>= count): the M of the layers after the check.

    Returns:
      (picked [capacity] int32 indices into the current rows, valid [capacity] bool).
    """
    score = jnp.where(forced, jnp.inf, jnp.where(eligible, deviation, -jnp.inf))
    top, picked = jax.lax.top_k(score, capacity)
    valid = (jnp.arange(capacity) < count) & (top > -jnp.inf)
    return picked.astype(jnp.int32), valid


def scorer_hidden(num_params: int) -> int | None:
    """Hidden units z of a flat learned-scorer parameter vector of ``num_params`` values
    (``z * (f + 2) + 1``, f = ``len(FEATURES)``), or None if no z >= 1 fits."""
    h, rest = divmod(num_params - 1, len(FEATURES) + 2)
    return h if h >= 1 and rest == 0 else None


def mlp_score(weights: jax.Array | tuple[float, ...], features: jax.Array) -> jax.Array:
    """The learned scorer: ``relu(features @ w1 + b1) @ w2 + b2``.

    Args:
      weights: flat parameters [z * (f + 2) + 1]: w1 [f, z] row-major, b1 [z], w2 [z], b2 [].
      features: [..., f] float32 (``FEATURES``).

    Returns:
      [...] float32 logit of "recompute this token".
    """
    weights = jnp.asarray(weights, jnp.float32)
    f = len(FEATURES)
    h = scorer_hidden(weights.shape[0])
    if h is None:
        raise ValueError(f"scorer parameters: {weights.shape[0]} values is not h * ({f} + 2) + 1 for any h >= 1")
    w1, b1 = weights[: f * h].reshape(f, h), weights[f * h : f * h + h]
    w2, b2 = weights[f * h + h : f * h + 2 * h], weights[-1]
    return jax.nn.relu(features @ w1 + b1) @ w2 + b2


def received_attention(
    q: jax.Array, query_pos: jax.Array, keys: jax.Array, key_pos: jax.Array, sm_scale: float, query_rows: int
) -> jax.Array:
    """Attention each key receives from the last ``query_rows`` query rows (summed over those
    rows and all heads; each row's softmax over keys at positions <= its own).

    Args:
      q: [M, H, d] queries of the current rows.
      query_pos: [M] int32 position of each row that may attend (the suffix), -1 otherwise.
      keys: [T, h, d] keys of every token at its actual position.
      key_pos: [T] int32 positions, -1 = padding.

    Returns:
      [T] float32 attention received, in units of attending query-heads (sums to the number
      of attending rows times H).
    """
    m, h, d = q.shape
    k = keys.shape[1]
    qpos, pick = jax.lax.top_k(query_pos, min(query_rows, m))  # the last suffix rows
    qs = q[pick].reshape(len(pick), k, h // k, d).astype(jnp.float32)  # [q, h, g, d]: the attending rows
    logits = jnp.einsum("qhgd,Thd->qhgT", qs, keys.astype(jnp.float32)) * sm_scale  # [q, h, g, T]
    visible = (key_pos[None, :] >= 0) & (key_pos[None, :] <= qpos[:, None]) & (qpos[:, None] >= 0)  # [q, T]
    logits = jnp.where(visible[:, None, None], logits, -jnp.inf)
    probs = jnp.where(visible[:, None, None], jax.nn.softmax(logits, axis=-1), 0.0)
    return probs.sum(axis=(0, 1, 2))


def check_features(
    q: jax.Array, k_new: jax.Array, v_new: jax.Array, seq_k: jax.Array, seq_v: jax.Array, idx: jax.Array,
    valid: jax.Array, positions: jax.Array, deltas: jax.Array, length: jax.Array, selectable: jax.Array,
    forced: jax.Array, sm_scale: float, query_rows: int,
) -> jax.Array:
    """Per-row features of a check layer (``FEATURES``).

    Deviations and attention are divided by their mean over the candidate rows (valid
    selectable rows) before the log, so the features do not depend on the prompt's scale.
    The attending queries are the last ``query_rows`` forced rows; they attend over the
    layer's keys with the rows' fresh keys in place of the reused ones.

    Args:
      q: [M, H, d] fresh queries; k_new, v_new: [M, h, d] fresh K/V of the rows.
      seq_k, seq_v: [T, h, d] reused K/V of the layer at the actual positions.
      idx, valid: [M] token index and validity of each row.
      positions: [T] int32 (-1 = padding); deltas: [T] actual minus stored position.
      length: [] int32 prompt length; selectable, forced: [T] bool roles.

    Returns:
      [M, f] float32.
    """
    t = seq_k.shape[0]
    row_pos = jnp.where(valid, positions[idx], -1)
    candidate = valid & selectable[idx]
    dk = token_deviation(k_new, v_new, seq_k[idx], seq_v[idx], "k")
    dv = token_deviation(k_new, v_new, seq_k[idx], seq_v[idx], "v")
    keys = seq_k.at[jnp.where(valid, idx, t)].set(k_new.astype(seq_k.dtype), mode="drop")
    attn = received_attention(q, jnp.where(valid & forced[idx], row_pos, -1), keys, positions, sm_scale, query_rows)[
        idx
    ]

    def log_relative(x: jax.Array) -> jax.Array:
        mean = jnp.sum(jnp.where(candidate, x, 0.0)) / jnp.maximum(candidate.sum(), 1)
        return jnp.log(x / jnp.maximum(mean, 1e-30) + 1e-6)

    stored = jnp.maximum(row_pos - deltas[idx], 0).astype(jnp.float32)
    fraction = row_pos.astype(jnp.float32) / jnp.maximum(length, 1).astype(jnp.float32)
    return jnp.stack([log_relative(dk), log_relative(dv), log_relative(attn), jnp.log1p(stored), fraction], axis=-1)


def check_score(
    score: CheckScore, q: jax.Array, k_new: jax.Array, v_new: jax.Array, seq_k: jax.Array, seq_v: jax.Array,
    idx: jax.Array, valid: jax.Array, positions: jax.Array, deltas: jax.Array, length: jax.Array,
    selectable: jax.Array, forced: jax.Array, sm_scale: float,
) -> jax.Array:
    """Score [M] of each row at a check layer (higher = recompute); arguments as ``check_features``.

    "deviation" is the squared fresh-minus-reused difference of ``score.deviation``;
    "attention" the attention received from the question rows; "fused" that attention plus
    the deviation, each divided by its mean over the candidate rows ("kv": the mean of the
    relative K and V deviations); "impact" that attention times the square root of that
    deviation: to first order, the error a stale row puts into the question rows' attention
    outputs (a_t times the norm of its value error, and the logit shift its key error makes
    scales the same way); "learned" the MLP over the features.
    """
    if score.kind == "deviation":
        return token_deviation(k_new, v_new, seq_k[idx], seq_v[idx], score.deviation)
    feats = check_features(q, k_new, v_new, seq_k, seq_v, idx, valid, positions, deltas, length, selectable, forced,
                           sm_scale, score.query_rows)
    if score.kind == "learned":
        return mlp_score(score.weights, feats)
    attention_term = jnp.exp(feats[:, 2])
    if score.kind == "attention":
        return attention_term
    dev = {"k": feats[:, 0:1], "v": feats[:, 1:2], "kv": feats[:, 0:2]}[score.deviation]
    deviation_term = jnp.exp(dev).sum(axis=-1) / dev.shape[-1]
    if score.kind == "impact":
        return attention_term * jnp.sqrt(deviation_term)
    return attention_term + deviation_term
