"""Recurrent-state reuse on a multi-turn chat trace, per policy and snapshot interval.

See ``configs/hybrid_reuse.py`` for the trace and the cells. Writes ``cells.csv`` (one row
per cell), ``turns.csv`` (per cell and turn: prompt, reused and attention-matchable tokens)
and ``summary.md`` to the run folder.
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Sequence

import ml_collections
import numpy as np

from experiments import report
from kvjax.cache.state_pool import slot_bytes
from kvjax.config import KvCacheConfig, SchedulerConfig
from kvjax.engine import Engine
from kvjax.model.model import Model
from kvjax.sampling import SamplingParams
from kvjax.testing.tiny import init_params, tiny_config


def hybrid_model(config: ml_collections.ConfigDict) -> Model:
    m = config.model
    cfg = tiny_config(
        name="hybrid-random",
        vocab_size=m.vocab_size,
        d_model=m.d_model,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        ffn_dim=m.ffn_dim,
        max_seq_len=config.max_seq_len,
        layer_types=tuple(m.layer_types),
    )
    return Model(config=cfg, params=init_params(cfg, config.seed), tokenizer=None, path=pathlib.Path("hybrid-random"))


class AttentionMatch:
    """Block-aligned prefixes computed so far (earlier rounds' prompts and outputs, earlier
    prompts of the same round, which prefix-aware scheduling lets later ones reuse): what a
    pure-attention model with the same cache would reuse (eviction ignored)."""

    def __init__(self, tokens_per_block: int) -> None:
        self.page = tokens_per_block
        self.prefixes: set[tuple[int, ...]] = set()

    def add(self, committed: Sequence[int]) -> None:
        for end in range(self.page, len(committed) + 1, self.page):
            self.prefixes.add(tuple(committed[:end]))

    def match(self, prompt: Sequence[int]) -> int:
        end = 0
        while end + self.page <= len(prompt) - 1 and tuple(prompt[: end + self.page]) in self.prefixes:
            end += self.page
        return end


def run_cell(
    model: Model,
    config: ml_collections.ConfigDict,
    kv: KvCacheConfig,
    openings: list[list[int]],
    users: list[list[list[int]]],
) -> tuple[dict, list[dict]]:
    """Serves the trace on a fresh engine; returns the cell's totals and its per-turn rows."""
    scheduler = SchedulerConfig(**config.scheduler.to_dict())
    engine = Engine(model, kv, scheduler, max_seq_len=config.max_seq_len)
    sampling = SamplingParams(max_new_tokens=config.output_tokens, ignore_eos=True)
    attention = AttentionMatch(kv.tokens_per_block)
    histories = [list(p) for p in openings]
    rows, peak_snapshots = [], 0
    start = time.perf_counter()
    for turn in range(config.turns):
        matches = []
        for h in histories:
            matches.append(attention.match(h))
            attention.add(h)
        outs = engine.generate(histories, sampling)
        for c, (out, match) in enumerate(zip(outs, matches)):
            rows.append(
                dict(
                    turn=turn + 1,
                    conversation=c,
                    prompt_tokens=len(out.prompt),
                    reused_tokens=out.num_reused_tokens,
                    attention_match_tokens=match,
                )
            )
            attention.add(out.prompt + out.output[:-1])
        peak_snapshots = max(peak_snapshots, engine.recurrent.index.num_snapshots)
        histories = [h + out.output + users[c][turn] for c, (h, out) in enumerate(zip(histories, outs))]
    elapsed = time.perf_counter() - start
    prompt = sum(r["prompt_tokens"] for r in rows)
    reused = sum(r["reused_tokens"] for r in rows)
    short = [r for r in rows if r["prompt_tokens"] < config.vllm_block_tokens]
    cfg = model.config
    per_slot = slot_bytes(len(cfg.recurrent_layers), cfg.num_heads, cfg.head_dim)
    totals = dict(
        tokens_per_block=kv.tokens_per_block,
        prompt_tokens=prompt,
        reused_tokens=reused,
        recomputed_tokens=prompt - reused,
        hit_rate=reused / prompt,
        attention_hit_rate=sum(r["attention_match_tokens"] for r in rows) / prompt,
        short_prompt_hit_rate=sum(r["reused_tokens"] for r in short) / max(1, sum(r["prompt_tokens"] for r in short)),
        later_turn_hit_rate=sum(r["reused_tokens"] for r in rows if r["turn"] > 1)
        / max(1, sum(r["prompt_tokens"] for r in rows if r["turn"] > 1)),
        snapshots_stored=engine.recurrent.index.stats["stored"],
        snapshots_kept=engine.recurrent.index.num_snapshots,
        peak_snapshots=peak_snapshots,
        peak_snapshot_mib=peak_snapshots * per_slot / 2**20,
        state_pool_mib=engine.recurrent.index.num_slots * per_slot / 2**20,
        seconds=elapsed,
    )
    return totals, rows


def run(config: ml_collections.ConfigDict, workdir: pathlib.Path) -> dict:
    model = hybrid_model(config)
    rng = np.random.default_rng(config.seed)
    vocab = config.model.vocab_size

    def ids(n: int) -> list[int]:
        return rng.integers(0, vocab, n).tolist()

    system = ids(config.system_tokens)
    openings = [system + ids(config.first_user_tokens) for _ in range(config.conversations)]
    users = [[ids(config.user_tokens) for _ in range(config.turns)] for _ in range(config.conversations)]
    base = dict(max_tokens=config.kv_cache.max_tokens, event_buffer_max_size=0)
    cells = []
    for policy in config.policies:
        for interval in config.intervals:
            kv = KvCacheConfig(
                tokens_per_block=config.kv_cache.tokens_per_block, **base,
                block_reuse_config={"policy": policy, "max_num_turns": config.max_num_turns},
                mamba_state_config={
                    "periodic_snapshot_interval": interval,
                    "additional_snapshot_offsets_from_end": list(config.offsets_from_end[policy]),
                    "max_snapshots": config.max_snapshots,
                },
            )
            cells.append((dict(cell=f"{policy}/{interval}", policy=policy, interval=interval), kv))
    vllm_block = config.vllm_block_tokens
    cells.append((
        dict(cell=f"vllm-like block {vllm_block}", policy="all_reusable", interval=vllm_block),
        KvCacheConfig(tokens_per_block=vllm_block, **base, mamba_state_config={
            "periodic_snapshot_interval": vllm_block, "max_snapshots": config.max_snapshots}),
    ))
    results, turn_rows = [], []
    for label, kv in cells:
        totals, rows = run_cell(model, config, kv, openings, users)
        results.append({**label, **totals})
        turn_rows += [{**label, **r} for r in rows]
    columns = ["cell", "tokens_per_block", "prompt_tokens", "reused_tokens", "recomputed_tokens", "hit_rate",
               "attention_hit_rate", "short_prompt_hit_rate", "later_turn_hit_rate", "snapshots_stored",
               "peak_snapshots", "peak_snapshot_mib", "state_pool_mib", "seconds"]
    report.write_csv(workdir / "cells.csv", results, columns)
    report.write_csv(workdir / "turns.csv", turn_rows)
    trace = (f"{config.conversations} conversations x {config.turns} turns; system prompt {config.system_tokens}, "
             f"first user message {config.first_user_tokens}, later ones {config.user_tokens}, "
             f"{config.output_tokens} generated tokens per turn; model {model.config.num_layers} layers "
             f"{tuple(config.model.layer_types)} cycled, d_model {config.model.d_model}, "
             f"{config.model.num_heads} heads of {config.model.head_dim}")
    report.write_summary(workdir, "Recurrent-state reuse on a multi-turn chat (hybrid model)", [
        ("Trace", trace + "\n"),
        ("Cells", report.markdown_table(results, columns)),
    ])
    return {"cells": results, "trace": trace}
