"""Drafters: propose the next tokens of running sequences, to be verified by the model.

Neither model here has a smaller sibling sharing its vocabulary, so no drafter needs a
second model:

* ``NgramDrafter`` (prompt lookup): the tokens that followed the most recent earlier
  occurrence of the context's last n tokens, longest n first. Free to compute on the host;
  drafts well where the answer copies its context (RAG, code edits, summaries).
* ``EarlyExitDrafter`` (self-speculation, LayerSkip-style without training): the model's
  first m layers and its LM head, run once per draft token over the *same* paged cache.
  Layer l < m of the model computes the same K/V at a position whether it runs as part of
  the full model or of the m-layer drafter, so the drafter reads the full model's
  cached K/V of those layers for the whole prefix (reused blocks included) and needs no
  cache of its own. It writes layers < m of the draft positions only; the verification
  forward rewrites every layer of those positions before any of them is committed, so the
  drafter's partial-layer K/V never reaches a block another request can match.

Both implement ``Drafter.propose``. Axis letters are ``kvjax/axes.py``'s (s: the rows,
padded to a bucket; a: the drafts per row).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import attention
from kvjax.cache import CacheLayout, PagePool
from kvjax.config import SpeculativeConfig
from kvjax.model.config import ModelConfig
from kvjax.model.transformer import Params, forward
from kvjax.sampling import probabilities, token_key
from kvjax.speculative.verify import DRAFT_STREAM


@dataclasses.dataclass(frozen=True, slots=True)
class DraftRow:
    """One sequence to draft for.

    Attributes:
      context: the sequence's tokens, prompt then output; the last one is the step's input
        token (its K/V is written by this step) at position ``start``.
      start: position of the step's input token (= tokens whose K/V is written).
      max_drafts: draft slots the sequence holds past ``start`` (0 = no drafting).
      temperature, top_p, seed: the request's sampling parameters.
      counter: tokens the request has generated (draft i is its output ``counter + i``).
    """

    context: Sequence[int]
    start: int
    max_drafts: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    counter: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class Drafts:
    """A batch of proposals.

    Attributes:
      tokens: [s, a] int32 drafts (entries past ``num_drafts`` are padding).
      num_drafts: [s] int32 drafts proposed per row, <= its ``max_drafts``.
      probs: [s, a, v] float32 distribution each draft was drawn from; None = point masses.
    """

    tokens: np.ndarray
    num_drafts: np.ndarray
    probs: jax.Array | None = None


class Drafter(abc.ABC):
    """Proposes up to ``max_drafts`` tokens per row."""

    @abc.abstractmethod
    def propose(
        self, rows: Sequence[DraftRow], num_rows: int, pool: PagePool, block_tables: tuple[jax.Array, ...]
    ) -> tuple[Drafts, PagePool]:
        """Drafts for ``rows`` padded to ``num_rows`` rows.

        Args:
          rows: the sequences, in batch order.
          num_rows: padded batch size s >= len(rows).
          pool: the page pool (donated by drafters that write it; the new pool is returned).
          block_tables: one [s, p] table per layer group, covering the draft slots.

        Returns:
          (drafts with a = max(max_drafts), the pool).
        """


class NgramDrafter(Drafter):
    """Prompt lookup: continue the most recent earlier match of the context's last n tokens.

    Args:
      ngram_sizes: (min n, max n); the longest n with a match wins, the most recent match of
        that n is continued.
    """

    def __init__(self, ngram_sizes: tuple[int, int]) -> None:
        self.min_n, self.max_n = ngram_sizes

    def lookup(self, context: Sequence[int], max_drafts: int) -> list[int]:
        """Up to ``max_drafts`` tokens that followed the latest earlier occurrence of the
        context's last n tokens (n from max_n down to min_n); [] when nothing matches."""
        tokens = np.asarray(context, np.int64)
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)  # starts 0 .. length - n - 1
            hits = np.flatnonzero(np.all(windows == tokens[length - n :], axis=1))
            if hits.size:
                follow = int(hits[-1]) + n
                return tokens[follow : follow + max_drafts].tolist()
        return []

    def propose(
        self, rows: Sequence[DraftRow], num_rows: int, pool: PagePool, block_tables: tuple[jax.Array, ...]
    ) -> tuple[Drafts, PagePool]:
        k = max((r.max_drafts for r in rows), default=0)
        tokens = np.zeros((num_rows, max(k, 1)), np.int32)
        num_drafts = np.zeros(num_rows, np.int32)
        for i, row in enumerate(rows):
            if row.max_drafts:
                found = self.lookup(row.context, row.max_drafts)
                tokens[i, : len(found)] = found
                num_drafts[i] = len(found)
        return Drafts(tokens[:, :k], num_drafts), pool


@jax.jit
def _draw(
    logits: jax.Array, temperature: jax.Array, top_p: jax.Array, seeds: jax.Array, index: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """A draft per row from the early-exit logits [s, v]: argmax for greedy rows, else drawn
    from q = ``probabilities`` (stream DRAFT_STREAM). Returns (tokens [s] int32, q [s, v])."""
    q = probabilities(logits, temperature, top_p)
    keys = jax.vmap(lambda seed, i: token_key(seed, i, DRAFT_STREAM))(seeds, index)
    drawn = jax.vmap(jax.random.categorical)(keys, jnp.log(q)).astype(jnp.int32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy), q


class EarlyExitDrafter(Drafter):
    """Self-speculation: the first ``exit_layer`` layers and the LM head, one token at a time.

    Args:
      params, cfg, layout: the model and the engine's cache layout.
      exit_layer: m, layers run per draft token (1 <= m < num_layers).
      attn_impl: attention implementation (``kvjax.attention``).
    """

    def __init__(
        self, params: Params, cfg: ModelConfig, layout: CacheLayout, exit_layer: int, attn_impl: attention.Impl = "auto"
    ) -> None:
        self.params, self.cfg, self.layout = params, cfg, layout
        self.exit_layer = exit_layer
        self.attn_impl = attn_impl

    def propose(
        self, rows: Sequence[DraftRow], num_rows: int, pool: PagePool, block_tables: tuple[jax.Array, ...]
    ) -> tuple[Drafts, PagePool]:
        k = max((r.max_drafts for r in rows), default=0)
        n = len(rows)
        max_drafts = np.zeros(num_rows, np.int32)
        max_drafts[:n] = [r.max_drafts for r in rows]
        start = np.zeros(num_rows, np.int32)
        start[:n] = [r.start for r in rows]
        temperature = np.zeros(num_rows, np.float32)
        top_p = np.ones(num_rows, np.float32)
        seeds = np.zeros(num_rows, np.int32)
        counters = np.zeros(num_rows, np.int32)
        for i, r in enumerate(rows):
            temperature[i], top_p[i], seeds[i], counters[i] = r.temperature, r.top_p, r.seed, r.counter
        device_sampling = jnp.asarray(temperature), jnp.asarray(top_p), jnp.asarray(seeds)
        current = np.zeros((num_rows, 1), np.int32)
        current[:n, 0] = [r.context[-1] for r in rows]
        inputs = jnp.asarray(current)  # [s, 1]: the token whose successor is drafted
        drafted, dists = [], []
        for i in range(k):
            live = i < max_drafts
            positions = np.where(live, start + i, -1).astype(np.int32)[:, None]  # [s, 1]
            lengths = np.where(live, start + i + 1, 0).astype(np.int32)  # [s]
            logits, pool = forward(
                self.params, pool, inputs, jnp.asarray(positions), block_tables, jnp.asarray(lengths),
                cfg=self.cfg, layout=self.layout, logits_mode="last", attn_impl=self.attn_impl,
                exit_layer=self.exit_layer,
            )
            tokens, q = _draw(logits, *device_sampling, jnp.asarray(counters + i))
            drafted.append(tokens)
            dists.append(q)
            inputs = tokens[:, None]
        tokens = np.asarray(jnp.stack(drafted, axis=1)) if k else np.zeros((num_rows, 0), np.int32)
        sampled = bool(np.any(temperature > 0))
        probs = jnp.stack(dists, axis=1) if k and sampled else None
        return Drafts(tokens, max_drafts, probs), pool


def make_drafter(
    config: SpeculativeConfig, params: Params, cfg: ModelConfig, layout: CacheLayout, attn_impl: attention.Impl = "auto"
) -> Drafter:
    """The drafter ``config.method`` names, for this model and cache layout."""
    config.check_model(cfg.num_layers)
    if config.method == "ngram":
        return NgramDrafter(config.ngram_sizes)
    return EarlyExitDrafter(params, cfg, layout, config.exit_layer, attn_impl)
