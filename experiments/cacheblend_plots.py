"""Figures of the CacheBlend experiment, one message each: plain tick labels, 95% intervals
drawn as bands (curves) or whiskers (points).

  policy_quality.png             gold score of every policy at the run's ratio, with intervals
  gold_vs_ratio.png              gold score vs recompute ratio per selector, full recompute and
                                 full reuse as reference lines
  kl_vs_ratio.png                KL from full recompute vs ratio per selector
  kv_deviation_cdf.png           how the reused KV deviates, per layer
  deviation_concentration.png    how much of the deviation the top tokens hold
  adjacent_layer_correlation.png whether a check layer predicts the next layers
  kv_deviation_by_layer.png      deviation left in reused vs recomputed tokens
  pareto_ttft.png, pareto_flops.png  gold-answer likelihood against mean TTFT / FLOP fraction, one
                                 point per policy and swept ratio with its interval, full recompute
                                 and full reuse the two ends (pareto_ttft_gold.png: the gold score)
"""

from __future__ import annotations

import pathlib

import matplotlib
import numpy as np

from experiments.report import save_figure
from kvjax import metrics

matplotlib.use("Agg")
import matplotlib.pyplot as plt

CDF_LAYERS = (1, 4, 10, 20)
_SIZE = (5.5, 3.6)


def policy_quality(path: pathlib.Path, rows: list[dict], ratio: float) -> None:
    """Gold score per policy (mean and 95% interval over prompts), best at the top."""
    rows = sorted(rows, key=lambda r: r["gold"])
    fig, ax = plt.subplots(figsize=_SIZE)
    y = np.arange(len(rows))
    mean = np.asarray([r["gold"] for r in rows])
    err = np.asarray([[r["gold"] - r["gold_lo"], r["gold_hi"] - r["gold"]] for r in rows]).T
    ax.errorbar(mean, y, xerr=err, fmt="o", capsize=3)
    ax.set_yticks(y, [r["policy"] for r in rows])
    ax.set(xlabel="gold score (mean over prompts, 95% CI)", title=f"Task quality at {ratio:.0%} recompute")
    save_figure(fig, path)


def quality_vs_ratio(
    path: pathlib.Path, sweep_rows: list[dict], key: str, label: str, references: dict[str, float]
) -> None:
    """``key`` vs recompute ratio per selector with 95% bands; ``references``: horizontal lines."""
    fig, ax = plt.subplots(figsize=_SIZE)
    for name in dict.fromkeys(r["policy"] for r in sweep_rows):
        rows = sorted((r for r in sweep_rows if r["policy"] == name), key=lambda r: r["ratio"])
        x = [100 * r["ratio"] for r in rows]
        (line,) = ax.plot(x, [r[key] for r in rows], marker="o", ms=3, label=name)
        ax.fill_between(
            x, [r[f"{key}_lo"] for r in rows], [r[f"{key}_hi"] for r in rows], color=line.get_color(), alpha=0.12
        )
    for name, value in references.items():
        ax.axhline(value, ls="--", lw=1, color="gray" if name == "full_recompute" else "black", label=name)
    ratios = sorted({100 * r["ratio"] for r in sweep_rows})
    ax.set_xticks(ratios, [f"{r:g}" for r in ratios])
    ax.set(xlabel="recompute ratio (% of chunk tokens)", ylabel=label)
    ax.legend(fontsize=7, ncol=2)
    save_figure(fig, path)


def deviation_figures(workdir: pathlib.Path, devs: list[np.ndarray]) -> dict:
    """The three deviation-structure figures; returns the statistics they show.

    Args:
      devs: per prompt [L, chunk tokens] relative deviation of the reused KV.
    """
    rel = np.concatenate(devs, axis=1)
    fig, ax = plt.subplots(figsize=_SIZE)
    for layer in CDF_LAYERS:
        if layer < rel.shape[0]:
            x = np.sort(rel[layer])
            ax.plot(x, np.linspace(0, 1, len(x)), label=f"layer {layer}")
    ax.set_xscale("log")
    ax.set(xlabel="relative KV deviation of reused tokens", ylabel="share of chunk tokens below")
    ax.legend()
    save_figure(fig, workdir / "kv_deviation_cdf.png")

    fracs = np.linspace(0, 1, 101)
    shares = []
    for dev in devs:
        s = -np.sort(-dev, axis=1)
        cum = np.cumsum(s, axis=1) / np.maximum(s.sum(axis=1, keepdims=True), 1e-30)
        idx = np.clip((fracs * dev.shape[1]).astype(int) - 1, 0, dev.shape[1] - 1)
        shares.append(np.where(fracs > 0, cum[:, idx].mean(axis=0), 0.0))
    fig, ax = plt.subplots(figsize=_SIZE)
    ax.plot(100 * fracs, np.mean(shares, axis=0), label="measured")
    ax.plot(100 * fracs, fracs, "--", color="gray", label="uniform")
    ax.axvline(15, color="red", lw=0.8)
    ax.set(xlabel="% of tokens (highest deviation first)", ylabel="share of total KV deviation")
    ax.legend()
    save_figure(fig, workdir / "deviation_concentration.png")

    spear = np.mean([metrics.adjacent_layer_spearman(d) for d in devs], axis=0)
    fig, ax = plt.subplots(figsize=_SIZE)
    ax.plot(np.arange(1, len(spear) + 1), spear, marker="o", ms=3)
    ax.set(xlabel="layer l (vs l - 1)", ylabel="Spearman of token deviations", ylim=(min(0, spear.min()), 1))
    save_figure(fig, workdir / "adjacent_layer_correlation.png")
    return {"top15_share_by_layer": np.mean([metrics.top_share(d, 0.15) for d in devs], axis=0),
            "adjacent_spearman_by_layer": spear}


def deviation_by_layer(path: pathlib.Path, per_policy: dict[str, list[dict]], names: tuple[str, ...]) -> None:
    """Mean deviation from full recompute per layer, of reused and of recomputed tokens."""
    fig, ax = plt.subplots(figsize=_SIZE)
    for name in names:
        results = [p for p in per_policy.get(name, []) if "dev_selected" in p]  # the detailed prompts
        if not results:
            continue
        (line,) = ax.plot(np.nanmean([p["dev_unselected"] for p in results], axis=0), label=f"{name}: reused tokens")
        if name != "full_reuse":
            ax.plot(np.nanmean([p["dev_selected"] for p in results], axis=0), "--", color=line.get_color(),
                    label=f"{name}: recomputed")
    ax.set(xlabel="layer", ylabel="relative KV deviation", yscale="log")
    ax.legend(fontsize=7)
    save_figure(fig, path)


def significant_front(points: list[tuple[float, float, float, float]]) -> list[tuple[float, float]]:
    """Cost-ordered points (cost, mean, lo, hi) that beat every cheaper point of the front by
    more than noise: a point joins when its interval's low end lies above the high end of the
    front's last point (the cheapest point starts it)."""
    front: list[tuple[float, float, float, float]] = []
    for x, y, lo, hi in sorted(points):
        if not front or lo > front[-1][3]:
            front.append((x, y, lo, hi))
    return [(x, y) for x, y, _, _ in front]


def pareto(path: pathlib.Path, rows: list[dict], sweep_rows: list[dict], cost: str, label: str, key: str, ylabel: str,
           budgets: list[dict] = ()) -> None:
    """``key`` (mean over prompts, 95% interval whiskers) against ``cost``: one marker per
    policy at the run's ratio (named in the legend, not on the plot, so close points stay
    legible), each swept selector's curve in its policy's colour, each selector's budget for
    95% of full reuse's loss as a star (TTFT only), and the front only through points that
    improve on cheaper ones beyond their intervals (``significant_front``)."""
    fig, ax = plt.subplots(figsize=(7.0, 4.2))
    markers = "os^vDPX<>*hp"
    colors = {}
    for i, r in enumerate(sorted(rows, key=lambda r: r[cost])):
        err = [[r[key] - r[f"{key}_lo"]], [r[f"{key}_hi"] - r[key]]]
        bar = ax.errorbar(r[cost], r[key], yerr=err, fmt=markers[i % len(markers)], ms=5, capsize=2, lw=0.8,
                          label=r["policy"], zorder=3)
        colors[r["policy"]] = bar[0].get_color()
    for name in dict.fromkeys(r["policy"] for r in sweep_rows):
        line = sorted((r for r in sweep_rows if r["policy"] == name), key=lambda r: r["ratio"])
        ax.errorbar([r[cost] for r in line], [r[key] for r in line],
                    yerr=[[r[key] - r[f"{key}_lo"] for r in line], [r[f"{key}_hi"] - r[key] for r in line]],
                    marker=".", lw=0.7, alpha=0.6, capsize=0, color=colors.get(name))
    if cost == "ttft_mean_s":
        full = next((r for r in rows if r["policy"] == "full_recompute"), None)
        for b in budgets:
            if b["metric"] == key and full is not None and np.isfinite(b["ratio_95%"]):
                at = full["ttft_mean_s"] / b["speedup_95%"]
                reuse = next(r[key] for r in rows if r["policy"] == "full_reuse")
                ax.scatter(at, reuse + 0.95 * (full[key] - reuse), marker="*", s=60, color=colors.get(b["policy"]),
                           edgecolors="black", linewidths=0.4, zorder=4)
    front = significant_front([(r[cost], r[key], r[f"{key}_lo"], r[f"{key}_hi"]) for r in [*rows, *sweep_rows]])
    if len(front) > 1:
        ax.plot(*zip(*front), "--", color="gray", lw=0.8, label="front (beyond noise)")
    ax.set(xlabel=label, ylabel=ylabel)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    save_figure(fig, path)
