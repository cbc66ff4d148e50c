"""Orbax snapshots of the whole cache state of an engine (SPEC E4).

A snapshot holds the device page pools, the host tier's pools, the manager's host state
(radix tree, ref counts, priorities and expiries, free queues, host map, events, stats), the
cache configuration and layout, the model name and a format version, plus a BLAKE3 checksum
over every array. Snapshots are steps of an ``orbax.checkpoint.CheckpointManager``: orbax
writes a step into a temporary folder and renames it only when complete, so an interrupted
save leaves the previous snapshot as the latest usable one.

Restoring checks, before anything changes, that the snapshot fits the engine (format
version, model, cache config, layout) and that the arrays hash to the stored checksum; a
mismatch raises ``SnapshotError`` naming what differs.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import blake3
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from kvjax.cache import PagePool
from kvjax.engine import Engine
from kvjax.manager import KVCacheManager, SnapshotError

FORMAT_VERSION = 1


def _arrays(engine: Engine) -> dict[str, np.ndarray]:
    arrays = {}
    for i, (k, v) in enumerate(zip(engine.pool.k, engine.pool.v)):
        arrays[f"device_k_{i:03d}"] = np.asarray(k)
        arrays[f"device_v_{i:03d}"] = np.asarray(v)
    for g, host in enumerate(engine.host_pools):
        arrays[f"host_{g:03d}"] = host
    return arrays


def _checksum(arrays: dict[str, np.ndarray]) -> str:
    h = blake3.blake3()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}:{a.dtype.str}:{a.shape}".encode())
        h.update(memoryview(a).cast("B"))
    return h.hexdigest()


def _identity(engine: Engine) -> dict[str, Any]:
    """What must match between a snapshot and the engine restoring it."""
    kv = dataclasses.asdict(engine.kv_config)
    if kv["max_attention_window"] is not None:
        kv["max_attention_window"] = list(kv["max_attention_window"])
    layout = dataclasses.asdict(engine.layout)
    return {
        "model": engine.model.config.name,
        "kv_cache_config": kv,
        "layout": {k: list(v) if isinstance(v, tuple) else v for k, v in layout.items()},
        "num_host_pages": engine.manager.num_host_pages,
    }


def _manager(directory: str | pathlib.Path) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(pathlib.Path(directory).absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=3))


def save_snapshot(engine: Engine, directory: str | pathlib.Path, step: int | None = None) -> int:
    """Saves the engine's cache state as a new step under ``directory``; returns the step.

    The engine must be idle (no queued or running request): a snapshot is of reusable
    cache contents, not of in-flight requests.
    """
    if engine.has_work:
        raise ValueError("save_snapshot needs an idle engine: finish or drop queued/running requests first")
    arrays = _arrays(engine)
    meta = {
        "format_version": FORMAT_VERSION,
        **_identity(engine),
        "checksum": _checksum(arrays),
        "manager_state": engine.manager.state_dict(),
    }
    with _manager(directory) as mgr:
        step = step if step is not None else (mgr.latest_step() or 0) + 1
        mgr.save(step, args=ocp.args.Composite(arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)))
        mgr.wait_until_finished()
    return step


def _diff(saved: Any, current: Any, path: str = "") -> list[str]:
    if isinstance(saved, dict) and isinstance(current, dict):
        out = []
        for key in sorted(set(saved) | set(current)):
            out += _diff(saved.get(key), current.get(key), f"{path}.{key}" if path else key)
        return out
    return [] if saved == current else [f"{path}: snapshot has {saved!r}, engine has {current!r}"]


def restore_snapshot(engine: Engine, directory: str | pathlib.Path, step: int | None = None) -> int:
    """Loads a snapshot (the latest complete step by default) into an idle engine; returns the step.

    Raises:
      SnapshotError: no snapshot, a different format version / model / config / layout,
        or arrays that do not match their checksum. The engine is unchanged then.
    """
    if engine.has_work:
        raise ValueError("restore_snapshot needs an idle engine: finish or drop queued/running requests first")
    with _manager(directory) as mgr:
        step = step if step is not None else mgr.latest_step()
        if step is None:
            raise SnapshotError(f"no complete snapshot under {str(directory)!r}")
        try:
            meta = mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except (FileNotFoundError, ValueError, KeyError, json.JSONDecodeError) as err:
            raise SnapshotError(f"snapshot step {step} under {str(directory)!r} is unreadable: {err}") from err
        if meta.get("format_version") != FORMAT_VERSION:
            raise SnapshotError(f"snapshot format_version={meta.get('format_version')!r}; this kvjax reads {FORMAT_VERSION}")
        differences = _diff({k: meta.get(k) for k in _identity(engine)}, _identity(engine))
        if differences:
            raise SnapshotError("snapshot does not fit this engine: " + "; ".join(differences))
        template = _arrays(engine)
        try:
            arrays = mgr.restore(step, args=ocp.args.Composite(arrays=ocp.args.StandardRestore(template)))["arrays"]
        except Exception as err:  # orbax/tensorstore raise many types for damaged files
            raise SnapshotError(f"snapshot step {step} arrays are damaged or missing: {err}") from err
    arrays = {k: np.asarray(v) for k, v in arrays.items()}
    if _checksum(arrays) != meta["checksum"]:
        raise SnapshotError(f"snapshot step {step} is damaged: its arrays do not match the stored BLAKE3 checksum")
    manager = KVCacheManager.from_state_dict(
        meta["manager_state"], engine.kv_config,
        layer_windows=engine.manager.layer_windows, num_device_pages=engine.manager.num_device_pages,
        num_host_pages=engine.manager.num_host_pages, max_seq_len=engine.manager.max_seq_len,
        bytes_per_page=engine.manager.bytes_per_page,
    )
    num_layers = engine.layout.num_layers
    engine.pool = PagePool(
        k=tuple(jnp.asarray(arrays[f"device_k_{i:03d}"]) for i in range(num_layers)),
        v=tuple(jnp.asarray(arrays[f"device_v_{i:03d}"]) for i in range(num_layers)),
    )
    engine.host_pools = [arrays[f"host_{g:03d}"].copy() for g in range(len(engine.host_pools))]
    engine.set_manager(manager)
    return step
