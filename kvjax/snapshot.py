"""Orbax snapshots of the whole cache state of an engine.

A snapshot step holds the arrays (device page pools, the host tier's pools, a hybrid model's
recurrent state pool) and one JSON metadata file: ``{"document": ..., "blake3": ...}``. The
document holds the manager's host state (radix tree, ref counts, priorities and expiries, free
queues, host map, events, stats), a hybrid model's recurrent-state snapshot index,
the cache configuration and layout, the model's identity (its name and the BLAKE3 digest of
its weights, ``Model.weights_digest``), the format version and a BLAKE3 digest of the arrays
(names, dtypes, shapes, bytes); ``blake3`` is the digest of the document's canonical JSON
bytes (sorted keys, no whitespace), so one verified digest covers everything that is restored.

Snapshots are steps of an ``orbax.checkpoint.CheckpointManager`` that keeps the 3 highest
steps: orbax writes a step into a temporary folder and renames it only when complete, so an
interrupted save leaves the previous snapshot as the latest usable one. Saving never drops
data silently: an existing step, or one below the latest, is refused; ``overwrite=True``
replaces an existing step by writing the new one under ``<directory>/.kvjax-staging`` and
swapping it in with two renames. A crash between the renames is repaired by the next save or
restore under that directory (the old step is put back), so either the old or the new
snapshot survives.

Restoring verifies before anything changes: the metadata digest, the format version, that the
snapshot fits the engine (model weights digest, cache config, layout), the arrays' digest and
the manager state's invariants. Any failure, including an unreadable or undecodable file,
raises ``SnapshotError`` naming the step and the file or the difference; the engine is
unchanged then.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import shutil
from collections.abc import Iterator
from typing import Any

import blake3
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from kvjax.cache import PagePool, QuantizedPages
from kvjax.engine import Engine
from kvjax.heap import release_free_heap
from kvjax.manager import KVCacheManager, SnapshotError, TieredCacheManager, require_tiered
from kvjax.manager.state_snapshots import StateSnapshotIndex

FORMAT_VERSION = 2
MAX_TO_KEEP = 3
"""Steps kept under one directory (orbax deletes the lowest ones beyond this)."""

_STAGING = ".kvjax-staging"
_REPLACED = ".kvjax-replaced-"


def _arrays(engine: Engine) -> dict[str, np.ndarray]:
    """Every array a snapshot holds: ``device_{k,v}_<layer>`` [num_pages, tokens_per_block, K, d]
    and ``host_<group>`` / ``disk_<group>`` (the host and disk tiers' pages of each layer
    group), as stored: a quantized cache's int8 / float8_e4m3fn values under those names and
    their scales beside them as ``device_{k,v}_scales_<layer>``, ``host_scales_<group>`` and
    ``disk_scales_<group>``."""
    arrays: dict[str, np.ndarray] = {}
    for i, (k, v) in enumerate(zip(engine.pool.k, engine.pool.v)):
        arrays |= _named(f"device_k_{i:03d}", f"device_k_scales_{i:03d}", k)
        arrays |= _named(f"device_v_{i:03d}", f"device_v_scales_{i:03d}", v)
    for tier, g, pages in engine.host_pool.pools():
        arrays |= _named(f"{tier}_{g:03d}", f"{tier}_scales_{g:03d}", pages)
    if engine.recurrent is not None:
        arrays["state_pool"] = np.asarray(engine.recurrent.pool)
    return arrays


def _named(values_name: str, scales_name: str, pages: Any) -> dict[str, np.ndarray]:
    if isinstance(pages, QuantizedPages):
        return {values_name: np.asarray(pages.values), scales_name: np.asarray(pages.scales)}
    return {values_name: np.asarray(pages)}


def _pages(arrays: dict[str, np.ndarray], values_name: str, scales_name: str, convert: Any) -> Any:
    """Inverse of ``_named``: the arrays (converted by ``convert``) as stored pages."""
    if scales_name in arrays:
        return QuantizedPages(values=convert(arrays[values_name]), scales=convert(arrays[scales_name]))
    return convert(arrays[values_name])


def _arrays_digest(arrays: dict[str, np.ndarray]) -> str:
    """BLAKE3 hex digest of the arrays' names, dtypes, shapes and bytes (bfloat16 included)."""
    h = blake3.blake3()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"|{name}:{a.dtype.str}:{a.dtype.name}:{a.shape}|".encode())
        h.update(a.reshape(-1).view(np.uint8).data)
    return h.hexdigest()


def _document_digest(document: dict[str, Any]) -> str:
    """BLAKE3 hex digest of the document's canonical JSON bytes."""
    return blake3.blake3(json.dumps(document, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _identity(engine: Engine) -> dict[str, Any]:
    """What must match between a snapshot and the engine restoring it."""
    kv = engine.kv_config.content_fields()
    layout = dataclasses.asdict(engine.layout)
    num_pages = {name: layout.pop(name) for name in ("num_host_pages", "num_disk_pages")}
    return {
        "model": {"name": engine.model.config.name, "weights_digest": engine.model.weights_digest},
        "kv_cache_config": kv,
        "layout": {k: list(v) if isinstance(v, tuple) else v for k, v in layout.items()},
        **num_pages,
    }


def _manager(directory: pathlib.Path, create: bool = True) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=MAX_TO_KEEP, create=create)
    return ocp.CheckpointManager(directory, options=options)


def _check_step(step: int | None) -> None:
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"step={step!r} must be None or an int >= 0")


def _root(directory: str | os.PathLike) -> pathlib.Path:
    root = pathlib.Path(directory).absolute()
    if root.exists() and not root.is_dir():
        raise SnapshotError(f"snapshot directory {str(root)!r} is not a directory")
    return root


def _recover(root: pathlib.Path) -> None:
    """Finishes or undoes an overwrite that a crash interrupted (see ``save_snapshot``)."""
    if not root.is_dir():
        return
    for replaced in root.glob(_REPLACED + "*"):
        step_dir = root / replaced.name.removeprefix(_REPLACED)
        if step_dir.exists():  # the new step was swapped in: drop the old one
            shutil.rmtree(replaced)
        else:  # crashed between the two renames: put the old step back
            os.rename(replaced, step_dir)
    shutil.rmtree(root / _STAGING, ignore_errors=True)


@contextlib.contextmanager
def _reading(what: str) -> Iterator[None]:
    """Turns any failure while reading ``what`` into a SnapshotError naming it."""
    try:
        yield
    except SnapshotError:
        raise
    except Exception as err:  # orbax, tensorstore and json raise many types for damaged files
        raise SnapshotError(f"{what} is unreadable or damaged: {type(err).__name__}: {err}") from err


def save_snapshot(
    engine: Engine, directory: str | os.PathLike, step: int | None = None, *, overwrite: bool = False
) -> int:
    """Saves the engine's cache state as a step under ``directory``; returns the step.

    Args:
      engine: an idle engine (no queued or running request): a snapshot is of reusable
        cache contents, not of in-flight requests.
      directory: the snapshot folder (created if missing); holds up to ``MAX_TO_KEEP`` steps.
      step: the step to write; None = one past the latest step (1 in an empty folder). A new
        step must exceed the latest one, which is what ``restore_snapshot`` reads by default.
      overwrite: replace ``step`` if it exists, atomically (a crash leaves the old or the new
        snapshot); without it an existing step is refused.

    Raises:
      ValueError: the engine has work or runs Manager V2, or ``step`` is not None or an int >= 0.
      SnapshotError: ``step`` exists and ``overwrite`` is False, ``step`` is below the latest
        step, ``directory`` is a file, or a file could not be written there (permissions, a
        full disk).
    """
    with engine.lock, _releasing_heap():  # no step may run while the state is read
        try:
            return _save(engine, directory, step, overwrite)
        except OSError as err:
            raise SnapshotError(
                f"cannot write a snapshot under {str(directory)!r}: {err.strerror or err} "
                f"({type(err).__name__}{'' if err.filename is None else ', ' + str(err.filename)})"
            ) from err


def _save(engine: Engine, directory: str | os.PathLike, step: int | None, overwrite: bool) -> int:
    manager = _check_engine(engine, "save_snapshot")
    _check_step(step)
    root = _root(directory)
    _recover(root)
    manager.drop_lost_disk_blocks()  # a damaged disk page is not saved as if it were cached
    arrays = _arrays(engine)
    document = {
        "format_version": FORMAT_VERSION,
        **_identity(engine),
        "arrays_blake3": _arrays_digest(arrays),
        "manager_state": manager.state_dict(),
        "state_snapshots": None if engine.recurrent is None else engine.recurrent.index.state_dict(),
    }
    document = json.loads(json.dumps(document))  # hash exactly what restore will read back
    meta = {"document": document, "blake3": _document_digest(document)}
    args = ocp.args.Composite(arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta))
    with _manager(root) as mgr:
        steps = mgr.all_steps()
        latest = max(steps, default=None)
        step = step if step is not None else (latest or 0) + 1
        if step in steps and not overwrite:
            raise SnapshotError(
                f"snapshot step {step} already exists under {str(root)!r}; pass overwrite=True to replace it"
            )
        if step not in steps:
            if latest is not None and step < latest:
                raise SnapshotError(
                    f"step={step} is below the latest step {latest} under {str(root)!r}: a new step must exceed it"
                )
            mgr.save(step, args=args, force=True)  # force: no orbax save policy may skip it silently
            mgr.wait_until_finished()
            return step
    staging = root / _STAGING
    with _manager(staging) as mgr:
        mgr.save(step, args=args)
        mgr.wait_until_finished()
    replaced = root / f"{_REPLACED}{step}"
    os.rename(root / str(step), replaced)  # a crash here: _recover puts the old step back
    os.rename(staging / str(step), root / str(step))  # a crash here: _recover drops the old step
    shutil.rmtree(replaced)
    shutil.rmtree(staging)
    return step


def _diff(saved: Any, current: Any, path: str = "") -> list[str]:
    if isinstance(saved, dict) and isinstance(current, dict):
        out = []
        for key in sorted(set(saved) | set(current)):
            out += _diff(saved.get(key), current.get(key), f"{path}.{key}" if path else key)
        return out
    return [] if saved == current else [f"{path}: snapshot has {saved!r}, engine has {current!r}"]


def _verified_document(meta: Any, where: str) -> dict[str, Any]:
    """The metadata document once its digest and format version check out."""
    if not isinstance(meta, dict) or not isinstance(meta.get("document"), dict):
        version = meta.get("format_version") if isinstance(meta, dict) else None
        if isinstance(version, int) and version != FORMAT_VERSION:
            raise SnapshotError(f"{where} has format_version={version}; this kvjax reads {FORMAT_VERSION}")
        raise SnapshotError(f"{where} is damaged: its metadata holds no document")
    document = meta["document"]
    if meta.get("blake3") != _document_digest(document):
        raise SnapshotError(f"{where} is damaged: its metadata does not match the stored BLAKE3 digest")
    if document.get("format_version") != FORMAT_VERSION:
        version = document.get("format_version")
        raise SnapshotError(f"{where} has format_version={version!r}; this kvjax reads {FORMAT_VERSION}")
    return document


def restore_snapshot(engine: Engine, directory: str | os.PathLike, step: int | None = None) -> int:
    """Loads a snapshot (the latest complete step by default) into an idle engine; returns the step.

    Raises:
      ValueError: the engine has work or runs Manager V2, or ``step`` is not None or an int >= 0.
      SnapshotError: no such snapshot; an unreadable or damaged file; metadata or arrays that
        do not match their BLAKE3 digests; a different format version, model (weights digest),
        cache config or layout. The engine is unchanged then.
    """
    with engine.lock, _releasing_heap():  # no step may run while the state is replaced
        return _restore(engine, directory, step)


@contextlib.contextmanager
def _releasing_heap() -> Iterator[None]:
    """Hands the heap the snapshot's copies of the cache went through back to the system when
    the save or restore ends (``kvjax.heap``): without it each one leaves ~its size resident."""
    try:
        yield
    finally:
        release_free_heap()


def _complete(step_dir: pathlib.Path) -> bool:
    """Whether a step folder holds both parts a save writes (a folder left empty is not a step)."""
    return (step_dir / "meta").is_dir() and (step_dir / "arrays").is_dir()


def _check_engine(engine: Engine, call: str) -> TieredCacheManager:
    """The idle ``engine``'s manager, whose state a snapshot holds, or a ``ValueError`` naming ``call``."""
    if engine.has_work:
        raise ValueError(f"{call} needs an idle engine: finish or drop queued/running requests first")
    return require_tiered(engine.manager, call)


def _restore(engine: Engine, directory: str | os.PathLike, step: int | None) -> int:
    _check_engine(engine, "restore_snapshot")
    _check_step(step)
    root = _root(directory)
    if not root.is_dir():
        raise SnapshotError(f"no complete snapshot under {str(directory)!r}")
    _recover(root)
    with _reading(f"snapshot directory {str(root)!r}"):
        mgr = _manager(root, create=False)
    with mgr:
        with _reading(f"snapshot directory {str(root)!r}"):
            steps = mgr.all_steps()
        if step is None:
            complete = [s for s in steps if _complete(root / str(s))]
            if not complete:
                raise SnapshotError(f"no complete snapshot under {str(directory)!r}")
            step = max(complete)
        elif step not in steps:
            raise SnapshotError(f"no snapshot step {step} under {str(root)!r}; steps there: {sorted(steps)}")
        where = f"snapshot step {step} under {str(root)!r}"
        with _reading(f"{where} (file {step}/meta/metadata)"):
            meta = mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        document = _verified_document(meta, where)
        differences = _diff({k: document.get(k) for k in _identity(engine)}, _identity(engine))
        if differences:
            raise SnapshotError(f"{where} does not fit this engine: " + "; ".join(differences))
        with _reading(f"{where} (files under {step}/arrays)"):
            restored = mgr.restore(step, args=ocp.args.Composite(arrays=ocp.args.StandardRestore(_arrays(engine))))
            arrays = {k: np.asarray(v) for k, v in restored["arrays"].items()}
    if _arrays_digest(arrays) != document["arrays_blake3"]:
        raise SnapshotError(f"{where} is damaged: its arrays do not match the stored BLAKE3 digest")
    try:  # validate everything, then apply: a refused restore changes nothing
        manager = KVCacheManager.from_state_dict(document["manager_state"], engine.kv_config, engine.layout)
    except SnapshotError as err:
        raise SnapshotError(f"{where}: {err}") from err
    index = None
    if engine.recurrent is not None:
        index = StateSnapshotIndex(
            engine.kv_config, tokens_per_block=engine.layout.tokens_per_block, num_live=engine.recurrent.index.num_live
        )
        try:
            index.load_state_dict(document["state_snapshots"])
        except (KeyError, TypeError, ValueError) as err:
            raise SnapshotError(f"{where}: its recurrent-state snapshots are damaged: {err}") from err
    tiers = {(tier, g): _pages(arrays, f"{tier}_{g:03d}", f"{tier}_scales_{g:03d}", np.asarray)
             for tier, g in engine.host_pool.pool_ids()}
    for (tier, g), saved in tiers.items():
        try:
            engine.host_pool.check_restore(tier, g, saved)
        except ValueError as err:
            raise SnapshotError(f"{where}: {err}") from err
    num_layers = engine.layout.num_layers
    pool = PagePool(
        k=tuple(
            _pages(arrays, f"device_k_{i:03d}", f"device_k_scales_{i:03d}", jnp.asarray) for i in range(num_layers)
        ),
        v=tuple(
            _pages(arrays, f"device_v_{i:03d}", f"device_v_scales_{i:03d}", jnp.asarray) for i in range(num_layers)
        ),
    )
    if index is not None and engine.recurrent is not None:
        engine.recurrent.index = index
        engine.recurrent.pool = jnp.asarray(arrays["state_pool"])
    engine.pool = pool
    for (tier, g), saved in tiers.items():  # copied into the pool's own arrays and page files
        engine.host_pool.restore(tier, g, saved)
    engine.set_manager(manager)
    return step
