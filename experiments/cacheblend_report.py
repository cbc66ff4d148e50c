"""Tables, figures and summary of the CacheBlend experiment, from the per-prompt records:
per-policy quality at the run's ratio with bootstrap 95% intervals over prompts, speed as
TTFT against full recompute's on the same prompts, paired differences against full
recompute and full reuse for every gold metric, the share of full reuse's gold loss each
selector recovers, the recompute ratio each selector needs for 99% of full recompute's gold,
quality-vs-ratio curves and the Pareto front, time fraction against FLOP fraction and the
fixed cost, where the run's time went, the learned scorer's training recall, the loading
controller.
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import ml_collections
import numpy as np

from experiments import cacheblend_plots as plots
from experiments import report
from experiments.cacheblend_eval import (
    GOLD_KEYS, Setup, TimingLog, budget_rows, ci_row, paired_rows, recovery, speed_row,
)
from experiments.timing import Compilations
from kvjax.blend.selection import SelectionConfig

TIME_SLACK = 1.3
"""A selector's time fraction must stay within this factor of its FLOP fraction (plus the fixed cost)."""
PHASES = ("load_s", "check_layers_s", "row_layers_s", "logits_s")


def _with_ci(row: dict, key: str) -> str:
    return f"{row[key]:.3f} [{row[f'{key}_lo']:.3f}, {row[f'{key}_hi']:.3f}]" if key in row else ""


def _display(rows: list[dict], keys: tuple[str, ...], first: tuple[str, ...]) -> list[dict]:
    """Rows with "mean [lo, hi]" strings for ``keys``, led by the plain columns ``first``."""
    return [{**{k: r.get(k) for k in first}, **{k: _with_ci(r, k) for k in keys if k in r}} for r in rows]


def _significance(paired: list[dict], key: str) -> str:
    """One sentence per baseline: which policies differ significantly on ``key`` and which do not."""
    lines = []
    for baseline in dict.fromkeys(r["baseline"] for r in paired):
        rows = [r for r in paired if r["baseline"] == baseline and r["metric"] == key]
        below = [f"{r['policy']} ({r['difference']:+.3f} [{r['lo']:+.3f}, {r['hi']:+.3f}])" for r in rows
                 if r["significant"] and r["difference"] < 0]
        above = [f"{r['policy']} ({r['difference']:+.3f} [{r['lo']:+.3f}, {r['hi']:+.3f}])" for r in rows
                 if r["significant"] and r["difference"] > 0]
        same = [r["policy"] for r in rows if not r["significant"]]
        lines.append(f"- vs {baseline.replace('_', ' ')} ({key}, paired 95% CI): significantly lower: "
                     f"{', '.join(below) or 'none'}; significantly higher: {', '.join(above) or 'none'}; "
                     f"not significantly different: {', '.join(same) or 'none'}.")
    return "\n".join(lines) + "\n"


def _fixed_cost(per_policy: dict[str, list[dict]]) -> dict:
    """Full reuse's TTFT in ms by part (the cost no recompute ratio removes): the blended
    prefill's phases and the engine step around them."""
    runs = per_policy.get("full_reuse")
    if not runs:
        return {}
    parts = {k.removesuffix("_s") + "_ms": 1e3 * float(np.mean([p["phases"].get(k, 0.0) for p in runs])) for k in PHASES}
    ttft = 1e3 * float(np.mean([p["ttft_s"] for p in runs]))
    return {"ttft_ms": ttft, **parts, "engine_step_ms": ttft - sum(parts.values())}


def write(
    workdir: pathlib.Path, config: ml_collections.ConfigDict, setup: Setup, *, sel_cfg: SelectionConfig,
    records: list[dict], policies: list[str], sweep: list[tuple], devs: list[np.ndarray], learned: dict,
    tier_rows: list[dict], controller, n_mean: float, log: TimingLog, compiled: Compilations, elapsed: float,
    resumed: int,
) -> dict:
    """Writes policies.csv, paired.csv, ratio_sweep.csv, budget.csv, the figures and summary.md; returns the results."""
    nboot, seed = config.eval.bootstrap, config.seed
    per_policy = {name: [r["runs"][name] for r in records] for name in policies}
    sweep_results = {}
    for key, name, pol in sweep:
        results = [r["runs"][key] for r in records if key in r["runs"]]
        sweep_results[(name, pol.recompute_ratio)] = results
    full = per_policy["full_recompute"]
    rows = []
    for name, results in per_policy.items():
        row = ci_row(name, results, nboot, seed, **speed_row(results, full, nboot, seed))
        row["time_bound"] = TIME_SLACK * row["flop_fraction"]
        rows.append(row)
    fixed = _fixed_cost(per_policy)
    fixed_fraction = fixed["ttft_ms"] / (1e3 * np.mean([p["ttft_s"] for p in full])) - next(
        r["flop_fraction"] for r in rows if r["policy"] == "full_reuse") if fixed else 0.0
    for row in rows:
        row["time_bound"] += fixed_fraction
        row["within_bound"] = bool(row["time_fraction"] <= row["time_bound"])
    gold_keys = tuple(k for k in GOLD_KEYS if k in rows[0])
    quality = ("kl", "top1", *gold_keys)
    report.write_csv(workdir / "policies.csv", rows)
    paired = (paired_rows(per_policy, "full_recompute", (*gold_keys, "kl", "top1"), nboot, seed)
              + paired_rows(per_policy, "full_reuse", (*gold_keys, "kl", "top1"), nboot, seed))
    report.write_csv(workdir / "paired.csv", paired)
    headline = recovery(per_policy, nboot, seed)
    sweep_rows = [ci_row(name, results, nboot, seed, ratio=r, ttft_mean_s=float(np.mean([p["ttft_s"] for p in results])))
                  for (name, r), results in sweep_results.items() if results]
    budgets = budget_rows(sweep_results, per_policy, nboot, seed)
    if sweep_rows:
        report.write_csv(workdir / "ratio_sweep.csv", sweep_rows)
        report.write_csv(workdir / "budget.csv", budgets)
        means = {r["policy"]: r["gold"] for r in rows if r["policy"] in ("full_recompute", "full_reuse")}
        plots.quality_vs_ratio(workdir / "gold_vs_ratio.png", sweep_rows, "gold", "gold score (95% CI band)", means)
        plots.quality_vs_ratio(workdir / "kl_vs_ratio.png", sweep_rows, "kl", "KL from full recompute, nats (95% CI band)", {})
    plots.pareto(workdir / "pareto_ttft.png", rows, sweep_rows, "ttft_mean_s", "mean TTFT (s)")
    plots.pareto(workdir / "pareto_flops.png", rows, sweep_rows, "flop_fraction", "FLOP fraction of full recompute")
    plots.policy_quality(workdir / "policy_quality.png", rows, sel_cfg.recompute_ratio)
    dev_stats = plots.deviation_figures(workdir, devs)
    plots.deviation_by_layer(workdir / "kv_deviation_by_layer.png", per_policy, ("full_reuse", "cacheblend", "query_aware", "random"))

    times = {k: float(np.sum([r["time"][k] for r in records])) for k in records[0]["time"] if k != "rss_gb"}
    rss = [r["time"]["rss_gb"] for r in records]
    per_hour = 3600.0 * len(records) / times["wall_s"]
    time_text = (
        f"{len(records)} prompts scored in {times['wall_s']:.0f} s of prompt loops ({resumed} read back from an earlier "
        f"run), {times['wall_s'] / len(records):.1f} s per prompt = **{per_hour:.0f} prompts per hour** on this machine "
        f"(compiles included). Where it went (sums over prompts): compile {times['compile_s']:.0f} s "
        f"({times['programs']:.0f} programs traced), ordinary prefills {times['prefill_s']:.0f} s, blended prefills "
        f"{times['blend_s']:.0f} s, decode {times['decode_s']:.0f} s, page ops {times['page_ops_s']:.1f} s, host (the rest) "
        f"{times['host_s']:.0f} s; prefill and decode times include the compiles that happened in them. Resident "
        f"memory after each prompt: first {rss[0]:.2f} GB, last {rss[-1]:.2f} GB, peak {max(rss):.2f} GB.\n\n"
        f"Compilation, apart from every timed figure: {compiled.seconds:.1f} s over the whole run ({compiled.programs} "
        f"programs traced, {compiled.backend_compiles} compiled by the backend, the rest from the compilation cache). "
        f"{log.warmup_runs} prefills compiled and were run again before being timed ({log.warmup_s:.1f} s); "
        f"{log.timed_runs} timed prefills, {log.compiles_in_timed} compilations inside them. Run time {elapsed:.0f} s.\n"
    )
    w = config.workload
    what = {"squad_multidoc": f"SQuAD `{w.source}` eval split, gold + up to {w.num_distractors} distractor paragraphs",
            "needle_haystack": f"needle in a haystack ({', '.join(w.niah_tasks)}), chunks {tuple(w.chunk_range)} tokens",
            "synthetic": f"synthetic ({', '.join(w.tasks)}), chunks {tuple(w.num_chunks)} x {tuple(w.chunk_tokens)}"}[w.name]
    split_note = (f" {setup.num_split_chunks} chunks longer than {setup.max_chunk_tokens} tokens (the longest a chunk "
                  "may be to stay whole in the smallest attention window) were split into pieces stored alone."
                  if setup.num_split_chunks else "")
    if setup.num_skipped:
        split_note += (f" {setup.num_skipped} drawn prompts were skipped: their suffix is shorter than their last "
                       f"partial page ({config.runtime.tokens_per_block} tokens), so a continuation would recompute chunk tokens.")
    head = "(no full reuse / full recompute pair)\n"
    if headline:
        shares = ", ".join(f"{k} {v[0]:.2f} [{v[1]:.2f}, {v[2]:.2f}]" for k, v in headline["recovered_share"].items())
        head = (f"full reuse minus full recompute, gold: {headline['reuse_minus_full']:.3f} "
                f"[{headline['lo']:.3f}, {headline['hi']:.3f}] (paired 95% CI). Share of that loss recovered at "
                f"{sel_cfg.recompute_ratio:.0%} (bootstrap 95% CI; undefined where the loss interval holds 0): {shares}.\n\n"
                + _significance(paired, "gold"))
    learned_text = "(not run)\n"
    if learned:
        learned_text = (f"trained on {learned['train_prompts']} training-split prompts ({learned['train_tokens']} chunk tokens), "
                        "disjoint from the evaluation prompts (checked). Training-set recall of the oracle's tokens by the "
                        "top-k of each score:\n\n" + report.markdown_table([learned["train_recall"]]))
    speed_cols = ("policy", "ttft_mean_s", "ttft_median_s", "speedup", "time_fraction", "flop_fraction", "time_bound",
                  "within_bound")
    speed_text = (report.markdown_table(
        [{**{k: r.get(k) for k in speed_cols}, "speedup": _with_ci(r, "speedup")} for r in rows], speed_cols)
        + f"\nspeedup = full recompute's total TTFT over the policy's on the same prompts (bootstrap 95% CI); time "
          f"fraction = its inverse; bound = {TIME_SLACK} x FLOP fraction + the fixed cost ({fixed_fraction:.3f} of full "
          f"recompute's TTFT: full reuse's time fraction minus its FLOP fraction). Full reuse's TTFT by part, ms:\n\n"
        + (report.markdown_table([fixed]) if fixed else "(full reuse not run)\n"))
    sections = [
        ("Setup", f"model `{config.model}`, workload: {what}; {len(records)} prompts, mean {n_mean:.0f} tokens; store "
                  f"variant `{config.store.variant}`; recompute ratio {sel_cfg.recompute_ratio:.4g} (requested "
                  f"{config.policy.recompute_ratio!r}); checks {sel_cfg.check_layers} budgets {sel_cfg.budgets}; "
                  f"N={config.eval.continuation_tokens}, answers of up to {config.eval.max_answer_tokens} tokens; backend "
                  f"{jax.default_backend()}.{split_note}\n"),
        ("Headline", head),
        ("Policies (mean [95% bootstrap CI over prompts])",
         report.markdown_table(_display(rows, (*quality, "flop_fraction"), ("policy", "recall_vs_oracle")))),
        ("Speed (TTFT of each policy's own prefill, no compilation inside)", speed_text),
        ("Paired differences vs full recompute and vs full reuse (policy minus baseline, 95% CI)",
         report.markdown_table(paired) if paired else "(none)\n"),
        ("Recompute ratio for 99% of full recompute's gold",
         report.markdown_table(budgets) + f"\non the first {config.sweep.num_prompts} prompts (the sweep's), interpolated "
         "between sweep ratios with full reuse at 0 and full recompute at 1; bootstrap 95% CI over prompts.\n"
         if budgets else "(no sweep)\n"),
        ("Quality vs recompute ratio", report.markdown_table(_display(sweep_rows, quality, ("policy", "ratio", "ttft_mean_s")))
         if sweep_rows else "(skipped)\n"),
        ("Time", time_text),
        ("Learned selector", learned_text),
        ("Deviation structure", f"share of KV deviation held by the top 15% tokens, mean over layers: "
                                f"{np.mean(dev_stats['top15_share_by_layer']):.3f}; adjacent-layer Spearman, mean: "
                                f"{np.nanmean(dev_stats['adjacent_spearman_by_layer']):.3f}.\n"),
        ("Loading controller", report.markdown_table(tier_rows)
         + f"\nchosen at the min ratio: {dataclasses.asdict(controller.decide(int(n_mean)))}\n"),
        ("Figures", ", ".join(sorted(p.name for p in workdir.glob("*.png"))) + "\n"),
    ]
    report.write_summary(workdir, f"CacheBlend selectors vs full recompute ({w.name}, {config.model})", sections)
    return {
        "policies": rows, "paired": paired, "headline": headline, "sweep": sweep_rows, "budget": budgets,
        "learned": learned, "deviation": dev_stats, "controller": {"tiers": tier_rows}, "ratio": sel_cfg.recompute_ratio,
        "fixed_cost_ms": fixed, "fixed_fraction": fixed_fraction, "time": {**times, "prompts_per_hour": per_hour, "rss_gb": rss},
        "timing": {**dataclasses.asdict(log), "compile_s": compiled.seconds, "programs": compiled.programs,
                   "backend_compiles": compiled.backend_compiles},
        "num_split_chunks": setup.num_split_chunks, "num_skipped": setup.num_skipped, "num_prompts": len(records), "run_seconds": elapsed,
    }
