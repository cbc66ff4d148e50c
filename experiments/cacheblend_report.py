"""Tables, figures and summary of the CacheBlend experiment: per-policy quality at the run's
ratio with bootstrap 95% intervals over prompts, paired differences against CacheBlend, the
gold loss of full reuse and the share of it each selector recovers, quality-vs-ratio curves,
the learned scorer's training recall, speed against the FLOP bound, the loading controller.
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import ml_collections
import numpy as np

from experiments import cacheblend_plots as plots
from experiments import report
from experiments.cacheblend_eval import GOLD_KEYS, Setup, ci_row, paired_rows, recovery
from kvjax.blend.selection import SelectionConfig

_PAIRED_KEYS = ("gold", "f1", "exact", "kl", "top1")


def _with_ci(row: dict, key: str) -> str:
    return f"{row[key]:.3f} [{row[f'{key}_lo']:.3f}, {row[f'{key}_hi']:.3f}]" if key in row else ""


def _display(rows: list[dict], keys: tuple[str, ...], first: tuple[str, ...]) -> list[dict]:
    """Rows with "mean [lo, hi]" strings for ``keys``, led by the plain columns ``first``."""
    return [{**{k: r.get(k) for k in first}, **{k: _with_ci(r, k) for k in keys if k in r}} for r in rows]


def write(
    workdir: pathlib.Path, config: ml_collections.ConfigDict, setup: Setup, *, sel_cfg: SelectionConfig,
    per_policy: dict[str, list[dict]], ttft: dict[str, list[float]], sweep_results: dict[tuple[str, float], list[dict]],
    phases: list[dict], devs: list[np.ndarray], learned: dict, tier_rows: list[dict], controller, n_mean: float,
    elapsed: float,
) -> dict:
    """Writes policies.csv, paired.csv, ratio_sweep.csv, the figures and summary.md; returns the results."""
    nboot, seed = config.eval.bootstrap, config.seed
    base = np.asarray(ttft["full_recompute"])
    rows = [ci_row(name, results, nboot, seed, ttft_s=float(np.median(ttft[name])),
                   speedup=float(np.median(base / np.asarray(ttft[name])))) for name, results in per_policy.items()]
    gold_keys = tuple(k for k in GOLD_KEYS if k in rows[0])
    quality = ("kl", "top1", *gold_keys)
    report.write_csv(workdir / "policies.csv", rows)
    paired = paired_rows(per_policy, "cacheblend", _PAIRED_KEYS, nboot, seed)
    if paired:
        report.write_csv(workdir / "paired.csv", paired)
    headline = recovery(per_policy, nboot, seed)
    sweep_rows = [ci_row(name, results, nboot, seed, ratio=r) for (name, r), results in sweep_results.items() if results]
    if sweep_rows:
        report.write_csv(workdir / "ratio_sweep.csv", sweep_rows)
        means = {r["policy"]: r["gold"] for r in rows if r["policy"] in ("full_recompute", "full_reuse")}
        plots.quality_vs_ratio(workdir / "gold_vs_ratio.png", sweep_rows, "gold", "gold score (95% CI band)", means)
        plots.quality_vs_ratio(workdir / "kl_vs_ratio.png", sweep_rows, "kl", "KL from full recompute, nats (95% CI band)", {})
    plots.policy_quality(workdir / "policy_quality.png", rows, sel_cfg.recompute_ratio)
    dev_stats = plots.deviation_figures(workdir, devs)
    plots.deviation_by_layer(workdir / "kv_deviation_by_layer.png", per_policy, ("full_reuse", "cacheblend", "query_aware", "random"))

    speed = {}
    if "cacheblend" in per_policy:
        fraction = float(np.mean([p["flop_fraction"] for p in per_policy["cacheblend"]]))
        speed = {"speedup": rows[list(per_policy).index("cacheblend")]["speedup"], "flop_bound": 1.0 / fraction,
                 "flop_fraction": fraction, "full_recompute_ttft_s": float(np.median(base)),
                 **{k: float(np.median([p[k] for p in phases])) for k in (phases[0] if phases else {})}}
    w = config.workload
    what = {"squad_multidoc": f"SQuAD `{w.source}` eval split, gold + up to {w.num_distractors} distractor paragraphs",
            "needle_haystack": f"needle in a haystack ({', '.join(w.niah_tasks)}), chunks {tuple(w.chunk_range)} tokens",
            "synthetic": f"synthetic ({', '.join(w.tasks)}), chunks {tuple(w.num_chunks)} x {tuple(w.chunk_tokens)}"}[w.name]
    head = "(no full reuse / full recompute pair)\n"
    if headline:
        shares = ", ".join(f"{k} {v:.2f}" for k, v in headline["recovered_share"].items())
        head = (f"full reuse minus full recompute, gold: {headline['reuse_minus_full']:.3f} "
                f"[{headline['lo']:.3f}, {headline['hi']:.3f}] (paired 95% CI). Share of that loss recovered at "
                f"{sel_cfg.recompute_ratio:.0%} (mean-based; meaningless when the loss interval holds 0): {shares}.\n")
    learned_text = "(not run)\n"
    if learned:
        learned_text = (f"trained on {learned['train_prompts']} training-split prompts ({learned['train_tokens']} chunk tokens), "
                        "disjoint from the evaluation prompts (checked). Training-set recall of the oracle's tokens by the "
                        "top-k of each score:\n\n" + report.markdown_table([learned["train_recall"]]))
    sections = [
        ("Setup", f"model `{config.model}`, workload: {what}; {len(per_policy['full_recompute'])} prompts, mean "
                  f"{n_mean:.0f} tokens; store variant `{config.store.variant}`; recompute ratio {sel_cfg.recompute_ratio:.4g} "
                  f"(requested {config.policy.recompute_ratio!r}); checks {sel_cfg.check_layers} budgets {sel_cfg.budgets}; "
                  f"N={config.eval.continuation_tokens}; backend {jax.default_backend()}; run time {elapsed:.0f} s.\n"),
        ("Headline", head),
        ("Policies (mean [95% bootstrap CI over prompts]; TTFT median)",
         report.markdown_table(_display(rows, (*quality, "flop_fraction"), ("policy", "ttft_s", "speedup", "recall_vs_oracle")))),
        ("Paired differences vs CacheBlend (policy minus cacheblend, 95% CI)", report.markdown_table(paired) if paired else "(none)\n"),
        ("Quality vs recompute ratio", report.markdown_table(_display(sweep_rows, quality, ("policy", "ratio")))
         if sweep_rows else "(skipped)\n"),
        ("Learned selector", learned_text),
        ("CacheBlend speed vs its FLOP bound", report.markdown_table([speed]) if speed else "(cacheblend not run)\n"),
        ("Deviation structure", f"share of KV deviation held by the top 15% tokens, mean over layers: "
                                f"{np.mean(dev_stats['top15_share_by_layer']):.3f}; adjacent-layer Spearman, mean: "
                                f"{np.mean(dev_stats['adjacent_spearman_by_layer']):.3f}.\n"),
        ("Loading controller", report.markdown_table(tier_rows)
         + f"\nchosen at the min ratio: {dataclasses.asdict(controller.decide(int(n_mean)))}\n"),
        ("Figures", ", ".join(sorted(p.name for p in workdir.glob("*.png"))) + "\n"),
    ]
    report.write_summary(workdir, f"CacheBlend selectors vs full recompute ({w.name}, {config.model})", sections)
    strip = lambda p: {k: v for k, v in p.items() if not isinstance(v, np.ndarray)}  # noqa: E731
    return {
        "policies": rows, "paired_vs_cacheblend": paired, "headline": headline, "sweep": sweep_rows, "learned": learned,
        "per_prompt": {name: [strip(p) for p in results] for name, results in per_policy.items()},
        "deviation": dev_stats, "controller": {"tiers": tier_rows}, "ratio": sel_cfg.recompute_ratio, "speed": speed,
        "run_seconds": elapsed,
    }
