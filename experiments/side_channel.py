"""Prefix-cache timing side channel: the attacker's ROC AUC from TTFT, shared vs per-tenant salts.

One engine serves a victim and an attacker. Each round, the victim caches secret prompts
(``secret | private suffix``) in every cell (setting x secret length); then the attacker
probes, in one shuffled order over all cells, every cached secret and as many fresh guesses of
the same length (``guess | tail``, the tail pushing a miss past the smallest prefill bucket).
A hit skips the secret's prefill, which is the side channel; the attacker scores each probe by
its TTFT and also sees ``num_reused_tokens``. Every sequence starts with a distinct token, so a
fresh guess shares no block, whole or partial, with anything cached. A discarded first round
compiles every shape; rounds and shuffling keep load drift out of the hit/miss comparison.

    python -m experiments.run --config=configs/side_channel.py
"""

from __future__ import annotations

import dataclasses
import pathlib
import time

import matplotlib
import ml_collections
import numpy as np
from tqdm import tqdm

from experiments import report
from kvjax.config import KvCacheConfig, SchedulerConfig
from kvjax.engine import Engine
from kvjax.model.registry import Model, load_model
from kvjax.sampling import SamplingParams
from kvjax.testing.tiny import tiny_model

matplotlib.use("Agg")
import matplotlib.pyplot as plt

SETTINGS = {"shared": (None, None), "per-tenant": ("tenant-a", "tenant-b")}
"""Setting -> (victim cache_salt, attacker cache_salt)."""
SAMPLING = SamplingParams(max_new_tokens=1, ignore_eos=True)


@dataclasses.dataclass(frozen=True, slots=True)
class Probe:
    """One attacker request: a guess of a ``secret_tokens``-token secret, plus the tail."""

    setting: str
    secret_tokens: int
    cached: bool  # the guess is a secret the victim cached in this setting
    tokens: list[int]


def load(config: ml_collections.ConfigDict) -> Model:
    """The registry model, or with ``model="tiny"`` a random 2-layer one (no tokenizer needed)."""
    if config.model == "tiny":
        cfg, params = tiny_model(0, vocab_size=1024)
        return Model(config=cfg, params=params, tokenizer=None, path=pathlib.Path("tiny"))
    return load_model(config.model, config.gguf_path or None, config.param_dtype or None)


def make_round(config: ml_collections.ConfigDict, per_cell: int, firsts: list[int], rng: np.random.Generator, vocab: int
               ) -> tuple[list[tuple[str | None, list[int]]], list[Probe]]:
    """(victim (salt, prompt) pairs, attacker probes), each shuffled; ``firsts`` supplies (and
    loses) the distinct first tokens."""

    def sequence(n: int) -> list[int]:
        return [firsts.pop()] + rng.integers(vocab, size=n - 1).tolist()

    victims, probes = [], []
    for setting, (victim_salt, _) in SETTINGS.items():
        for n in config.secret_tokens:
            tail = max(0, config.min_miss_tokens - n)
            for _ in range(per_cell):
                secret = sequence(n)
                victims.append((victim_salt, secret + rng.integers(vocab, size=config.victim_suffix_tokens).tolist()))
                for cached, guess in ((True, secret), (False, sequence(n))):
                    probes.append(Probe(setting, n, cached, guess + rng.integers(vocab, size=tail).tolist()))
    return [victims[i] for i in rng.permutation(len(victims))], [probes[i] for i in rng.permutation(len(probes))]


def play(engine: Engine, victims: list[tuple[str | None, list[int]]], probes: list[Probe]) -> list[dict]:
    """Runs the victims' requests, then the probes one at a time; one row per probe."""
    for salt, prompt in victims:
        engine.generate([prompt], SAMPLING, cache_salt=salt)
    rows = []
    for p in probes:
        [out] = engine.generate([p.tokens], SAMPLING, cache_salt=SETTINGS[p.setting][1])
        rows.append({"setting": p.setting, "secret_tokens": p.secret_tokens, "probe_tokens": len(p.tokens),
                     "cached": p.cached, "ttft_ms": 1e3 * out.ttft_s, "reused_tokens": out.num_reused_tokens})
    return rows


def auc(hits: np.ndarray, misses: np.ndarray) -> float:
    """ROC AUC of flagging the faster probe as cached: the Mann-Whitney U over all (hit, miss)
    pairs, P(miss score > hit score) with ties counted half, divided by the number of pairs."""
    diff = misses[:, None] - hits[None, :]
    return float(np.mean(diff > 0) + 0.5 * np.mean(diff == 0))


def cell_summary(rows: list[dict], bootstrap: int, rng: np.random.Generator) -> dict:
    """AUC (TTFT as the score) with a percentile-bootstrap 95% CI, medians and reuse of one cell."""
    hit, miss = ([r for r in rows if r["cached"] == c] for c in (True, False))
    t_hit, t_miss = (np.array([r["ttft_ms"] for r in rs]) for rs in (hit, miss))
    boot = [auc(rng.choice(t_hit, t_hit.size), rng.choice(t_miss, t_miss.size)) for _ in range(bootstrap)]
    reused_hit, reused_miss = (np.array([r["reused_tokens"] for r in rs], float) for rs in (hit, miss))
    return {
        "setting": rows[0]["setting"],
        "secret_tokens": rows[0]["secret_tokens"],
        "probe_tokens": rows[0]["probe_tokens"],
        "probes": len(rows),
        "auc": auc(t_hit, t_miss),
        "auc_ci_low": float(np.quantile(boot, 0.025)),
        "auc_ci_high": float(np.quantile(boot, 0.975)),
        "median_ttft_hit_ms": float(np.median(t_hit)),
        "median_ttft_miss_ms": float(np.median(t_miss)),
        "mean_reused_tokens_hit": float(reused_hit.mean()),
        "mean_reused_tokens_miss": float(reused_miss.mean()),
        "max_reused_tokens": int(max(reused_hit.max(), reused_miss.max())),
        "reuse_auc": auc(-reused_hit, -reused_miss),  # the attacker's AUC when it scores by num_reused_tokens
    }


def plot(cells: list[dict], rows: list[dict], path: pathlib.Path, title: str) -> None:
    """TTFT histograms of cached vs fresh probes: one row per secret length (common bins), one
    column per setting."""
    lengths = sorted({c["secret_tokens"] for c in cells})
    fig, axes = plt.subplots(len(lengths), len(SETTINGS), figsize=(10, 3.2 * len(lengths)), squeeze=False, sharex="row")
    for i, n in enumerate(lengths):
        ttft = np.array([r["ttft_ms"] for r in rows if r["secret_tokens"] == n])
        top = np.quantile(ttft, 0.98)  # the slowest 2% (load spikes) go into the last bin
        bins = np.linspace(ttft.min(), top, 40)
        for c in (c for c in cells if c["secret_tokens"] == n):
            ax = axes[i, list(SETTINGS).index(c["setting"])]
            for cached, label in ((True, "cached by the victim (hit)"), (False, "fresh guess (miss)")):
                sample = [
                    r["ttft_ms"]
                    for r in rows
                    if (r["setting"], r["secret_tokens"], r["cached"]) == (c["setting"], n, cached)
                ]
                ax.hist(np.minimum(sample, top), bins, alpha=0.55, label=label)
            ax.set_title(f"{c['setting']} salt, {n}-token secret: AUC {c['auc']:.2f}", fontsize=9)
            ax.set_xlabel("TTFT (ms)")
            ax.set_ylabel("probes")
            ax.ticklabel_format(axis="x", style="plain", useOffset=False)
            ax.legend(fontsize=7)
    fig.suptitle(title)
    report.save_figure(fig, path)


def run(config: ml_collections.ConfigDict, workdir: pathlib.Path) -> dict:
    start = time.perf_counter()
    model = load(config)
    engine = Engine(model, KvCacheConfig(**config.kv_cache.to_dict()), SchedulerConfig(**config.scheduler.to_dict()),
                    max_seq_len=config.max_seq_len)
    rng = np.random.default_rng(config.seed)
    vocab = model.config.vocab_size
    firsts = rng.permutation(vocab).tolist()
    play(engine, *make_round(config, max(1, config.warmup_probes // 2), firsts, rng, vocab))  # compiles; discarded
    per_cell = config.probes // (2 * config.rounds)
    rows = []
    for r in tqdm(range(config.rounds), desc="rounds", leave=False):
        rows += [{"round": r, **row} for row in play(engine, *make_round(config, per_cell, firsts, rng, vocab))]
    cells = [cell_summary([r for r in rows if r["setting"] == s and r["secret_tokens"] == n], config.bootstrap, rng)
             for s in SETTINGS for n in config.secret_tokens]
    plot(cells, rows, workdir / "ttft.png", f"Prefix-cache timing side channel: {config.model}")
    report.write_csv(workdir / "probes.csv", rows)
    results = {"model": config.model, "salts": {s: {"victim": v, "attacker": a} for s, (v, a) in SETTINGS.items()},
               "cells": cells, "runtime_s": time.perf_counter() - start, "rows": rows}
    report.write_summary(
        workdir,
        f"Prefix-cache timing side channel: {config.model}",
        [
            (
                "Attacker AUC (TTFT as the score; reuse_auc: num_reused_tokens as the score)",
                report.markdown_table(cells),
            ),
            (
                "TTFT of cached vs fresh probes",
                "![ttft](ttft.png)\n\nThe slowest 2% of each panel are drawn in its last bin.\n",
            ),
        ],
    )
    return results
