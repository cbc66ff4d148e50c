"""CacheBlend against full recompute on synthetic RAG prompts, every policy through the engine.

Per prompt: the chunks are stored in the engine's cache manager (untimed, as offline
precompute), then every policy runs as an engine request on the same tokens and is timed to
its first token; the full-recompute greedy continuation of N tokens is the reference that
every policy is teacher-forced along (the continuation fed behind the prompt of another
request of the same policy). A ratio sweep, deviation analyses (CDFs, concentration,
adjacent-layer correlation), cheaper check schedules and the loading controller's decision
complete the run folder.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time

import jax
import matplotlib
import ml_collections
import numpy as np
from absl import logging
from tqdm import tqdm

from experiments import report
from experiments.policies import POLICIES, policy
from experiments.workloads.rag import answer_matches, make_examples
from kvjax import metrics
from kvjax.blend import loading_controller, selection
from kvjax.blend.blender import FULL_RECOMPUTE, Blender, BlendPrompt, PolicyRun
from kvjax.blend.chunk_store import ChunkStore
from kvjax.config import KvCacheConfig, SchedulerConfig
from kvjax.engine import Engine
from kvjax.model.registry import load_model

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

CDF_LAYERS = (1, 4, 10, 20)


def _selection_config(config: ml_collections.ConfigDict, ratio: float) -> selection.SelectionConfig:
    """The one selection config of the run (selector "cacheblend"; policies swap the selector)."""
    p = config.policy
    return selection.SelectionConfig(
        recompute_ratio=ratio, check_layers=tuple(p.check_layers), budgets=tuple(p.budgets),
        deviation=p.deviation, row_bucket=p.row_bucket, seed=config.seed,
    )


@dataclasses.dataclass
class Reference:
    """Full recompute of one prompt: continuation, its logits, KV and suffix attention."""

    continuation: np.ndarray  # [N]
    logits: np.ndarray  # [N, V]
    answer_len: int
    answer: str
    k: np.ndarray  # [L, T, K, d]
    v: np.ndarray
    true_dev: np.ndarray  # [L, T] deviation of the reused KV (full reuse)
    attn: np.ndarray  # [L, P, H*d]
    ttft_s: float


def _answer(tokenizer, tokens: list[int], stop_ids: tuple[int, ...]) -> tuple[str, int]:
    """Decoded answer up to the first stop token, and its length in tokens (stop included)."""
    end = next((i + 1 for i, t in enumerate(tokens) if t in stop_ids), len(tokens))
    return tokenizer.decode(tokens[:end]).strip(), end


def _reference(blender: Blender, prompt: BlendPrompt, sel_cfg, config, stop_ids, tokenizer) -> Reference:
    n = prompt.roles.num_tokens
    full = blender.run(prompt, FULL_RECOMPUTE, max_new_tokens=config.eval.continuation_tokens)
    continuation = np.asarray(full.tokens, np.int32)
    answer, answer_len = _answer(tokenizer, continuation.tolist()[: config.eval.max_answer_tokens], stop_ids)
    probes = config.eval.num_probes
    exact = blender.run(prompt, dataclasses.replace(sel_cfg, selector="all"), num_probes=probes).trace
    reused = blender.run(prompt, dataclasses.replace(sel_cfg, selector="none"), num_probes=probes).trace
    k_full, v_full = np.asarray(exact["k"])[:, :n], np.asarray(exact["v"])[:, :n]
    true_dev = metrics.kv_deviation(np.asarray(reused["k"])[:, :n], np.asarray(reused["v"])[:, :n], k_full, v_full)
    return Reference(continuation, full.logits, answer_len, answer, k_full, v_full, true_dev, np.asarray(exact["attn"]),
                     full.ttft_s)


def _evaluate(blender, prompt, name: str, pol, ref: Reference, config, stop_ids, tokenizer, gold: str, detailed: bool) -> dict:
    """Quality of one policy against the reference: its logits along the reference continuation
    (``pol``: a SelectionConfig; full recompute is evaluated as selector "all", which equals it)."""
    n = prompt.roles.num_tokens
    probes = config.eval.num_probes if detailed else 1
    forced = blender.run(prompt, pol, feed=ref.continuation[:-1].tolist(), num_probes=probes, scores=ref.true_dev)
    logits = forced.logits
    kl = metrics.kl_divergence(ref.logits, logits)
    agree = metrics.top1_agreement(ref.logits, logits)
    div = metrics.first_divergence(ref.logits, logits)
    out = {"kl": float(kl.mean()), "kl_first": float(kl[0]), "top1": float(agree.mean()), "first_div": div,
           "answer_agree": float(div >= ref.answer_len), "kl_per_token": kl}
    if div >= ref.answer_len:
        answer = ref.answer
    else:
        tokens = [*ref.continuation[:div].tolist(), int(np.argmax(logits[div]))]
        budget = config.eval.max_answer_tokens - len(tokens)
        if tokens[-1] not in stop_ids and budget > 0:
            more = blender.run(prompt, pol, feed=tokens[:-1], max_new_tokens=budget + 1, scores=ref.true_dev).tokens
            tokens += more[1:]
        answer, _ = _answer(tokenizer, tokens, stop_ids)
    out["gold"] = float(answer_matches(answer, gold))
    out["answer"] = answer
    trace = forced.trace
    mask = np.asarray(trace["recomputed"])[:, :n]
    if name == "full_recompute":
        mask = np.ones_like(mask)
    out["flop_fraction"] = metrics.recompute_flop_fraction(blender.engine.model.config, mask, n, forced.qkv_checks)
    if detailed:
        k, v = np.asarray(trace["k"])[:, :n], np.asarray(trace["v"])[:, :n]
        dev = metrics.relative_kv_deviation(metrics.kv_deviation(k, v, ref.k, ref.v), ref.k, ref.v)
        selectable, _ = prompt.roles.masks(n)
        sel = mask & selectable[None]
        unsel = ~mask & selectable[None]
        out["dev_selected"] = np.asarray([dev[i][sel[i]].mean() if sel[i].any() else np.nan for i in range(len(dev))])
        out["dev_unselected"] = np.asarray([dev[i][unsel[i]].mean() if unsel[i].any() else np.nan for i in range(len(dev))])
        valid = np.arange(config.eval.num_probes) < prompt.roles.num_forced
        out["attn_dev"] = metrics.attention_deviation(np.asarray(trace["attn"]), ref.attn, valid)
        final = np.flatnonzero(mask[-1] & selectable)
        oracle = selection.select_oracle(prompt.roles, pol.recompute_ratio, ref.true_dev, 1)
        oracle_ids = np.setdiff1d(oracle.rows[oracle.rows_valid], np.arange(prompt.roles.suffix_start, n))
        out["recall"] = metrics.recall(final, oracle_ids)
    return out


def _controller(config, cfg, workdir: pathlib.Path, seconds_per_token_layer: float):
    """The loading controller (measured host/disk, configured HBM/NVMe) and its per-tier table."""
    bytes_per_token_layer = 2 * cfg.num_kv_heads * cfg.head_dim * 4
    tiers = [
        loading_controller.configured_tier("hbm", config.controller.hbm_gbps, 0.0, 3),
        loading_controller.measure_host_tier(),
        loading_controller.configured_tier("nvme", config.controller.nvme_gbps, config.controller.nvme_latency_ms, 1),
        loading_controller.measure_disk_tier(workdir),
    ]
    controller = loading_controller.LoadingController(
        tiers, seconds_per_token_layer, bytes_per_token_layer, config.controller.min_ratio
    )
    n = sum(config.workload.chunk_tokens) // 2 * sum(config.workload.num_chunks) // 2
    rows = []
    for t in tiers:
        d = dataclasses.asdict(controller.decide(n, t.name))
        rows.append({"tier": t.name, "GB_per_s": t.bandwidth / 1e9, "latency_ms": t.latency * 1e3, "measured": t.measured,
                     **{k: d[k] for k in ("ratio", "break_even", "load_s", "recompute_s")}})
    return controller, rows


def _timed(blender: Blender, prompt: BlendPrompt, pol, ref: Reference | None) -> PolicyRun:
    """One policy's prefill to its first token (TTFT), scores for the oracle from ``ref``."""
    return blender.run(prompt, pol, scores=None if ref is None else ref.true_dev)


def _ci_row(name: str, per_prompt: list[dict], ttfts: list[float], base_ttft: list[float], nboot: int, seed: int) -> dict:
    row = {"policy": name}
    for key in ("kl", "top1", "answer_agree", "gold", "flop_fraction"):
        mean, lo, hi = metrics.bootstrap_ci([p[key] for p in per_prompt], num=nboot, seed=seed)
        row[key] = mean
        row[f"{key}_ci"] = f"[{lo:.4g}, {hi:.4g}]"
    row["first_div"] = float(np.mean([p["first_div"] for p in per_prompt]))
    row["ttft_s"] = float(np.median(ttfts))
    row["speedup"] = float(np.median(np.asarray(base_ttft) / np.asarray(ttfts)))
    if "recall" in per_prompt[0]:
        row["recall_vs_oracle"] = float(np.mean([p["recall"] for p in per_prompt]))
    return row


def _plots(workdir: pathlib.Path, devs: list[np.ndarray], per_policy: dict, sweep_rows: list[dict], cfg) -> dict:
    """Writes the PNG figures; returns the deviation statistics they show."""
    rel = np.concatenate(devs, axis=1)  # [L, sum of chunk tokens]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for layer in CDF_LAYERS:
        if layer < rel.shape[0]:
            x = np.sort(rel[layer])
            ax.plot(x, np.linspace(0, 1, len(x)), label=f"layer {layer}")
    ax.set_xscale("log")
    ax.set(xlabel="KV deviation (full reuse vs full recompute, relative)", ylabel="CDF over chunk tokens")
    ax.legend()
    fig.tight_layout()
    fig.savefig(workdir / "kv_deviation_cdf.png", dpi=120)
    plt.close(fig)

    fracs = np.linspace(0, 1, 101)
    shares = []
    for dev in devs:
        s = -np.sort(-dev, axis=1)
        cum = np.cumsum(s, axis=1) / np.maximum(s.sum(axis=1, keepdims=True), 1e-30)
        idx = np.clip((fracs * dev.shape[1]).astype(int) - 1, 0, dev.shape[1] - 1)
        shares.append(np.where(fracs > 0, cum[:, idx].mean(axis=0), 0.0))
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(fracs, np.mean(shares, axis=0), label="measured")
    ax.plot(fracs, fracs, "--", color="gray", label="uniform")
    ax.axvline(0.15, color="red", lw=0.8)
    ax.set(xlabel="share of tokens (highest deviation first)", ylabel="share of total KV deviation")
    ax.legend()
    fig.tight_layout()
    fig.savefig(workdir / "deviation_concentration.png", dpi=120)
    plt.close(fig)

    spear = np.mean([metrics.adjacent_layer_spearman(d) for d in devs], axis=0)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(np.arange(1, len(spear) + 1), spear, marker="o", ms=3)
    ax.set(xlabel="layer l (vs l-1)", ylabel="Spearman of token deviations", ylim=(min(0, spear.min()), 1))
    fig.tight_layout()
    fig.savefig(workdir / "adjacent_layer_correlation.png", dpi=120)
    plt.close(fig)

    if sweep_rows:
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
        for name in dict.fromkeys(r["policy"] for r in sweep_rows):
            rows = [r for r in sweep_rows if r["policy"] == name]
            r_ = [r["ratio"] for r in rows]
            axes[0].plot(r_, [r["kl"] for r in rows], marker="o", label=name)
            axes[1].plot(r_, [r["top1"] for r in rows], marker="o", label=name)
        axes[0].set(xlabel="recompute ratio", ylabel="KL vs full recompute (nats)", yscale="symlog")
        axes[1].set(xlabel="recompute ratio", ylabel="top-1 agreement")
        axes[0].legend()
        fig.tight_layout()
        fig.savefig(workdir / "quality_vs_ratio.png", dpi=120)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for name, per_prompt in per_policy.items():
        if per_prompt and "dev_selected" in per_prompt[0] and name in ("cacheblend", "random", "full_reuse"):
            ax.plot(np.nanmean([p["dev_unselected"] for p in per_prompt], axis=0), label=f"{name}: reused tokens")
            if name != "full_reuse":
                ax.plot(np.nanmean([p["dev_selected"] for p in per_prompt], axis=0), "--", label=f"{name}: recomputed")
    ax.set(xlabel="layer", ylabel="KV deviation from full recompute", yscale="log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(workdir / "kv_deviation_by_layer.png", dpi=120)
    plt.close(fig)
    return {
        "top15_share_by_layer": np.mean([metrics.top_share(d, 0.15) for d in devs], axis=0),
        "adjacent_spearman_by_layer": spear,
    }


def run(config: ml_collections.ConfigDict, workdir: pathlib.Path) -> dict:
    """Runs the experiment; writes tables, plots and summary.md into ``workdir``."""
    started = time.perf_counter()
    unknown = [p for p in config.policies if p not in POLICIES]
    if unknown or "full_recompute" not in config.policies:
        raise ValueError(f"policies={tuple(config.policies)} must include 'full_recompute' and only names from {POLICIES}")
    model = load_model(config.model, config.gguf_path or None)
    cfg, tok = model.config, model.tokenizer
    # Chat models stop at <|im_end|>; a base model's answer (after the prefilled stem) ends at a newline.
    stop_text = "<|im_end|>" if tok.chat_format == "chatml" else "\n"
    stop_ids = tuple(cfg.eos_ids) + tuple(tok.encode(stop_text, add_bos=False))
    examples = make_examples(
        tok, num=config.num_prompts, seed=config.seed, tasks=tuple(config.workload.tasks),
        num_chunks=tuple(config.workload.num_chunks), chunk_tokens=tuple(config.workload.chunk_tokens),
    )
    prompts = [BlendPrompt(e.prefix, e.chunks, e.suffix) for e in examples]
    bucket = config.runtime.token_bucket
    max_tokens = max(p.roles.num_tokens for p in prompts) + config.eval.continuation_tokens + config.eval.max_answer_tokens
    engine = Engine(
        model, KvCacheConfig(tokens_per_block=config.runtime.page_size, max_tokens=config.store.cache_tokens,
                             event_buffer_max_size=100_000),
        SchedulerConfig(max_num_tokens=8192, prefill_chunk_size=8192), max_seq_len=max_tokens + bucket,
        attn_impl=config.runtime.attn_impl,
    )
    store = ChunkStore(engine, variant=config.store.variant, prefix_tokens=examples[0].prefix)
    blender = Blender(store, token_bucket=bucket)
    policies = [p for p in POLICIES if p in config.policies]
    n_mean = float(np.mean([p.roles.num_tokens for p in prompts]))

    for chunk in prompts[0].chunks:
        store.put(chunk)
    for _ in range(2):  # compile the reference path, then time it for the controller's per-token cost
        t_profile = blender.run(prompts[0], FULL_RECOMPUTE).ttft_s
    controller, tier_rows = _controller(config, cfg, workdir, t_profile / (prompts[0].roles.num_tokens * cfg.num_layers))
    requested = str(config.policy.recompute_ratio)
    if requested == "auto":
        ratio = controller.decide(int(n_mean), config.store.tier).ratio
    else:
        try:
            ratio = float(requested)
        except ValueError:
            raise ValueError(f"policy.recompute_ratio={requested!r} must be a number in [0, 1] or 'auto'") from None
    sel_cfg = _selection_config(config, ratio)
    sweep = [(name, r) for name in config.sweep.policies for r in config.sweep.ratios]
    schedules = [(tuple(c), tuple(b)) for c, b in config.schedules]

    per_policy: dict[str, list[dict]] = {p: [] for p in policies}
    ttft: dict[str, list[float]] = {p: [] for p in policies}
    phases: list[dict] = []
    sweep_results: dict[tuple[str, float], list[dict]] = {key: [] for key in sweep}
    sweep_ttft: dict[tuple[str, float], list[float]] = {key: [] for key in sweep}
    sched_results: dict[tuple, list[dict]] = {key: [] for key in schedules}
    sched_ttft: dict[tuple, list[float]] = {key: [] for key in schedules}
    devs, tasks = [], []
    bar = tqdm(total=len(prompts), desc="prompts", unit="prompt")
    for i, (example, prompt) in enumerate(zip(examples, prompts)):
        for chunk in prompt.chunks:
            store.put(chunk)
        ref = _reference(blender, prompt, sel_cfg, config, stop_ids, tok)
        if i == 0:  # compile every prefill shape before timing anything
            warm = [policy(p, sel_cfg) for p in policies]
            warm += [policy(name, dataclasses.replace(sel_cfg, recompute_ratio=r)) for name, r in sweep]
            warm += [dataclasses.replace(sel_cfg, check_layers=c, budgets=b) for c, b in schedules]
            for pol in tqdm(warm, desc="compile", leave=False):
                _timed(blender, prompt, pol, ref)
            ref = _reference(blender, prompt, sel_cfg, config, stop_ids, tok)
        selectable, _ = prompt.roles.masks(prompt.roles.num_tokens)
        devs.append(metrics.relative_kv_deviation(ref.true_dev, ref.k, ref.v)[:, selectable])
        tasks.append(example.task)
        for name in policies:
            pol = policy(name, sel_cfg)
            if name == "full_recompute":
                ttft[name].append(ref.ttft_s)
                pol = dataclasses.replace(sel_cfg, selector="all")
            else:
                run_ = _timed(blender, prompt, pol, ref)
                ttft[name].append(run_.ttft_s)
                if name == "cacheblend":
                    phases.append({"load_s": run_.report.load_s, **{f"{k}_s": v for k, v in run_.report.phases.items()}})
            per_policy[name].append(_evaluate(blender, prompt, name, pol, ref, config, stop_ids, tok, example.answer, True))
        if i < config.sweep.num_prompts:
            for name, r in tqdm(sweep, desc="sweep", leave=False):
                pol = policy(name, dataclasses.replace(sel_cfg, recompute_ratio=r))
                sweep_ttft[(name, r)].append(_timed(blender, prompt, pol, ref).ttft_s)
                sweep_results[(name, r)].append(_evaluate(blender, prompt, name, pol, ref, config, stop_ids, tok, example.answer, False))
        for key in schedules:
            pol = dataclasses.replace(sel_cfg, check_layers=key[0], budgets=key[1])
            sched_ttft[key].append(_timed(blender, prompt, pol, ref).ttft_s)
            sched_results[key].append(_evaluate(blender, prompt, "cacheblend", pol, ref, config, stop_ids, tok, example.answer, False))
        bar.update()
        bar.set_postfix(kl_cacheblend=np.mean([p["kl"] for p in per_policy.get("cacheblend", [])] or [np.nan]))
    bar.close()

    base = ttft["full_recompute"]
    nboot, seed = config.eval.bootstrap, config.seed
    rows = [_ci_row(name, per_policy[name], ttft[name], base, nboot, seed) for name in policies]
    columns = ["policy", "ttft_s", "speedup", "flop_fraction", "kl", "kl_ci", "top1", "top1_ci", "first_div",
               "answer_agree", "answer_agree_ci", "gold", "gold_ci", "recall_vs_oracle"]
    report.write_csv(workdir / "policies.csv", rows, columns)
    paired = []
    if "cacheblend" in per_policy:
        for name in policies:
            if name in ("cacheblend", "full_recompute"):
                continue
            for key in ("kl", "top1"):
                diff = [a[key] - b[key] for a, b in zip(per_policy[name], per_policy["cacheblend"])]
                mean, lo, hi = metrics.bootstrap_ci(diff, num=nboot, seed=seed)
                paired.append({"policy": name, "metric": key, "minus_cacheblend": mean, "ci": f"[{lo:.4g}, {hi:.4g}]"})
    sweep_rows = []
    for (name, r), results in sweep_results.items():
        if results:
            sweep_rows.append({
                "policy": name, "ratio": r, "kl": float(np.mean([p["kl"] for p in results])),
                "top1": float(np.mean([p["top1"] for p in results])),
                "answer_agree": float(np.mean([p["answer_agree"] for p in results])),
                "flop_fraction": float(np.mean([p["flop_fraction"] for p in results])),
                "ttft_s": float(np.median(sweep_ttft[(name, r)])),
                "speedup": float(np.median(np.asarray(base[: len(results)]) / np.asarray(sweep_ttft[(name, r)]))),
            })
    if sweep_rows:
        report.write_csv(workdir / "ratio_sweep.csv", sweep_rows)
    by_task = []
    for task in dict.fromkeys(tasks):
        idx = [j for j, t in enumerate(tasks) if t == task]
        by_task.append({"task": task, "prompts": len(idx), **{
            f"kl_{name}": float(np.mean([per_policy[name][j]["kl"] for j in idx])) for name in policies if name != "full_recompute"
        }})
    dev_stats = _plots(workdir, devs, per_policy, sweep_rows, cfg)

    flop_bound = 1.0 / float(np.mean([p["flop_fraction"] for p in per_policy["cacheblend"]])) if "cacheblend" in per_policy else None
    time_fraction = float(np.median(np.asarray(ttft["cacheblend"]) / np.asarray(base))) if "cacheblend" in ttft else None
    phase_row = {k: float(np.median([p[k] for p in phases])) for k in phases[0]} if phases else {}
    schedule_rows = [{
        "check_layers": str(c), "budgets": str(b), "kl": float(np.mean([p["kl"] for p in sched_results[(c, b)]])),
        "flop_fraction": float(np.mean([p["flop_fraction"] for p in sched_results[(c, b)]])),
        "ttft_s": float(np.median(sched_ttft[(c, b)])),
        "speedup": float(np.median(np.asarray(base) / np.asarray(sched_ttft[(c, b)]))),
    } for c, b in schedules]
    if schedule_rows:
        report.write_csv(workdir / "schedules.csv", schedule_rows)
    events = engine.manager.get_kv_cache_events()
    engine_state = {
        "store": dataclasses.asdict(store.stats),
        "events": {kind: sum(e.kind == kind for e in events) for kind in ("stored", "removed", "updated")},
        "manager": {k: getattr(engine.manager.stats, k) for k in ("num_requests", "reused_tokens", "stored_blocks", "onboarded_pages")},
    }
    chosen = dataclasses.asdict(controller.decide(int(n_mean)))
    elapsed = time.perf_counter() - started
    table = report.markdown_table(rows, columns)
    sections = [
        ("Setup", f"model `{config.model}`, {len(prompts)} prompts ({', '.join(dict.fromkeys(tasks))}), "
                  f"chunks {tuple(config.workload.num_chunks)} x {tuple(config.workload.chunk_tokens)} tokens, "
                  f"mean prompt {n_mean:.0f} tokens, store variant `{config.store.variant}` (chunks as blocks of the engine's "
                  f"cache manager), recompute ratio run {ratio:.4g} (requested {requested!r}), checks "
                  f"{tuple(config.policy.check_layers)} budgets {tuple(config.policy.budgets)}, "
                  f"deviation `{config.policy.deviation}`, N={config.eval.continuation_tokens}, backend {jax.default_backend()}, "
                  f"every policy an engine request, run time {elapsed:.0f} s.\n"),
        ("Policies (mean over prompts, bootstrap 95% CI over prompts; TTFT median)", table),
        ("CacheBlend speed vs its FLOP bound", report.markdown_table([{
            "speedup": rows[[r["policy"] for r in rows].index("cacheblend")]["speedup"] if "cacheblend" in policies else None,
            "flop_bound": flop_bound, "time_fraction": time_fraction,
            "flop_fraction": None if flop_bound is None else 1.0 / flop_bound,
            "full_recompute_ttft_s": float(np.median(base)), **phase_row,
        }]) + "\nPhases of the CacheBlend prefill (median seconds): load = chunk lookups and the KV gather; reposition = "
              "re-rotating the reused keys of all layers; check_layers = layers 0 .. last check layer (all tokens, then "
              "narrowing); row_layers = the remaining layers over the selected rows; logits_write = logits and writing "
              "the fused KV of all layers into the request's pages. TTFT also holds scheduling and sampling.\n"),
        ("Cheaper check schedules (same ratio)", report.markdown_table(schedule_rows) if schedule_rows else "(none)\n"),
        ("Paired differences vs CacheBlend (policy minus cacheblend, bootstrap 95% CI)", report.markdown_table(paired)),
        ("KL by task", report.markdown_table(by_task)),
        ("Quality vs recompute ratio", report.markdown_table(sweep_rows) if sweep_rows else "(skipped)\n"),
        ("Deviation structure", "share of KV deviation held by the top 15% tokens, mean over layers: "
                                f"{np.mean(dev_stats['top15_share_by_layer']):.3f}; adjacent-layer Spearman, mean: "
                                f"{np.mean(dev_stats['adjacent_spearman_by_layer']):.3f}.\n"),
        ("Loading controller", report.markdown_table(tier_rows) + f"\nchosen at the min ratio: {chosen}\n"),
        ("Chunk store and manager", f"chunk store {engine_state['store']}; events {engine_state['events']}; "
                                    f"manager {engine_state['manager']}\n"),
        ("Figures", "kv_deviation_cdf.png, deviation_concentration.png, adjacent_layer_correlation.png, "
                    "quality_vs_ratio.png, kv_deviation_by_layer.png\n"),
    ]
    report.write_summary(workdir, "CacheBlend vs full recompute", sections)
    logging.info("cacheblend experiment finished in %.0f s", elapsed)
    return {
        "policies": rows, "paired_vs_cacheblend": paired, "by_task": by_task, "sweep": sweep_rows,
        "per_prompt": {name: [{k: v for k, v in p.items() if not isinstance(v, np.ndarray)} for p in per_policy[name]] for name in policies},
        "kl_per_prompt": {name: [p["kl"] for p in per_policy[name]] for name in policies},
        "deviation": dev_stats, "controller": {"tiers": tier_rows, "chosen": chosen}, "ratio": ratio,
        "speed": {"flop_bound": flop_bound, "time_fraction": time_fraction, **phase_row}, "schedules": schedule_rows,
        "engine": engine_state, "run_seconds": elapsed,
    }
