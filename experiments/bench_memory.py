"""KV-cache memory: bytes/token by attention type and KV dtype (quantized int8 / fp8 with
their scales included), tokens that fit a fixed budget, windowed layer groups, host-offload
capacity, per-group pool splits.

See ``configs/bench_memory.py`` for the four parts and the command.
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import matplotlib
import ml_collections
import numpy as np
from tqdm import tqdm

from experiments import report
from kvjax.cache import NULL_PAGE, QUANTIZED_DTYPES, CacheLayout, PagePool, init_pool
from kvjax.config import KvCacheConfig, SchedulerConfig
from kvjax.engine import Engine
from kvjax.model.registry import Model, load_model
from kvjax.sampling import SamplingParams

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ATTENTION_KIND = {1: "MQA"}
DTYPE_SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int8": "i8", "fp8": "fp8"}


def pool_nbytes(pool: PagePool) -> int:
    """Bytes of every allocated K and V page array."""
    return sum(int(a.nbytes) for a in jax.tree.leaves(pool))


def storage_variants(dtypes: tuple[str, ...], granularities: tuple[str, ...]) -> list[tuple[str, str]]:
    """(dtype, scale granularity) pairs: each quantized dtype with every granularity, the float dtypes once."""
    return [(d, g) for d in dtypes for g in (granularities if d in QUANTIZED_DTYPES else ("-",))]


def attention_rows(config: ml_collections.ConfigDict, model: Model) -> list[dict]:
    """bytes/token of each (KV heads, dtype, scale granularity): the layout's formula (scales
    included) checked against an allocated pool, and the tokens that fit ``budget_bytes``."""
    cfg, c = model.config, config.attention
    rows = []
    for kv_heads in c.kv_heads:
        if cfg.num_heads % kv_heads:
            raise ValueError(f"attention.kv_heads entry {kv_heads} must divide num_heads={cfg.num_heads}")
        kind = "MHA" if kv_heads == cfg.num_heads else ATTENTION_KIND.get(kv_heads, "GQA")
        for dtype, granularity in storage_variants(c.dtypes, c.scale_granularities):
            layout = CacheLayout(
                layer_windows=(cfg.max_seq_len,) * cfg.num_layers,
                num_pages=(c.num_pages,),
                tokens_per_block=c.tokens_per_block,
                num_kv_heads=kv_heads,
                head_dim=cfg.head_dim,
                max_seq_len=cfg.max_seq_len,
                dtype=dtype,
                scale_granularity="token" if granularity == "-" else granularity,
            )
            allocated = pool_nbytes(init_pool(layout))
            if allocated != layout.pool_bytes():
                raise RuntimeError(
                    f"{dtype}/{granularity}: allocated pool {allocated} B != layout.pool_bytes() {layout.pool_bytes()} "
                    f"B"
                )
            page_bytes = layout.bytes_per_page(0)
            rows.append(
                {
                    "attention": kind,
                    "kv_heads": kv_heads,
                    "dtype": dtype,
                    "scales": granularity,
                    "layers": cfg.num_layers,
                    "head_dim": cfg.head_dim,
                    "bytes_per_token": layout.bytes_per_token,
                    "allocated_bytes_per_slot": allocated / (c.num_pages * c.tokens_per_block),
                    "tokens_in_budget": c.budget_bytes // page_bytes * c.tokens_per_block,
                    "vs_float32": round(_float32_bytes(cfg, kv_heads) / (page_bytes / c.tokens_per_block), 3),
                }
            )
    return rows


def _float32_bytes(cfg, kv_heads: int) -> int:
    return 2 * cfg.num_layers * kv_heads * cfg.head_dim * 4


def window_rows(config: ml_collections.ConfigDict, model: Model, rng: np.random.Generator) -> list[dict]:
    """Bytes held per layer group by one running request of each length (real engine)."""
    c = config.windows
    longest = max(c.lengths)
    windows = tuple(c.smollm2_window) if model.config.name.startswith("smollm2") else None
    kv = KvCacheConfig(tokens_per_block=c.tokens_per_block, max_tokens=2 * (longest + 64), max_attention_window=windows)
    scheduler = SchedulerConfig(prefill_chunk_size=c.prefill_chunk_size, max_num_tokens=c.prefill_chunk_size)
    engine = Engine(model, kv, scheduler, max_seq_len=longest + 64)
    layout = engine.layout
    if pool_nbytes(engine.pool) != layout.pool_bytes():
        raise RuntimeError(
            f"allocated pool {pool_nbytes(engine.pool)} B != layout.pool_bytes() {layout.pool_bytes()} B"
        )
    rows = []
    for length in tqdm(c.lengths, desc=f"windows {model.config.name}"):
        prompt = rng.integers(3, model.config.vocab_size, length).tolist()
        rid = engine.submit(prompt, SamplingParams(max_new_tokens=2, ignore_eos=True))
        while engine.requests[rid].first_token_time is None:
            engine.step()
        for g in range(layout.num_groups):
            held = sum(p != NULL_PAGE for p in engine.manager.block_table(rid, g))
            full = layout.pages_for(engine.manager.num_tokens(rid))
            window = layout.group_windows[g]
            rows.append({
                "model": model.config.name, "tokens": length, "group": g,
                "window": "full" if window >= layout.max_seq_len else window, "layers": layout.group_layers[g],
                "pages_held": held, "bytes_held": held * layout.bytes_per_page(g),
                "bytes_if_full": full * layout.bytes_per_page(g),
            })
        engine.run()
    return rows


def offload_rows(config: ml_collections.ConfigDict, model: Model, rng: np.random.Generator) -> list[dict]:
    """Distinct prompts reusable after filling the cache, for each host-cache size."""
    c = config.offload
    prompts = [rng.integers(3, model.config.vocab_size, c.prompt_tokens).tolist() for _ in range(c.num_prompts)]
    sampling = SamplingParams(max_new_tokens=1, ignore_eos=True)
    cfg = model.config
    device_bytes = (
        c.device_tokens * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * model.params.embed.dtype.itemsize
    )
    rows = []
    for multiple in c.host_multiples:
        kv = KvCacheConfig(
            tokens_per_block=c.tokens_per_block,
            max_tokens=c.device_tokens,
            host_cache_size=int(multiple * device_bytes),
        )
        engine = Engine(model, kv, max_seq_len=2 * c.prompt_tokens)
        if engine.cache_size.cache_bytes != device_bytes:
            raise RuntimeError(f"engine cache {engine.cache_size.cache_bytes} B != {device_bytes} B expected")
        for prompt in tqdm(prompts, desc=f"offload host={multiple}x"):
            engine.generate([prompt], sampling)
        estimates = [engine.manager.estimate_reusable_tokens(p) for p in prompts]
        reusable = [i for i, e in enumerate(estimates) if e > 0]
        stats = dataclasses.replace(engine.manager.stats)
        check = {}
        if reusable:
            [out] = engine.generate([prompts[reusable[0]]], sampling)
            check = {
                "oldest_reusable": reusable[0], "rerun_reused_tokens": out.num_reused_tokens,
                "rerun_estimate": estimates[reusable[0]],
                "rerun_onboarded_pages": engine.manager.stats.onboarded_pages - stats.onboarded_pages,
            }
        rows.append({
            "host_multiple": multiple, "host_bytes": kv.host_cache_size, "device_bytes": device_bytes,
            "reusable_prompts": len(reusable), "reusable_tokens": int(sum(estimates)),
            "device_evictions": stats.device_evictions, "host_evictions": stats.host_evictions,
            "offloaded_bytes": stats.offloaded_bytes, **check,
        })
    return rows


def pool_rows(config: ml_collections.ConfigDict, model: Model) -> list[dict]:
    """Pages, bytes and tokens per layer group of one device budget under each per-group pool
    setting, for the model and for a hybrid of its geometry (layers cycled recurrent,
    recurrent, attention; the recurrent layers still hold KV pages in this split)."""
    pools = config.pools
    hybrid = dataclasses.replace(model.config, layer_types=("recurrent", "recurrent", "attention"))
    settings = [("equal pages", {})] + [(f"avg_seq_len={n}", {"avg_seq_len": n}) for n in pools.avg_seq_lens]
    settings += [(f"pool_ratio={list(r)}", {"pool_ratio": tuple(r)}) for r in pools.ratios]
    rows = []
    for name, cfg in ((model.config.name, model.config), (f"{model.config.name} as hybrid", hybrid)):
        for setting, fields in settings if cfg is model.config else [("none (fallback)", {})]:
            kv = KvCacheConfig(tokens_per_block=32, max_tokens=pools.max_tokens, free_memory_bytes=1 << 34, **fields)
            layout, _ = CacheLayout.for_model(
                kv,
                model_windows=cfg.layer_windows,
                num_kv_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim,
                max_seq_len=pools.max_seq_len,
                model_dtype="float32",
                hybrid=bool(cfg.recurrent_layers),
            )
            total = sum((p - 1) * layout.bytes_per_page(g) for g, p in enumerate(layout.num_pages))
            for g, pages in enumerate(layout.num_pages):
                rows.append(
                    {
                        "model": name,
                        "setting": setting,
                        "group": g,
                        "window": layout.group_windows[g],
                        "layers": layout.group_layers[g],
                        "pages": pages - 1,
                        "tokens": (pages - 1) * layout.tokens_per_block,
                        "mib": (pages - 1) * layout.bytes_per_page(g) / 2**20,
                        "share": (pages - 1) * layout.bytes_per_page(g) / total,
                    }
                )
    return rows


def plot(attention: list[dict], windows: list[dict], offload: list[dict], path: pathlib.Path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    labels = [
        f"{r['attention']}\n{DTYPE_SHORT.get(r['dtype'], r['dtype'])}"
        f"{'' if r['scales'] == '-' else '/' + r['scales'][0]}"
        for r in attention
    ]
    ax.bar(range(len(attention)), [r["bytes_per_token"] / 1024 for r in attention])
    ax.set_xticks(range(len(attention)), labels, fontsize=6)
    ax.set(ylabel="KiB / token", title="KV bytes per token (all layers)")
    ax = axes[1]
    for (model, group), rows in _by(windows, ("model", "group")).items():
        ax.plot([r["tokens"] for r in rows], [r["bytes_held"] / 2**20 for r in rows], marker="o",
                label=f"{model} g{group} (window {rows[0]['window']}, {rows[0]['layers']} layers)")
        if rows[0]["window"] != "full":
            ax.plot(
                [r["tokens"] for r in rows], [r["bytes_if_full"] / 2**20 for r in rows], linestyle=":", color="gray"
            )
    ax.set(xlabel="tokens in the request", ylabel="MiB held", title="pages held per layer group (dotted: unwindowed)")
    ax.legend(fontsize=7)
    ax = axes[2]
    ax.plot([r["host_multiple"] for r in offload], [r["reusable_prompts"] for r in offload], marker="o")
    ax.set(
        xlabel="host cache (x device cache bytes)",
        ylabel="distinct prompts reusable",
        title="capacity with host offload",
    )
    report.save_figure(fig, path)


def _by(rows: list[dict], keys: tuple[str, ...]) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return out


def run(config: ml_collections.ConfigDict, workdir: pathlib.Path) -> dict:
    rng = np.random.default_rng(config.seed)
    models = {
        name: load_model(name)
        for name in {config.attention.model, config.offload.model, config.pools.model, *config.windows.models}
    }
    attention = attention_rows(config, models[config.attention.model])
    windows = [r for name in config.windows.models for r in window_rows(config, models[name], rng)]
    offload = offload_rows(config, models[config.offload.model], rng)
    pools = pool_rows(config, models[config.pools.model])
    for name, rows in (("attention", attention), ("windows", windows), ("offload", offload), ("pools", pools)):
        report.write_csv(workdir / f"{name}.csv", rows)
    plot(attention, windows, offload, workdir / "memory.png")
    sections = [
        (f"KV bytes per token (layout formula vs allocated pool, scales included) and tokens in "
         f"{config.attention.budget_bytes:,} bytes", report.markdown_table(attention)),
        ("Pages held per layer group by one running request", report.markdown_table(windows)),
        ("Distinct prompts reusable after the fill", report.markdown_table(offload)),
        (f"Per-group pools: one {config.pools.max_tokens:,}-token budget split between the layer groups",
         report.markdown_table(pools)),
        ("Plot", "![memory](memory.png)\n"),
    ]
    report.write_summary(workdir, "bench_memory — KV-cache memory", sections)
    (workdir / "memory.md").write_text("".join(f"## {h}\n\n{b}\n" for h, b in sections))
    return {
        "attention": attention,
        "windows": windows,
        "offload": offload,
        "pools": pools,
        "device": jax.devices()[0].device_kind,
    }
