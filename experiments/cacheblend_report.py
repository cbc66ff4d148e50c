"""Tables, figures and summary of the CacheBlend experiment, from the per-prompt records:
per-policy quality at the run's ratio with bootstrap 95% intervals over prompts, speed as
TTFT against full recompute's on the same prompts, paired differences against full
recompute and full reuse for every metric, the share of full reuse's loss each selector
recovers (gold-answer likelihood first, then the gold score), the recompute ratio each
selector needs for 95% and 99% of that loss and the speedup within 1% of full recompute,
quality-vs-ratio curves and the Pareto front, time fraction against FLOP fraction and the
fixed cost, where the run's time went and in which pieces, the learned scorer's training
recall, the loading controller.

Regenerate them from whatever a run folder holds (a run still going, or stopped midway)::

    python -m experiments.cacheblend_report runs/cacheblend-20261204-190000

A selector added after a run was made is evaluated on the same prompts in a folder of its own
(the same config, sweeping only the new selectors) and paired with the published selectors of
the first run (``write_against``)::

    python -m experiments.cacheblend_report <new folder> --against <first run's folder>
"""

from __future__ import annotations

import json
import pathlib
import sys

import ml_collections
import numpy as np

from experiments import cacheblend_plots as plots
from experiments import report
from experiments.cacheblend_eval import (
    GOLD_KEYS,
    LIKELIHOOD,
    RECOVERED,
    RELATIVE_DROP,
    budget_differences,
    budget_rows,
    ci_row,
    paired_rows,
    recovery,
    speed_row,
)
from experiments.policies import OWN_SELECTORS, POLICIES, PUBLISHED_SELECTORS

RECORDS = "per_prompt.jsonl"
"""One JSON line per scored prompt: {"index", "num_tokens", "runs": {key: metrics}, "time": {...}, ...}."""
STATE = "run_state.json"
"""The config a run folder's records belong to, the learned scorer and the recompute ratio
they used, and the facts of the setup the summary states ("meta")."""
PIECES = "pieces.jsonl"
"""One JSON line per piece of the run: prompts scored, seconds, compilation, machine, commit."""
DEVIATIONS = "deviation"
"""Folder of per-prompt [L, chunk tokens] relative KV deviations of full reuse (float16 .npy)."""

TIME_SLACK = 1.3
"""A selector's time fraction must stay within this factor of its FLOP fraction (plus the fixed cost)."""
PHASES = ("load_s", "check_layers_s", "row_layers_s", "logits_s")
ADDED_FIELDS = {"workload.split": "eval"}
"""Config fields added after runs under ``docs/results/`` began, at the value that reproduces
them: a saved config without the field reads as one with the field at that value."""
SELECTOR_FIELDS = ("policies", "sweep.policies")
"""The config fields two runs of the same prompts may differ in and still be paired (``write_against``)."""


def comparable(config: ml_collections.ConfigDict) -> dict:
    """The config as a JSON dict without the fields a resumed run may change (its size and its
    pieces' bounds)."""
    d = config.to_dict()
    d.pop("num_prompts", None)
    d.pop("piece", None)
    return json.loads(json.dumps(d, default=str))


def _flat(d: dict, prefix: str = "") -> dict:
    """Nested dicts as one dict of dotted keys."""
    out: dict = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_differences(saved: dict, config: ml_collections.ConfigDict, ignore: tuple[str, ...] = ()) -> list[str]:
    """The dotted fields, but ``ignore``, in which ``saved`` (a ``comparable`` dict, perhaps
    written before ``ADDED_FIELDS``) and ``config`` differ, sorted."""
    current = _flat(comparable(config))
    old = {**{k: v for k, v in ADDED_FIELDS.items() if k in current}, **_flat(saved)}
    return sorted(k for k in set(old) | set(current) if old.get(k) != current.get(k) and k not in ignore)


def _with_ci(row: dict, key: str) -> str:
    return f"{row[key]:.3f} [{row[f'{key}_lo']:.3f}, {row[f'{key}_hi']:.3f}]" if key in row else ""


def _display(rows: list[dict], keys: tuple[str, ...], first: tuple[str, ...]) -> list[dict]:
    """Rows with "mean [lo, hi]" strings for ``keys``, led by the plain columns ``first``."""
    return [{**{k: r.get(k) for k in first}, **{k: _with_ci(r, k) for k in keys if k in r}} for r in rows]


def _significance(paired: list[dict], key: str) -> str:
    """One sentence per baseline: which policies differ significantly on ``key`` (interval
    excluding 0 and a difference above the metric's tolerance) and which do not."""
    lines = []
    for baseline in dict.fromkeys(r["baseline"] for r in paired):
        rows = [r for r in paired if r["baseline"] == baseline and r["metric"] == key]
        below = [f"{r['policy']} ({r['difference']:+.3f} [{r['lo']:+.3f}, {r['hi']:+.3f}])" for r in rows
                 if r["significant"] and r["difference"] < 0]
        above = [f"{r['policy']} ({r['difference']:+.3f} [{r['lo']:+.3f}, {r['hi']:+.3f}])" for r in rows
                 if r["significant"] and r["difference"] > 0]
        same = [r["policy"] for r in rows if not r["significant"]]
        tol = rows[0]["tolerance"] if rows else 0.0
        lines.append(
            f"- vs {baseline.replace('_', ' ')} ({key}, paired 95% CI, tolerance {tol:g}): significantly lower: "
            f"{', '.join(below) or 'none'}; significantly higher: {', '.join(above) or 'none'}; "
            f"not significantly different: {', '.join(same) or 'none'}."
        )
    return "\n".join(lines) + "\n"


def _headline(h: dict, paired: list[dict], ratio: float) -> str:
    """Full reuse's loss on one metric, the share of it each selector recovers (best first)
    and which policies differ significantly."""
    key = h["metric"]
    shares = sorted(h["recovered_share"].items(), key=lambda kv: -np.nan_to_num(kv[1][0], nan=-np.inf))
    text = ", ".join(f"{k} {v[0]:.2f} [{v[1]:.2f}, {v[2]:.2f}]" for k, v in shares)
    return (f"**{key}**: full reuse minus full recompute {h['reuse_minus_full']:.4f} [{h['lo']:.4f}, {h['hi']:.4f}] "
            f"(paired 95% CI). Share of that loss recovered at {ratio:.0%} (bootstrap 95% CI; undefined where the loss "
            f"interval holds 0): {text}.\n\n" + _significance(paired, key) + "\n")


def _budget_headline(budgets: list[dict]) -> str:
    """One line per metric: the ratio each selector needs for the first ``RECOVERED`` share."""
    label = f"{round(100 * RECOVERED[0])}%"
    lines = []
    for key in dict.fromkeys(b["metric"] for b in budgets):
        rows = [b for b in budgets if b["metric"] == key]
        parts = [f"{b['policy']} {b[f'ratio_{label}']:.2f} [{b[f'ratio_{label}_lo']:.2f}, {b[f'ratio_{label}_hi']:.2f}]"
                 for b in sorted(rows, key=lambda b: np.nan_to_num(b[f"ratio_{label}"], nan=np.inf))]
        lines.append(f"- ratio for {label} of full reuse's {key} loss: {', '.join(parts)}.\n")
    return "".join(lines)


def _display_budgets(budgets: list[dict]) -> list[dict]:
    """Budget rows as "ratio [lo, hi]" strings beside the speedup there."""
    out = []
    for b in budgets:
        row = {"policy": b["policy"], "metric": b["metric"], "prompts": b["prompts"]}
        for k in b:
            if k.startswith("ratio_") and not k.endswith(("_lo", "_hi")):
                row[k] = f"{b[k]:.3f} [{b[k + '_lo']:.3f}, {b[k + '_hi']:.3f}]"
                speed = b["speedup_" + k.removeprefix("ratio_")]
                row["speedup_" + k.removeprefix("ratio_")] = f"{speed:.2f}x"
        out.append(row)
    return out


def _display_differences(differences: list[dict]) -> list[dict]:
    """Ratio differences as "difference [lo, hi]" strings."""
    out = []
    for d in differences:
        row = {k: d[k] for k in ("policy", "minus", "metric", "prompts")}
        for k in d:
            if k.startswith("difference_") and not k.endswith(("_lo", "_hi")):
                row[k] = f"{d[k]:+.3f} [{d[k + '_lo']:+.3f}, {d[k + '_hi']:+.3f}]"
        out.append(row)
    return out


def _fixed_cost(per_policy: dict[str, list[dict]]) -> dict:
    """Full reuse's TTFT in ms by part (the cost no recompute ratio removes): the blended
    prefill's phases and the engine step around them."""
    runs = per_policy.get("full_reuse")
    if not runs:
        return {}
    parts = {
        k.removesuffix("_s") + "_ms": 1e3 * float(np.mean([p["phases"].get(k, 0.0) for p in runs])) for k in PHASES
    }
    ttft = 1e3 * float(np.mean([p["ttft_s"] for p in runs]))
    return {"ttft_ms": ttft, **parts, "engine_step_ms": ttft - sum(parts.values())}


def read_lines(path: pathlib.Path) -> list[dict]:
    """The JSON lines of ``path`` up to the first one cut short (an interrupted write)."""
    out = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


def write_folder(workdir: pathlib.Path) -> dict:
    """Writes the tables, figures and summary of the run in ``workdir`` from the records it
    holds (``config.json``, ``run_state.json``, ``per_prompt.jsonl``, ``pieces.jsonl``,
    ``deviation/``); returns the results.

    Raises:
      FileNotFoundError: ``workdir`` holds no run (its config or state is missing).
      ValueError: it holds no scored prompt yet.
    """
    workdir = pathlib.Path(workdir)
    for name in ("config.json", STATE):
        if not (workdir / name).is_file():
            raise FileNotFoundError(f"{workdir} holds no CacheBlend run: {name} is missing")
    config = ml_collections.ConfigDict(json.loads((workdir / "config.json").read_text()))
    state = json.loads((workdir / STATE).read_text())
    records = sorted(
        (r for r in read_lines(workdir / RECORDS) if r["index"] < config.num_prompts), key=lambda r: r["index"]
    )
    if not records:
        raise ValueError(f"{workdir} holds no scored prompt yet ({RECORDS} is empty)")
    devs = [np.load(workdir / DEVIATIONS / f"{r['index']:05d}.npy").astype(np.float32) for r in records]
    return write(workdir, config, records=records, state=state, pieces=read_lines(workdir / PIECES), devs=devs)


def _read_run(workdir: pathlib.Path) -> tuple[ml_collections.ConfigDict, dict[int, dict]]:
    """The config of the run in ``workdir`` and its scored prompts by index.

    Raises:
      FileNotFoundError: ``workdir`` holds no run.
    """
    if not (workdir / "config.json").is_file():
        raise FileNotFoundError(f"{workdir} holds no CacheBlend run: config.json is missing")
    config = ml_collections.ConfigDict(json.loads((workdir / "config.json").read_text()))
    return config, {r["index"]: r for r in read_lines(workdir / RECORDS) if r["index"] < config.num_prompts}


def write_against(workdir: pathlib.Path, base: pathlib.Path) -> dict:
    """Our selectors (``OWN_SELECTORS``) swept in ``workdir`` against the published ones
    (``PUBLISHED_SELECTORS``) swept in ``base``: two runs of one config but its
    ``SELECTOR_FIELDS``, so of the same prompts. On the prompts both scored: the ratio each
    selector needs (``budget_rows``; its speedup against its own run's full recompute) and the
    paired differences of ours minus theirs (``budget_differences``; the goals from ``base``'s
    full recompute and full reuse). Writes ``against-<base name>.md``, ``-budget.csv`` and
    ``-differences.csv`` in ``workdir``; returns the rows and the largest gap between the two
    runs' full recompute or full reuse gold-answer likelihood on one prompt (nats per token;
    0 on one machine: the runs are deterministic).

    Raises:
      FileNotFoundError: either folder holds no run.
      ValueError: the configs differ in other fields; a shared prompt's length or reference
        answer differs; the runs share no prompt, or no selector of ours or no published one.
    """
    workdir, base = pathlib.Path(workdir), pathlib.Path(base)
    (config, records), (base_config, base_records) = _read_run(workdir), _read_run(base)
    differ = config_differences(comparable(base_config), config, ignore=SELECTOR_FIELDS)
    if differ:
        raise ValueError(f"{workdir} and {base} ran other configs (fields {differ} differ): their prompts differ")
    ours = [n for n in config.sweep.policies if n in OWN_SELECTORS]
    theirs = [n for n in base_config.sweep.policies if n in PUBLISHED_SELECTORS]
    if not ours or not theirs:
        raise ValueError(f"{workdir} must sweep one of {OWN_SELECTORS} (it sweeps {tuple(config.sweep.policies)}) and "
                         f"{base} one of {PUBLISHED_SELECTORS} (it sweeps {tuple(base_config.sweep.policies)})")
    swept = [(records, n) for n in ours] + [(base_records, n) for n in theirs]
    shared = sorted(i for i in set(records) & set(base_records)
                    if all(f"{n}@{r:g}" in rs[i]["runs"] for rs, n in swept for r in config.sweep.ratios))
    if not shared:
        raise ValueError(f"{workdir} and {base} share no prompt swept by every selector")
    for i in shared:
        mine, theirs_ = records[i], base_records[i]
        if (mine["num_tokens"], mine["reference_answer"]) != (theirs_["num_tokens"], theirs_["reference_answer"]):
            raise ValueError(
                f"prompt {i} differs: {mine['num_tokens']} tokens answered {mine['reference_answer']!r} in {workdir}, "
                f"{theirs_['num_tokens']} answered {theirs_['reference_answer']!r} in {base}")
    ends = ("full_recompute", "full_reuse")
    own_ends = {n: [records[i]["runs"][n] for i in shared] for n in ends}
    base_ends = {n: [base_records[i]["runs"][n] for i in shared] for n in ends}
    gap = max(abs(a[LIKELIHOOD] - b[LIKELIHOOD]) for n in ends for a, b in zip(own_ends[n], base_ends[n]))
    sweep = {(n, r): [rs[i]["runs"][f"{n}@{r:g}"] for i in shared] for rs, n in swept for r in config.sweep.ratios}
    nboot, seed = config.eval.bootstrap, config.seed
    budgets = [*budget_rows({k: v for k, v in sweep.items() if k[0] in ours}, own_ends, nboot, seed),
               *budget_rows({k: v for k, v in sweep.items() if k[0] in theirs}, base_ends, nboot, seed)]
    differences = budget_differences(sweep, base_ends, nboot, seed)
    stem = f"against-{base.name}"
    report.write_csv(workdir / f"{stem}-budget.csv", budgets)
    report.write_csv(workdir / f"{stem}-differences.csv", differences)
    text = (
        f"{', '.join(ours)} (this folder) against {', '.join(theirs)} (`{base}`), on the {len(shared)} prompts both "
        f"scored (indices {shared[0]}-{shared[-1]}), at ratios {tuple(config.sweep.ratios)}. Goals come from "
        f"`{base.name}`'s full recompute and full reuse; this folder's differ from them by at most {gap:.2g} "
        f"nats per token ({LIKELIHOOD}, any prompt). Speedups are against each run's own full recompute.\n\n"
        + _budget_headline(budgets)
    )
    report.write_summary(workdir, f"{', '.join(ours)} against the published selectors of {base.name}", [
        ("Pairing", text),
        ("Ratio each selector needs (bootstrap 95% CI over prompts), with the TTFT speedup there",
         report.markdown_table(_display_budgets(budgets))),
        ("Ours minus published: difference of the ratios needed, paired bootstrap 95% CI (negative = ours needs less)",
         report.markdown_table(_display_differences(differences))),
    ], name=f"{stem}.md")
    return {"prompts": len(shared), "likelihood_gap": gap, "budget": budgets, "budget_differences": differences}


def _pieces_text(pieces: list[dict]) -> str:
    """The run's pieces: prompts, time, code and machine of each."""
    rows = [{"piece": p["piece"], "prompts": len(p["prompts"]), "first": min(p["prompts"], default=None),
             "last": max(p["prompts"], default=None), "seconds": p["seconds"], "compile_s": p["compile_s"],
             "code": p["code"], "cpu": p["machine"]["cpu"], "cores": p["machine"]["cores"],
             "matmul_GFLOP_s": p["machine"]["matmul_2048_gflops"], "copy_GB_s": p["machine"]["copy_gb_s"],
             "max_map_count": p["machine"].get("max_map_count", "-"), "released": p["executables_released"],
             "ended": p["ended"]} for p in pieces]
    return report.markdown_table(rows) if rows else "(no piece has ended yet)\n"


def write(workdir: pathlib.Path, config: ml_collections.ConfigDict, *, records: list[dict], state: dict,
          pieces: list[dict], devs: list[np.ndarray]) -> dict:
    """Writes policies.csv, paired.csv, ratio_sweep.csv, budget.csv, the figures and summary.md
    from ``records`` (per-prompt, by index), the run's ``state`` (learned scorer, ratio and
    setup facts) and its ``pieces``; returns the results."""
    nboot, seed = config.eval.bootstrap, config.seed
    meta, learned = state["meta"], state["learned"]
    ratio = meta["ratio"]
    n_mean = meta["n_mean"]
    policies = [p for p in POLICIES if p in config.policies]
    per_policy = {name: [r["runs"][name] for r in records] for name in policies}
    sweep_results = {}
    for name in config.sweep.policies:
        for r in config.sweep.ratios:
            sweep_results[(name, r)] = [
                rec["runs"][f"{name}@{r:g}"] for rec in records if f"{name}@{r:g}" in rec["runs"]
            ]
    log = {
        k: sum(p["timing"][k] for p in pieces) for k in ("timed_runs", "warmup_runs", "warmup_s", "compiles_in_timed")
    }
    compiled = {k: sum(p[k] for p in pieces) for k in ("compile_s", "programs", "backend_compiles")}
    elapsed = sum(p["seconds"] for p in pieces)
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
    gold_keys = tuple(k for k in (LIKELIHOOD, *GOLD_KEYS) if k in rows[0])
    quality = ("kl", "top1", *gold_keys)
    report.write_csv(workdir / "policies.csv", rows)
    paired = (paired_rows(per_policy, "full_recompute", (*gold_keys, "kl", "top1"), nboot, seed)
              + paired_rows(per_policy, "full_reuse", (*gold_keys, "kl", "top1"), nboot, seed))
    report.write_csv(workdir / "paired.csv", paired)
    headlines = [h for h in (recovery(per_policy, nboot, seed, key) for key in (LIKELIHOOD, "gold")) if h]
    sweep_rows = [
        ci_row(name, results, nboot, seed, ratio=r, ttft_mean_s=float(np.mean([p["ttft_s"] for p in results])))
        for (name, r), results in sweep_results.items()
        if results
    ]
    budgets = budget_rows(sweep_results, per_policy, nboot, seed)
    differences = budget_differences(sweep_results, per_policy, nboot, seed)
    modelled = any(p.get("ttft_modelled") for results in sweep_results.values() for p in results)
    if sweep_rows:
        report.write_csv(workdir / "ratio_sweep.csv", sweep_rows)
        report.write_csv(workdir / "budget.csv", budgets)
        if differences:
            report.write_csv(workdir / "budget_differences.csv", differences)
        for key, label in ((LIKELIHOOD, "gold-answer log-likelihood, nats/token"), ("gold", "gold score")):
            if key in rows[0]:
                means = {r["policy"]: r[key] for r in rows if r["policy"] in ("full_recompute", "full_reuse")}
                plots.quality_vs_ratio(
                    workdir / f"{key}_vs_ratio.png", sweep_rows, key, f"{label} (95% CI band)", means
                )
        plots.quality_vs_ratio(
            workdir / "kl_vs_ratio.png", sweep_rows, "kl", "KL from full recompute, nats (95% CI band)", {}
        )
    for key, suffix, ylabel in (
        (LIKELIHOOD, "", "gold-answer log-likelihood (nats/token)"),
        ("gold", "_gold", "gold score"),
    ):
        if key in rows[0]:
            plots.pareto(
                workdir / f"pareto_ttft{suffix}.png",
                rows,
                sweep_rows,
                "ttft_mean_s",
                "mean TTFT (s)",
                key,
                ylabel,
                budgets,
            )
    if LIKELIHOOD in rows[0]:
        plots.pareto(workdir / "pareto_flops.png", rows, sweep_rows, "flop_fraction", "FLOP fraction of full recompute",
                     LIKELIHOOD, "gold-answer log-likelihood (nats/token)")
    plots.policy_quality(workdir / "policy_quality.png", rows, ratio)
    dev_stats = plots.deviation_figures(workdir, devs)
    plots.deviation_by_layer(
        workdir / "kv_deviation_by_layer.png", per_policy, ("full_reuse", "cacheblend", "query_aware", "random")
    )

    times = {
        k: float(np.sum([r["time"][k] for r in records])) for k in records[0]["time"] if k not in ("rss_gb", "mappings")
    }
    rss = [r["time"]["rss_gb"] for r in records]
    per_hour = 3600.0 * len(records) / times["wall_s"]
    time_text = (
        f"{len(records)} prompts scored in {times['wall_s']:.0f} s of prompt loops over {len(pieces)} pieces "
        f"(below), {times['wall_s'] / len(records):.1f} s per prompt = **{per_hour:.0f} prompts per hour** on this "
        f"machine "
        f"(compiles included). Where it went (sums over prompts): compile {times['compile_s']:.0f} s "
        f"({times['programs']:.0f} programs traced), ordinary prefills {times['prefill_s']:.0f} s, blended prefills "
        f"{times['blend_s']:.0f} s, decode {times['decode_s']:.0f} s, page ops {times['page_ops_s']:.1f} s, host (the "
        f"rest) "
        f"{times['host_s']:.0f} s; prefill and decode times include the compiles that happened in them. Resident "
        f"memory after each prompt: first {rss[0]:.2f} GB, last {rss[-1]:.2f} GB, peak {max(rss):.2f} GB.\n\n"
        f"Compilation, apart from every timed figure: {compiled['compile_s']:.1f} s over the whole run "
        f"({compiled['programs']} programs traced, {compiled['backend_compiles']} compiled by the backend, the rest "
        f"from "
        f"the compilation cache). {log['warmup_runs']} prefills compiled and were run again before being timed "
        f"({log['warmup_s']:.1f} s); {log['timed_runs']} timed prefills, {log['compiles_in_timed']} compilations "
        f"inside "
        f"them. Run time {elapsed:.0f} s.\n\nPieces (each a process; matmul: jitted f32 2048^3, copy: a 256 MiB array, "
        f"read + written):\n\n" + _pieces_text(pieces)
    )
    w = config.workload
    split = w.get("split", ADDED_FIELDS["workload.split"])  # a run saved before the field existed: "eval"
    what = {
        "squad_multidoc": f"SQuAD `{w.source}` {split} split, gold + up to {w.num_distractors} distractor paragraphs",
        "needle_haystack": f"needle in a haystack ({', '.join(w.niah_tasks)}), chunks {tuple(w.chunk_range)} tokens",
        "synthetic": f"synthetic ({', '.join(w.tasks)}), chunks {tuple(w.num_chunks)} x {tuple(w.chunk_tokens)}",
    }[w.name]
    split_note = (f" {meta['num_split_chunks']} chunks longer than {meta['max_chunk_tokens']} tokens (the longest a "
                  "chunk may be to stay whole in the smallest attention window) were split into pieces stored alone."
                  if meta["num_split_chunks"] else "")
    head = "".join(_headline(h, paired, ratio) for h in headlines) or "(no full reuse / full recompute pair)\n"
    head += _budget_headline(budgets)
    learned_text = "(not run)\n"
    if learned:
        learned_text = (
            f"trained on {learned['train_prompts']} training-split prompts ({learned['train_tokens']} chunk tokens), "
            "disjoint from the evaluation prompts (checked). Training-set recall of the oracle's tokens by the "
            "top-k of each score:\n\n" + report.markdown_table([learned["train_recall"]])
        )
    speed_cols = ("policy", "ttft_mean_s", "ttft_median_s", "speedup", "time_fraction", "flop_fraction", "time_bound",
                  "within_bound")
    speed_text = (
        report.markdown_table(
            [{**{k: r.get(k) for k in speed_cols}, "speedup": _with_ci(r, "speedup")} for r in rows], speed_cols
        )
        + f"\nspeedup = full recompute's total TTFT over the policy's on the same prompts (bootstrap 95% CI); time "
        f"fraction = its inverse; bound = {TIME_SLACK} x FLOP fraction + the fixed cost ({fixed_fraction:.3f} of full "
        f"recompute's TTFT: full reuse's time fraction minus its FLOP fraction). Full reuse's TTFT by part, ms:\n\n"
        + (report.markdown_table([fixed]) if fixed else "(full reuse not run)\n")
    )
    sections = [
        (
            "Setup",
            f"model `{config.model}`, workload: {what}; {len(records)} prompts, mean {n_mean:.0f} tokens; store "
            f"variant `{config.store.variant}`; recompute ratio {ratio:.4g} (requested "
            f"{config.policy.recompute_ratio!r}); checks {tuple(config.policy.check_layers)} budgets "
            f"{tuple(config.policy.budgets)}; "
            f"N={config.eval.continuation_tokens}, answers of up to {config.eval.max_answer_tokens} tokens; backend "
            f"{', '.join(sorted({p['machine']['backend'] for p in pieces})) or 'unknown'}.{split_note}\n",
        ),
        ("Headline", head),
        (
            "Policies (mean [95% bootstrap CI over prompts])",
            report.markdown_table(_display(rows, (*quality, "flop_fraction"), ("policy", "recall_vs_oracle"))),
        ),
        ("Speed (TTFT of each policy's own prefill, no compilation inside)", speed_text),
        (
            "Paired differences vs full recompute and vs full reuse (policy minus baseline, 95% CI)",
            report.markdown_table(paired) if paired else "(none)\n",
        ),
        (
            "Recompute ratio each selector needs",
            report.markdown_table(_display_budgets(budgets))
            + f"\non the first {min(config.sweep.num_prompts, len(records))} prompts (the sweep's): the smallest ratio "
            f"recovering {' and '.join(f'{t:.0%}' for t in RECOVERED)} of full reuse's loss, and the one within "
            f"{RELATIVE_DROP:.0%} of full recompute (gold_ll: per-token probability), interpolated between sweep "
            f"ratios "
            "with full reuse at 0 and full recompute at 1 (bootstrap 95% CI over prompts; NaN: not even full recompute "
            "reaches it in a resample), and the TTFT speedup over full recompute there."
            + (
                " The sweep points of one ratio prefilled together (sweep.batched), so their TTFT is modelled: per "
                "prompt, "
                "the least-squares line of the blended runs timed alone (TTFT against FLOP fraction) at each point's "
                "FLOP "
                "fraction; the ratio column does not depend on it.\n"
                if modelled
                else "\n"
            )
            if budgets
            else "(no sweep)\n",
        ),
        *(
            [(
                "Our selectors against the published ones",
                report.markdown_table(_display_differences(differences))
                + f"\nthe ratio each of this project's selectors needs on {LIKELIHOOD} minus the ratio a published "
                "one needs (negative: ours needs less), at each column of the table above, with a paired bootstrap "
                "95% CI (both from the same resamples of the sweep's prompts).\n",
            )]
            if differences
            else []
        ),
        (
            "Quality vs recompute ratio",
            report.markdown_table(_display(sweep_rows, quality, ("policy", "ratio", "ttft_mean_s")))
            if sweep_rows
            else "(skipped)\n",
        ),
        ("Time", time_text),
        ("Learned selector", learned_text),
        (
            "Deviation structure",
            f"share of KV deviation held by the top 15% tokens, mean over layers: "
            f"{np.mean(dev_stats['top15_share_by_layer']):.3f}; adjacent-layer Spearman, mean: "
            f"{np.nanmean(dev_stats['adjacent_spearman_by_layer']):.3f}.\n",
        ),
        (
            "Loading controller",
            report.markdown_table(meta["tier_rows"]) + f"\nchosen at the min ratio: {meta['controller_choice']}\n",
        ),
        ("Figures", ", ".join(sorted(p.name for p in workdir.glob("*.png"))) + "\n"),
    ]
    done = f"{len(records)} of {config.num_prompts} prompts"
    report.write_summary(
        workdir, f"CacheBlend selectors vs full recompute ({w.name}, {config.model}; {done})", sections
    )
    return {
        "policies": rows,
        "paired": paired,
        "headline": headlines,
        "sweep": sweep_rows,
        "budget": budgets,
        "budget_differences": differences,
        "headline_text": f"{done}.\n{head}",
        "learned": learned,
        "deviation": dev_stats,
        "controller": {"tiers": meta["tier_rows"]},
        "ratio": ratio,
        "fixed_cost_ms": fixed,
        "fixed_fraction": fixed_fraction,
        "time": {**times, "prompts_per_hour": per_hour, "rss_gb": rss},
        "timing": {**log, **compiled},
        "pieces": len(pieces),
        "num_split_chunks": meta["num_split_chunks"],
        "num_prompts": len(records),
        "run_seconds": elapsed,
    }


def main(argv: list[str]) -> None:
    if len(argv) == 4 and argv[2] == "--against":
        workdir, base = pathlib.Path(argv[1]), pathlib.Path(argv[3])
        results = write_against(workdir, base)
        print(f"{results['prompts']} prompts paired: {workdir / f'against-{base.name}.md'}")
        return
    if len(argv) != 2:
        raise SystemExit("usage: python -m experiments.cacheblend_report <run folder> [--against <base run folder>]")
    results = write_folder(pathlib.Path(argv[1]))
    print(results["headline_text"])
    print(f"summary: {pathlib.Path(argv[1]) / 'summary.md'}")


if __name__ == "__main__":
    main(sys.argv)
