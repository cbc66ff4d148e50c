"""CacheBlend and its successors' selectors against full recompute on RAG prompts (real SQuAD
multi-document QA, needle in a haystack, or synthetic), every policy an engine request.

Per prompt, from an empty cache: the chunks are stored in the engine's cache manager
(untimed, as offline precompute); full recompute gives the reference (``cacheblend_eval.reference``); every policy
(and, on the first ``sweep.num_prompts`` prompts, every selector at every sweep ratio) runs
one prefill, timed with nothing compiling in it, whose KV its teacher-forced continuation and
greedy answer then extend (``cacheblend_eval.evaluate_prompt``). The learned selector is
trained first on the workload's training split.

Each prompt's results are appended to ``per_prompt.jsonl`` in the run folder as soon as they
are scored, so memory stays flat and a run stopped midway resumes: run the same config with
``--workdir`` set to its folder and the prompts already scored are read back, not run again
(``num_prompts`` may grow). ``cacheblend_report`` writes the tables, figures and summary.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time

import ml_collections
import numpy as np
import psutil
from tqdm import tqdm

from experiments import cacheblend_eval as ev
from experiments import cacheblend_report, report
from experiments.policies import POLICIES, policy
from experiments.timing import compile_counter
from kvjax import metrics

RECORDS = "per_prompt.jsonl"
"""One JSON line per scored prompt: {"index", "num_tokens", "runs": {key: metrics}, "time": {...}, ...}."""
STATE = "run_state.json"
"""The config a run folder's records belong to and the learned scorer they used."""
DEVIATIONS = "deviation"
"""Folder of per-prompt [L, chunk tokens] relative KV deviations of full reuse (float16 .npy)."""


def _ratio(config: ml_collections.ConfigDict, controller, num_tokens: int) -> float:
    requested = str(config.policy.recompute_ratio)
    if requested == "auto":
        return controller.decide(num_tokens, config.store.tier).ratio
    try:
        return float(requested)
    except ValueError:
        raise ValueError(f"policy.recompute_ratio={requested!r} must be a number in [0, 1] or 'auto'") from None


def _comparable(config: ml_collections.ConfigDict) -> dict:
    """The config without the fields a resumed run may change."""
    d = config.to_dict()
    d.pop("num_prompts", None)
    return json.loads(json.dumps(d, default=str))


def _resume(workdir: pathlib.Path, config: ml_collections.ConfigDict) -> tuple[list[dict], dict | None]:
    """Records already in ``workdir`` (first ``num_prompts``) and its saved state, or ([], None).

    Raises:
      ValueError: the folder holds records of another config.
    """
    state_path = workdir / STATE
    if not state_path.is_file():
        return [], None
    state, current = json.loads(state_path.read_text()), _comparable(config)
    if state["config"] != current:
        differ = sorted(k for k in set(state["config"]) | set(current) if state["config"].get(k) != current.get(k))
        raise ValueError(f"{workdir} holds results of another config (fields {differ} differ); use a new --workdir")
    lines = (workdir / RECORDS).read_text().splitlines() if (workdir / RECORDS).is_file() else []
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by the interruption: that prompt runs again
            break
    return [r for r in records if r["index"] < config.num_prompts], state


def run(config: ml_collections.ConfigDict, workdir: pathlib.Path) -> dict:
    """Runs the experiment (or resumes it in ``workdir``); writes tables, plots and summary.md."""
    started = time.perf_counter()
    compiles = compile_counter()
    compile_start = dataclasses.replace(compiles)
    records, state = _resume(workdir, config)
    setup = ev.build(config)
    prompts = setup.prompts
    n_mean = float(np.mean([p.roles.num_tokens for p in prompts]))
    log = ev.TimingLog()
    for chunk in prompts[0].chunks:
        setup.store.put(chunk)
    controller, tier_rows = ev.controller_table(config, setup, workdir, int(n_mean))
    sel_cfg = ev.selection_config(config, _ratio(config, controller, int(n_mean)))
    if state is not None:
        weights, learned = tuple(state["weights"]), state["learned"]
    else:
        weights, learned = ev.train_learned(setup, config, sel_cfg) if setup.train_examples else ((), {})
        report.write_json(workdir / STATE, {"config": _comparable(config), "weights": list(weights), "learned": learned})
        (workdir / RECORDS).write_text("")
    policies = [p for p in POLICIES if p in config.policies]
    main_runs = [(name, name, policy(name, sel_cfg, weights)) for name in policies]
    sweep_runs = [(f"{name}@{r:g}", name, policy(name, dataclasses.replace(sel_cfg, recompute_ratio=r), weights))
                  for name in config.sweep.policies for r in config.sweep.ratios]
    (workdir / DEVIATIONS).mkdir(exist_ok=True)
    done = {r["index"] for r in records}
    todo = [i for i in range(len(prompts)) if i not in done]
    for i in tqdm(todo, desc="prompts", unit="prompt"):
        example, prompt = setup.examples[i], prompts[i]
        t0, timings, compiled = time.perf_counter(), dict(setup.engine.timings), dataclasses.replace(compiles)
        warm = dataclasses.replace(log)
        setup.engine.manager.clear_cache()  # no earlier prompt's chunk blocks (kept before runs' blocks) crowd this one's out
        for chunk in prompt.chunks:
            setup.store.put(chunk)
        ref = ev.reference(setup, prompt, sel_cfg, config, log, detailed=i < config.eval.detail_prompts)
        selectable, _ = prompt.roles.masks(prompt.roles.num_tokens)
        dev = metrics.relative_kv_deviation(ref.true_dev, ref.k, ref.v)[:, selectable]
        np.save(workdir / DEVIATIONS / f"{i:05d}.npy", dev.astype(np.float16))
        runs = main_runs + (sweep_runs if i < config.sweep.num_prompts else [])
        results = ev.evaluate_prompt(setup, example, runs, ref, config, log, detailed=i < config.eval.detail_prompts)
        engine_s = {k: setup.engine.timings[k] - timings.get(k, 0) for k in ("prefill_s", "blend_s", "decode_s", "page_ops_s")}
        wall = time.perf_counter() - t0
        record = {
            "index": i, "num_tokens": prompt.roles.num_tokens, "reference_answer": ref.answer,
            "reference_last_logit_error": ref.last_logit_error, "runs": report.jsonable(results, nan_as_text=False),
            "time": {"wall_s": wall, "compile_s": compiles.since(compiled).seconds, **engine_s,
                     "host_s": wall - sum(engine_s.values()), "programs": compiles.since(compiled).programs,
                     "rss_gb": psutil.Process().memory_info().rss / 2**30,
                     "warmup_runs": log.warmup_runs - warm.warmup_runs, "warmup_s": log.warmup_s - warm.warmup_s},
        }
        with open(workdir / RECORDS, "a") as f:
            f.write(json.dumps(record) + "\n")
        records.append(record)
        del ref, results
    records.sort(key=lambda r: r["index"])
    devs = [np.load(workdir / DEVIATIONS / f"{r['index']:05d}.npy").astype(np.float32) for r in records]
    return cacheblend_report.write(
        workdir, config, setup, sel_cfg=sel_cfg, records=records, policies=policies, sweep=sweep_runs, devs=devs,
        learned=learned, tier_rows=tier_rows, controller=controller, n_mean=n_mean, log=log,
        compiled=compiles.since(compile_start), elapsed=time.perf_counter() - started, resumed=len(done),
    )
