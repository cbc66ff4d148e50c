"""Layer-by-layer blended prefill into the paged cache: the one blended-prefill driver.

The reused KV of every prompt token (chunks precomputed alone) sits in the engine's pages.
For every layer l (compiled as a check phase plus one reused layer step, see
``blend_prefill``):

1. the layer's reused KV is read from its slots and its keys re-rotated to the actual
   positions (``read_layer``), as one contiguous [T, h, d] array;
2. the rows still being recomputed get fresh q/k/v from their own hidden states; at a check
   layer their deviation from the reused KV narrows the set (``scoring.narrow``);
3. the recomputed rows' K/V overwrite the reused ones in the layer's contiguous K/V (the
   fused KV);
4. the recomputed rows attend over it (``attention.row_attention``: the blocked XLA
   implementation straight over the contiguous K/V, a kernel with the array seen as pages
   0, 1, ...), with a causal mask exact by position
   (``key_pos <= query_pos``), and run the MLP. After a check the kept rows are in token
   order, so blocks of rows attend over a causal staircase of keys;
5. the layer's fused KV is written into the sequence's pages (``write_layer_fused``; tokens
   below ``num_cached`` are left alone).

Only one layer's reused KV is held at a time, so layer l + 1's KV can still be on its way
from a slower tier while layer l computes (``fetch``: ``kvjax.engine.page_ops.LayerwiseOnboard``).
Decoding then continues with ``transformer.forward`` like after any prefill.
``blend_prefill`` is the only layer loop; the engine runs it for every request submitted
with chunks (``kvjax.blend.engine_blend``), for several variants of one prompt at once when
they share a step (steps 1 and 5 once per layer, the rows of one capacity through steps 2-4
as one batch, each variant over its own fused KV). Recomputing every row reproduces full recompute;
recomputing only the suffix is full KV reuse.

Axis letters are ``kvjax/axes.py``'s. Each layer group (G, one per attention window) has its
own pages and block table; a windowed layer's rows attend only inside its window.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from kvjax import attention
from kvjax.blend.reposition import reposition_keys
from kvjax.blend.scoring import FEATURES, CheckScore, check_features, check_score, narrow
from kvjax.blend.timeline import ComputeTimeline, PhaseClock
from kvjax.cache.layout import CacheLayout
from kvjax.cache.pool import PagePool, Pages, read_slots, slot_mapping, write_layer
from kvjax.model import transformer
from kvjax.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class BlendPlan:
    """Static part of a blended prefill (a jit static argument).

    Attributes:
      checks: (layer, row capacity after narrowing) per check layer; empty = fixed rows.
      score: how the checks score rows.
      num_probes: rows whose per-layer attention output is traced (0 = no trace).
      num_logits: logits returned for this many last prompt positions (>= 1; all of them
        must be recomputed rows, e.g. the suffix).
    """

    checks: tuple[tuple[int, int], ...] = ()
    score: CheckScore = CheckScore()
    num_probes: int = 0
    num_logits: int = 1


@flax.struct.dataclass
class BlendInputs:
    """Device inputs of one blended prefill (one sequence).

    Attributes:
      tokens: [T] int32 prompt ids (padding: any id).
      positions: [T] int32 absolute positions; -1 = padding.
      page_ids: [G, T] int32 page of each token's stored KV (keys rotated for the stored
        positions) in each layer group's pool; offsets: [T] int32 its slot in the page. Any
        slot where ``reused`` is False.
      reused: [T] bool tokens with stored KV (the others, e.g. the suffix, start from zeros).
      deltas: [T] int32 actual minus stored position of each token.
      selectable: [T] bool chunk tokens (may be selected).
      forced: [T] bool suffix tokens (always recomputed).
      rows: [M] int32 tokens recomputed from layer 0 (M: the capacity before the first check);
        rows_valid: [M] bool.
      counts: [num_checks] int32 rows kept after each check.
      block_table: [G, p] int32 pages of the sequence in each layer group.
      length: [1] int32 prompt length.
      probes: [o] int32 positions whose attention output is traced (-1 = none).
      num_cached: [] int32 leading tokens whose KV the pages already hold (blocks matched by
        prefix reuse, possibly shared with other requests): their reused KV is not written
        and they must not be rows, so no shared page is ever written (0 = write all).
    """

    tokens: jax.Array
    positions: jax.Array
    page_ids: jax.Array
    offsets: jax.Array
    reused: jax.Array
    deltas: jax.Array
    selectable: jax.Array
    forced: jax.Array
    rows: jax.Array
    rows_valid: jax.Array
    counts: jax.Array
    block_table: jax.Array
    length: jax.Array
    probes: jax.Array
    num_cached: jax.Array

    @classmethod
    def on_device(cls, **fields: np.ndarray | np.generic) -> BlendInputs:
        """The inputs from fields built on the host (numpy), each moved to the device."""
        return cls(**{name: jnp.asarray(value) for name, value in fields.items()})


@flax.struct.dataclass
class RecomputedRows:
    """The rows being recomputed.

    Attributes:
      idx: [M] int32 token index of each row.
      valid: [M] bool.
      x: [M, D] residual stream of each row.
    """

    idx: jax.Array
    valid: jax.Array
    x: jax.Array


def blend_layer(
    lp: transformer.LayerParams,
    cfg: ModelConfig,
    layout: CacheLayout,
    layer: int,
    rows: RecomputedRows,
    seq_k: jax.Array,
    seq_v: jax.Array,
    inputs: BlendInputs,
    check: tuple[int, jax.Array] | None,
    score: CheckScore,
    attn_impl: attention.Impl,
) -> tuple[RecomputedRows, jax.Array, jax.Array, jax.Array]:
    """One layer of the blended prefill.

    Args:
      layer: layer index (static: RoPE base and window).
      rows: the rows entering the layer.
      seq_k, seq_v: [T, h, d] reused KV of this layer at the actual positions (T a multiple
        of the page size).
      check: (capacity, count) to narrow the rows at this layer, or None.
      score: how the check scores rows (unused without a check).

    Returns:
      (rows leaving the layer, fused seq_k, seq_v, attention output [M, H, d] of the rows).
    """
    row_pos = jnp.where(rows.valid, inputs.positions[rows.idx], -1)  # [M]
    q, k, v = transformer.qkv(lp, cfg, layer, rows.x[None], row_pos[None])  # [1, M, *, d]
    if check is not None:
        capacity, count = check
        dev = check_score(
            score, q[0], k[0], v[0], seq_k, seq_v, rows.idx, rows.valid, inputs.positions, inputs.deltas,
            inputs.length[0], inputs.selectable, inputs.forced, cfg.sm_scale,
        )  # [M]
        forced = inputs.forced[rows.idx] & rows.valid
        eligible = (inputs.selectable[rows.idx] | inputs.forced[rows.idx]) & rows.valid
        picked, valid = narrow(dev, forced, eligible, count, capacity)
        # Kept rows in token order (invalid ones last): the row attention's query blocks then
        # span narrow position ranges and visit only the key blocks up to their last row.
        order = jnp.argsort(jnp.where(valid, rows.idx[picked], jnp.iinfo(jnp.int32).max))
        picked, valid = picked[order], valid[order]
        rows = RecomputedRows(idx=rows.idx[picked], valid=valid, x=rows.x[picked])
        q, k, v = q[:, picked], k[:, picked], v[:, picked]
        row_pos = jnp.where(valid, inputs.positions[rows.idx], -1)

    t = seq_k.shape[0]
    target = jnp.where(rows.valid, rows.idx, t)  # invalid rows write nowhere
    seq_k = seq_k.at[target].set(k[0].astype(seq_k.dtype), mode="drop")
    seq_v = seq_v.at[target].set(v[0].astype(seq_v.dtype), mode="drop")
    spec = attention.AttentionSpec(cfg.sm_scale, layout.window_of(layer))
    out = attention.row_attention(
        q[0], row_pos, seq_k, seq_v, inputs.length[0], spec, tokens_per_block=layout.tokens_per_block, impl=attn_impl
    )  # [M, H, d]
    x = transformer.finish_layer(lp, cfg, rows.x[None], out[None])[0]
    return dataclasses.replace(rows, x=x), seq_k, seq_v, out


def read_layer(
    k_pages: Pages, v_pages: Pages, inputs: BlendInputs, *, cfg: ModelConfig, layout: CacheLayout, layer: int
) -> tuple[jax.Array, jax.Array]:
    """One layer's reused KV at the actual positions, read from the pool's slots: keys
    re-rotated by ``deltas``, zeros where a token has no stored KV. Traceable.

    Args:
      k_pages, v_pages: the layer's pages (``PagePool.k[layer]``, ``.v[layer]``).

    Returns:
      (k, v): [T, h, d] each (quantized pages dequantized).
    """
    ids = inputs.page_ids[layout.layer_group[layer]]
    mask = inputs.reused[:, None, None]
    k = jnp.where(mask, read_slots(k_pages, ids, inputs.offsets), 0)
    v = jnp.where(mask, read_slots(v_pages, ids, inputs.offsets), 0)
    return reposition_keys(k, inputs.deltas, cfg.layer_rope_theta[layer], cfg.layer_rope_scaling[layer]), v


def write_layer_fused(
    k_pages: Pages, v_pages: Pages, seq_k: jax.Array, seq_v: jax.Array, block_tables: jax.Array, inputs: BlendInputs, *,
    layout: CacheLayout, layer: int,
) -> tuple[Pages, Pages]:
    """Writes one layer's fused KV of B variants of the prompt (seq_k, seq_v: [B, T, h, d])
    into each variant's pages (block_tables: [B, G, p]), except the ``num_cached`` leading
    tokens (pages the tree already holds, possibly shared). Traceable.

    The pages written (the requests' own, past ``num_cached``) are never slots ``read_layer``
    reads, so a layer can be written as soon as it is fused."""
    write_pos = jnp.where(inputs.positions >= inputs.num_cached, inputs.positions, -1)  # [T]
    write_pos = jnp.broadcast_to(write_pos, seq_k.shape[:2])  # [B, T]
    page_ids, offsets = slot_mapping(block_tables[:, layout.layer_group[layer]], write_pos, layout.tokens_per_block)
    return write_layer(k_pages, page_ids, offsets, seq_k), write_layer(v_pages, page_ids, offsets, seq_v)


def initial_rows(params: transformer.Params, cfg: ModelConfig, inputs: BlendInputs) -> RecomputedRows:
    """Embeddings of the rows recomputed from layer 0."""
    x = transformer.embed_tokens(params, cfg, inputs.tokens[inputs.rows][None])[0]  # [M, D]
    return RecomputedRows(idx=inputs.rows, valid=inputs.rows_valid, x=x)


def last_logits(
    params: transformer.Params, cfg: ModelConfig, rows: RecomputedRows, positions: jax.Array, num: int
) -> jax.Array:
    """Logits [num, v] of the rows at the ``num`` highest valid positions, in position order."""
    row_pos = jnp.where(rows.valid, positions[rows.idx], -1)
    _, top = jax.lax.top_k(row_pos, num)
    return jax.vmap(lambda x: transformer.logits_of(params, cfg, x))(rows.x[top[::-1]])


def _recomputed(inputs: BlendInputs, rows: RecomputedRows) -> jax.Array:
    """[T] bool: the tokens one layer recomputed."""
    return jnp.zeros(inputs.tokens.shape[0], bool).at[rows.idx].max(rows.valid)


def _probe_attention(inputs: BlendInputs, rows: RecomputedRows, out: jax.Array) -> jax.Array:
    """Attention output [o, H*d] of one layer at the probe positions (zeros where not recomputed)."""
    row_pos = jnp.where(rows.valid, inputs.positions[rows.idx], -1)  # [M]
    match = (inputs.probes[:, None] == row_pos[None, :]) & (inputs.probes[:, None] >= 0)  # [o, M]
    return match.astype(out.dtype) @ out.reshape(out.shape[0], -1)  # [o, H*d]


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "layout", "checks", "score", "num_probes", "attn_impl"),
    donate_argnames=("k_pages", "v_pages"),
)
def _check_phase(
    params: transformer.Params,
    k_pages: tuple[Pages, ...],
    v_pages: tuple[Pages, ...],
    inputs: BlendInputs,
    *,
    cfg: ModelConfig,
    layout: CacheLayout,
    checks: tuple[tuple[int, int], ...],
    score: CheckScore,
    num_probes: int,
    attn_impl: attention.Impl,
) -> tuple[RecomputedRows, tuple[Pages, ...], tuple[Pages, ...], list, list, jax.Array, tuple]:
    """Layers 0 .. last check layer in one program: all tokens, then narrowing at each check.

    ``k_pages``/``v_pages`` are the pages of exactly these layers (donated): each layer's
    reused KV is read from them and its fused KV written back into the sequence's pages.

    Returns:
      (rows, k_pages, v_pages, per-layer recomputed masks [T], per-layer probe attention
      [o, H*d] (empty unless ``num_probes``), features [T, f] of every token at the first check
      layer (``scoring.check_features``; zeros unless ``num_probes``), per-layer fused (k, v)
      [T, h, d] (empty unless ``num_probes``)).
    """
    check_at = {layer: (i, capacity) for i, (layer, capacity) in enumerate(checks)}
    rows = initial_rows(params, cfg, inputs)
    pages_k, pages_v = list(k_pages), list(v_pages)
    masks: list[jax.Array] = []
    probes: list[jax.Array] = []
    fused: list[tuple[jax.Array, jax.Array]] = []
    t = inputs.tokens.shape[0]
    features = jnp.zeros((t, len(FEATURES)), jnp.float32)
    for layer in range(len(pages_k)):
        seq_k, seq_v = read_layer(pages_k[layer], pages_v[layer], inputs, cfg=cfg, layout=layout, layer=layer)
        check = None
        if layer in check_at:
            i, capacity = check_at[layer]
            check = (capacity, inputs.counts[i])
        if num_probes and layer == checks[0][0]:
            row_pos = jnp.where(rows.valid, inputs.positions[rows.idx], -1)
            q, k, v = transformer.qkv(params.layers[layer], cfg, layer, rows.x[None], row_pos[None])
            feats = check_features(
                q[0], k[0], v[0], seq_k, seq_v, rows.idx, rows.valid, inputs.positions, inputs.deltas,
                inputs.length[0], inputs.selectable, inputs.forced, cfg.sm_scale, score.query_rows,
            )  # [M, f]
            features = features.at[jnp.where(rows.valid, rows.idx, t)].set(feats, mode="drop")
        rows, seq_k, seq_v, out = blend_layer(
            params.layers[layer], cfg, layout, layer, rows, seq_k, seq_v, inputs, check, score, attn_impl,
        )
        pages_k[layer], pages_v[layer] = write_layer_fused(
            pages_k[layer],
            pages_v[layer],
            seq_k[None],
            seq_v[None],
            inputs.block_table[None],
            inputs,
            layout=layout,
            layer=layer,
        )
        masks.append(_recomputed(inputs, rows))
        if num_probes:
            probes.append(_probe_attention(inputs, rows, out))
            fused.append((seq_k, seq_v))
    return rows, tuple(pages_k), tuple(pages_v), masks, probes, features, tuple(fused)


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "layout", "layer", "num_probes", "attn_impl"),
    donate_argnames=("k_pages", "v_pages"),
)
def layer_step(
    lp: transformer.LayerParams,
    rows: RecomputedRows,
    k_pages: Pages,
    v_pages: Pages,
    inputs: BlendInputs,
    block_tables: jax.Array,
    *,
    cfg: ModelConfig,
    layout: CacheLayout,
    layer: int,
    num_probes: int,
    attn_impl: attention.Impl,
) -> tuple[RecomputedRows, Pages, Pages, jax.Array, tuple[jax.Array, jax.Array, jax.Array] | None]:
    """One layer without a check for B variants of one prompt, as one program: reads the
    layer's reused KV from its pages (donated) once, runs ``blend_layer`` for each variant's
    rows over its own copy (vmapped: the variants' rows go through the projections and the MLP
    as one batch, each attends to its own fused KV) and writes each fused KV into its pages.

    ``layer`` only fixes the RoPE base, scaling and window, so one compiled step serves every
    layer with the same three and the same shapes (see ``transformer.layer_kind``). It does not
    read ``inputs.rows``, ``rows_valid``, ``counts`` or ``block_table`` (``blend_prefill``
    passes them empty).

    Args:
      rows: the variants' rows, stacked: idx, valid [B, M], x [B, M, D].
      block_tables: [B, G, p] int32 each variant's pages.

    Returns:
      (rows [B, M], k_pages, v_pages, recomputed [B, T] bool, with ``num_probes`` (probe
      attention [B, o, H*d], fused k, v [B, T, h, d]) else None).
    """
    seq_k, seq_v = read_layer(k_pages, v_pages, inputs, cfg=cfg, layout=layout, layer=layer)

    def variant(rows: RecomputedRows) -> tuple[RecomputedRows, jax.Array, jax.Array, jax.Array]:
        return blend_layer(lp, cfg, layout, layer, rows, seq_k, seq_v, inputs, None, CheckScore(), attn_impl)

    rows, fused_k, fused_v, out = jax.vmap(variant)(rows)
    k_pages, v_pages = write_layer_fused(
        k_pages, v_pages, fused_k, fused_v, block_tables, inputs, layout=layout, layer=layer
    )
    recomputed = jax.vmap(lambda r: _recomputed(inputs, r))(rows)
    trace = (jax.vmap(lambda r, o: _probe_attention(inputs, r, o))(rows, out), fused_k, fused_v) if num_probes else None
    return rows, k_pages, v_pages, recomputed, trace


_NO_INITIAL_ROWS: dict[str, Any] = dict(
    rows=np.zeros(0, np.int32), rows_valid=np.zeros(0, bool), counts=np.zeros(0, np.int32),
    block_table=np.zeros((0, 0), np.int32),
)
"""``BlendInputs`` fields ``layer_step`` does not read (the rows from layer 0, the check
counts and one variant's block table), emptied for it so their shapes do not key its
compiled programs."""


initial_rows_jit = jax.jit(initial_rows, static_argnames=("cfg",))


@functools.partial(jax.jit, static_argnames=("cfg", "num"))
def cohort_logits(
    params: transformer.Params, cfg: ModelConfig, rows: RecomputedRows, positions: jax.Array, num: int
) -> jax.Array:
    """``last_logits`` of B variants' stacked rows (idx, valid [B, M], x [B, M, D]): [B, num, v]."""
    return jax.vmap(lambda r: last_logits(params, cfg, r, positions, num))(rows)


class PrefillInterrupted(Exception):
    """A layer of ``blend_prefill`` failed (its ``__cause__``): ``pool`` holds the pages as they
    are now, donated layers replaced by their outputs, so the caller can keep the engine's pool."""

    def __init__(self, pool: PagePool) -> None:
        super().__init__("the blended prefill stopped at a failing layer")
        self.pool = pool


LayerFetch = Callable[[int, Pages, Pages], tuple[Pages, Pages]]
"""``fetch(layer, k_pages, v_pages)``: waits until the layer's reused KV that is still on its
way from a slower tier is in its pages and returns the pages (``kvjax.engine.page_ops.LayerwiseOnboard``)."""


@dataclasses.dataclass(frozen=True)
class BlendResult:
    """What ``blend_prefill`` returns for one variant.

    Attributes:
      logits: [plan.num_logits, v] float32 of the last prompt tokens.
      recomputed: [l, T] bool, the rows each layer computed.
      trace: with ``plan.num_probes > 0``: ``attn`` [l, o, H*d] (attention output of the
        probe positions, zeros where a probe was not recomputed), ``recomputed``, the fused
        KV ``k``, ``v`` [l, T, h, d] and the ``features`` [T, f] of every token at the first
        check layer (zeros without checks); else None.
    """

    logits: jax.Array
    recomputed: jax.Array
    trace: dict[str, jax.Array] | None


def _stack(states: list[RecomputedRows]) -> RecomputedRows:
    return jax.tree.map(lambda *xs: jnp.stack(xs), *states)


def blend_prefill(
    params: transformer.Params,
    pool: PagePool,
    inputs: Sequence[BlendInputs],
    plans: Sequence[BlendPlan],
    *,
    cfg: ModelConfig,
    layout: CacheLayout,
    attn_impl: attention.Impl = "auto",
    phases: dict[str, float] | None = None,
    fetch: LayerFetch | None = None,
    timeline: ComputeTimeline | None = None,
) -> tuple[list[BlendResult], PagePool]:
    """Blended prefill of B variants of one prompt (e.g. the selectors and ratios of a sweep);
    writes each variant's fused KV into its own pages of the pool (donated).

    The variants share the prompt and its reused KV (every ``BlendInputs`` field but
    ``rows``, ``rows_valid``, ``counts`` and ``block_table``) and differ in their selection.
    Two kinds of compiled programs: a variant's check phase (layers 0 .. its last check
    layer, all tokens, then gradual filtering) as one program, and one compiled layer step
    (``layer_step``) per remaining layer for the variants whose rows have the same capacity,
    together: the layer's reused KV is read and re-rotated once and their rows go through it
    as one batch, dispatched asynchronously (a 30-layer unrolled program would take ~5x longer
    to compile for every new row capacity, with no faster run time). Each layer writes its
    fused KV into the variants' pages as it goes, so reused KV is held for one layer (a check
    phase's layers together), never for all layers. One variant (B = 1) is the ordinary
    blended prefill.

    With ``fetch``, layer l's pages are asked for just before the first program that reads
    layer l is dispatched: while the loader brings layer l + 1 from its tier, layer l computes
    (the check phases wait for all their layers first).

    Args:
      inputs: one per variant; T must be a multiple of ``layout.tokens_per_block``.
      plans: one per variant; all with the same ``num_logits`` and ``num_probes`` (> 0 only
        for a single variant).
      phases: if given, receives the seconds of each phase ("check_layers", "row_layers",
        "logits"), waiting for each to finish before the next starts.
      fetch: see ``LayerFetch``; None = every reused page is already on the device.
      timeline: records when each layer's computation ran.

    Returns:
      (one ``BlendResult`` per variant, the pool).
    """
    if len(inputs) != len(plans) or not plans:
        raise ValueError(f"got {len(inputs)} inputs and {len(plans)} plans: one of each per variant, at least one")
    if len({(p.num_logits, p.num_probes) for p in plans}) > 1 or (plans[0].num_probes and len(plans) > 1):
        raise ValueError(
            "the variants of one blended prefill must share num_logits and num_probes, and only one may trace probes"
        )
    if inputs[0].tokens.shape[0] % layout.tokens_per_block:
        raise ValueError(
            f"padded tokens T={inputs[0].tokens.shape[0]} must be a multiple of "
            f"tokens_per_block={layout.tokens_per_block}"
        )
    clock = PhaseClock(phases)
    host_tables = [np.asarray(x.block_table) for x in inputs]
    inputs = [jax.device_put(x) for x in inputs]
    k_pages, v_pages = list(pool.k), list(pool.v)
    num_probes = plans[0].num_probes
    fetched_to = 0

    def fetched(end: int) -> None:
        nonlocal fetched_to
        for layer in range(fetched_to, end):
            if fetch is not None:
                k_pages[layer], v_pages[layer] = fetch(layer, k_pages[layer], v_pages[layer])
        fetched_to = max(fetched_to, end)

    firsts = [plan.checks[-1][0] + 1 if plan.checks else 0 for plan in plans]
    rows: dict[int, RecomputedRows] = {}
    masks: list[list[jax.Array]] = [[] for _ in plans]
    probes: list[jax.Array] = []
    fused: list[tuple[jax.Array, jax.Array]] = []
    features = jnp.zeros((inputs[0].tokens.shape[0], len(FEATURES)), jnp.float32)
    options = dict(cfg=cfg, layout=layout, num_probes=num_probes, attn_impl=attn_impl)
    try:
        fetched(max(firsts))
        for b, (first, plan) in enumerate(zip(firsts, plans)):
            if first:
                rows[b], k_pages[:first], v_pages[:first], masks[b], probes, features, traced = _check_phase(
                    params,
                    tuple(k_pages[:first]),
                    tuple(v_pages[:first]),
                    inputs[b],
                    checks=plan.checks,
                    score=plan.score,
                    **options,
                )
                fused = list(traced)
                if timeline is not None:
                    timeline.dispatched((0, first), rows[b].x)
            else:
                rows[b] = initial_rows_jit(params, cfg=cfg, inputs=inputs[b])
        clock.lap("check_layers", [r.x for r in rows.values()])
        # one step program per row count, any schedule
        row_inputs = jax.device_put(dataclasses.replace(inputs[0], **_NO_INITIAL_ROWS))
        # row capacity -> (variants, stacked rows, block tables)
        cohorts: dict[int, tuple[list[int], RecomputedRows, jax.Array]] = {}
        for layer in range(min(firsts), cfg.num_layers + 1):  # variants join at their first row layer (or at the end)
            joining = [b for b, first in enumerate(firsts) if first == layer]
            for capacity in dict.fromkeys(rows[b].idx.shape[0] for b in joining):
                members, stacked, _ = cohorts.get(capacity, ([], None, None))
                new = [b for b in joining if rows[b].idx.shape[0] == capacity]
                stacked = _stack([rows[b] for b in new]) if stacked is None else jax.tree.map(
                    lambda a, *xs: jnp.concatenate([a, jnp.stack(xs)]), stacked, *(rows[b] for b in new))
                members = [*members, *new]
                cohorts[capacity] = (members, stacked, jnp.asarray(np.stack([host_tables[b] for b in members])))
            if layer == cfg.num_layers:
                break
            fetched(layer + 1)
            for capacity, (members, stacked, tables) in cohorts.items():
                stacked, k_pages[layer], v_pages[layer], mask, trace = layer_step(
                    params.layers[layer], stacked, k_pages[layer], v_pages[layer], row_inputs, tables,
                    layer=transformer.layer_kind(cfg, layout, layer), **options,
                )
                cohorts[capacity] = (members, stacked, tables)
                if timeline is not None:
                    timeline.dispatched((layer, layer + 1), stacked.x)
                for i, b in enumerate(members):
                    masks[b].append(mask[i])
                if trace is not None:
                    probes.append(trace[0][0])
                    fused.append((trace[1][0], trace[2][0]))
    except Exception as err:
        raise PrefillInterrupted(PagePool(k=tuple(k_pages), v=tuple(v_pages))) from err
    clock.lap("row_layers", [stacked.x for _, stacked, _ in cohorts.values()])
    logits: dict[int, jax.Array] = {}
    for members, stacked, _ in cohorts.values():
        out = cohort_logits(params, cfg, stacked, inputs[0].positions, plans[0].num_logits)
        for i, b in enumerate(members):
            logits[b] = out[i]
    pool = PagePool(k=tuple(k_pages), v=tuple(v_pages))
    clock.lap("logits", (logits, pool))
    results = []
    for b in range(len(plans)):
        recomputed, trace = jnp.stack(masks[b]), None
        if num_probes:
            trace = {"attn": jnp.stack(probes), "recomputed": recomputed, "k": jnp.stack([k for k, _ in fused]),
                     "v": jnp.stack([v for _, v in fused]), "features": features}
        results.append(BlendResult(logits=logits[b], recomputed=recomputed, trace=trace))
    return results, pool
