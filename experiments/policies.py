"""Prefill policies compared on identical inputs, each a request of the engine.

  full_recompute     the reference: the whole prompt as an ordinary request (nothing reused)
  prefix_caching     exact prefix KV reused (system prompt, plus chunk 0 when it was stored
                     behind it); the rest recomputed (selector "prefix")
  full_reuse         every chunk's KV reused and repositioned; only the suffix computed ("none")
  cacheblend         CacheBlend: deviation checks at layers 1-3 with gradual filtering
  cacheblend_single  LMCache's production CacheBlend: one check at layer 1 by key difference
  epic               EPIC: the first ratio share of every chunk's tokens
  query_aware        ProphetKV / QCFuse family: attention received from the question rows
  query_aware_fused  that attention fused with the KV deviation
  query_impact       ours: that attention times the KV deviation's norm (first-order output error)
  learned            a small MLP over check-layer features, trained on a training split
  random             the same number of chunk tokens, chosen uniformly (the control)
  oracle             the tokens of highest true deviation (needs the full-recompute KV)

The selectors themselves, and the papers they follow, are in ``kvjax.blend.selection``.
"""

from __future__ import annotations

import dataclasses

from experiments.blender import FULL_RECOMPUTE
from kvjax.blend.selection import SelectionConfig

_SELECTOR = {
    "prefix_caching": "prefix",
    "full_reuse": "none",
    "cacheblend": "cacheblend",
    "cacheblend_single": "cacheblend_single",
    "epic": "epic",
    "query_aware": "query_aware",
    "query_aware_fused": "query_aware_fused",
    "query_impact": "query_impact",
    "learned": "learned",
    "random": "random",
    "oracle": "oracle",
}
POLICIES = ("full_recompute", *_SELECTOR)
SELECTOR_POLICIES = (
    "cacheblend",
    "cacheblend_single",
    "epic",
    "query_aware",
    "query_aware_fused",
    "query_impact",
    "learned",
    "random",
    "oracle",
)
"""Policies that recompute a ratio of the chunk tokens (the quality-vs-ratio curves)."""
PUBLISHED_SELECTORS = ("cacheblend", "cacheblend_single", "epic", "query_aware")
"""Selectors that follow a paper or a production system (``kvjax.blend.selection``)."""
OWN_SELECTORS = ("query_aware_fused", "query_impact", "learned")
"""This project's selectors (random and oracle are the controls)."""


def policy(name: str, config: SelectionConfig, scorer: tuple[float, ...] = ()) -> SelectionConfig | str:
    """Policy ``name`` as the Blender runs it: ``FULL_RECOMPUTE`` or ``config`` with its selector
    (and, for "learned", the trained ``scorer`` parameters)."""
    if name == "full_recompute":
        return FULL_RECOMPUTE
    if name not in _SELECTOR:
        raise ValueError(f"policy={name!r} must be one of {POLICIES}")
    return dataclasses.replace(config, selector=_SELECTOR[name], scorer=tuple(scorer) if name == "learned" else ())
