"""Executes the manager's page operations on the tiers: device copies, offloads to the host
tier, spills to the disk tier and onboards back to the device (``kvjax.manager.tiers.PageOp``),
all at once (``apply_page_ops``) or, for the onboards a blended prefill waits for, one layer
at a time by a loader thread while the prefill computes (``LayerwiseOnboard``)."""

from __future__ import annotations

import itertools
import queue
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import NULL_PAGE, CacheLayout, HostPool, PagePool, Pages
from kvjax.cache.host_pool import TierName
from kvjax.cache.pool import copy_pages, read_pages, write_layer_pages, write_pages
from kvjax.engine.buckets import pow2_bucket
from kvjax.manager import PageOp

ONBOARDS = ("onboard", "onboard_disk")


def apply_page_ops(
    pool: PagePool, layout: CacheLayout, host_pool: HostPool, ops: list[PageOp], end_step: bool = True
) -> PagePool:
    """Runs ``ops`` in order, each run of one kind and group as one batched op padded to a
    power-of-two count; returns the new device pool (the host and disk tiers are written in
    place), then ends the disk tier's step (``HostPool.end_step``) unless ``end_step`` is
    False (onboards of this step still to come: ``LayerwiseOnboard.finish`` ends it)."""
    for (kind, group), run in itertools.groupby(ops, key=lambda op: (op.kind, op.group)):
        pool = _apply(pool, layout, host_pool, kind, group, list(run))
    if end_step:
        host_pool.end_step()
    return pool


def split_layerwise(ops: list[PageOp]) -> tuple[list[PageOp], list[PageOp]]:
    """Splits queued ops into (ops to run now, in order; onboards that may run afterwards,
    layer by layer). An onboard stays in order when a later op overwrites its source page
    (an offload or spill into the tier slot it freed), reads its destination page (a copy
    or offload from it) or writes that page again (a copy or onboard into it); running the
    others after every queued op changes nothing, since no later op touches their pages."""
    kept = set()
    for i, op in enumerate(ops):
        if op.kind not in ONBOARDS:
            continue
        refill = "offload" if op.kind == "onboard" else "spill"
        for later in ops[i + 1 :]:
            if later.group == op.group and ((later.kind == refill and later.dst == op.src)
                                            or (later.kind in ("copy", "offload") and later.src == op.dst)
                                            or (later.kind in ("copy", *ONBOARDS) and later.dst == op.dst)):
                kept.add(i)
                break
    now = [op for i, op in enumerate(ops) if op.kind not in ONBOARDS or i in kept]
    return now, [op for i, op in enumerate(ops) if op.kind in ONBOARDS and i not in kept]


class LayerwiseOnboard:
    """Onboards to the device pages, one layer at a time, by a loader thread that reads each
    layer's pages from their tier (``HostPool.load``, throttled like any tier read) at most
    ``depth`` layers ahead of the consumer. The consumer takes layer l with ``fetch`` (which
    writes it into the layer's pages), so layer l + 1 is read while layer l computes: the
    overlap is wall-clock, the loader thread waits on reads (and throttles) with the GIL
    released while XLA runs the layer on its own threads.

    Args:
      host_pool, layout: the tiers and the cache geometry.
      ops: onboards from ``split_layerwise`` (their pages stay referenced until ``finish``); the
        thread starts reading at once, so run the ops that must come first before building this.
      depth: layers loaded ahead of the consumer (host buffers in flight), >= 1.

    ``error`` is the read error the loader stopped on (None while none). ``events`` lists every read: dicts with
    "layer", "tier", "pages", "bytes", "start_s",
    "end_s" (``time.perf_counter()`` seconds).
    """

    def __init__(self, host_pool: HostPool, layout: CacheLayout, ops: list[PageOp], depth: int = 2) -> None:
        if depth < 1:
            raise ValueError(f"depth={depth!r} must be >= 1")
        self.host_pool, self.layout = host_pool, layout
        self.events: list[dict] = []
        self.error: BaseException | None = None
        """The read error the loader stopped on, if any."""
        self._runs: dict[int, list[tuple[TierName, np.ndarray, np.ndarray]]] = {}
        """Per group, (tier, source pages, destination pages padded to a power of two with the null page)."""
        for (group, kind), run in itertools.groupby(
            sorted(ops, key=lambda op: (op.group, op.kind)), key=lambda op: (op.group, op.kind)
        ):
            ops_run = list(run)
            dst = np.full(pow2_bucket(len(ops_run)), NULL_PAGE, np.int32)
            dst[: len(ops_run)] = [op.dst for op in ops_run]
            self._runs.setdefault(group, []).append(
                ("host" if kind == "onboard" else "disk", np.asarray([op.src for op in ops_run]), dst)
            )
        self._next = 0
        self._buffers: queue.Queue = queue.Queue(maxsize=depth)
        self._thread = threading.Thread(target=self._load, name="kvjax-layerwise-onboard", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        index_in_group = [self.layout.layer_group[:i].count(g) for i, g in enumerate(self.layout.layer_group)]
        try:
            for layer, group in enumerate(self.layout.layer_group):
                parts = []
                for tier, src, dst in self._runs.get(group, ()):
                    start = time.perf_counter()
                    kv = self.host_pool.load(tier, group, src, len(dst), layer=index_in_group[layer])
                    self.events.append(
                        {
                            "layer": layer,
                            "tier": tier,
                            "pages": len(src),
                            "start_s": start,
                            "end_s": time.perf_counter(),
                            "bytes": sum(leaf.nbytes for leaf in jax.tree.leaves(kv)) * len(src) // len(dst),
                        }
                    )
                    parts.append((dst, kv))
                self._buffers.put(parts)
        except BaseException as err:  # handed to the consumer, raised there
            self._buffers.put(err)

    def fetch(self, layer: int, k_pages: Pages, v_pages: Pages) -> tuple[Pages, Pages]:
        """Waits for ``layer``'s onboarded pages and writes them into its K and V pages
        (donated); layers must be fetched in order, each once.

        Raises:
          ValueError: ``layer`` is not the next layer.
          the loader's error (e.g. ``LostPageError``) for the layer it failed on.
        """
        if layer != self._next:
            raise ValueError(f"layer={layer} must be the next layer to fetch, {self._next}")
        parts = self._buffers.get()
        if isinstance(parts, BaseException):
            self._next = self.layout.num_layers
            self.error = parts
            raise parts
        self._next += 1
        for dst, kv in parts:
            k_pages, v_pages = write_layer_pages(k_pages, v_pages, jnp.asarray(dst), kv)
        return k_pages, v_pages

    def finish(self, pool: PagePool) -> PagePool:
        """Fetches the layers not fetched yet (a prefill that stopped early leaves no page
        the manager thinks onboarded unwritten), waits for the loader and ends the disk tier's
        step; returns the pool. Never raises a read error: one met here (the prefill stopped
        before that layer, so its own error is already on its way) is kept in ``error``, and
        the pool comes back with every layer fetched before it, so no donated page is lost."""
        k, v = list(pool.k), list(pool.v)
        while self._next < self.layout.num_layers:
            layer = self._next
            try:
                k[layer], v[layer] = self.fetch(layer, k[layer], v[layer])
            except Exception:  # kept in self.error by fetch
                break
        self._thread.join()
        self.host_pool.end_step()
        return PagePool(k=tuple(k), v=tuple(v))


def _apply(
    pool: PagePool, layout: CacheLayout, host_pool: HostPool, kind: str, group: int, ops: list[PageOp]
) -> PagePool:
    n = pow2_bucket(len(ops))
    src = np.full(n, NULL_PAGE, np.int32)
    dst = np.full(n, NULL_PAGE, np.int32)
    src[: len(ops)] = [op.src for op in ops]
    dst[: len(ops)] = [op.dst for op in ops]
    if kind == "copy":
        return copy_pages(pool, layout, group, jnp.asarray(src), jnp.asarray(dst))
    if kind == "offload":
        host_pool.store(
            "host", group, dst[: len(ops)], jax.device_get(read_pages(pool, layout, group, jnp.asarray(src)))
        )
        return pool
    if kind == "spill":
        host_pool.store("disk", group, dst[: len(ops)], host_pool.load("host", group, src[: len(ops)], n))
        return pool
    if kind in ("onboard", "onboard_disk"):
        kv = host_pool.load("host" if kind == "onboard" else "disk", group, src[: len(ops)], n)
        return write_pages(pool, layout, group, jnp.asarray(dst), kv)
    raise ValueError(f"page op kind={kind!r} must be 'copy', 'offload', 'spill', 'onboard' or 'onboard_disk'")
