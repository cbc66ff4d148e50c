"""Which tokens a blended prefill recomputes.

Token roles in one blended prompt (T = padded token count)::

    | prefix (system prompt) | chunk 0 | chunk 1 | ... | chunk n-1 | suffix (question) | pad |
      exact, never selected    selectable: reused KV, recompute candidates   always recomputed

Selectors (``SELECTORS``, by name) produce a ``Selection``: either a fixed set of rows
recomputed in every layer (random, oracle, first-k per chunk, full reuse "none", full
recompute "all", prefix caching "prefix"), or a deviation schedule
(CacheBlend): all tokens run up to the first check layer; at each check layer the rows still
being recomputed are scored by the deviation of their fresh K/V from the reused K/V and the
set narrows to that layer's budget (gradual filtering). The suffix is always kept.

Row counts are dynamic (arrays) while row capacities are static and bucketed, so prompts of
similar size share one compiled prefill. ``plan`` is the one function that turns a
``SelectionConfig`` (selector name and recompute ratio included) into the ``Selection`` a
blended prefill runs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.config import ConfigError

Deviation = Literal["k", "v", "kv"]
DEVIATIONS = ("k", "v", "kv")
SELECTORS = ("cacheblend", "random", "oracle", "first_k", "none", "all", "prefix")


@dataclasses.dataclass(frozen=True)
class SelectionConfig:
    """How a blended prefill selects the tokens it recomputes.

    Attributes:
      selector: a name in ``SELECTORS``.
      recompute_ratio: share of the chunk tokens recomputed at the last check layer, in [0, 1].
      check_layers: layers where deviations are measured, strictly increasing, the first >= 1
        (layer 0 KV depends only on token and position, so it is exact after repositioning).
      budgets: row budget after each check layer in units of the target count, non-increasing
        and ending at 1.0; the first > 1 makes the candidate set larger than the target.
      deviation: "k", "v" or "kv": which fresh-minus-reused difference scores a token.
      row_bucket: row capacities are rounded up to a multiple of this (avoids recompiles).
      seed: the "random" selector's seed.
    """

    selector: str = "cacheblend"
    recompute_ratio: float = 0.15
    check_layers: tuple[int, ...] = (1, 2, 3)
    budgets: tuple[float, ...] = (2.0, 1.5, 1.0)
    deviation: Deviation = "kv"
    row_bucket: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        def number(value: object) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool)

        def require(ok: bool, message: str) -> None:
            if not ok:
                raise ConfigError(message)

        for name in ("check_layers", "budgets"):
            value = getattr(self, name)
            require(isinstance(value, (list, tuple)), f"{name}={value!r} must be a list or tuple")
            object.__setattr__(self, name, tuple(value))
        require(isinstance(self.selector, str) and self.selector in SELECTORS, f"selector={self.selector!r} must be one of {SELECTORS}")
        require(
            number(self.recompute_ratio) and 0.0 <= self.recompute_ratio <= 1.0,
            f"recompute_ratio={self.recompute_ratio!r} must be a number in [0, 1]",
        )
        require(
            all(isinstance(c, int) and not isinstance(c, bool) for c in self.check_layers)
            and bool(self.check_layers) and self.check_layers[0] >= 1 and list(self.check_layers) == sorted(set(self.check_layers)),
            f"check_layers={self.check_layers!r} must be strictly increasing layer indices >= 1",
        )
        require(
            all(number(b) for b in self.budgets) and len(self.budgets) == len(self.check_layers),
            f"budgets={self.budgets!r} must be numbers, one per check layer ({len(self.check_layers)})",
        )
        require(
            all(b <= a for a, b in zip(self.budgets, self.budgets[1:])) and self.budgets[-1] == 1.0 and min(self.budgets) >= 1.0,
            f"budgets={self.budgets} must be non-increasing, >= 1.0, and end at 1.0",
        )
        require(self.deviation in DEVIATIONS, f"deviation={self.deviation!r} must be one of {DEVIATIONS}")
        require(
            isinstance(self.row_bucket, int) and not isinstance(self.row_bucket, bool) and self.row_bucket >= 1,
            f"row_bucket={self.row_bucket!r} must be an int >= 1",
        )
        require(isinstance(self.seed, int) and not isinstance(self.seed, bool), f"seed={self.seed!r} must be an int")


@dataclasses.dataclass(frozen=True)
class Roles:
    """Token roles of one prompt (host side).

    Attributes:
      num_tokens: real prompt tokens.
      prefix_len: tokens of the exact prefix (never selected).
      chunk_spans: (start, end) of each chunk, in prompt order.
      suffix_start: first suffix token; the suffix runs to ``num_tokens``.
    """

    num_tokens: int
    prefix_len: int
    chunk_spans: tuple[tuple[int, int], ...]
    suffix_start: int

    @property
    def num_selectable(self) -> int:
        return sum(e - s for s, e in self.chunk_spans)

    @property
    def num_forced(self) -> int:
        return self.num_tokens - self.suffix_start

    def masks(self, padded: int) -> tuple[np.ndarray, np.ndarray]:
        """(selectable [padded] bool, forced [padded] bool)."""
        selectable = np.zeros(padded, bool)
        for s, e in self.chunk_spans:
            selectable[s:e] = True
        forced = np.zeros(padded, bool)
        forced[self.suffix_start : self.num_tokens] = True
        return selectable, forced


@dataclasses.dataclass(frozen=True)
class Selection:
    """A selector's decision, ready for the fusor.

    Attributes:
      rows: [M0] int32 token indices recomputed from layer 0 (padding rows: any index).
      rows_valid: [M0] bool.
      checks: static (layer, row capacity) narrowing steps; empty = fixed set.
      counts: [len(checks)] int32 rows kept after each check (suffix included).
      deviation: which difference scores tokens at the checks.
    """

    rows: np.ndarray
    rows_valid: np.ndarray
    checks: tuple[tuple[int, int], ...] = ()
    counts: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))
    deviation: Deviation = "kv"


def bucket(n: int, multiple: int) -> int:
    """``n`` rounded up to a positive multiple of ``multiple``."""
    return max(multiple, -(-n // multiple) * multiple)


def target_count(roles: Roles, ratio: float) -> int:
    """Chunk tokens recomputed at ``ratio`` (ceil, at most all of them)."""
    return min(roles.num_selectable, math.ceil(ratio * roles.num_selectable - 1e-9))


def _fixed(token_ids: np.ndarray, row_bucket: int) -> Selection:
    capacity = bucket(len(token_ids), row_bucket)
    rows = np.zeros(capacity, np.int32)
    rows[: len(token_ids)] = token_ids
    valid = np.arange(capacity) < len(token_ids)
    return Selection(rows=rows, rows_valid=valid)


def _suffix_ids(roles: Roles) -> np.ndarray:
    return np.arange(roles.suffix_start, roles.num_tokens, dtype=np.int32)


def select_fixed(roles: Roles, chosen: np.ndarray, row_bucket: int) -> Selection:
    """The suffix plus the given chunk tokens, recomputed in every layer."""
    ids = np.unique(np.concatenate([np.asarray(chosen, np.int32), _suffix_ids(roles)]))
    return _fixed(ids.astype(np.int32), row_bucket)


def select_none(roles: Roles, row_bucket: int) -> Selection:
    """Full KV reuse: only the suffix is computed."""
    return select_fixed(roles, np.zeros(0, np.int32), row_bucket)


def select_all(roles: Roles, row_bucket: int) -> Selection:
    """Full recompute of every non-prefix token (with an exact prefix: equals full recompute)."""
    return select_fixed(roles, np.arange(roles.prefix_len, roles.suffix_start, dtype=np.int32), row_bucket)


def select_random(roles: Roles, ratio: float, rng: np.random.Generator, row_bucket: int) -> Selection:
    """The control: a uniform sample of ``ratio`` of the chunk tokens."""
    pool = np.concatenate([np.arange(s, e) for s, e in roles.chunk_spans] or [np.zeros(0, int)])
    chosen = rng.choice(pool, size=target_count(roles, ratio), replace=False) if len(pool) else pool
    return select_fixed(roles, chosen, row_bucket)


def select_first_k(roles: Roles, ratio: float, row_bucket: int) -> Selection:
    """EPIC-style: the first ``ceil(ratio · len)`` tokens of every chunk (their attention-sink-like
    beginnings carry most of the deviation of a chunk computed alone)."""
    chosen = [np.arange(s, s + math.ceil(ratio * (e - s) - 1e-9)) for s, e in roles.chunk_spans]
    return select_fixed(roles, np.concatenate(chosen or [np.zeros(0, int)]), row_bucket)


def select_oracle(roles: Roles, ratio: float, true_deviation: np.ndarray, row_bucket: int) -> Selection:
    """The tokens with the highest true deviation (known only after a full recompute).

    Args:
      true_deviation: [num_layers, num_tokens] deviation of the reused KV from the full
        recompute KV; each layer is normalised by its mean over chunk tokens, then summed.
    """
    selectable, _ = roles.masks(true_deviation.shape[1])
    dev = true_deviation[:, selectable]
    score = (dev / np.maximum(dev.mean(axis=1, keepdims=True), 1e-30)).sum(axis=0)
    order = np.argsort(-score, kind="stable")[: target_count(roles, ratio)]
    return select_fixed(roles, np.flatnonzero(selectable)[order], row_bucket)


def select_cacheblend(roles: Roles, config: SelectionConfig, padded: int, num_layers: int) -> Selection:
    """The deviation schedule: all tokens until ``check_layers[0]``, then gradual filtering."""
    if config.check_layers[-1] >= num_layers:
        raise ValueError(f"check_layers={config.check_layers} must be < num_layers={num_layers}")
    target = target_count(roles, config.recompute_ratio)
    counts, checks = [], []
    for layer, budget in zip(config.check_layers, config.budgets):
        count = roles.num_forced + min(roles.num_selectable, math.ceil(budget * target - 1e-9))
        counts.append(count)
        capacity = bucket(count, config.row_bucket)
        if checks:
            capacity = min(capacity, checks[-1][1])
        checks.append((layer, min(capacity, padded)))
    rows = np.arange(padded, dtype=np.int32)
    return Selection(
        rows=rows, rows_valid=rows < roles.num_tokens, checks=tuple(checks),
        counts=np.asarray(counts, np.int32), deviation=config.deviation,
    )


def plan(
    roles: Roles,
    config: SelectionConfig,
    padded: int,
    num_layers: int,
    *,
    forced: np.ndarray = np.zeros(0, np.int32),
    num_cached: int = 0,
    exact_len: int = 0,
    scores: np.ndarray | None = None,
) -> Selection:
    """The rows a blended prefill recomputes: ``config``'s selector over ``roles``, plus the
    ``forced`` token ids in every layer, and no row below ``num_cached``.

    Fixed selections get the forced ids as extra rows; deviation schedules keep
    ``len(forced)`` more rows after each check (forced rows win every check).

    Args:
      roles: token roles; its chunk spans are the tokens with stored KV.
      padded: padded token count T.
      forced: [F] int32 tokens recomputed in every layer besides the suffix (chunk tokens
        without stored KV, prefix tokens not cached).
      num_cached: leading tokens whose KV the pages already hold.
      exact_len: tokens whose reused KV is exact (the "prefix" selector recomputes the rest).
      scores: [L, T] true deviation (the "oracle" selector only).
    """
    name, ratio, row_bucket = config.selector, config.recompute_ratio, config.row_bucket
    if name == "cacheblend":
        sel = select_cacheblend(roles, config, padded, num_layers)
    elif name == "random":
        sel = select_random(roles, ratio, np.random.default_rng(config.seed), row_bucket)
    elif name == "first_k":
        sel = select_first_k(roles, ratio, row_bucket)
    elif name == "oracle":
        if scores is None:
            raise ValueError("selector 'oracle' needs scores (the true deviation [L, T] from full recompute)")
        sel = select_oracle(roles, ratio, scores, row_bucket)
    elif name == "none":
        sel = select_none(roles, row_bucket)
    elif name == "all":
        sel = select_all(roles, row_bucket)
    else:
        chunk_ids = np.concatenate([np.arange(s, e) for s, e in roles.chunk_spans] or [np.zeros(0, int)])
        sel = select_fixed(roles, chunk_ids[chunk_ids >= exact_len], row_bucket)
    forced = np.asarray(forced, np.int32)
    if not sel.checks:
        ids = sel.rows[sel.rows_valid]
        ids = np.unique(np.concatenate([ids[ids >= num_cached], forced])).astype(np.int32)
        return _fixed(ids, row_bucket)
    counts = sel.counts + len(forced)
    checks, cap = [], padded
    for (layer, _), count in zip(sel.checks, counts):
        cap = min(bucket(int(count), row_bucket), cap)
        checks.append((layer, cap))
    return dataclasses.replace(
        sel, rows_valid=sel.rows_valid & (sel.rows >= num_cached), checks=tuple(checks), counts=counts.astype(np.int32)
    )


def estimated_rows(roles: Roles, config: SelectionConfig, num_layers: int) -> int:
    """Token-rows a blended prefill computes, averaged over layers (its scheduling charge)."""
    target = target_count(roles, config.recompute_ratio)
    if config.selector == "none":
        return roles.num_forced
    if config.selector in ("all", "prefix"):
        return roles.num_tokens - roles.prefix_len
    if config.selector != "cacheblend":
        return roles.num_forced + target
    counts = [roles.num_forced + min(roles.num_selectable, math.ceil(b * target)) for b in config.budgets]
    ends = [*config.check_layers[1:], num_layers - 1]
    rows = (config.check_layers[0] + 1) * (roles.num_tokens - roles.prefix_len)
    rows += sum((end - check) * count for check, end, count in zip(config.check_layers, ends, counts))
    return max(1, math.ceil(rows / num_layers))


def token_deviation(
    k_new: jax.Array, v_new: jax.Array, k_old: jax.Array, v_old: jax.Array, kind: Deviation
) -> jax.Array:
    """Squared L2 deviation per token, summed over KV heads and head_dim.

    Args:
      k_new, v_new, k_old, v_old: [T, K, d].

    Returns:
      [T] float32.
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
      capacity: static number of output slots (>= count).

    Returns:
      (picked [capacity] int32 indices into the M rows, valid [capacity] bool).
    """
    score = jnp.where(forced, jnp.inf, jnp.where(eligible, deviation, -jnp.inf))
    top, picked = jax.lax.top_k(score, capacity)
    valid = (jnp.arange(capacity) < count) & (top > -jnp.inf)
    return picked.astype(jnp.int32), valid
