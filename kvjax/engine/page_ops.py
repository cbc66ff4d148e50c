"""Executes the manager's page operations on the tiers: device copies, offloads to the host
tier, spills to the disk tier and onboards back to the device (``kvjax.manager.tiers.PageOp``)."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import NULL_PAGE, CacheLayout, HostPool, PagePool
from kvjax.cache.pool import copy_pages, read_pages, write_pages
from kvjax.engine.buckets import pow2_bucket
from kvjax.manager import PageOp


def apply_page_ops(pool: PagePool, layout: CacheLayout, host_pool: HostPool, ops: list[PageOp]) -> PagePool:
    """Runs ``ops`` in order, each run of one kind and group as one batched op padded to a
    power-of-two count; returns the new device pool (the host and disk tiers are written in
    place), then ends the disk tier's step (``HostPool.end_step``)."""
    for (kind, group), run in itertools.groupby(ops, key=lambda op: (op.kind, op.group)):
        pool = _apply(pool, layout, host_pool, kind, group, list(run))
    host_pool.end_step()
    return pool


def _apply(pool: PagePool, layout: CacheLayout, host_pool: HostPool, kind: str, group: int, ops: list[PageOp]) -> PagePool:
    n = pow2_bucket(len(ops))
    src = np.full(n, NULL_PAGE, np.int32)
    dst = np.full(n, NULL_PAGE, np.int32)
    src[: len(ops)] = [op.src for op in ops]
    dst[: len(ops)] = [op.dst for op in ops]
    if kind == "copy":
        return copy_pages(pool, layout, group, jnp.asarray(src), jnp.asarray(dst))
    if kind == "offload":
        host_pool.store("host", group, dst[: len(ops)], jax.device_get(read_pages(pool, layout, group, jnp.asarray(src))))
        return pool
    if kind == "spill":
        host_pool.store("disk", group, dst[: len(ops)], host_pool.load("host", group, src[: len(ops)], n))
        return pool
    if kind in ("onboard", "onboard_disk"):
        kv = host_pool.load("host" if kind == "onboard" else "disk", group, src[: len(ops)], n)
        return write_pages(pool, layout, group, jnp.asarray(dst), kv)
    raise ValueError(f"page op kind={kind!r} must be 'copy', 'offload', 'spill', 'onboard' or 'onboard_disk'")
