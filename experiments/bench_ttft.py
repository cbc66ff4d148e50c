"""TTFT vs prompt length: cold and prefix hits through the engine, CacheBlend through kvjax.blend.

See ``configs/bench_ttft.py`` for the methods and the command.
"""

from __future__ import annotations

import collections
import pathlib

import jax
import matplotlib
import matplotlib.ticker
import ml_collections
import numpy as np
from tqdm import tqdm

from experiments import report
from experiments.blender import FULL_RECOMPUTE, Blender
from kvjax.blend import selection
from kvjax.blend.chunk_store import ChunkStore
from kvjax.blend.prompt import BlendPrompt
from kvjax.config import KvCacheConfig, SchedulerConfig
from kvjax.engine import Engine
from kvjax.model.registry import Model, load_model
from kvjax.sampling import SamplingParams

matplotlib.use("Agg")
import matplotlib.pyplot as plt

SAMPLING = SamplingParams(max_new_tokens=1, ignore_eos=True)


def engine_round(
    engine: Engine, config: ml_collections.ConfigDict, length: int, rng: np.random.Generator
) -> dict[str, tuple[float, int]]:
    """One round at ``length``: cold, then one prompt per hit fraction sharing a cached base prompt.

    Returns:
      method -> (TTFT seconds, reused tokens).
    """
    vocab = engine.model.config.vocab_size
    draw = lambda n: rng.integers(3, vocab, n).tolist()
    [cold] = engine.generate([draw(length)], SAMPLING)
    out = {"cold": (cold.ttft_s, cold.num_reused_tokens)}
    base = draw(length)
    engine.generate([base], SAMPLING)
    block = config.kv_cache.tokens_per_block
    for fraction in config.hit_fractions:
        cached = round(fraction * length / block) * block
        [hit] = engine.generate([base[:cached] + draw(length - cached)], SAMPLING)
        out[f"hit_{round(100 * fraction)}"] = (hit.ttft_s, hit.num_reused_tokens)
    return out


def blend_prompt(
    config: ml_collections.ConfigDict, prefix: tuple[int, ...], length: int, rng: np.random.Generator, vocab: int
) -> BlendPrompt:
    """``prefix`` + random chunks of ``blend.chunk_tokens`` (the last one shorter) + a random suffix."""
    c = config.blend
    middle = length - len(prefix) - c.suffix_tokens
    if middle <= 0:
        raise ValueError(
            f"lengths entry {length} must exceed blend.prefix_tokens + blend.suffix_tokens = "
            f"{len(prefix) + c.suffix_tokens}"
        )
    sizes = [c.chunk_tokens] * (middle // c.chunk_tokens) + (
        [middle % c.chunk_tokens] if middle % c.chunk_tokens else []
    )
    draw = lambda n: tuple(int(t) for t in rng.integers(3, vocab, n))
    return BlendPrompt(prefix=prefix, chunks=tuple(draw(n) for n in sizes), suffix=draw(c.suffix_tokens))


def blend_round(
    blender: Blender, config: ml_collections.ConfigDict, length: int, rng: np.random.Generator
) -> dict[str, tuple[float, int]]:
    """One round at ``length``: full recompute and CacheBlend at each ratio on one fresh prompt,
    all engine requests (the chunks are stored first, untimed).

    Returns:
      method -> (TTFT seconds, top-1 agreement with full recompute as 0/1).
    """
    c = config.blend
    prompt = blend_prompt(config, blender.store.prefix_tokens, length, rng, blender.engine.model.config.vocab_size)
    for chunk in prompt.chunks:  # offline precompute, untimed
        blender.store.put(chunk)
    full = blender.run(prompt, FULL_RECOMPUTE)
    out = {"blend_full": (full.ttft_s, 1)}
    for ratio in config.blend_ratios:
        sel_config = selection.SelectionConfig(
            recompute_ratio=ratio, check_layers=tuple(c.check_layers), budgets=tuple(c.budgets), row_bucket=c.row_bucket
        )
        run = blender.run(prompt, sel_config)
        out[f"blend_{ratio:g}"] = (run.ttft_s, int(np.argmax(run.logits[-1]) == np.argmax(full.logits[0])))
    return out


def plot(rows: list[dict], path: pathlib.Path) -> None:
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    cmap = {"cold": "black", "blend_full": "gray"}
    for i, method in enumerate(methods):
        mine = [r for r in rows if r["method"] == method]
        style = dict(marker="o", label=method, color=cmap.get(method, plt.cm.viridis(i / max(len(methods), 1))))
        if method.startswith("blend_"):
            style.update(linestyle="--", marker="s")
        axes[0].plot([r["length"] for r in mine], [r["ttft_ms"] for r in mine], **style)
        axes[1].plot([r["length"] for r in mine], [r["speedup_vs_cold"] for r in mine], **style)
    axes[0].set(yscale="log", xlabel="prompt tokens", ylabel="median TTFT (ms)", title="time to first token")
    axes[1].set(xlabel="prompt tokens", ylabel="cold TTFT / TTFT", title="speed-up over cold prefill")
    lengths = sorted({r["length"] for r in rows})
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xticks(lengths, [str(n) for n in lengths])
    axes[1].legend(fontsize=7, ncol=2)
    report.save_figure(fig, path)


def run(config: ml_collections.ConfigDict, workdir: pathlib.Path) -> dict:
    model: Model = load_model(config.model)
    rng = np.random.default_rng(config.seed)
    engine = Engine(
        model, KvCacheConfig(**config.kv_cache.to_dict()), SchedulerConfig(**config.scheduler.to_dict()),
        max_seq_len=max(config.lengths) + 64,
    )
    blender = None
    if config.blend_ratios:
        prefix = tuple(int(t) for t in rng.integers(3, model.config.vocab_size, config.blend.prefix_tokens))
        blender = Blender(
            ChunkStore(engine, variant="system", prefix_tokens=prefix), token_bucket=config.blend.token_bucket
        )
    samples: dict[tuple[int, str], list[tuple[float, int]]] = collections.defaultdict(list)
    for length in config.lengths:
        for round_ in tqdm(range(config.warmup + config.repeats), desc=f"ttft {length} tokens"):
            measured = engine_round(engine, config, length, rng)
            if blender is not None:
                measured |= blend_round(blender, config, length, rng)
            if round_ >= config.warmup:
                for method, value in measured.items():
                    samples[length, method].append(value)
    rows = []
    for (length, method), values in samples.items():
        ttft = float(np.median([v[0] for v in values]))
        cold = float(np.median([v[0] for v in samples[length, "cold"]]))
        row = {"length": length, "method": method, "ttft_ms": 1e3 * ttft, "speedup_vs_cold": cold / ttft}
        if method.startswith("blend_"):
            row["top1_agrees_with_full"] = float(np.mean([v[1] for v in values]))
        else:
            row["reused_tokens"] = int(np.median([v[1] for v in values]))
        rows.append(row)
    columns = ["length", "method", "ttft_ms", "speedup_vs_cold", "reused_tokens", "top1_agrees_with_full"]
    report.write_csv(workdir / "ttft.csv", rows, columns)
    plot(rows, workdir / "ttft.png")
    table = report.markdown_table(rows, columns)
    (workdir / "ttft.md").write_text(table)
    note = (
        f"{config.model} on {jax.devices()[0].device_kind} ({jax.default_backend()}), median of {config.repeats} "
        f"after {config.warmup} warm-up round(s). Engine TTFT is submit-to-first-token (scheduling included); "
        "blend TTFT is prefill call to logits on the host (chunk KV precompute excluded, loading from the device "
        "tier included). The engine pads prefill chunks to power-of-two token buckets, so hits that leave the "
        "same bucket (e.g. 10% and 30% of 256) cost the same.\n"
    )
    report.write_summary(
        workdir, "bench_ttft — time to first token", [("Setup", note), ("TTFT", table), ("Plot", "![ttft](ttft.png)\n")]
    )
    return {"rows": rows, "device": jax.devices()[0].device_kind}
