"""Prefill policies compared on identical inputs, each a request of the engine.

  full_recompute  the reference: the whole prompt as an ordinary request (nothing reused)
  prefix_caching  exact prefix KV reused (system prompt, plus chunk 0 when it was stored
                  behind it); the rest recomputed (selector "prefix")
  full_reuse      every chunk's KV reused and repositioned; only the suffix computed ("none")
  cacheblend      deviation-selected recompute with gradual filtering
  random          the same number of chunk tokens, chosen uniformly (the control)
  oracle          the tokens of highest true deviation (needs the full-recompute KV)
  first_k         the first ratio share of every chunk's tokens (EPIC-style)
"""

from __future__ import annotations

import dataclasses

from kvjax.blend.blender import FULL_RECOMPUTE
from kvjax.blend.selection import SelectionConfig

POLICIES = ("full_recompute", "prefix_caching", "full_reuse", "cacheblend", "random", "oracle", "first_k")
_SELECTOR = {"prefix_caching": "prefix", "full_reuse": "none", "cacheblend": "cacheblend", "random": "random",
             "oracle": "oracle", "first_k": "first_k"}


def policy(name: str, config: SelectionConfig) -> SelectionConfig | str:
    """Policy ``name`` as the Blender runs it: ``FULL_RECOMPUTE`` or ``config`` with its selector."""
    if name == "full_recompute":
        return FULL_RECOMPUTE
    if name not in _SELECTOR:
        raise ValueError(f"policy={name!r} must be one of {POLICIES}")
    return dataclasses.replace(config, selector=_SELECTOR[name])
