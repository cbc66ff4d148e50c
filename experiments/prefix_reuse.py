"""Prefix reuse through the engine on the real model: TTFT cold vs warm, hit rates, agreement.

Two engines share the model: ``cold`` has ``enable_block_reuse=False`` (every prompt is
prefilled in full) and ``warm`` reuses cached blocks. Each request runs on both, one after
the other, so the two TTFTs see the same machine load. Workload::

    single-turn:  | system prompt s (shared) | question q |            s = 1..S, q = 1..Q
    multi-turn:   | system prompt | user 1 | answer 1 | ... | user t |  t = 1..T (answers: greedy output)

The first pass compiles every shape and is discarded; caches are cleared before each measured
pass. SmolLM2 prompts use its ChatML template; Gemma 3 (a base model) gets plain text
("User: ... / Assistant: ...").

    python -m experiments.run --config=configs/prefix_reuse.py [--config.model=gemma3-270m]
"""

from __future__ import annotations

import dataclasses
import pathlib

import matplotlib
import ml_collections
import numpy as np

from experiments import report
from experiments.workloads.chat import one_pass
from kvjax.config import KvCacheConfig, SchedulerConfig
from kvjax.engine import Engine
from kvjax.model.registry import load_model

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def plot(rows: list[dict], path: pathlib.Path, title: str) -> None:
    """TTFT per request, cold and warm bars side by side."""
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(rows)), 3.8))
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["ttft_cold_s"] for r in rows], 0.4, label="cold (no reuse)")
    ax.bar(x + 0.2, [r["ttft_warm_s"] for r in rows], 0.4, label="warm (prefix reuse)")
    ax.set_xticks(
        x, [f"{'S' if r['kind'] == 'shared-system' else 'C'}{r['group']}.{r['index']}" for r in rows], fontsize=7
    )
    ax.set_xlabel("request (S = shared system prompt s.q, C = chat c.turn)")
    ax.set_ylabel("TTFT (s)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    report.save_figure(fig, path)


def run(config: ml_collections.ConfigDict, workdir: pathlib.Path) -> dict:
    model = load_model(config.model, config.gguf_path or None, config.param_dtype or None)
    sched = SchedulerConfig(**config.scheduler.to_dict())
    engines = {
        reuse: Engine(model, KvCacheConfig(**config.kv_cache.to_dict(), enable_block_reuse=reuse), sched,
                      max_seq_len=config.max_seq_len)
        for reuse in (False, True)
    }
    cold, warm = engines[False], engines[True]
    one_pass(config, model, cold, warm, "compile pass")
    rows = []
    for p in range(config.measure_passes):
        warm.manager.clear_cache()
        before = dataclasses.replace(warm.manager.stats)
        rows += [{"pass": p, **r} for r in one_pass(config, model, cold, warm, f"pass {p}")]
    after = warm.manager.stats
    prompt_blocks = after.prompt_blocks - before.prompt_blocks
    hits = [r for r in rows if r["reused_tokens"] > 0]
    results = {
        "model": config.model,
        "requests": len(rows),
        "token_hit_rate": sum(r["reused_tokens"] for r in rows) / sum(r["prompt_tokens"] for r in rows),
        "block_hit_rate": (after.reused_blocks - before.reused_blocks) / prompt_blocks if prompt_blocks else 0.0,
        "median_ttft_cold_s": float(np.median([r["ttft_cold_s"] for r in rows])),
        "median_ttft_warm_s": float(np.median([r["ttft_warm_s"] for r in rows])),
        "median_ttft_cold_hits_s": float(np.median([r["ttft_cold_s"] for r in hits])) if hits else None,
        "median_ttft_warm_hits_s": float(np.median([r["ttft_warm_s"] for r in hits])) if hits else None,
        "median_speedup_hits": float(np.median([r["speedup"] for r in hits])) if hits else None,
        "outputs_agree": all(r["outputs_agree"] for r in rows),
        "max_logits_rel_err": max(r["logits_rel_err"] for r in rows),
        "rows": rows,
    }
    plot(rows, workdir / "ttft.png", f"TTFT cold vs warm — {config.model}")
    report.write_csv(workdir / "requests.csv", rows)
    summary = {k: v for k, v in results.items() if k != "rows"}
    report.write_summary(workdir, f"Prefix reuse — {config.model}", [
        ("Summary", report.markdown_table([summary])),
        ("Requests (cold and warm run back to back)", report.markdown_table(rows)),
        ("TTFT", "![ttft](ttft.png)\n"),
    ])
    return results
