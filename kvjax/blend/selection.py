"""Which tokens a blended prefill recomputes.

Token roles in one blended prompt of T tokens (its padding included)::

    | prefix (system prompt) | chunk 0 | chunk 1 | ... | chunk n-1 | suffix (question) | pad |
      exact, never selected    selectable: reused KV, recompute candidates   always recomputed

Selectors (``SELECTORS``, by name) produce a ``Selection``: either a fixed set of rows
recomputed in every layer, or a check schedule: all tokens run up to the first check layer;
at each check layer the rows still being recomputed are scored (``CheckScore``) and the set
narrows to that layer's budget. The suffix is always kept.

  cacheblend         Yao et al., CacheBlend (EuroSys 2025): checks at ``check_layers`` with
                     gradual filtering (budgets 2x, 1.5x, 1x of the target), scored by the
                     deviation of fresh from reused K/V.
  cacheblend_single  LMCache's production CacheBlend: one check at layer 1, top-k by the squared
                     key difference, the indices frozen for all later layers.
  epic               Hu et al., EPIC (position-independent context caching): the first
                     ``ceil(ratio * len)`` tokens of every chunk, fixed in advance.
  query_aware        the query-aware family (ProphetKV, QCFuse): chunk tokens scored by the
                     attention they receive from the question (suffix) rows at the check layers.
  query_aware_fused  the same attention fused with the K/V deviation (each divided by its mean
                     over the candidates, then added).
  query_impact       ours: that attention times the norm of the K/V deviation, the first-order
                     error a stale row puts into the question rows' outputs; the checks and
                     budgets of ``cacheblend``.
  learned            a small MLP over cheap features of the first check layer (``FEATURES``),
                     trained offline on a training split (``kvjax.blend.scorer``); one check,
                     indices frozen afterwards.
  random             the control: a uniform sample of the same size.
  oracle             the tokens of highest true deviation (needs full recompute; analysis).
  none / all / prefix  full KV reuse / every non-prefix token / prefix caching.

Row counts are dynamic (arrays) while row capacities are static and bucketed, so prompts of
similar size share one compiled prefill. ``plan`` is the one function that turns a
``SelectionConfig`` (selector name and recompute ratio included) into the ``Selection`` a
blended prefill runs.

Axis letters are ``kvjax/axes.py``'s.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from kvjax.blend.scoring import DEVIATIONS, FEATURES, CheckScore, Deviation, ScoreKind, scorer_hidden
from kvjax.config import ConfigError

SELECTORS = (
    "cacheblend", "cacheblend_single", "epic", "query_aware", "query_aware_fused", "query_impact", "learned", "random",
    "oracle", "none", "all", "prefix",
)
_SCHEDULE_SCORES: dict[str, ScoreKind] = {
    "cacheblend": "deviation", "cacheblend_single": "deviation", "query_aware": "attention",
    "query_aware_fused": "fused", "query_impact": "impact", "learned": "learned",
}
"""Selectors that narrow at check layers, and how their checks score rows."""
SCHEDULE_SELECTORS = tuple(_SCHEDULE_SCORES)
_SINGLE_CHECK = ("cacheblend_single", "learned")
"""Selectors with one check at ``check_layers[0]`` whose indices stay frozen afterwards."""


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
      row_bucket: row capacities are rounded up to a multiple of this, or to a coarser step
        above 4 x row_bucket rows (``row_capacity``: fewer compiled shapes, padding < 25%).
      seed: the "random" selector's seed.
      query_rows: the last this many suffix rows are the queries whose attention scores
        tokens ("query_aware", "query_aware_fused", "query_impact", "learned"), >= 1.
      scorer: the "learned" selector's flat MLP parameters (``kvjax.blend.scorer``); empty
        for every other selector.
    """

    selector: str = "cacheblend"
    recompute_ratio: float = 0.15
    check_layers: tuple[int, ...] = (1, 2, 3)
    budgets: tuple[float, ...] = (2.0, 1.5, 1.0)
    deviation: Deviation = "kv"
    row_bucket: int = 64
    seed: int = 0
    query_rows: int = 64
    scorer: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        def number(value: object) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool)

        def require(ok: bool, message: str) -> None:
            if not ok:
                raise ConfigError(message)

        for name in ("check_layers", "budgets", "scorer"):
            value = getattr(self, name)
            require(isinstance(value, (list, tuple)), f"{name}={value!r} must be a list or tuple")
            object.__setattr__(self, name, tuple(value))
        require(
            isinstance(self.selector, str) and self.selector in SELECTORS,
            f"selector={self.selector!r} must be one of {SELECTORS}",
        )
        require(
            number(self.recompute_ratio) and 0.0 <= self.recompute_ratio <= 1.0,
            f"recompute_ratio={self.recompute_ratio!r} must be a number in [0, 1]",
        )
        require(
            all(isinstance(c, int) and not isinstance(c, bool) for c in self.check_layers)
            and bool(self.check_layers)
            and self.check_layers[0] >= 1
            and list(self.check_layers) == sorted(set(self.check_layers)),
            f"check_layers={self.check_layers!r} must be strictly increasing layer indices >= 1",
        )
        require(
            all(number(b) for b in self.budgets) and len(self.budgets) == len(self.check_layers),
            f"budgets={self.budgets!r} must be numbers, one per check layer ({len(self.check_layers)})",
        )
        require(
            all(b <= a for a, b in zip(self.budgets, self.budgets[1:]))
            and self.budgets[-1] == 1.0
            and min(self.budgets) >= 1.0,
            f"budgets={self.budgets} must be non-increasing, >= 1.0, and end at 1.0",
        )
        require(self.deviation in DEVIATIONS, f"deviation={self.deviation!r} must be one of {DEVIATIONS}")
        require(
            isinstance(self.row_bucket, int) and not isinstance(self.row_bucket, bool) and self.row_bucket >= 1,
            f"row_bucket={self.row_bucket!r} must be an int >= 1",
        )
        require(isinstance(self.seed, int) and not isinstance(self.seed, bool), f"seed={self.seed!r} must be an int")
        require(
            isinstance(self.query_rows, int) and not isinstance(self.query_rows, bool) and self.query_rows >= 1,
            f"query_rows={self.query_rows!r} must be an int >= 1",
        )
        if self.selector == "learned":
            hidden = scorer_hidden(len(self.scorer))
            require(
                hidden is not None and all(number(w) and math.isfinite(w) for w in self.scorer),
                f"scorer has {len(self.scorer)} values; selector 'learned' needs the finite flat parameters of an MLP "
                f"over {len(FEATURES)} features (h * ({len(FEATURES)} + 2) + 1 values for h >= 1 hidden units)",
            )
        else:
            require(not self.scorer, f"scorer holds {len(self.scorer)} values but only selector 'learned' uses one")


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
      rows: [M] int32 token indices recomputed from layer 0 (padding rows: any index).
      rows_valid: [M] bool.
      checks: static (layer, row capacity) narrowing steps; empty = fixed set.
      counts: [len(checks)] int32 rows kept after each check (suffix included).
      score: how the checks score rows.
    """

    rows: np.ndarray
    rows_valid: np.ndarray
    checks: tuple[tuple[int, int], ...] = ()
    counts: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))
    score: CheckScore = dataclasses.field(default_factory=lambda: CheckScore())


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a positive multiple of ``multiple``."""
    return max(multiple, -(-n // multiple) * multiple)


def row_capacity(n: int, row_bucket: int) -> int:
    """Compiled row capacity for ``n`` recomputed rows: ``n`` rounded up to a multiple of
    ``row_bucket``, or of the largest power of two <= n / 4 when that is coarser. Padding stays
    below ``row_bucket`` rows or 25%, with at most 4 capacities per doubling of ``n`` (each
    capacity is a compiled check phase per scoring kind, about 2 s of XLA:CPU compile for
    SmolLM2, so a run over prompts of varied lengths compiles half as many as at 8)."""
    step = max(row_bucket, 1 << max(0, max(n, 1).bit_length() - 3))
    return round_up(n, step)


def target_count(roles: Roles, ratio: float) -> int:
    """Chunk tokens recomputed at ``ratio`` (ceil, at most all of them)."""
    return min(roles.num_selectable, math.ceil(ratio * roles.num_selectable - 1e-9))


def _fixed(token_ids: np.ndarray, row_bucket: int) -> Selection:
    capacity = row_capacity(len(token_ids), row_bucket)
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


def select_epic(roles: Roles, ratio: float, row_bucket: int) -> Selection:
    """EPIC (Hu et al.): the first ``ceil(ratio · len)`` tokens of every chunk, fixed in advance
    (a chunk computed alone puts attention-sink weight on its first tokens)."""
    chosen = [np.arange(s, s + math.ceil(ratio * (e - s) - 1e-9)) for s, e in roles.chunk_spans]
    return select_fixed(roles, np.concatenate(chosen or [np.zeros(0, int)]), row_bucket)


def check_scores(scores: np.ndarray, num_layers: int, num_tokens: int, field: str = "scores") -> None:
    """Raises ValueError naming ``field`` unless the oracle's ``scores`` are [num_layers, >=
    num_tokens] and finite over the first ``num_tokens`` tokens."""
    scores = np.asarray(scores)
    if scores.ndim != 2 or scores.shape[0] != num_layers or scores.shape[1] < num_tokens:
        raise ValueError(
            f"{field} has shape {scores.shape}; the oracle needs [num_layers={num_layers}, >= {num_tokens} tokens]"
        )
    if not np.isfinite(scores[:, :num_tokens]).all():
        raise ValueError(f"{field} must be finite over the prompt's {num_tokens} tokens (NaN or inf found)")


def select_oracle(roles: Roles, ratio: float, true_deviation: np.ndarray, row_bucket: int) -> Selection:
    """The tokens with the highest true deviation (known only after a full recompute).

    Args:
      true_deviation: [l, T] deviation of the reused KV from the full recompute KV; each
        layer is normalised by its mean over chunk tokens, then summed.
    """
    selectable, _ = roles.masks(true_deviation.shape[1])
    dev = true_deviation[:, selectable]
    score = (dev / np.maximum(dev.mean(axis=1, keepdims=True), 1e-30)).sum(axis=0)
    order = np.argsort(-score, kind="stable")[: target_count(roles, ratio)]
    return select_fixed(roles, np.flatnonzero(selectable)[order], row_bucket)


def schedule(config: SelectionConfig) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """(check layers, budgets) a check-schedule selector runs: the config's, or for the
    single-check selectors one check at ``check_layers[0]`` with budget 1."""
    if config.selector in _SINGLE_CHECK:
        return config.check_layers[:1], (1.0,)
    return config.check_layers, config.budgets


def select_schedule(roles: Roles, config: SelectionConfig, padded: int, num_layers: int) -> Selection:
    """A check schedule: all tokens until the first check layer, then narrowing at each check
    (gradual filtering when the budgets decrease), scored as ``config.selector`` scores."""
    check_layers, budgets = schedule(config)
    if check_layers[-1] >= num_layers:
        raise ValueError(f"check_layers={config.check_layers} must be < num_layers={num_layers}")
    target = target_count(roles, config.recompute_ratio)
    counts: list[int] = []
    checks: list[tuple[int, int]] = []
    for layer, budget in zip(check_layers, budgets):
        count = roles.num_forced + min(roles.num_selectable, math.ceil(budget * target - 1e-9))
        counts.append(count)
        capacity = row_capacity(count, config.row_bucket)
        if checks:
            capacity = min(capacity, checks[-1][1])
        checks.append((layer, min(capacity, padded)))
    rows = np.arange(padded, dtype=np.int32)
    deviation = "k" if config.selector == "cacheblend_single" else config.deviation
    score = CheckScore(kind=_SCHEDULE_SCORES[config.selector], deviation=deviation, query_rows=config.query_rows,
                       weights=config.scorer)
    return Selection(
        rows=rows,
        rows_valid=rows < roles.num_tokens,
        checks=tuple(checks),
        counts=np.asarray(counts, np.int32),
        score=score,
    )


def plan(
    roles: Roles,
    config: SelectionConfig,
    padded: int,
    num_layers: int,
    *,
    forced: np.ndarray | Sequence[int] = (),
    num_cached: int = 0,
    exact_len: int = 0,
    scores: np.ndarray | None = None,
) -> Selection:
    """The rows a blended prefill recomputes: ``config``'s selector over ``roles``, plus the
    ``forced`` token ids in every layer, and no row below ``num_cached``.

    Fixed selections get the forced ids as extra rows; deviation schedules keep
    ``len(forced)`` more rows after each check (forced rows win every check). A schedule's
    row capacity after a check is ``row_capacity`` of ``budget`` times one unit (the rows kept
    at budget 1, rounded), or of the rows kept when that is more.

    Args:
      roles: token roles; its chunk spans are the tokens with stored KV.
      padded: padded token count T.
      forced: token ids (1-D int) recomputed in every layer besides the suffix (chunk tokens
        without stored KV, prefix tokens not cached).
      num_cached: leading tokens whose KV the pages already hold.
      exact_len: tokens whose reused KV is exact (the "prefix" selector recomputes the rest).
      scores: [l, T] true deviation (the "oracle" selector only).
    """
    name, ratio, row_bucket = config.selector, config.recompute_ratio, config.row_bucket
    if name in _SCHEDULE_SCORES:
        sel = select_schedule(roles, config, padded, num_layers)
    elif name == "random":
        sel = select_random(roles, ratio, np.random.default_rng(config.seed), row_bucket)
    elif name == "epic":
        sel = select_epic(roles, ratio, row_bucket)
    elif name == "oracle":
        if scores is None:
            raise ValueError("selector 'oracle' needs scores (the true deviation [L, T] from full recompute)")
        check_scores(scores, num_layers, roles.num_tokens)
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
    # Capacities from one unit (the rows at budget 1, rounded) rather than from each count:
    # a schedule's capacities then vary with a single number across prompts, so its compiled
    # check phases repeat instead of one per combination of rounded counts.
    _, budgets = schedule(config)
    unit = row_capacity(roles.num_forced + len(forced) + target_count(roles, ratio), row_bucket)
    checks, cap = [], padded
    for (layer, _), count, budget in zip(sel.checks, counts, budgets):
        cap = min(row_capacity(max(int(count), math.ceil(budget * unit)), row_bucket), cap)
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
    if config.selector not in _SCHEDULE_SCORES:
        return roles.num_forced + target
    check_layers, budgets = schedule(config)
    counts = [roles.num_forced + min(roles.num_selectable, math.ceil(b * target)) for b in budgets]
    ends = [*check_layers[1:], num_layers - 1]
    rows = (check_layers[0] + 1) * (roles.num_tokens - roles.prefix_len)
    rows += sum((end - check) * count for check, end, count in zip(check_layers, ends, counts))
    return max(1, math.ceil(rows / num_layers))
