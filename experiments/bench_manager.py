"""Host bookkeeping cost per block operation and per request vs the model's step time.

Three measurements in one run:

1. **Manager replay** (``experiments.eviction.replay``): the trace through ``KVCacheManager``
   alone, ``concurrency`` requests in flight; every call is timed, giving µs per block
   operation by kind (prefix match, allocation with eviction, commit, decode token, free).
2. **Scheduler replay**: the same trace through ``Scheduler.schedule``/``finish_step`` with a
   stand-in for the model (sampled token = a fixed id), i.e. all host work of an engine step:
   admission with prefix-aware estimates, chunked prefill, allocation, commits, frees.
3. **Model steps**: SmolLM2 prefill and batched decode through the engine (after a compile
   warm-up), so host cost is expressed as a share of the step it runs beside.

µs are CPU time of the Python process (wall time scaled by the process's CPU share, so time
the shared cores spent on other jobs is not charged to the manager).

    python -m experiments.run --config=configs/bench_manager.py
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Sequence

import matplotlib
import ml_collections
import numpy as np
from tqdm import tqdm

from experiments import report
from experiments.workloads.trace import OP_KINDS, TraceRequest, make_manager, make_trace, replay
from kvjax.config import KvCacheConfig, SchedulerConfig
from kvjax.engine.scheduler import Scheduler, SchedulerRequest
from kvjax.manager import KVCacheManager

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def scheduler_replay(mgr: KVCacheManager, trace: Sequence[TraceRequest], cfg: ml_collections.ConfigDict,
                     desc: str) -> dict:
    """Host CPU seconds of driving the trace through the scheduler (no model); per step and request.

    Requests are fed so that at most ``2 * max_batch_size`` wait at once (an engine's queue
    under steady load), which keeps the scheduler's per-step admission scan realistic.
    """
    sched = Scheduler(SchedulerConfig(**cfg.scheduler.to_dict()), mgr)
    backlog = 2 * cfg.scheduler.max_batch_size
    pending = iter(enumerate(trace))
    steps = prefill_steps = 0
    progress = tqdm(total=len(trace), desc=desc, leave=False)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    while True:
        while len(sched.waiting) < backlog:
            nxt = next(pending, None)
            if nxt is None:
                break
            i, req = nxt
            sched.add(SchedulerRequest(f"r{i}", req.prompt, max(len(req.output), 1), retention=req.retention()))
        if not sched.has_work():
            break
        plan = sched.schedule()
        mgr.take_page_ops()
        prefill_steps += any(w.is_prefill for w in plan.scheduled)
        finished = sched.finish_step({w.request_id: 7 for w in plan.scheduled if w.samples})
        progress.update(len(finished))
        steps += 1
    cpu = time.process_time() - cpu0
    progress.close()
    return {"steps": steps, "prefill_steps": prefill_steps, "cpu_s": cpu, "wall_s": time.perf_counter() - wall0,
            "us_per_step": 1e6 * cpu / steps, "us_per_request": 1e6 * cpu / len(trace),
            "token_hit_rate": mgr.stats.token_hit_rate}


def model_steps(cfg: ml_collections.ConfigDict) -> dict:
    """SmolLM2 (or ``cfg.model``) prefill and batched-decode step times through the engine."""
    from kvjax.engine import Engine
    from kvjax.model.registry import load_model
    from kvjax.sampling import SamplingParams

    m = cfg.model_steps
    model = load_model(cfg.model, cfg.gguf_path or None)
    rng = np.random.default_rng(cfg.trace.seed)
    engine = Engine(
        model,
        KvCacheConfig(tokens_per_block=cfg.tokens_per_block, max_tokens=m.max_tokens, enable_block_reuse=False),
        SchedulerConfig(
            max_batch_size=m.batch_size, max_num_tokens=m.prompt_tokens, prefill_chunk_size=m.prompt_tokens
        ),
        max_seq_len=m.max_seq_len,
    )
    sampling = SamplingParams(max_new_tokens=m.new_tokens, ignore_eos=True)

    def batch() -> list[list[int]]:
        return [rng.integers(1, model.config.vocab_size, m.prompt_tokens).tolist() for _ in range(m.batch_size)]

    engine.generate(batch(), sampling)  # compile
    engine.timings.clear()
    engine.generate(batch(), sampling)
    t = engine.timings
    return {
        "model": cfg.model,
        "prefill_tokens_per_step": m.prompt_tokens,
        "prefill_step_ms": 1e3 * t["prefill_s"] / t["prefill_steps"],
        "decode_batch": m.batch_size,
        "decode_step_ms": 1e3 * t["decode_s"] / t["decode_steps"],
    }


def plot(op_rows: Sequence[dict], compare: Sequence[dict], path: pathlib.Path) -> None:
    """Left: µs per block operation by kind; right: host vs model time per step, log scale."""
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4))
    x = np.arange(len(OP_KINDS))
    width = 0.8 / len(op_rows)
    for j, r in enumerate(op_rows):
        bars = ax0.bar(x + (j - (len(op_rows) - 1) / 2) * width, [r[f"us_per_{k}_block"] for k in OP_KINDS], width,
                       label=f"host pages = {r['host_pages']}")
        ax0.bar_label(bars, fmt="%.2f", fontsize=7)
    ax0.set_xticks(x, OP_KINDS)
    ax0.set_ylabel("µs per block operation (CPU)")
    ax0.set_title("Manager cost by operation")
    ax0.legend(fontsize=8)
    if compare:
        labels = [r["what"] for r in compare]
        y = np.arange(len(labels))
        ax1.barh(y - 0.2, [r["host_us"] for r in compare], 0.4, label="host bookkeeping")
        ax1.barh(y + 0.2, [r["model_us"] for r in compare], 0.4, label="model step")
        ax1.set_yticks(y, labels, fontsize=8)
        ax1.set_xscale("log")
        ax1.set_xlabel("µs (log)")
        ax1.set_title("Host bookkeeping vs model step")
        ax1.legend(fontsize=8)
    else:
        ax1.axis("off")
    report.save_figure(fig, path)


def run(config: ml_collections.ConfigDict, workdir: pathlib.Path) -> dict:
    sim = ml_collections.ConfigDict({**config.to_dict(), **config.trace.to_dict()})
    trace = make_trace(sim, config.vocab_size)
    op_rows, sched_rows = [], []
    for host in config.host_pages:
        res = replay(make_manager(sim, host), trace, priorities=True, concurrency=config.concurrency,
                     desc=f"manager host={host}")
        op_rows.append({
            "host_pages": host, "block_hit_rate": res.block_hit_rate,
            **{f"us_per_{k}_block": res.us_per_block(k) for k in OP_KINDS},
            **{f"{k}_blocks": res.blocks[k] for k in OP_KINDS},
            "us_per_request": 1e6 * res.total_s / len(trace), "cpu_share": res.cpu_share,
        })
        sched_rows.append({"host_pages": host, **scheduler_replay(make_manager(sim, host), trace, config,
                                                                  f"scheduler host={host}")})
    steps = model_steps(config) if config.model_steps.enabled else None
    compare = []
    if steps is not None:
        m = config.model_steps
        decode_block_us = max(r["us_per_decode_block"] for r in op_rows)
        per_step = max(r["us_per_step"] for r in sched_rows)
        per_request = max(r["us_per_request"] for r in sched_rows)
        mean_prompt = float(np.mean([len(r.prompt) for r in trace]))
        mean_output = float(np.mean([len(r.output) for r in trace]))
        model_request_us = 1e3 * (steps["prefill_step_ms"] * mean_prompt / m.prompt_tokens
                                  + steps["decode_step_ms"] * mean_output / m.batch_size)
        compare = [
            {"what": f"decode step, batch {m.batch_size}: manager", "host_us": decode_block_us * m.batch_size,
             "model_us": 1e3 * steps["decode_step_ms"]},
            {"what": "scheduler step (all host work)", "host_us": per_step, "model_us": 1e3 * steps["decode_step_ms"]},
            {"what": "per request (trace mean)", "host_us": per_request, "model_us": model_request_us},
        ]
        for r in compare:
            r["host_share_pct"] = 100 * r["host_us"] / r["model_us"]
    plot(op_rows, compare, workdir / "bench_manager.png")
    report.write_csv(workdir / "ops.csv", op_rows)
    sections = [
        (
            "Trace",
            f"{len(trace)} requests, {sum(len(r.prompt) for r in trace)} prompt tokens, "
            f"{config.tokens_per_block} tokens/block, {config.num_device_pages - 1} device pages; "
            f"manager replay with {config.concurrency} requests in flight.\n",
        ),
        (
            "µs per block operation (CPU)",
            report.markdown_table(
                op_rows,
                ["host_pages", "block_hit_rate"]
                + [f"us_per_{k}_block" for k in OP_KINDS]
                + ["us_per_request", "cpu_share"],
            ),
        ),
        ("Scheduler replay (all host work of the engine loop, no model)", report.markdown_table(sched_rows)),
    ]
    if steps is not None:
        sections += [
            (f"Model steps ({config.model}, this machine)", report.markdown_table([steps])),
            ("Host bookkeeping vs model", report.markdown_table(compare)),
        ]
    sections.append(("Plot", "![bench](bench_manager.png)\n"))
    report.write_summary(workdir, "Manager bookkeeping cost", sections)
    return {"trace_requests": len(trace), "ops": op_rows, "scheduler": sched_rows, "model_steps": steps,
            "host_vs_model": compare}
