"""CacheBlend and its successors' selectors against full recompute on RAG prompts (real SQuAD
multi-document QA, needle in a haystack, or synthetic), every policy an engine request.

Per prompt: the chunks are stored in the engine's cache manager (untimed, as offline
precompute); full recompute gives the reference (``cacheblend_eval.reference``); every policy
runs once timed to its first token and once teacher-forced along the reference for its
quality (``cacheblend_eval.evaluate``); the first ``sweep.num_prompts`` prompts also run the
selectors at every sweep ratio. The learned selector is trained first on the workload's
training split. ``cacheblend_report`` writes the tables, figures and summary.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time

import ml_collections
import numpy as np
from tqdm import tqdm

from experiments import cacheblend_eval as ev
from experiments import cacheblend_report
from experiments.policies import POLICIES, policy
from kvjax import metrics
from kvjax.blend.blender import FULL_RECOMPUTE


def _ratio(config: ml_collections.ConfigDict, controller, num_tokens: int) -> float:
    requested = str(config.policy.recompute_ratio)
    if requested == "auto":
        return controller.decide(num_tokens, config.store.tier).ratio
    try:
        return float(requested)
    except ValueError:
        raise ValueError(f"policy.recompute_ratio={requested!r} must be a number in [0, 1] or 'auto'") from None


def run(config: ml_collections.ConfigDict, workdir: pathlib.Path) -> dict:
    """Runs the experiment; writes tables, plots and summary.md into ``workdir``."""
    started = time.perf_counter()
    setup = ev.build(config)
    prompts, blender, cfg = setup.prompts, setup.blender, setup.model.config
    n_mean = float(np.mean([p.roles.num_tokens for p in prompts]))
    for chunk in prompts[0].chunks:
        setup.store.put(chunk)
    for _ in range(2):  # compile the reference path, then time it for the controller's per-token cost
        t_profile = blender.run(prompts[0], FULL_RECOMPUTE).ttft_s
    controller, tier_rows = ev.controller_table(config, setup, workdir, t_profile / (prompts[0].roles.num_tokens * cfg.num_layers),
                                                int(n_mean))
    sel_cfg = ev.selection_config(config, _ratio(config, controller, int(n_mean)))
    weights, learned = ev.train_learned(setup, config, sel_cfg) if setup.train_examples else ((), {})
    policies = [p for p in POLICIES if p in config.policies]
    sweep = [(name, r) for name in config.sweep.policies for r in config.sweep.ratios]
    per_policy: dict[str, list[dict]] = {p: [] for p in policies}
    ttft: dict[str, list[float]] = {p: [] for p in policies}
    sweep_results: dict[tuple[str, float], list[dict]] = {key: [] for key in sweep}
    phases, devs = [], []
    for i, (example, prompt) in enumerate(tqdm(list(zip(setup.examples, prompts)), desc="prompts", unit="prompt")):
        for chunk in prompt.chunks:
            setup.store.put(chunk)
        ref = ev.reference(setup, prompt, sel_cfg, config)
        if i == 0:  # compile every prefill shape of this prompt before timing anything
            for name in policies:
                ev.timed(setup, prompt, policy(name, sel_cfg, weights), ref)
            ref = ev.reference(setup, prompt, sel_cfg, config)
        selectable, _ = prompt.roles.masks(prompt.roles.num_tokens)
        devs.append(metrics.relative_kv_deviation(ref.true_dev, ref.k, ref.v)[:, selectable])
        for name in policies:
            pol = policy(name, sel_cfg, weights)
            run_ = ev.timed(setup, prompt, pol, ref) if name != "full_recompute" else None
            ttft[name].append(ref.ttft_s if run_ is None else run_.ttft_s)
            if name == "cacheblend":
                phases.append({"load_s": run_.report.load_s, **{f"{k}_s": v for k, v in run_.report.phases.items()}})
            pol = pol if run_ is not None else dataclasses.replace(sel_cfg, selector="all")  # equals full recompute
            per_policy[name].append(ev.evaluate(setup, example, name, pol, ref, config, detailed=True))
        if i < config.sweep.num_prompts:
            for name, r in tqdm(sweep, desc="sweep", leave=False):
                pol = policy(name, dataclasses.replace(sel_cfg, recompute_ratio=r), weights)
                sweep_results[(name, r)].append(ev.evaluate(setup, example, name, pol, ref, config, detailed=False))
    return cacheblend_report.write(
        workdir, config, setup, sel_cfg=sel_cfg, per_policy=per_policy, ttft=ttft, sweep_results=sweep_results,
        phases=phases, devs=devs, learned=learned, tier_rows=tier_rows, controller=controller, n_mean=n_mean,
        elapsed=time.perf_counter() - started,
    )
