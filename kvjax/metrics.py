"""Quality and cost of a KV-reuse policy, measured against full recompute.

Host-side numpy functions over arrays read back from the device:

  deviations   per token and layer KV deviation, its concentration (share held by the top
               tokens), adjacent-layer Spearman correlation, attention deviation of rows;
  outputs      KL of next-token distributions along a teacher-forced continuation, top-1
               agreement, first divergence, the log-likelihood of a teacher-forced gold answer;
  selection    recall against an oracle set;
  cost         recomputed FLOP fraction;
  gold         SQuAD exact match and token F1 (the official v1.1 normalisation, max over the
               gold answers), needle-in-a-haystack exact retrieval.

Intervals over prompts are the experiments' (``experiments/statistics.py``).

Axis letters are ``kvjax/axes.py``'s.
"""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Sequence

import numpy as np
from scipy import stats as scipy_stats

from kvjax.model.config import ModelConfig


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def kl_divergence(ref_logits: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """KL(P_ref || P) per position: [..., v] x2 -> [...] (nats)."""
    lp, lq = log_softmax(ref_logits), log_softmax(logits)
    return np.sum(np.exp(lp) * (lp - lq), axis=-1)


def top1_agreement(ref_logits: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """[...] bool: the argmax tokens agree (logits [..., v] x2)."""
    return np.argmax(ref_logits, axis=-1) == np.argmax(logits, axis=-1)


def first_divergence(ref_logits: np.ndarray, logits: np.ndarray) -> int:
    """First position (row of the logits, [positions, v] each) whose argmax differs; the number
    of positions if none (greedy decoding follows the reference exactly up to this position)."""
    differ = np.flatnonzero(~top1_agreement(ref_logits, logits))
    return int(differ[0]) if len(differ) else int(ref_logits.shape[0])


def answer_log_likelihood(logits: np.ndarray, answer: Sequence[int]) -> float:
    """Mean log-probability per token (nats, <= 0) of ``answer`` teacher-forced: ``logits``
    [len(answer), v] are the logits before each of its tokens (the prompt's last position,
    then after each answer token but the last)."""
    ids = np.asarray(answer, np.int64)
    if logits.shape[0] != len(ids) or len(ids) == 0:
        raise ValueError(f"logits {logits.shape} must hold one row per answer token ({len(ids)}, at least 1)")
    return float(np.take_along_axis(log_softmax(logits), ids[:, None], axis=-1).mean())


def kv_deviation(k: np.ndarray, v: np.ndarray, k_ref: np.ndarray, v_ref: np.ndarray, kind: str = "kv") -> np.ndarray:
    """Squared L2 deviation per layer and token, summed over heads and head_dim.

    Args:
      k, v, k_ref, v_ref: [l, T, h, d].
      kind: "k", "v" or "kv".

    Returns:
      [l, T] float64.
    """
    dk = np.sum(np.square(np.asarray(k, np.float64) - k_ref), axis=(-2, -1))
    dv = np.sum(np.square(np.asarray(v, np.float64) - v_ref), axis=(-2, -1))
    return {"k": dk, "v": dv, "kv": dk + dv}[kind]


def relative_kv_deviation(dev: np.ndarray, k_ref: np.ndarray, v_ref: np.ndarray) -> np.ndarray:
    """``dev`` [l, T] divided by each layer's mean squared K+V norm over the tokens."""
    norm = np.mean(
        np.sum(np.square(k_ref, dtype=np.float64), axis=(-2, -1))
        + np.sum(np.square(v_ref, dtype=np.float64), axis=(-2, -1)),
        axis=1,
    )
    return dev / np.maximum(norm, 1e-30)[:, None]


def top_share(dev: np.ndarray, fraction: float = 0.15) -> np.ndarray:
    """Share of each layer's total deviation held by its top ``fraction`` of tokens: [l, T] -> [l]."""
    n = max(1, int(np.ceil(fraction * dev.shape[1])))
    top = -np.sort(-dev, axis=1)[:, :n]
    return top.sum(axis=1) / np.maximum(dev.sum(axis=1), 1e-30)


def adjacent_layer_spearman(dev: np.ndarray) -> np.ndarray:
    """Spearman rank correlation of token deviations between adjacent layers: [l, T] -> [l - 1]."""
    return np.asarray([scipy_stats.spearmanr(dev[i], dev[i + 1]).statistic for i in range(dev.shape[0] - 1)])


def attention_deviation(attn: np.ndarray, attn_ref: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Relative L2 deviation of rows' attention outputs per layer.

    Args:
      attn, attn_ref: [l, o, H*d] (the probe rows); valid: [o] rows to include.

    Returns:
      [l]: mean over valid rows of ||attn - attn_ref|| / ||attn_ref||.
    """
    a, r = np.asarray(attn, np.float64)[:, valid], np.asarray(attn_ref, np.float64)[:, valid]
    return np.mean(np.linalg.norm(a - r, axis=-1) / np.maximum(np.linalg.norm(r, axis=-1), 1e-30), axis=1)


def recall(selected: Sequence[int] | np.ndarray, oracle: Sequence[int] | np.ndarray) -> float:
    """|selected ∩ oracle| / |oracle| (1.0 for an empty oracle)."""
    wanted = set(np.asarray(oracle).tolist())
    if not wanted:
        return 1.0
    return len(wanted & set(np.asarray(selected).tolist())) / len(wanted)


def layer_flops(cfg: ModelConfig, rows: np.ndarray, positions: np.ndarray, qkv_only: np.ndarray | None = None) -> float:
    """FLOPs of one layer over ``rows`` (bool [T]) at ``positions`` [T], causal attention included.

    Args:
      qkv_only: [T] bool rows that only got their q/k/v projected (dropped at a check layer).
    """
    d, h, kv, ffn = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.ffn_dim
    qkv = 2 * d * cfg.head_dim * (h + 2 * kv)
    rest = 2 * h * cfg.head_dim * d + 2 * 3 * d * ffn
    attn = 4 * h * cfg.head_dim * (positions[rows] + 1).sum()
    flops = rows.sum() * (qkv + rest) + attn
    if qkv_only is not None:
        flops += qkv_only.sum() * qkv
    return float(flops)


def recompute_flop_fraction(
    cfg: ModelConfig, recomputed: np.ndarray, num_tokens: int, qkv_checks: Sequence[int] = ()
) -> float:
    """FLOPs of a (partial) prefill over those of the full prefill.

    Args:
      recomputed: [l, T] bool rows computed at each layer.
      num_tokens: prompt tokens (full prefill computes all of them in every layer).
      qkv_checks: check layers, where the previous layer's rows got q/k/v before narrowing.
    """
    positions = np.arange(recomputed.shape[1])
    full_rows = positions < num_tokens
    full = cfg.num_layers * layer_flops(cfg, full_rows, positions)
    part = 0.0
    for layer in range(cfg.num_layers):
        dropped = recomputed[layer - 1] & ~recomputed[layer] if layer in qkv_checks else None
        part += layer_flops(cfg, recomputed[layer], positions, dropped)
    return part / full


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def squad_normalize(text: str) -> str:
    """The official SQuAD v1.1 answer normalisation: lowercase, drop ASCII punctuation, drop
    the articles a/an/the, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def squad_exact_match(prediction: str, gold_answers: Sequence[str]) -> float:
    """1.0 if the normalised prediction equals any normalised gold answer, else 0.0."""
    pred = squad_normalize(prediction)
    return float(any(pred == squad_normalize(g) for g in gold_answers))


def _token_f1(prediction: str, gold: str) -> float:
    pred, ref = squad_normalize(prediction).split(), squad_normalize(gold).split()
    same = sum((collections.Counter(pred) & collections.Counter(ref)).values())
    if same == 0:
        return 0.0
    precision, rec = same / len(pred), same / len(ref)
    return 2 * precision * rec / (precision + rec)


def squad_f1(prediction: str, gold_answers: Sequence[str]) -> float:
    """Token-overlap F1 of the normalised bag of words, max over the gold answers, in [0, 1]."""
    return max((_token_f1(prediction, g) for g in gold_answers), default=0.0)


def niah_recall(prediction: str, values: Sequence[str]) -> float:
    """Share of the needle values found in the prediction as whole tokens (a value is not
    matched inside a longer number or word)."""
    if not values:
        return 1.0
    found = [re.search(rf"(?<![0-9A-Za-z]){re.escape(v)}(?![0-9A-Za-z])", prediction) is not None for v in values]
    return sum(found) / len(values)


def niah_exact(prediction: str, values: Sequence[str]) -> float:
    """Exact retrieval: 1.0 if every required needle value is in the prediction, else 0.0."""
    return float(niah_recall(prediction, values) == 1.0)
