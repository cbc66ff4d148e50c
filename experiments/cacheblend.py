"""CacheBlend against full recompute on synthetic RAG prompts (SPEC C3-C8, E2).

Per prompt: the chunks are stored (untimed, as offline precompute), then every policy runs
its prefill on the same tokens and is timed to the first token's logits; the full-recompute
greedy continuation of N tokens is the reference that every policy is teacher-forced along.
A ratio sweep, deviation analyses (CDFs, concentration, adjacent-layer correlation), the
loading controller's decision and the layer-wise pipeline overlap complete the run folder.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time

import jax
import jax.numpy as jnp
import matplotlib
import ml_collections
import numpy as np
from absl import logging
from tqdm import tqdm

from experiments import report
from experiments.policies import POLICIES, PrefillResult, run_policy
from experiments.workloads.rag import answer_matches, make_examples
from kvjax import metrics
from kvjax.blend import loading_controller, selection
from kvjax.blend.blender import Blender, BlendPrompt
from kvjax.blend.chunk_store import ChunkStore
from kvjax.blend.engine_blend import submit_blended
from kvjax.blend.managed_store import ManagedChunkStore
from kvjax.blend.pipeline import pipelined_blend
from kvjax.blend.reposition import reposition_layers
from kvjax.config import KvCacheConfig, SchedulerConfig
from kvjax.engine import Engine
from kvjax.model.registry import load_model
from kvjax.sampling import SamplingParams

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SELECTORS = ("cacheblend", "random", "oracle", "first_k")
CDF_LAYERS = (1, 4, 10, 20)


def _selection_config(config: ml_collections.ConfigDict, ratio: float) -> selection.SelectionConfig:
    p = config.policy
    return selection.SelectionConfig(
        recompute_ratio=ratio, check_layers=tuple(p.check_layers), budgets=tuple(p.budgets),
        deviation=p.deviation, row_bucket=p.row_bucket,
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


def _timed(fn) -> tuple[PrefillResult, float]:
    t = time.perf_counter()
    result = fn()
    result.logits.block_until_ready()
    return result, time.perf_counter() - t


def _answer(tokenizer, tokens: list[int], stop_ids: tuple[int, ...]) -> tuple[str, int]:
    """Decoded answer up to the first stop token, and its length in tokens (stop included)."""
    end = next((i + 1 for i, t in enumerate(tokens) if t in stop_ids), len(tokens))
    return tokenizer.decode(tokens[:end]).strip(), end


def _reference(blender: Blender, prompt: BlendPrompt, first_logits: jax.Array, config, stop_ids, tokenizer) -> Reference:
    n = prompt.roles.num_tokens
    padded = blender.padded(n)
    k_full, v_full = (np.asarray(a) for a in blender.kv(n))
    first = int(jnp.argmax(first_logits))
    steps = config.eval.continuation_tokens - 1
    rest, rest_logits = blender.decode(first, n, steps)
    continuation = np.asarray([first, *rest], np.int32)
    logits = np.concatenate([np.asarray(first_logits)[None], rest_logits])
    answer, answer_len = _answer(tokenizer, continuation.tolist()[: config.eval.max_answer_tokens], stop_ids)
    k_re, v_re = blender.reused_kv(prompt, padded)
    k_re = jnp.stack(reposition_layers(blender.cfg, tuple(k_re), jnp.asarray(blender.deltas(prompt, padded))))
    true_dev = metrics.kv_deviation(np.asarray(k_re)[:, :n], np.asarray(v_re)[:, :n], k_full, v_full)
    pad = ((0, 0), (0, padded - n), (0, 0), (0, 0))
    _, trace = blender.blend(
        prompt, selection.select_none(prompt.roles, 64), num_probes=config.eval.num_probes,
        reused=(jnp.asarray(np.pad(k_full, pad)), jnp.asarray(np.pad(v_full, pad))),
    )
    return Reference(continuation, logits, answer_len, answer, k_full, v_full, true_dev, np.asarray(trace["attn"]))


def _evaluate(blender, prompt, result: PrefillResult, ref: Reference, config, stop_ids, tokenizer, gold: str, detailed: bool) -> dict:
    """Quality of one policy's prefill against the reference (pool holds the policy's KV)."""
    n = prompt.roles.num_tokens
    forced = np.asarray(blender.teacher_force(n, ref.continuation))
    logits = np.concatenate([np.asarray(result.logits)[None], forced])
    kl = metrics.kl_divergence(ref.logits, logits)
    agree = metrics.top1_agreement(ref.logits, logits)
    div = metrics.first_divergence(ref.logits, logits)
    out = {"kl": float(kl.mean()), "kl_first": float(kl[0]), "top1": float(agree.mean()), "first_div": div,
           "answer_agree": float(div >= ref.answer_len)}
    if div >= ref.answer_len:
        answer = ref.answer
    else:
        tokens = [*ref.continuation[:div].tolist(), int(np.argmax(logits[div]))]
        budget = config.eval.max_answer_tokens - len(tokens)
        if tokens[-1] not in stop_ids and budget > 0:
            more, _ = blender.decode(tokens[-1], n + div, budget, stop_ids)
            tokens += more
        answer, _ = _answer(tokenizer, tokens, stop_ids)
    out["gold"] = float(answer_matches(answer, gold))
    out["answer"] = answer
    mask = result.recomputed_mask()[:, :n]
    out["flop_fraction"] = metrics.recompute_flop_fraction(blender.cfg, mask, n, result.qkv_checks)
    if detailed:
        k, v = (np.asarray(a) for a in blender.kv(n))
        dev = metrics.relative_kv_deviation(metrics.kv_deviation(k, v, ref.k, ref.v), ref.k, ref.v)
        selectable, _ = prompt.roles.masks(n)
        sel = mask & selectable[None]
        unsel = ~mask & selectable[None]
        out["dev_selected"] = np.asarray([dev[i][sel[i]].mean() if sel[i].any() else np.nan for i in range(len(dev))])
        out["dev_unselected"] = np.asarray([dev[i][unsel[i]].mean() if unsel[i].any() else np.nan for i in range(len(dev))])
        if result.trace is not None:
            valid = np.arange(config.eval.num_probes) < prompt.roles.num_forced
            out["attn_dev"] = metrics.attention_deviation(np.asarray(result.trace["attn"]), ref.attn, valid)
        final = np.flatnonzero(mask[-1] & selectable)
        oracle = selection.select_oracle(prompt.roles, config.policy.recompute_ratio, ref.true_dev, 1)
        oracle_ids = np.setdiff1d(oracle.rows[oracle.rows_valid], np.arange(prompt.roles.suffix_start, n))
        out["recall"] = metrics.recall(final, oracle_ids)
    return out


def _engine_blend(
    store: ManagedChunkStore, prompt: BlendPrompt, sel_cfg, ref: Reference, standalone: jax.Array, n: int,
    token_bucket: int, salt: str | None = None,
) -> dict:
    """CacheBlend end to end through the engine: chunks from the manager, fused KV in the
    request's pages, ``n`` greedy tokens decoded by ``Engine.step`` (compared free-running).
    ``salt`` overrides the blend scope (the warm-up uses its own, so the timed run matches nothing)."""
    sampling = SamplingParams(max_new_tokens=n, ignore_eos=True, return_logits=True)
    rep = submit_blended(store, prompt, sel_cfg, sampling, token_bucket=token_bucket, salt=salt)
    out = store.engine.run()[0]
    first = np.asarray(out.logits[0])[None]
    tokens = np.asarray(out.output)
    diverged = np.flatnonzero(tokens != ref.continuation[: len(tokens)])
    return {
        "ttft_s": rep.prefill_s, "kl_first": float(metrics.kl_divergence(ref.logits[:1], first)[0]),
        "kl_vs_standalone": float(metrics.kl_divergence(np.asarray(standalone)[None], first)[0]),
        "token_agree": float(np.mean(tokens == ref.continuation[: len(tokens)])),
        "first_div": int(diverged[0]) if len(diverged) else len(tokens),
        "chunk_hit": rep.chunk_hit, "tail_forced": rep.num_tail, "onboarded_pages": rep.onboarded_pages,
    }


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
    max_tokens = max(p.roles.num_tokens for p in prompts) + config.eval.continuation_tokens + config.eval.max_answer_tokens
    store = ChunkStore(
        model.params, cfg, variant=config.store.variant, prefix_tokens=examples[0].prefix, tier=config.store.tier,
        device_capacity=config.store.device_capacity, disk_dir=workdir / "chunk_store" if config.store.tier == "disk" else None,
    )
    blender = Blender(
        model.params, cfg, store, examples[0].prefix, max_tokens=max_tokens, page_size=config.runtime.page_size,
        token_bucket=config.runtime.token_bucket, attn_impl=config.runtime.attn_impl,
    )
    ratio = config.policy.recompute_ratio
    sel_cfg = _selection_config(config, ratio)
    if config.store.backend not in ("standalone", "manager"):
        raise ValueError(f"store.backend={config.store.backend!r} must be 'standalone' or 'manager'")
    managed = None
    if config.store.backend == "manager":
        engine = Engine(
            model, KvCacheConfig(tokens_per_block=config.runtime.page_size, max_tokens=config.store.manager_max_tokens,
                                 event_buffer_max_size=100_000),
            SchedulerConfig(), max_seq_len=max_tokens + config.runtime.token_bucket, attn_impl=config.runtime.attn_impl,
        )
        managed = ManagedChunkStore(engine, variant=config.store.variant, prefix_tokens=examples[0].prefix)
    engine_rows: list[dict] = []
    rng = np.random.default_rng(config.seed)
    policies = [p for p in POLICIES if p in config.policies]
    sweep = [(name, r) for name in config.sweep.policies for r in config.sweep.ratios]

    per_policy: dict[str, list[dict]] = {p: [] for p in policies}
    ttft: dict[str, list[float]] = {p: [] for p in policies}
    sweep_results: dict[tuple[str, float], list[dict]] = {key: [] for key in sweep}
    sweep_ttft: dict[tuple[str, float], list[float]] = {key: [] for key in sweep}
    devs, tasks = [], []
    bar = tqdm(total=len(prompts), desc="prompts", unit="prompt")
    for i, (example, prompt) in enumerate(zip(examples, prompts)):
        store.clear()
        for chunk in prompt.chunks:
            store.put(chunk)
        run = lambda name, r, oracle=None: run_policy(  # noqa: E731
            name, blender, prompt, ratio=r, config=sel_cfg, rng=rng, oracle_deviation=oracle,
            num_probes=config.eval.num_probes,
        )
        if i == 0:  # compile every prefill shape before timing anything
            warm = [(p, ratio) for p in policies] + sweep
            for name, r in tqdm(warm, desc="compile", leave=False):
                run(name, r, np.ones((cfg.num_layers, prompt.roles.num_tokens))).logits.block_until_ready()
                blender.teacher_force(prompt.roles.num_tokens, np.zeros(config.eval.continuation_tokens, np.int32))
        full_result, t_full = _timed(lambda: run("full_recompute", ratio))
        ref = _reference(blender, prompt, full_result.logits, config, stop_ids, tok)
        selectable, _ = prompt.roles.masks(prompt.roles.num_tokens)
        devs.append(metrics.relative_kv_deviation(ref.true_dev, ref.k, ref.v)[:, selectable])
        tasks.append(example.task)
        for name in policies:
            if name == "full_recompute":
                result, t = full_result, t_full
            else:
                result, t = _timed(lambda: run(name, ratio, ref.true_dev))
            ttft[name].append(t)
            per_policy[name].append(_evaluate(blender, prompt, result, ref, config, stop_ids, tok, example.answer, True))
        if managed is not None:
            n_engine, bucket = config.eval.continuation_tokens, config.runtime.token_bucket
            for chunk in prompt.chunks:  # offline precompute, untimed like the standalone store
                managed.put(chunk)
            if i == 0:  # compile the engine path before timing it
                _engine_blend(managed, prompt, sel_cfg, ref, full_result.logits, n_engine, bucket, salt="warm-up")
            standalone = run("cacheblend", ratio).logits
            engine_rows.append(_engine_blend(managed, prompt, sel_cfg, ref, standalone, n_engine, bucket))
        if i < config.sweep.num_prompts:
            for name, r in tqdm(sweep, desc="sweep", leave=False):
                result, t = _timed(lambda: run(name, r, ref.true_dev))
                sweep_ttft[(name, r)].append(t)
                sweep_results[(name, r)].append(_evaluate(blender, prompt, result, ref, config, stop_ids, tok, example.answer, False))
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

    # Loading controller (C6): measured host/disk, configured HBM/NVMe; per-token cost from full recompute.
    n_mean = float(np.mean([p.roles.num_tokens for p in prompts]))
    bytes_per_token_layer = 2 * cfg.num_kv_heads * cfg.head_dim * 4
    tiers = [
        loading_controller.configured_tier("hbm", config.controller.hbm_gbps, 0.0, 3),
        loading_controller.measure_host_tier(),
        loading_controller.configured_tier("nvme", config.controller.nvme_gbps, config.controller.nvme_latency_ms, 1),
        loading_controller.measure_disk_tier(workdir),
    ]
    controller = loading_controller.LoadingController(
        tiers, float(np.median(base)) / (n_mean * cfg.num_layers), bytes_per_token_layer, config.controller.min_ratio
    )
    decisions = {t.name: dataclasses.asdict(controller.decide(int(n_mean), t.name)) for t in tiers}
    chosen = dataclasses.asdict(controller.decide(int(n_mean)))
    tier_rows = [{"tier": t.name, "GB_per_s": t.bandwidth / 1e9, "latency_ms": t.latency * 1e3, "measured": t.measured,
                  **{k: decisions[t.name][k] for k in ("ratio", "break_even", "load_s", "recompute_s")}} for t in tiers]

    pipeline = None
    if config.pipeline.enabled:
        pipe_store = ChunkStore(
            model.params, cfg, variant=config.store.variant, prefix_tokens=examples[0].prefix, tier=config.pipeline.tier,
            disk_dir=workdir / "pipeline_store" if config.pipeline.tier == "disk" else None,
        )
        blender.store = pipe_store
        prompt = prompts[0]
        for chunk in prompt.chunks:
            pipe_store.put(chunk)
        sel = selection.select_cacheblend(prompt.roles, sel_cfg, blender.padded(prompt.roles.num_tokens), cfg.num_layers)
        pipelined_blend(blender, prompt, sel)  # compile
        _, rep = pipelined_blend(blender, prompt, sel)
        pipeline = dataclasses.asdict(rep)
        pipe_store.clear()
        blender.store = store

    engine_path = None
    if managed is not None:
        report.write_csv(workdir / "engine_path.csv", engine_rows)
        events = managed.engine.manager.get_kv_cache_events()
        engine_path = {
            **{k: float(np.mean([r[k] for r in engine_rows])) for k in engine_rows[0]},
            "store": dataclasses.asdict(managed.stats),
            "events": {kind: sum(e.kind == kind for e in events) for kind in ("stored", "removed", "updated")},
            "manager": {k: getattr(managed.engine.manager.stats, k) for k in ("num_requests", "reused_tokens", "stored_blocks", "onboarded_pages")},
        }
    elapsed = time.perf_counter() - started
    table = report.markdown_table(rows, columns)
    sections = [
        ("Setup", f"model `{config.model}`, {len(prompts)} prompts ({', '.join(dict.fromkeys(tasks))}), "
                  f"chunks {tuple(config.workload.num_chunks)} x {tuple(config.workload.chunk_tokens)} tokens, "
                  f"mean prompt {n_mean:.0f} tokens, store variant `{config.store.variant}`, tier `{config.store.tier}`, "
                  f"recompute ratio {ratio}, checks {tuple(config.policy.check_layers)} budgets {tuple(config.policy.budgets)}, "
                  f"deviation `{config.policy.deviation}`, N={config.eval.continuation_tokens}, backend {jax.default_backend()}, "
                  f"run time {elapsed:.0f} s.\n"),
        ("Policies (mean over prompts, bootstrap 95% CI over prompts; TTFT median)", table),
        ("Paired differences vs CacheBlend (policy minus cacheblend, bootstrap 95% CI)", report.markdown_table(paired)),
        ("KL by task", report.markdown_table(by_task)),
        ("Quality vs recompute ratio", report.markdown_table(sweep_rows) if sweep_rows else "(skipped)\n"),
        ("Deviation structure", "share of KV deviation held by the top 15% tokens, mean over layers: "
                                f"{np.mean(dev_stats['top15_share_by_layer']):.3f}; adjacent-layer Spearman, mean: "
                                f"{np.mean(dev_stats['adjacent_spearman_by_layer']):.3f}.\n"),
        ("Loading controller", report.markdown_table(tier_rows) + f"\nchosen at the min ratio: {chosen}\n"),
        ("Layer-wise pipeline", (report.markdown_table([pipeline]) if pipeline else "(disabled)\n")),
        ("CacheBlend through the engine (store.backend=manager)", "(store.backend=standalone)\n" if engine_path is None else
         report.markdown_table([{k: v for k, v in engine_path.items() if not isinstance(v, dict)}])
         + f"\nchunk store {engine_path['store']}; events {engine_path['events']}; manager {engine_path['manager']}\n"),
        ("Figures", "kv_deviation_cdf.png, deviation_concentration.png, adjacent_layer_correlation.png, "
                    "quality_vs_ratio.png, kv_deviation_by_layer.png\n"),
    ]
    report.write_summary(workdir, "CacheBlend vs full recompute", sections)
    logging.info("cacheblend experiment finished in %.0f s", elapsed)
    return {
        "policies": rows, "paired_vs_cacheblend": paired, "by_task": by_task, "sweep": sweep_rows,
        "per_prompt": {name: [{k: v for k, v in p.items() if not isinstance(v, np.ndarray)} for p in per_policy[name]] for name in policies},
        "deviation": dev_stats, "controller": {"tiers": tier_rows, "chosen": chosen}, "pipeline": pipeline,
        "engine_path": engine_path, "run_seconds": elapsed,
    }
