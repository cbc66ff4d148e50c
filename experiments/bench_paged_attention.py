"""Paged vs contiguous decode attention: tokens/s and achieved bandwidth on the backend at hand.

Both paths read every cached key and value once per decode step, so the figure of merit
is ``KV bytes / time`` against the device's copy bandwidth (``2 * bytes / time`` of a
read-modify-write over an array of the same size). Writes ``results.json``, ``summary.md``
and ``bandwidth.png`` into the workdir. Configured by ``configs/bench_paged_attention.py``.
"""

from __future__ import annotations

import json
import pathlib
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
from einops import rearrange

from experiments.report import save_figure
from experiments.timing import median_seconds
from kvjax import attention

if TYPE_CHECKING:
    import ml_collections

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def contiguous_decode(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, sm_scale: float) -> jax.Array:
    """GQA decode over contiguous caches.

    Args:
      q: [num_seqs, num_heads, head_dim].
      k, v: [num_seqs, kv_len, num_kv_heads, head_dim].
      lengths: [num_seqs] int32.

    Returns:
      [num_seqs, num_heads, head_dim].
    """
    qg = rearrange(q, "s (h g) d -> s h g d", h=k.shape[2])
    logits = jnp.einsum("shgd,skhd->shgk", qg, k, preferred_element_type=jnp.float32) * sm_scale
    visible = jnp.arange(k.shape[1])[None, None, None, :] < lengths[:, None, None, None]
    probs = jax.nn.softmax(jnp.where(visible, logits, -jnp.inf), axis=-1)
    out = jnp.einsum("shgk,skhd->shgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return rearrange(out, "s h g d -> s (h g) d").astype(q.dtype)


def measure(config: ml_collections.ConfigDict, context_len: int) -> dict:
    """One operating point: paged, contiguous and copy timings at ``context_len``."""
    dtype = jnp.dtype(config.dtype)
    rng = np.random.default_rng(config.seed)
    pages_per_seq = -(-context_len // config.tokens_per_block)
    num_pages = 1 + config.num_seqs * pages_per_seq
    kv_shape = (config.num_seqs, pages_per_seq * config.tokens_per_block, config.num_kv_heads, config.head_dim)
    k = jnp.asarray(rng.standard_normal(kv_shape), dtype)
    v = jnp.asarray(rng.standard_normal(kv_shape), dtype)
    q = jnp.asarray(rng.standard_normal((config.num_seqs, config.num_heads, config.head_dim)), dtype)
    lengths = jnp.full((config.num_seqs,), context_len, jnp.int32)
    # Scatter each sequence's pages to a random permutation of the pool (page 0 stays spare).
    table = rng.permutation(np.arange(1, num_pages)).reshape(config.num_seqs, pages_per_seq).astype(np.int32)
    to_pages = lambda x: rearrange(x, "s (p t) h d -> (s p) t h d", t=config.tokens_per_block)
    order = np.argsort(table.reshape(-1))
    pool_of = lambda x: jnp.concatenate([jnp.zeros_like(to_pages(x)[:1]), to_pages(x)[order]])
    k_pages, v_pages, table = pool_of(k), pool_of(v), jnp.asarray(table)
    sm_scale = config.head_dim**-0.5

    paged = jax.jit(
        lambda q, kp, vp, n, t: attention.paged_attention(
            q, attention.PagedKV(kp, vp, n, t), attention.AttentionSpec(sm_scale), impl=config.impl
        )
    )
    contiguous = jax.jit(lambda q, k, v, n: contiguous_decode(q, k, v, n, sm_scale))
    copy = jax.jit(lambda x: x + jnp.ones((), x.dtype))
    max_abs_diff = float(jnp.max(jnp.abs(
        paged(q, k_pages, v_pages, lengths, table).astype(jnp.float32)
        - contiguous(q, k, v, lengths).astype(jnp.float32)
    )))
    kv_bytes = 2 * config.num_seqs * context_len * config.num_kv_heads * config.head_dim * dtype.itemsize
    paged_s = median_seconds(lambda: paged(q, k_pages, v_pages, lengths, table), config.warmup, config.iters)
    contiguous_s = median_seconds(lambda: contiguous(q, k, v, lengths), config.warmup, config.iters)
    copy_s = median_seconds(lambda: copy(k), config.warmup, config.iters)
    copy_bandwidth = 2 * k.size * dtype.itemsize / copy_s
    return {
        "context_len": context_len,
        "kv_bytes": kv_bytes,
        "max_abs_diff": max_abs_diff,
        "copy_bytes_per_s": copy_bandwidth,
        **{
            f"{name}_{key}": value
            for name, seconds in (("paged", paged_s), ("contiguous", contiguous_s))
            for key, value in (
                ("s", seconds),
                ("tokens_per_s", config.num_seqs / seconds),
                ("bytes_per_s", kv_bytes / seconds),
                ("fraction_of_copy", kv_bytes / seconds / copy_bandwidth),
            )
        },
    }


def write_summary(rows: list[dict], config: ml_collections.ConfigDict, path: pathlib.Path) -> None:
    """A markdown table, one line per (context length, layout)."""
    lines = [
        f"# Decode attention on {jax.default_backend()} ({jax.devices()[0].device_kind}), "
        f"impl={config.impl}, {config.dtype}",
        "",
        f"batch {config.num_seqs}, heads {config.num_heads}/{config.num_kv_heads} KV, head_dim {config.head_dim}, "
        f"tokens_per_block {config.tokens_per_block}",
        "",
        "| context | layout | ms | tokens/s | GB/s | of copy BW | copy GB/s |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        for name in ("paged", "contiguous"):
            lines.append(
                f"| {row['context_len']} | {name} | {row[f'{name}_s'] * 1e3:.3f} | {row[f'{name}_tokens_per_s']:.0f} "
                f"| {row[f'{name}_bytes_per_s'] / 1e9:.2f} | {row[f'{name}_fraction_of_copy']:.2f} "
                f"| {row['copy_bytes_per_s'] / 1e9:.2f} |"
            )
    path.write_text("\n".join(lines) + "\n")


def plot(rows: list[dict], path: pathlib.Path) -> None:
    """Achieved GB/s of both layouts and the copy bandwidth against context length."""
    contexts = [row["context_len"] for row in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in ("paged", "contiguous"):
        ax.plot(contexts, [row[f"{name}_bytes_per_s"] / 1e9 for row in rows], marker="o", label=name)
    ax.plot(contexts, [row["copy_bytes_per_s"] / 1e9 for row in rows], linestyle="--", label="copy")
    ax.set(xscale="log", xlabel="context length (tokens)", ylabel="GB/s", title="decode attention bandwidth")
    ax.legend()
    save_figure(fig, path)


def run(config: ml_collections.ConfigDict, workdir: pathlib.Path) -> dict:
    """Runs every context length in the config; returns and writes the results."""
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    rows = [measure(config, context_len) for context_len in config.context_lens]
    results = {
        "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
        "config": config.to_dict(),
        "rows": rows,
    }
    (workdir / "results.json").write_text(json.dumps(results, indent=2))
    write_summary(rows, config, workdir / "summary.md")
    plot(rows, workdir / "bandwidth.png")
    return results
