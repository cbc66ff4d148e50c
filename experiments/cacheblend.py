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
(``num_prompts`` may grow). A run goes in pieces: ``piece.max_prompts`` / ``piece.max_minutes``
end this process after that many prompts or minutes, each piece appends its machine (matmul
rate, copy bandwidth), commit and time to ``pieces.jsonl``, and with ``piece.commit`` the
folder is committed to git as the piece ends. ``cacheblend_report`` writes the tables,
figures and summary from whatever records the folder holds ("k of N prompts"), after every
piece or on its own (``python -m experiments.cacheblend_report <folder>``).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib
import time

import jax
import ml_collections
import numpy as np
import psutil
from tqdm import tqdm

from experiments import cacheblend_eval as ev
from experiments import cacheblend_report, report
from experiments.cacheblend_report import DEVIATIONS, PIECES, RECORDS, STATE, read_lines
from experiments.policies import POLICIES, policy
from experiments.timing import compile_counter, machine_limits, mappings_limit, memory_mappings, release_executables
from kvjax import metrics
from kvjax.blend import loading_controller


def _ratio(config: ml_collections.ConfigDict, controller, num_tokens: int) -> float:
    requested = str(config.policy.recompute_ratio)
    if requested == "auto":
        return controller.decide(num_tokens, config.store.tier).ratio
    try:
        return float(requested)
    except ValueError:
        raise ValueError(f"policy.recompute_ratio={requested!r} must be a number in [0, 1] or 'auto'") from None


def _resume(workdir: pathlib.Path, config: ml_collections.ConfigDict) -> tuple[list[dict], dict | None]:
    """Records already in ``workdir`` (first ``num_prompts``) and its saved state, or ([], None).

    Raises:
      ValueError: the folder holds records of another config.
    """
    state_path = workdir / STATE
    if not state_path.is_file():
        return [], None
    state = json.loads(state_path.read_text())
    differ = cacheblend_report.config_differences(state["config"], config)
    if differ:
        raise ValueError(f"{workdir} holds results of another config (fields {differ} differ); use a new --workdir")
    records = read_lines(workdir / RECORDS)
    lines = (workdir / RECORDS).read_text().splitlines() if (workdir / RECORDS).is_file() else []
    if len(records) < len(lines):  # a line cut short by the interruption: that prompt runs again
        (workdir / RECORDS).write_text("".join(json.dumps(r) + "\n" for r in records))
    return [r for r in records if r["index"] < config.num_prompts], state


def _meta(setup: ev.Setup, controller, n_mean: float, ratio: float, tier_rows: list[dict]) -> dict:
    """What the report states about the run's setup, fixed by its first piece."""
    return {"n_mean": n_mean, "ratio": ratio, "tier_rows": tier_rows,
            "controller_choice": dataclasses.asdict(controller.decide(int(n_mean))),
            "num_split_chunks": setup.num_split_chunks, "max_chunk_tokens": setup.max_chunk_tokens}


def _check_piece(config: ml_collections.ConfigDict) -> None:
    for field in ("max_prompts", "max_minutes"):
        value = config.piece[field]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"piece.{field}={value!r} must be a number >= 0 (0 = no bound)")


def run(config: ml_collections.ConfigDict, workdir: pathlib.Path) -> dict:
    """Runs one piece of the experiment (or all of it), resuming from the records in
    ``workdir``; writes tables, plots and summary.md from every record the folder holds."""
    _check_piece(config)
    started, code = time.perf_counter(), report.code_commit()
    compiles = compile_counter()
    compile_start = dataclasses.replace(compiles)
    workdir.mkdir(parents=True, exist_ok=True)
    records, state = _resume(workdir, config)
    report.write_config(workdir, config)
    setup = ev.build(config)
    prompts = setup.prompts
    n_mean = float(np.mean([p.roles.num_tokens for p in prompts]))
    log = ev.TimingLog()
    if state is None:  # the first piece measures the controller (on the first prompt's chunks) and trains the scorer
        for chunk in prompts[0].chunks:
            setup.store.put(chunk)
        controller, tier_rows = ev.controller_table(config, setup, workdir, int(n_mean))
        ratio = _ratio(config, controller, int(n_mean))
        sel_cfg = ev.selection_config(config, ratio)
        weights, learned = ev.train_learned(setup, config, sel_cfg) if setup.train_examples else ((), {})
        state = {"config": cacheblend_report.comparable(config), "weights": list(weights), "learned": learned,
                 "meta": _meta(setup, controller, n_mean, ratio, tier_rows)}
        report.write_json(workdir / STATE, state)
        (workdir / RECORDS).write_text("")
        (workdir / PIECES).write_text("")
    sel_cfg = ev.selection_config(config, state["meta"]["ratio"])
    weights = tuple(state["weights"])
    policies = [p for p in POLICIES if p in config.policies]
    main_runs = [(name, name, policy(name, sel_cfg, weights)) for name in policies]
    sweep_runs = [(f"{name}@{r:g}", name, policy(name, dataclasses.replace(sel_cfg, recompute_ratio=r), weights))
                  for name in config.sweep.policies for r in config.sweep.ratios]
    (workdir / DEVIATIONS).mkdir(exist_ok=True)
    done = {r["index"] for r in records}
    todo = [i for i in range(len(prompts)) if i not in done]
    if config.piece.max_prompts:
        todo = todo[: int(config.piece.max_prompts)]
    deadline = started + 60 * config.piece.max_minutes if config.piece.max_minutes else float("inf")
    scored, releases = [], 0
    for i in tqdm(todo, desc="prompts", unit="prompt"):
        if time.perf_counter() >= deadline:
            break
        releases += release_executables()
        example, prompt = setup.examples[i], prompts[i]
        t0, timings, compiled = time.perf_counter(), dict(setup.engine.timings), dataclasses.replace(compiles)
        warm = dataclasses.replace(log)
        # no earlier prompt's chunk blocks (kept before runs' blocks) crowd this one's out
        setup.engine.manager.clear_cache()
        for chunk in prompt.chunks:
            setup.store.put(chunk)
        ref = ev.reference(setup, prompt, sel_cfg, config, log, detailed=i < config.eval.detail_prompts)
        selectable, _ = prompt.roles.masks(prompt.roles.num_tokens)
        dev = metrics.relative_kv_deviation(ref.true_dev, ref.k, ref.v)[:, selectable]
        np.save(workdir / DEVIATIONS / f"{i:05d}.npy", dev.astype(np.float16))
        runs = main_runs + (sweep_runs if i < config.sweep.num_prompts else [])
        results = ev.evaluate_prompt(setup, example, runs, ref, config, log, detailed=i < config.eval.detail_prompts)
        engine_s = {
            k: setup.engine.timings[k] - timings.get(k, 0) for k in ("prefill_s", "blend_s", "decode_s", "page_ops_s")
        }
        wall = time.perf_counter() - t0
        record = {
            "index": i, "num_tokens": prompt.roles.num_tokens, "reference_answer": ref.answer,
            "reference_last_logit_error": ref.last_logit_error, "runs": report.jsonable(results, nan_as_text=False),
            "time": {"wall_s": wall, "compile_s": compiles.since(compiled).seconds, **engine_s,
                     "host_s": wall - sum(engine_s.values()), "programs": compiles.since(compiled).programs,
                     "rss_gb": psutil.Process().memory_info().rss / 2**30, "mappings": memory_mappings(),
                     "warmup_runs": log.warmup_runs - warm.warmup_runs, "warmup_s": log.warmup_s - warm.warmup_s},
        }
        with open(workdir / RECORDS, "a") as f:
            f.write(json.dumps(record) + "\n")
        scored.append(i)
        del ref, results
    compiled = compiles.since(compile_start)
    pieces = read_lines(workdir / PIECES)
    piece = {
        "piece": len(pieces),
        "prompts": scored,
        "seconds": time.perf_counter() - started,
        "code": code,
        "machine": {
            "cpu": loading_controller.cpu_name(),
            "cores": os.cpu_count(),
            "backend": jax.default_backend(),
            "max_map_count": mappings_limit(),
            **machine_limits(),
        },
        "timing": dataclasses.asdict(log),
        "compile_s": compiled.seconds,
        "programs": compiled.programs,
        "backend_compiles": compiled.backend_compiles,
        "executables_released": releases,
        "ended": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    with open(workdir / PIECES, "a") as f:
        f.write(json.dumps(report.jsonable(piece)) + "\n")
    results = cacheblend_report.write_folder(workdir)
    report.write_json(workdir / "results.json", results)  # in the piece's commit (run.py writes the same again)
    if config.piece.commit:
        total = len(read_lines(workdir / RECORDS))
        report.commit_folder(
            workdir, f"Results: {config.experiment} {workdir.name}, piece {piece['piece']} ({len(scored)} prompts, "
                     f"{total} of {config.num_prompts}) on {piece['machine']['cpu']} at "
                     f"{piece['machine']['matmul_2048_gflops']:.0f} GFLOP/s, code {piece['code']}")
    return results
