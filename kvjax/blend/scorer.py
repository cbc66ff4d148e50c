"""Training the "learned" selector's scorer: a small MLP from check-layer features to "recompute".

The features (``scoring.FEATURES``) are what a blended prefill sees at its first check
layer: relative K and V deviation, relative attention received from the question rows,
stored position and position in the prompt (``scoring.check_features``; a blended run with
probes returns them as ``trace["features"]``). The label of a chunk token is whether the
oracle would recompute it at ``ratio``: its true deviation (full reuse vs full recompute,
each layer over its mean, summed) is in the top ``ratio`` share of its prompt.

Training minimises class-balanced binary cross-entropy with optax's Adam over every chunk
token of the training prompts, on standardised features; the standardisation is folded into
the first layer, so the returned flat parameters score raw features
(``scoring.mlp_score``). Which prompts train it is the caller's decision: they must be
disjoint from the evaluation prompts.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kvjax.blend.scoring import FEATURES, mlp_score
from kvjax.blend.selection import Roles, target_count


@dataclasses.dataclass(frozen=True)
class TrainingSet:
    """Chunk tokens of the training prompts.

    Attributes:
      features: [N, len(FEATURES)] float32.
      labels: [N] bool, True = the oracle recomputes the token.
      prompt: [N] int32 index of each token's prompt.
    """

    features: np.ndarray
    labels: np.ndarray
    prompt: np.ndarray


def oracle_labels(roles: Roles, true_deviation: np.ndarray, ratio: float) -> np.ndarray:
    """[num_selectable] bool over the chunk tokens in prompt order: in the oracle's top ``ratio``.

    Args:
      true_deviation: [L, T] deviation of the reused KV from the full-recompute KV, T >= num_tokens.
    """
    selectable, _ = roles.masks(true_deviation.shape[1])
    dev = true_deviation[:, selectable]
    score = (dev / np.maximum(dev.mean(axis=1, keepdims=True), 1e-30)).sum(axis=0)
    labels = np.zeros(dev.shape[1], bool)
    labels[np.argsort(-score, kind="stable")[: target_count(roles, ratio)]] = True
    return labels


def training_set(
    roles: list[Roles], features: list[np.ndarray], true_deviations: list[np.ndarray], ratio: float
) -> TrainingSet:
    """The chunk tokens of each prompt with their features ([T, F] from a trace) and oracle labels."""
    if not len(roles) == len(features) == len(true_deviations) or not roles:
        raise ValueError(f"roles, features and true_deviations must be equally long and non-empty, got "
                         f"{len(roles)}, {len(features)}, {len(true_deviations)}")
    xs, ys, ps = [], [], []
    for i, (r, f, dev) in enumerate(zip(roles, features, true_deviations)):
        if f.shape[1] != len(FEATURES):
            raise ValueError(f"features[{i}] has {f.shape[1]} columns, expected {len(FEATURES)} ({FEATURES})")
        selectable, _ = r.masks(f.shape[0])
        xs.append(np.asarray(f, np.float32)[selectable])
        ys.append(oracle_labels(r, dev, ratio))
        ps.append(np.full(int(selectable.sum()), i, np.int32))
    return TrainingSet(np.concatenate(xs), np.concatenate(ys), np.concatenate(ps))


def train_scorer(
    data: TrainingSet, *, hidden: int = 8, steps: int = 400, learning_rate: float = 0.01, seed: int = 0
) -> tuple[float, ...]:
    """Fits the scorer MLP; returns its flat parameters (``scoring.mlp_score`` layout).

    Args:
      data: the training tokens (both labels present).
      hidden: hidden units (>= 1).
      steps: full-batch Adam steps (>= 1).
      learning_rate: Adam's step size (> 0).
    """
    if not isinstance(hidden, int) or hidden < 1:
        raise ValueError(f"hidden={hidden!r} must be an int >= 1")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r} must be an int >= 1")
    if not learning_rate > 0:
        raise ValueError(f"learning_rate={learning_rate!r} must be > 0")
    y = np.asarray(data.labels, np.float32)
    if y.min() == y.max():
        raise ValueError(f"labels must hold both classes, got only {bool(y[0])} over {len(y)} tokens")
    x = np.asarray(data.features, np.float32)
    mean, std = x.mean(axis=0), np.maximum(x.std(axis=0), 1e-6)
    xz = jnp.asarray((x - mean) / std)
    f = len(FEATURES)
    key1, key2 = jax.random.split(jax.random.PRNGKey(seed))
    params = jnp.concatenate([
        jax.random.normal(key1, (f * hidden,)) * np.sqrt(2.0 / f), jnp.zeros(hidden),
        jax.random.normal(key2, (hidden,)) * np.sqrt(1.0 / hidden), jnp.zeros(1),
    ])
    pos_weight = float((1 - y).sum() / y.sum())
    yj = jnp.asarray(y)

    def loss(p: jax.Array) -> jax.Array:
        logit = mlp_score(p, xz)
        return jnp.mean(optax.sigmoid_binary_cross_entropy(logit, yj) * jnp.where(yj > 0, pos_weight, 1.0))

    opt = optax.adam(learning_rate)

    def step(carry, _):
        p, state = carry
        grad = jax.grad(loss)(p)
        updates, state = opt.update(grad, state, p)
        return (optax.apply_updates(p, updates), state), None

    (params, _), _ = jax.lax.scan(step, (params, opt.init(params)), None, length=steps)
    p = np.asarray(params, np.float64)
    w1, b1 = p[: f * hidden].reshape(f, hidden), p[f * hidden : f * hidden + hidden]
    w1_raw = w1 / std[:, None]
    b1_raw = b1 - (mean / std) @ w1
    return tuple(float(w) for w in np.concatenate([w1_raw.ravel(), b1_raw, p[f * hidden + hidden :]]))


def top_k_recall(data: TrainingSet, scores: np.ndarray) -> float:
    """Mean over prompts of the share of oracle tokens among each prompt's top-scored tokens
    (as many as the prompt has oracle tokens)."""
    recalls = []
    for i in np.unique(data.prompt):
        mask = data.prompt == i
        k = int(data.labels[mask].sum())
        top = np.argsort(-scores[mask], kind="stable")[:k]
        recalls.append(float(data.labels[mask][top].mean()) if k else 1.0)
    return float(np.mean(recalls))
