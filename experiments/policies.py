"""Prefill policies compared on identical inputs (SPEC C3).

  full_recompute  the reference: the whole prompt through ``transformer.forward``
  prefix_caching  exact prefix KV reused (system prompt, plus chunk 0 when it was stored
                  behind it); the rest through ``transformer.forward``
  full_reuse      every chunk's KV reused and repositioned; only the suffix computed
  cacheblend      deviation-selected recompute with gradual filtering (``selection``)
  random          the same number of chunk tokens, chosen uniformly (the control)
  oracle          the tokens of highest true deviation (needs the full-recompute KV)
  first_k         the first ratio share of every chunk's tokens (EPIC-style)

``run_policy`` dispatches the prefill and returns device arrays without waiting, so the
caller times it with ``block_until_ready``.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from kvjax.blend import selection
from kvjax.blend.blender import Blender, BlendPrompt

POLICIES = ("full_recompute", "prefix_caching", "full_reuse", "cacheblend", "random", "oracle", "first_k")


@dataclasses.dataclass
class PrefillResult:
    """One policy's prefill.

    Attributes:
      logits: [V] device array of the last prompt token.
      trace: the fusor trace (``attn`` [L, P, H*d], ``recomputed`` [L, T]) or None.
      recomputed: [L, T] bool rows computed per layer for policies run by ``forward``.
      qkv_checks: check layers (q/k/v of the previous rows computed before narrowing).
    """

    logits: jax.Array
    trace: dict | None
    recomputed: np.ndarray | None
    qkv_checks: tuple[int, ...] = ()

    def recomputed_mask(self) -> np.ndarray:
        return np.asarray(self.trace["recomputed"]) if self.trace is not None else self.recomputed


def run_policy(
    name: str,
    blender: Blender,
    prompt: BlendPrompt,
    *,
    ratio: float,
    config: selection.SelectionConfig,
    rng: np.random.Generator,
    oracle_deviation: np.ndarray | None = None,
    num_probes: int = 16,
) -> PrefillResult:
    """Runs policy ``name`` on ``prompt`` with recompute ``ratio`` (selectors only)."""
    roles = prompt.roles
    padded = blender.padded(roles.num_tokens)
    layers = blender.cfg.num_layers
    bucket = config.row_bucket
    if name in ("full_recompute", "prefix_caching"):
        start = 0 if name == "full_recompute" else blender.exact_prefix_len(prompt)
        logits = blender.full_recompute(prompt) if name == "full_recompute" else blender.prefix_caching(prompt)
        mask = np.zeros((layers, padded), bool)
        mask[:, start : roles.num_tokens] = True
        return PrefillResult(logits=logits, trace=None, recomputed=mask)
    if name == "full_reuse":
        sel = selection.select_none(roles, bucket)
    elif name == "cacheblend":
        sel = selection.select_cacheblend(roles, dataclasses.replace(config, recompute_ratio=ratio), padded, layers)
    elif name == "random":
        sel = selection.select_random(roles, ratio, rng, bucket)
    elif name == "first_k":
        sel = selection.select_first_k(roles, ratio, bucket)
    elif name == "oracle":
        if oracle_deviation is None:
            raise ValueError("policy 'oracle' needs oracle_deviation (the true deviation [L, T] from full recompute)")
        sel = selection.select_oracle(roles, ratio, oracle_deviation, bucket)
    else:
        raise ValueError(f"policy={name!r} must be one of {POLICIES}")
    logits, trace = blender.blend(prompt, sel, num_probes=num_probes)
    return PrefillResult(logits=logits, trace=trace, recomputed=None, qkv_checks=tuple(layer for layer, _ in sel.checks))
