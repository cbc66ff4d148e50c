"""Layer-wise pipelined blended prefill: load layer l+1's KV while layer l recomputes (SPEC C7).

A loader thread reads each layer's stored KV of the prompt's chunks from the host or disk
tier (one layer of every chunk; disk files are memory-mapped so a layer is read alone),
assembles it and transfers it to the device, up to ``depth`` layers ahead. The main thread
runs one jitted ``fusor.blend_layer`` per layer as soon as its KV has arrived. The same
prefill run with loading and compute in sequence gives the baseline; the overlap is the share
of the shorter activity hidden under the longer one::

    overlap = (load_total + compute_total - pipelined_wall) / min(load_total, compute_total)

Shapes: L = layers, T = padded prompt tokens, K = kv heads, d = head_dim.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.blend.blender import Blender, BlendPrompt
from kvjax.blend.fusor import BlendInputs, initial_rows_jit, last_logits_jit, layer_step, representative_layer
from kvjax.blend.selection import Selection
from kvjax.cache.pool import PagePool


@dataclasses.dataclass(frozen=True)
class PipelineReport:
    """Timings of one pipelined prefill (seconds).

    Attributes:
      wall: pipelined prefill, first load to logits.
      sequential_wall: the same prefill with all loads before the compute.
      load_total, compute_total: summed per-layer load and compute times (pipelined run).
      stall_total: time the compute waited for a layer's KV.
      overlap: share of min(load_total, compute_total) hidden, in [0, 1].
    """

    wall: float
    sequential_wall: float
    load_total: float
    compute_total: float
    stall_total: float
    overlap: float


def _layer_kv(blender: Blender, prompt: BlendPrompt, layer: int, padded: int) -> tuple[jax.Array, jax.Array]:
    """Reads one layer's reused KV of the prompt from the store and moves it to the device: [T, K, d] each."""
    shape = (padded, blender.cfg.num_kv_heads, blender.cfg.head_dim)
    k, v = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
    if blender.prefix_kv is not None:
        n = len(blender.prefix)
        k[:n], v[:n] = np.asarray(blender.prefix_kv[0][layer]), np.asarray(blender.prefix_kv[1][layer])
    for chunk, start in zip(prompt.chunks, prompt.chunk_starts):
        ck, cv = blender.store.read_host(blender.store.get(chunk), layer)
        k[start : start + len(chunk)], v[start : start + len(chunk)] = ck, cv
    return jax.device_put(k), jax.device_put(v)


def _inputs(blender: Blender, prompt: BlendPrompt, selection: Selection, padded: int) -> BlendInputs:
    roles = prompt.roles
    tok, pos = blender.padded_span(prompt.tokens, 0, padded)
    selectable, forced = roles.masks(padded)
    empty = jnp.zeros((blender.cfg.num_layers, 0, blender.cfg.num_kv_heads, blender.cfg.head_dim))
    return jax.device_put(BlendInputs(
        tokens=tok, positions=pos, reused_k=empty, reused_v=empty, deltas=blender.deltas(prompt, padded),
        selectable=selectable, forced=forced, rows=selection.rows, rows_valid=selection.rows_valid,
        counts=selection.counts, block_table=blender.table[None], length=np.asarray([roles.num_tokens], np.int32),
        probes=np.zeros(0, np.int32), num_cached=np.int32(0),
    ))


def _compute(blender: Blender, inputs: BlendInputs, selection: Selection, get_layer, timings: dict) -> jax.Array:
    """Runs all layers, taking each layer's KV from ``get_layer(l)``; returns logits [V]."""
    cfg, layout = blender.cfg, blender.layout
    checks = {layer: (i, cap) for i, (layer, cap) in enumerate(selection.checks)}
    rows = initial_rows_jit(blender.params, cfg=cfg, inputs=inputs)
    pool_k, pool_v = list(blender.pool.k), list(blender.pool.v)
    try:
        for layer, lp in enumerate(blender.params.layers):
            t = time.perf_counter()
            k_l, v_l = get_layer(layer)
            timings["stall"] += time.perf_counter() - t
            i, capacity = checks.get(layer, (0, 0))
            t = time.perf_counter()
            rows, pool_k[layer], pool_v[layer], _ = layer_step(
                lp, pool_k[layer], pool_v[layer], rows, k_l, v_l, inputs, inputs.counts[i] if capacity else jnp.int32(0),
                cfg=cfg, layout=layout, layer=representative_layer(cfg, layout, layer), capacity=capacity,
                deviation=selection.deviation, num_probes=0, attn_impl=blender.attn_impl,
            )
            rows.x.block_until_ready()
            timings["compute"] += time.perf_counter() - t
    finally:  # also after a failed load: done layers hold their new buffers (the old ones were donated)
        blender.pool = PagePool(k=tuple(pool_k), v=tuple(pool_v))
    return last_logits_jit(blender.params, cfg=cfg, rows=rows, positions=inputs.positions)


def pipelined_blend(blender: Blender, prompt: BlendPrompt, selection: Selection, depth: int = 2) -> tuple[jax.Array, PipelineReport]:
    """Blended prefill with per-layer loading overlapped with per-layer recompute.

    The store's tier must be "host" or "disk". Returns (logits [V], timings); the pool ends
    holding the fused KV, exactly as after ``Blender.blend`` with the same selection. An error
    while loading a layer (e.g. ``ChunkIntegrityError``) is raised here, in the caller's thread.
    """
    if blender.store.tier not in ("host", "disk"):
        raise ValueError(f"store tier={blender.store.tier!r}; the pipeline loads from 'host' or 'disk'")
    blender.check_prompt(prompt)
    padded = blender.padded(prompt.roles.num_tokens)
    inputs = _inputs(blender, prompt, selection, padded)
    num_layers = blender.cfg.num_layers

    # Sequential baseline: every load first, then every layer.
    t0 = time.perf_counter()
    loaded = [_layer_kv(blender, prompt, layer, padded) for layer in range(num_layers)]
    jax.block_until_ready(loaded)
    seq_timings = {"stall": 0.0, "compute": 0.0}
    _compute(blender, inputs, selection, lambda layer: loaded[layer], seq_timings).block_until_ready()
    sequential_wall = time.perf_counter() - t0
    del loaded

    # Pipelined: a loader thread runs up to ``depth`` layers ahead.
    ready: queue.Queue = queue.Queue(maxsize=depth)
    load_times: list[float] = []

    def loader() -> None:
        try:
            for layer in range(num_layers):
                t = time.perf_counter()
                kv = jax.block_until_ready(_layer_kv(blender, prompt, layer, padded))
                load_times.append(time.perf_counter() - t)
                ready.put(kv)
        except Exception as err:  # handed to the compute thread, which raises it
            ready.put(err)

    def next_layer(layer: int) -> tuple[jax.Array, jax.Array]:
        item = ready.get()
        if isinstance(item, Exception):
            raise item
        return item

    timings = {"stall": 0.0, "compute": 0.0}
    t0 = time.perf_counter()
    thread = threading.Thread(target=loader, daemon=True)
    thread.start()
    logits = _compute(blender, inputs, selection, next_layer, timings)
    logits.block_until_ready()
    wall = time.perf_counter() - t0
    thread.join()
    load_total = float(sum(load_times))
    hidden = load_total + timings["compute"] - wall
    overlap = hidden / max(min(load_total, timings["compute"]), 1e-9)
    return logits, PipelineReport(
        wall=wall, sequential_wall=sequential_wall, load_total=load_total, compute_total=timings["compute"],
        stall_total=timings["stall"], overlap=float(np.clip(overlap, 0.0, 1.0)),
    )
