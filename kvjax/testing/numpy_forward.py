"""An independent, unpaged float64/float32 numpy forward of the same architecture.

Written from the model definitions (HF Llama / Gemma 3), sharing no code with
``kvjax.model.transformer``; tests use it as the oracle for the paged JAX model. Recurrent
layers of hybrid models run the plain sequential recurrence, one token at a time (the JAX
model runs a chunked form).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kvjax.model.config import ModelConfig
from kvjax.model.rope import RopeScaling
from kvjax.model.transformer import LayerParams, Params


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _scaled(inv: np.ndarray, scaling: RopeScaling | None) -> np.ndarray:
    """Frequencies after HF's ``linear`` or ``llama3`` rope scaling (per wavelength band)."""
    if scaling is None:
        return inv
    if scaling.kind == "linear":
        return inv / scaling.factor
    wavelen, old = 2 * np.pi / inv, scaling.original_max_positions
    low, high = old / scaling.low_freq_factor, old / scaling.high_freq_factor
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * inv / scaling.factor + smooth * inv
    return np.where(wavelen > low, inv / scaling.factor, np.where(wavelen < high, inv, blended))


def _rope(x: np.ndarray, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """x: [T, heads, d], positions 0..T-1, half rotation."""
    t, _, d = x.shape
    inv = _scaled(1.0 / theta ** (np.arange(0, d, 2) / d), scaling)
    ang = np.arange(t)[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def _mlp(lp: LayerParams, cfg: ModelConfig, x: np.ndarray, mixed: np.ndarray, p: Callable) -> np.ndarray:
    """Output projection of the mixer's heads [T, H, d], residual, MLP, residual."""
    o = mixed.reshape(x.shape[0], -1) @ p(lp.wo)
    if cfg.sandwich_norm:
        o = _rms(o, p(lp.post_attn_norm), cfg.rms_eps)
    x = x + o
    h = _rms(x, p(lp.ffn_norm), cfg.rms_eps)
    g = h @ p(lp.w_gate)
    act = g / (1.0 + np.exp(-g)) if cfg.activation == "silu" else _gelu_tanh(g)
    m = (act * (h @ p(lp.w_up))) @ p(lp.w_down)
    if cfg.sandwich_norm:
        m = _rms(m, p(lp.post_ffn_norm), cfg.rms_eps)
    return x + m


def recurrent_layer_numpy(
    lp: LayerParams, cfg: ModelConfig, h: np.ndarray, state: np.ndarray, dtype: type = np.float64
) -> tuple[np.ndarray, np.ndarray]:
    """Gated linear attention of one recurrent layer, one token at a time.

    Args:
      h: [T, D] normed residual stream; state: [H, d, d] before the first token.

    Returns:
      (normed per-head outputs [T, H, d], state after the last token [H, d, d]).
    """

    def p(a: Any) -> np.ndarray:
        return np.asarray(a, dtype=dtype)

    heads, d = cfg.num_heads, cfg.head_dim
    z = h @ p(lp.decay_w) + p(lp.decay_bias)  # [T, H]
    decay = np.exp(-np.logaddexp(0.0, z))  # exp(-softplus(z))
    out: np.ndarray = np.zeros((h.shape[0], heads, d), dtype)
    state = state.astype(dtype).copy()
    for t in range(h.shape[0]):
        q = (h[t] @ p(lp.wq)).reshape(heads, d)
        k = (h[t] @ p(lp.wk)).reshape(heads, d) / np.sqrt(d)
        v = (h[t] @ p(lp.wv)).reshape(heads, d)
        for head in range(heads):
            state[head] = decay[t, head] * state[head] + np.outer(k[head], v[head])
            out[t, head] = q[head] @ state[head]
    return _rms(out, p(lp.state_norm), cfg.rms_eps), state


def numpy_logits(
    params: Params, cfg: ModelConfig, tokens: np.ndarray, dtype: type = np.float64, rows: np.ndarray | None = None
) -> np.ndarray:
    """Logits [T, V] of one sequence of tokens [T] at positions 0..T-1 (only ``rows`` if given)."""

    def p(a: Any) -> np.ndarray:
        return np.asarray(a, dtype=dtype)

    x = p(params.embed)[np.asarray(tokens)]
    if cfg.embed_scale:
        x = x * np.sqrt(cfg.d_model)
    t = x.shape[0]
    group = cfg.num_heads // cfg.num_kv_heads
    for i, lp in enumerate(params.layers):
        h = _rms(x, p(lp.attn_norm), cfg.rms_eps)
        if cfg.is_recurrent(i):
            o, _ = recurrent_layer_numpy(
                lp, cfg, h, np.zeros((cfg.num_heads, cfg.head_dim, cfg.head_dim), dtype), dtype
            )
            x = _mlp(lp, cfg, x, o, p)
            continue
        q, k, v = (h @ p(w) + (0 if b is None else p(b)) for w, b in ((lp.wq, lp.bq), (lp.wk, lp.bk), (lp.wv, lp.bv)))
        q = q.reshape(t, cfg.num_heads, cfg.head_dim)
        k = k.reshape(t, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = _rms(q, p(lp.q_norm), cfg.rms_eps), _rms(k, p(lp.k_norm), cfg.rms_eps)
        theta, scaling = cfg.layer_rope_theta[i], cfg.layer_rope_scaling[i]
        q, k = _rope(q, theta, scaling), _rope(k, theta, scaling)
        k = np.repeat(k, group, axis=1)
        v = np.repeat(v, group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) * cfg.sm_scale
        qi, ki = np.arange(t)[:, None], np.arange(t)[None, :]
        mask = ki <= qi
        if cfg.is_local(i):
            mask &= qi - ki < cfg.sliding_window
        scores = np.where(mask[None], scores, -np.inf)
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        probs = scores / scores.sum(-1, keepdims=True)
        x = _mlp(lp, cfg, x, np.einsum("hqk,khd->qhd", probs, v), p)
    if rows is not None:
        x = x[np.asarray(rows)]
    head = params.embed if params.lm_head is None else params.lm_head
    return _rms(x, p(params.final_norm), cfg.rms_eps) @ p(head).T
