"""Eviction under memory pressure: priority-LRU vs plain LRU vs Belady's offline optimum.

A seeded trace mixes three kinds of content::

    doc request:  | system prompt (prio 90) | document (Zipf-popular, prio 35) | one-off question (prio 10..34) |
    chat turn:    | system prompt (prio 90) | history: earlier turns and answers (35)        | new user turn (35) |

The same trace is replayed through ``KVCacheManager`` (no model) with the retention configs
(priority-LRU) and without them (plain LRU: every block at the default 35), each with and
without a host tier, and the block-access stream is run through Belady's MIN (evict the block
whose next use is farthest, or bypass the incoming one) with the same capacity, device plus
host. MIN maximises the hits of any policy that caches what it has seen, so it bounds the
manager's block hit rate from above. A short run through the real engine replays a small
trace and checks that its hit rates and offload/onboard bytes equal the simulation's.

    python -m experiments.run --config=configs/eviction.py
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
from collections.abc import Iterator, Sequence

import matplotlib
import ml_collections
import numpy as np
from tqdm import tqdm

from experiments import report
from experiments.workloads.trace import OP_KINDS, TraceRequest, belady_hit_rate, make_manager, make_trace, replay
from kvjax.config import KvCacheConfig, SchedulerConfig
from kvjax.manager import KVCacheManager
from kvjax.manager.hashing import block_key, root_key

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def block_accesses(trace: Sequence[TraceRequest], tokens_per_block: int) -> Iterator[tuple[bytes, bool]]:
    """The (block key, is a prompt block) accesses of a sequential replay, in order: each
    request's full prompt blocks, then the full blocks its output completes."""
    ps = tokens_per_block
    root = root_key(None, None)
    for req in trace:
        seq = req.prompt + req.output
        parent = root
        for b in range(len(seq) // ps):
            parent = block_key(parent, seq[b * ps : (b + 1) * ps], ())
            yield parent, b < len(req.prompt) // ps


def simulate(cfg: ml_collections.ConfigDict, trace: Sequence[TraceRequest]) -> list[dict]:
    """Rows of (policy, host pages, disk pages) → hit rates, traffic and µs per block op,
    manager only; the disk tier sizes run below every host tier size > 0."""
    accesses = list(block_accesses(trace, cfg.tokens_per_block))
    rows = []
    for host in cfg.host_pages:
        for disk in cfg.disk_pages if host else (0,):
            for policy in ("priority-LRU", "LRU"):
                res = replay(make_manager(cfg, host, disk), trace, priorities=policy == "priority-LRU",
                             desc=f"{policy} host={host} disk={disk}")
                rows.append({
                    "policy": policy, "host_pages": host, "disk_pages": disk, "token_hit_rate": res.token_hit_rate,
                    "block_hit_rate": res.block_hit_rate, "device_evictions": res.device_evictions,
                    "host_evictions": res.host_evictions, "offloaded_MB": res.offloaded_bytes / 2**20,
                    "spilled_MB": res.spilled_bytes / 2**20, "onboarded_MB": res.onboarded_bytes / 2**20,
                    "disk_onboarded_MB": res.disk_onboarded_bytes / 2**20,
                    **{f"us_per_{k}_block": res.us_per_block(k) for k in OP_KINDS},
                })
            rows.append({"policy": "Belady (offline)", "host_pages": host, "disk_pages": disk,
                         "block_hit_rate": belady_hit_rate(accesses, cfg.num_device_pages - 1 + host + disk)})
    return rows


def engine_check(cfg: ml_collections.ConfigDict) -> list[dict]:
    """A small trace on the real model (one request at a time, one new token each), with a
    manager-only replay of the same trace on the engine's page counts beside it."""
    from kvjax.engine import Engine
    from kvjax.model.registry import load_model
    from kvjax.sampling import SamplingParams

    e = cfg.engine
    model = load_model(cfg.model, cfg.gguf_path or None)
    trace_cfg = ml_collections.ConfigDict({**cfg.trace.to_dict(), **e.trace.to_dict()})
    trace = [dataclasses.replace(r, output=()) for r in make_trace(trace_cfg, model.config.vocab_size)]
    sampling = SamplingParams(max_new_tokens=1, ignore_eos=True)
    rows = []
    for host_mb in (0, e.host_cache_mb):
        for policy in ("priority-LRU", "LRU"):
            kv = KvCacheConfig(tokens_per_block=cfg.tokens_per_block, max_tokens=e.max_tokens,
                               host_cache_size=int(host_mb * 2**20))
            engine = Engine(model, kv, SchedulerConfig(max_num_tokens=e.max_seq_len, prefill_chunk_size=e.max_seq_len),
                            max_seq_len=e.max_seq_len)
            start = time.perf_counter()
            for req in tqdm(trace, desc=f"engine {policy} host={host_mb}MB", leave=False):
                engine.generate([req.prompt], sampling, retention=req.retention() if policy == "priority-LRU" else None)
            seconds = time.perf_counter() - start
            mgr = engine.manager
            twin = KVCacheManager(kv, engine.layout)
            sim = replay(twin, trace, priorities=policy == "priority-LRU")
            s = mgr.stats
            rows.append({
                "policy": policy, "host_pages": engine.layout.num_host_pages,
                "device_pages": engine.layout.num_pages[0] - 1,
                "block_hit_rate": s.block_hit_rate, "sim_block_hit_rate": sim.block_hit_rate,
                "token_hit_rate": s.token_hit_rate, "sim_token_hit_rate": sim.token_hit_rate,
                "offloaded_MB": s.offloaded_bytes / 2**20, "sim_offloaded_MB": sim.offloaded_bytes / 2**20,
                "onboarded_MB": s.onboarded_bytes / 2**20, "sim_onboarded_MB": sim.onboarded_bytes / 2**20,
                "engine_s": seconds,
            })
    return rows


def plot(rows: Sequence[dict], path: pathlib.Path) -> None:
    """Grouped bars: block hit rate per policy, per (host, disk) tier sizes."""
    tiers = sorted({(r["host_pages"], r["disk_pages"]) for r in rows})
    policies = ["LRU", "priority-LRU", "Belady (offline)"]
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    width = 0.8 / len(policies)
    for j, policy in enumerate(policies):
        values = [next(r["block_hit_rate"] for r in rows if r["policy"] == policy
                       and (r["host_pages"], r["disk_pages"]) == t) for t in tiers]
        bars = ax.bar(np.arange(len(tiers)) + (j - 1) * width, values, width, label=policy)
        ax.bar_label(bars, fmt="%.3f", fontsize=7)
    ax.set_xticks(np.arange(len(tiers)), [f"host {h}\ndisk {d}" for h, d in tiers])
    ax.set_ylabel("block hit rate")
    ax.set_ylim(0, 1)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title("Eviction policy under memory pressure (same trace)")
    report.save_figure(fig, path)


def run(config: ml_collections.ConfigDict, workdir: pathlib.Path) -> dict:
    sim_cfg = ml_collections.ConfigDict({**config.to_dict(), **config.trace.to_dict()})
    trace = make_trace(sim_cfg, config.vocab_size)
    rows = simulate(sim_cfg, trace)
    plot(rows, workdir / "hit_rates.png")
    report.write_csv(workdir / "simulation.csv", rows)
    engine_rows = engine_check(config) if config.engine.enabled else []
    if engine_rows:
        report.write_csv(workdir / "engine.csv", engine_rows)
    kinds = {k: sum(1 for r in trace if r.kind == k) for k in ("doc", "chat")}
    sections = [
        ("Trace", f"{len(trace)} requests ({kinds['doc']} doc, {kinds['chat']} chat), "
                  f"{sum(len(r.prompt) for r in trace)} prompt tokens, {config.tokens_per_block} tokens/block, "
                  f"{config.num_device_pages - 1} device pages.\n"),
        ("Hit rates (manager-only simulation)", report.markdown_table(
            rows, ["policy", "host_pages", "disk_pages", "block_hit_rate", "token_hit_rate", "device_evictions",
                   "host_evictions", "offloaded_MB", "spilled_MB", "onboarded_MB", "disk_onboarded_MB"])),
        ("Host cost, µs per block operation", report.markdown_table(
            [r for r in rows if "us_per_match_block" in r],
            ["policy", "host_pages", "disk_pages"] + [f"us_per_{k}_block" for k in OP_KINDS])),
        ("Hit rates", "![hit rates](hit_rates.png)\n"),
    ]
    if engine_rows:
        sections.append(
            (f"Real engine ({config.model}) vs the same trace in the simulator", report.markdown_table(engine_rows))
        )
    report.write_summary(workdir, "Eviction: priority-LRU vs LRU vs Belady", sections)
    return {"trace_requests": len(trace), "simulation": rows, "engine": engine_rows}
