"""Loading controller: recompute ratio and storage tier from a cost model.

Per layer, loading a prompt's reused KV from a tier takes
``latency + tokens · bytes_per_token_layer / bandwidth``; recomputing ``ratio`` of the tokens
takes ``ratio · tokens · seconds_per_token_layer`` (profiled on this machine). With the two
overlapped layer by layer (C7), recompute is free while it is shorter than the load, so

    ratio = max(min_ratio, break-even ratio)        break-even: recompute time = load time

and the cheapest tier whose load still hides behind the recompute adds no delay.
Host and disk bandwidths are measured here; HBM and NVMe come from configured numbers.
"""

from __future__ import annotations

import dataclasses
import pathlib
import tempfile
import time
from collections.abc import Sequence

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class TierSpec:
    """One storage tier.

    Attributes:
      name: tier name.
      bandwidth: bytes per second into device memory.
      latency: seconds per per-layer read.
      cost_rank: 0 = cheapest storage per byte; higher = dearer.
      measured: True when measured on this machine, False when configured.
    """

    name: str
    bandwidth: float
    latency: float
    cost_rank: int
    measured: bool

    def __post_init__(self) -> None:
        if self.bandwidth <= 0 or self.latency < 0:
            raise ValueError(f"tier {self.name!r}: bandwidth={self.bandwidth} must be > 0 and latency={self.latency} >= 0")


def measure_host_tier(num_bytes: int = 64 << 20, repeats: int = 3) -> TierSpec:
    """Host memory -> device: timed ``jax.device_put`` of a numpy buffer (best of ``repeats``)."""
    buf = np.ones(num_bytes // 4, np.float32)
    small = np.ones(256, np.float32)
    best, best_small = float("inf"), float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        jax.device_put(buf).block_until_ready()
        best = min(best, time.perf_counter() - t)
        t = time.perf_counter()
        jax.device_put(small).block_until_ready()
        best_small = min(best_small, time.perf_counter() - t)
    return TierSpec("host", num_bytes / max(best - best_small, 1e-9), best_small, cost_rank=2, measured=True)


def measure_disk_tier(folder: str | pathlib.Path | None = None, num_bytes: int = 64 << 20, repeats: int = 3) -> TierSpec:
    """Disk -> device: timed ``np.load`` of a freshly written file plus the transfer.

    The file may still sit in the OS page cache, so this is an upper bound on disk bandwidth.
    """
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        path = pathlib.Path(tmp) / "probe.npy"
        np.save(path, np.ones(num_bytes // 4, np.float32))
        small = pathlib.Path(tmp) / "small.npy"
        np.save(small, np.ones(256, np.float32))
        best, best_small = float("inf"), float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            jax.device_put(np.load(path)).block_until_ready()
            best = min(best, time.perf_counter() - t)
            t = time.perf_counter()
            jax.device_put(np.load(small)).block_until_ready()
            best_small = min(best_small, time.perf_counter() - t)
    return TierSpec("disk", num_bytes / max(best - best_small, 1e-9), best_small, cost_rank=0, measured=True)


def configured_tier(name: str, gbps: float, latency_ms: float, cost_rank: int) -> TierSpec:
    """A tier from configured numbers (GB/s, ms)."""
    return TierSpec(name, gbps * 1e9, latency_ms * 1e-3, cost_rank, measured=False)


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
      seconds_per_token_layer: profiled recompute time of one token in one layer.
      bytes_per_token_layer: K+V bytes of one token in one layer.
      min_ratio: quality floor of the ratio, in [0, 1].
    """

    def __init__(self, tiers: Sequence[TierSpec], seconds_per_token_layer: float, bytes_per_token_layer: int, min_ratio: float = 0.15):
        if not tiers:
            raise ValueError("tiers must not be empty")
        if seconds_per_token_layer <= 0:
            raise ValueError(f"seconds_per_token_layer={seconds_per_token_layer} must be > 0")
        if not 0.0 <= min_ratio <= 1.0:
            raise ValueError(f"min_ratio={min_ratio} must lie in [0, 1]")
        self.tiers = {t.name: t for t in tiers}
        self.seconds_per_token_layer = seconds_per_token_layer
        self.bytes_per_token_layer = bytes_per_token_layer
        self.min_ratio = min_ratio

    def load_time(self, tier: str, num_tokens: int) -> float:
        spec = self.tiers[tier]
        return spec.latency + num_tokens * self.bytes_per_token_layer / spec.bandwidth

    def recompute_time(self, ratio: float, num_tokens: int) -> float:
        return ratio * num_tokens * self.seconds_per_token_layer

    def break_even_ratio(self, tier: str, num_tokens: int) -> float:
        return self.load_time(tier, num_tokens) / (num_tokens * self.seconds_per_token_layer)

    def choose_ratio(self, tier: str, num_tokens: int) -> float:
        """``max(min_ratio, break-even ratio)``, capped at 1."""
        return min(1.0, max(self.min_ratio, self.break_even_ratio(tier, num_tokens)))

    def choose_tier(self, ratio: float, num_tokens: int) -> str:
        """The cheapest tier whose per-layer load hides behind the recompute at ``ratio``;
        the fastest tier when none does."""
        budget = self.recompute_time(ratio, num_tokens)
        hidden = [t for t in self.tiers.values() if self.load_time(t.name, num_tokens) <= budget]
        if hidden:
            return min(hidden, key=lambda t: t.cost_rank).name
        return min(self.tiers.values(), key=lambda t: self.load_time(t.name, num_tokens)).name

    def decide(self, num_tokens: int, tier: str | None = None) -> Decision:
        """Ratio for ``tier`` (default: the tier chosen at ``min_ratio``), and the tier's costs."""
        tier = tier or self.choose_tier(self.min_ratio, num_tokens)
        ratio = self.choose_ratio(tier, num_tokens)
        return Decision(
            ratio=ratio, break_even=self.break_even_ratio(tier, num_tokens), tier=tier,
            load_s=self.load_time(tier, num_tokens), recompute_s=self.recompute_time(ratio, num_tokens),
        )
