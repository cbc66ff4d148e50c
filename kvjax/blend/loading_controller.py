"""Loading controller: recompute ratio and storage tier from measured costs.

Per layer, loading a prompt's reused KV from a tier takes ``latency + tokens · bytes_per_token_layer
/ bandwidth``; recomputing ``ratio`` of the tokens takes ``fixed + ratio · tokens ·
seconds_per_token_layer``. The blended prefill overlaps the two layer by layer (a loader
thread onboards layer l + 1 while layer l computes: ``kvjax.engine.page_ops.LayerwiseOnboard``),
so recompute is free while it is shorter than the load, and

    ratio = max(min_ratio, hidden ratio)        hidden: recompute time = headroom · load time

(the break-even ratio, where the two are equal, at ``headroom`` = 1), while the cheapest tier
whose load still hides behind the recompute at a given ratio (load ≤ headroom · recompute) adds
no delay. The headroom (default 0.8) keeps the hidden side clear of the other by the
predictions' error: planned exactly at the break-even, a layer that computes a few percent
slower than predicted turns the whole prefill compute-bound. Without the overlap (serial
onboarding) nothing hides and the ratio is ``min_ratio``. Both sides are measured on this machine, on first use: the
tiers' per-layer reads
through the engine's own ``HostPool`` (``measure_tier``: throttled like the engine's tiers), and
the cost of the blended prefill's layer step at two row counts (``measure_recompute``, cached in
the kvjax cache folder per model, geometry, machine and jax version). The device tier's load
is free: its pages are read by the layer step itself.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import platform
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import attention
from kvjax.blend.fusor import BlendInputs, RecomputedRows, layer_step
from kvjax.cache import CacheLayout, HostPool, TierThrottle
from kvjax.cache.host_pool import TierName
from kvjax.cache.pool import init_pool
from kvjax.model import transformer
from kvjax.model.config import ModelConfig
from kvjax.paths import cache_dir

TIERS = ("device", "host", "disk")
"""Tier names, dearest storage first."""


@dataclasses.dataclass(frozen=True)
class TierSpec:
    """One storage tier.

    Attributes:
      name: tier name.
      bandwidth: bytes per second into device memory (``inf`` = free).
      latency: seconds per per-layer read.
      cost_rank: 0 = cheapest storage per byte; higher = dearer.
    """

    name: str
    bandwidth: float
    latency: float
    cost_rank: int

    def __post_init__(self) -> None:
        if not self.bandwidth > 0 or self.latency < 0:
            raise ValueError(
                f"tier {self.name!r}: bandwidth={self.bandwidth} must be > 0 and latency={self.latency} >= 0"
            )


@dataclasses.dataclass(frozen=True)
class RecomputeCost:
    """Measured cost of one layer of the blended prefill's layer step.

    Attributes:
      fixed_s: seconds per layer at zero rows (reading, re-rotating and writing the layer's KV,
        the dispatch).
      seconds_per_token_layer: seconds per recomputed row per layer.
      num_tokens: prompt tokens it was measured at (the attention span).
    """

    fixed_s: float
    seconds_per_token_layer: float
    num_tokens: int


def _timed(fn, repeats: int) -> float:
    """Best wall time of ``fn()`` (which blocks on its outputs) over ``repeats`` calls after one warm-up."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_tier(layout: CacheLayout, tier: TierName, throttle: TierThrottle, num_tokens: int,
                 disk_dir: str | None = None, repeats: int = 3) -> TierSpec:
    """Per-layer read time of ``tier`` ("host" or "disk") as the layer-wise onboard reads it
    (``HostPool.load`` of one layer, throttled by ``throttle``), on a probe pool of this
    geometry: latency and bandwidth fitted from reads of one page and of ``num_tokens`` tokens'
    pages (best of ``repeats``). Disk pages are read from their verified records, as the
    onboard does after the manager's check.

    Raises:
      ValueError: ``tier`` is not "host" or "disk", or ``num_tokens`` < 1.
    """
    if tier not in ("host", "disk"):
        raise ValueError(f"tier={tier!r} must be 'host' or 'disk' (the device tier is not read)")
    if num_tokens < 1:
        raise ValueError(f"num_tokens={num_tokens} must be >= 1")
    pages = max(2, layout.pages_for(num_tokens))
    probe = dataclasses.replace(layout, num_host_pages=pages, num_disk_pages=pages if tier == "disk" else 0)
    pool = HostPool(probe, disk_dir, throttles={tier: throttle})
    slots = np.arange(pages)
    if tier == "disk":
        pool.store("disk", 0, slots, probe.host_zeros(0, pages))
        if not all(pool.check_disk(0, int(p)) for p in slots):
            raise RuntimeError(f"the disk probe's pages under {disk_dir!r} did not read back as written")
    times = {n: _timed(lambda n=n: pool.load(tier, 0, slots[:n], n, layer=0), repeats) for n in (1, pages)}
    bytes_per_page = probe.bytes_per_token_layer * probe.tokens_per_block
    per_byte = max(times[pages] - times[1], 1e-12) / ((pages - 1) * bytes_per_page)
    latency = max(0.0, times[1] - bytes_per_page * per_byte)
    return TierSpec(tier, 1.0 / per_byte, latency, cost_rank=TIERS[::-1].index(tier))


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the platform's name for it where there is no /proc."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        return cpu


def _recompute_key(cfg: ModelConfig, layout: CacheLayout, num_tokens: int, rows: Sequence[int], attn_impl: str) -> str:
    cpu = cpu_name()
    parts = (cfg.name, cfg.num_layers, cfg.d_model, layout.layer_windows, layout.tokens_per_block, layout.num_kv_heads,
             layout.head_dim, layout.dtype, num_tokens, tuple(rows), attn_impl, jax.__version__, jax.default_backend(),
             jax.device_count(), cpu)
    return hashlib.blake2s(repr(parts).encode(), digest_size=10).hexdigest()


def measure_recompute(
    params: transformer.Params, cfg: ModelConfig, layout: CacheLayout, num_tokens: int, *,
    rows: Sequence[int] | None = None, repeats: int = 5, attn_impl: attention.Impl = "auto", cache: bool = True,
) -> RecomputeCost:
    """Cost of the blended prefill's layer step (``fusor.layer_step``: read and re-rotate one
    layer's reused KV of ``num_tokens`` tokens, recompute the rows, write the fused KV back),
    fitted as ``fixed + rows · seconds_per_token_layer`` from its best time at each row count
    in ``rows`` (default: ``num_tokens`` / 16 and / 4, the span of typical recompute ratios;
    compiled first, never timed). Cached as JSON in ``<kvjax cache>/controller``
    per model, geometry, row counts, machine and jax version (``cache=False``: measure anyway).
    """
    rows = tuple(rows) if rows is not None else (max(1, num_tokens // 16), max(2, num_tokens // 4))
    if len(rows) < 2 or min(rows) < 1 or max(rows) > num_tokens:
        raise ValueError(f"rows={tuple(rows)} must hold at least two row counts in [1, num_tokens={num_tokens}]")
    path = cache_dir() / "controller" / f"recompute-{_recompute_key(cfg, layout, num_tokens, rows, attn_impl)}.json"
    if cache and path.exists():
        return RecomputeCost(**json.loads(path.read_text()))
    ps = layout.tokens_per_block
    t = -(-num_tokens // ps) * ps
    probe = dataclasses.replace(
        layout, num_pages=(t // ps + 1,) * layout.num_groups, num_host_pages=0, num_disk_pages=0
    )
    layer = transformer.layer_kind(cfg, probe, cfg.num_layers - 1)
    pool = init_pool(probe)
    k_pages, v_pages = pool.k[layer], pool.v[layer]
    idx = np.arange(t)
    table = (idx[::ps] // ps + 1).astype(np.int32)
    times = []
    for m in rows:
        picked = np.linspace(0, num_tokens - 1, m).round().astype(np.int32)  # rows spread over the prompt
        inputs = BlendInputs.on_device(
            tokens=np.zeros(t, np.int32),
            positions=np.where(idx < num_tokens, idx, -1).astype(np.int32),
            page_ids=np.tile(idx // ps + 1, (layout.num_groups, 1)).astype(np.int32),
            offsets=(idx % ps).astype(np.int32),
            reused=idx < num_tokens,
            deltas=np.zeros(t, np.int32),
            selectable=idx < num_tokens,
            forced=np.zeros(t, bool),
            rows=picked,
            rows_valid=np.ones(m, bool),
            counts=np.zeros(0, np.int32),
            block_table=np.tile(table, (layout.num_groups, 1)),
            length=np.asarray([num_tokens], np.int32),
            probes=np.zeros(0, np.int32),
            num_cached=np.int32(0),
        )
        state = RecomputedRows(idx=jnp.asarray(picked)[None], valid=jnp.ones((1, m), bool),
                         x=jnp.asarray(np.random.default_rng(0).normal(size=(1, m, cfg.d_model)), params.embed.dtype))

        def step(state: RecomputedRows = state, inputs: BlendInputs = inputs) -> None:
            nonlocal k_pages, v_pages
            out, k_pages, v_pages, _, _ = layer_step(
                params.layers[layer],
                state,
                k_pages,
                v_pages,
                inputs,
                inputs.block_table[None],
                cfg=cfg,
                layout=probe,
                layer=layer,
                num_probes=0,
                attn_impl=attn_impl,
            )
            jax.block_until_ready(out.x)

        times.append(_timed(step, repeats))
    slope, fixed = np.polyfit(np.asarray(rows, float), np.asarray(times), 1)
    cost = RecomputeCost(
        fixed_s=max(0.0, float(fixed)), seconds_per_token_layer=max(float(slope), 1e-12), num_tokens=num_tokens
    )
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dataclasses.asdict(cost)))
    return cost


@dataclasses.dataclass(frozen=True)
class Decision:
    """The controller's choice for one prompt.

    Attributes:
      ratio: recompute ratio to use.
      break_even: ratio at which recompute time equals load time for ``tier``.
      tier: tier the KV should come from.
      load_s, recompute_s: per-layer load and recompute time at ``ratio`` on ``tier``.
    """

    ratio: float
    break_even: float
    tier: str
    load_s: float
    recompute_s: float


class LoadingController:
    """Chooses recompute ratio and tier.

    Args:
      tiers: available tiers.
      seconds_per_token_layer: recompute time of one row in one layer.
      bytes_per_token_layer: K+V bytes of one token in one layer.
      min_ratio: quality floor of the ratio, in [0, 1].
      fixed_s: recompute time of a layer at zero rows (what every blended layer costs).
      headroom: share of the other side's time the hidden side may fill, in (0, 1].
    """

    def __init__(self, tiers: Sequence[TierSpec], seconds_per_token_layer: float, bytes_per_token_layer: int,
                 min_ratio: float = 0.15, fixed_s: float = 0.0, headroom: float = 0.8):
        if not tiers:
            raise ValueError("tiers must not be empty")
        if seconds_per_token_layer <= 0:
            raise ValueError(f"seconds_per_token_layer={seconds_per_token_layer} must be > 0")
        if not 0.0 <= min_ratio <= 1.0:
            raise ValueError(f"min_ratio={min_ratio} must lie in [0, 1]")
        if fixed_s < 0:
            raise ValueError(f"fixed_s={fixed_s} must be >= 0")
        if not 0.0 < headroom <= 1.0:
            raise ValueError(f"headroom={headroom} must lie in (0, 1]")
        self.tiers = {t.name: t for t in tiers}
        self.seconds_per_token_layer = seconds_per_token_layer
        self.bytes_per_token_layer = bytes_per_token_layer
        self.min_ratio = min_ratio
        self.fixed_s = fixed_s
        self.headroom = headroom

    @classmethod
    def measured(
        cls,
        params: transformer.Params,
        cfg: ModelConfig,
        layout: CacheLayout,
        throttles: dict[str, TierThrottle],
        num_tokens: int,
        *,
        min_ratio: float = 0.15,
        headroom: float = 0.8,
        disk_dir: str | None = None,
        attn_impl: attention.Impl = "auto",
    ) -> LoadingController:
        """A controller from this machine's measurements: the device tier (free), the host tier,
        and the disk tier when ``layout`` has one, each read through ``throttles``
        (``HostPool.throttles``); the recompute cost at ``num_tokens`` tokens."""
        cost = measure_recompute(params, cfg, layout, num_tokens, attn_impl=attn_impl)
        tiers = [TierSpec("device", float("inf"), 0.0, cost_rank=2)]
        lower: tuple[tuple[TierName, int], ...] = (("host", layout.num_host_pages), ("disk", layout.num_disk_pages))
        tiers += [measure_tier(layout, name, throttles[name], num_tokens, disk_dir) for name, pages in lower if pages]
        return cls(tiers, cost.seconds_per_token_layer, layout.bytes_per_token_layer, min_ratio, cost.fixed_s, headroom)

    def load_time(self, tier: str, num_tokens: int) -> float:
        spec = self.tiers[tier]
        return spec.latency + num_tokens * self.bytes_per_token_layer / spec.bandwidth

    def recompute_time(self, ratio: float, num_tokens: int) -> float:
        return self.fixed_s + ratio * num_tokens * self.seconds_per_token_layer

    def break_even_ratio(self, tier: str, num_tokens: int, share: float = 1.0) -> float:
        """Ratio whose recompute takes ``share`` of ``tier``'s load time (0 when even no rows do)."""
        return max(0.0, share * self.load_time(tier, num_tokens) - self.fixed_s) / (
            num_tokens * self.seconds_per_token_layer
        )

    def choose_ratio(self, tier: str, num_tokens: int, overlapped: bool = True) -> float:
        """``max(min_ratio, break_even_ratio(..., headroom))``, capped at 1; ``min_ratio`` when
        the load is not ``overlapped`` with the recompute (serial onboarding)."""
        hidden = self.break_even_ratio(tier, num_tokens, self.headroom) if overlapped else 0.0
        return min(1.0, max(self.min_ratio, hidden))

    def choose_tier(self, ratio: float, num_tokens: int) -> str:
        """The cheapest tier whose per-layer load hides behind the recompute at ``ratio`` (takes
        at most ``headroom`` of it); the fastest tier when none does."""
        budget = self.headroom * self.recompute_time(ratio, num_tokens)
        hidden = [t for t in self.tiers.values() if self.load_time(t.name, num_tokens) <= budget]
        if hidden:
            return min(hidden, key=lambda t: t.cost_rank).name
        return min(self.tiers.values(), key=lambda t: self.load_time(t.name, num_tokens)).name

    def decide(self, num_tokens: int, tier: str | None = None, overlapped: bool = True) -> Decision:
        """Ratio for ``tier`` (default: the tier chosen at ``min_ratio``), and the tier's costs;
        ``overlapped``: whether the tier's load runs beside the recompute (``choose_ratio``)."""
        tier = tier or self.choose_tier(self.min_ratio, num_tokens)
        ratio = self.choose_ratio(tier, num_tokens, overlapped)
        return Decision(
            ratio=ratio, break_even=self.break_even_ratio(tier, num_tokens), tier=tier,
            load_s=self.load_time(tier, num_tokens), recompute_s=self.recompute_time(ratio, num_tokens),
        )
