"""The engine's page operations on the tiers: which onboards may be deferred to a layer-wise
loader (``split_layerwise``), and that the loader (``LayerwiseOnboard``) leaves exactly the pool
``apply_page_ops`` gives, raises its read errors where the layer is fetched and refuses layers
out of order (two layer groups, float32 and int8 pages, host and disk tiers)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache import CacheLayout, HostPool, PagePool, init_pool, read_pages
from kvjax.cache.page_file import LostPageError
from kvjax.engine.page_ops import LayerwiseOnboard, apply_page_ops, split_layerwise
from kvjax.manager import PageOp


def _layout(dtype: str = "float32") -> CacheLayout:
    """Two groups: window 16 (layers 0, 2, 4) and the full window (layers 1, 3); 8 device pages
    (page 0 the null page), 4 host and 4 disk pages per group."""
    return CacheLayout(layer_windows=(16, 64, 16, 64, 16), num_pages=(8, 8), tokens_per_block=4, num_kv_heads=2,
                       head_dim=8, max_seq_len=64, dtype=dtype, num_host_pages=4, num_disk_pages=4)


def _pool(layout: CacheLayout, seed: int = 0) -> PagePool:
    """Random device pages (the same for the same seed), valid quantized pages for int8."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape) * 3, a.dtype), init_pool(layout))


def _tiers(layout: CacheLayout, tmp_path) -> HostPool:
    """Host pages 0..3 and disk pages 0..2 of every group filled from another random pool;
    disk page 3 is never written."""
    tiers = HostPool(layout, tmp_path)
    source = _pool(layout, seed=1)
    for g in range(layout.num_groups):
        tiers.store(
            "host", g, np.arange(4), jax.device_get(read_pages(source, layout, g, jnp.array([1, 2, 3, 4], jnp.int32)))
        )
        tiers.store(
            "disk", g, np.arange(3), jax.device_get(read_pages(source, layout, g, jnp.array([7, 6, 5, 0], jnp.int32)))
        )
    return tiers


ONBOARDS = [
    PageOp("onboard", 0, 2, 1), PageOp("onboard_disk", 0, 1, 2), PageOp("onboard", 0, 0, 3),
    PageOp("onboard", 1, 3, 5), PageOp("onboard_disk", 1, 0, 1), PageOp("onboard_disk", 1, 2, 4),
]


def _assert_same(a: PagePool, b: PagePool) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ---------------------------------------------------------------------------------- split_layerwise


def test_split_defers_onboards_no_later_op_touches():
    ops = [PageOp("offload", 0, 1, 2), PageOp("onboard", 0, 0, 1), PageOp("copy", 0, 3, 4),
           PageOp("onboard_disk", 1, 2, 3), PageOp("spill", 0, 1, 0)]
    assert split_layerwise(ops) == (
        [PageOp("offload", 0, 1, 2), PageOp("copy", 0, 3, 4), PageOp("spill", 0, 1, 0)],
        [PageOp("onboard", 0, 0, 1), PageOp("onboard_disk", 1, 2, 3)],
    )
    assert split_layerwise([]) == ([], [])
    assert split_layerwise(ONBOARDS) == ([], ONBOARDS)


@pytest.mark.parametrize(
    "onboard, later, kept",
    [
        # the tier slot the onboard freed is refilled
        (PageOp("onboard", 0, 2, 5), PageOp("offload", 0, 3, 2), True),
        (PageOp("onboard_disk", 0, 2, 5), PageOp("spill", 0, 1, 2), True),
        # the same slot number in another tier or another group is another page
        (PageOp("onboard", 0, 2, 5), PageOp("spill", 0, 1, 2), False),
        (PageOp("onboard_disk", 0, 2, 5), PageOp("offload", 0, 3, 2), False),
        (PageOp("onboard", 0, 2, 5), PageOp("offload", 1, 3, 2), False),
        # the destination device page is read
        (PageOp("onboard", 0, 2, 5), PageOp("copy", 0, 5, 6), True),
        (PageOp("onboard_disk", 0, 2, 5), PageOp("offload", 0, 5, 3), True),
        (PageOp("onboard", 0, 2, 5), PageOp("copy", 1, 5, 6), False),
        # the destination device page is written again
        (PageOp("onboard", 0, 2, 5), PageOp("copy", 0, 6, 5), True),
        (PageOp("onboard", 0, 2, 5), PageOp("onboard_disk", 0, 1, 5), True),
        (PageOp("onboard_disk", 0, 2, 5), PageOp("onboard", 0, 1, 5), True),
        # reading the onboard's source, or other pages, is no hazard
        (PageOp("onboard", 0, 2, 5), PageOp("spill", 0, 2, 1), False),
        (PageOp("onboard", 0, 2, 5), PageOp("copy", 0, 6, 7), False),
    ],
)
def test_split_keeps_an_onboard_in_order_for_each_hazard(onboard, later, kept):
    later_deferred = later.kind in ("onboard", "onboard_disk")  # the last op: nothing comes after it
    want_now = ([onboard] if kept else []) + ([] if later_deferred else [later])
    want_deferred = ([] if kept else [onboard]) + ([later] if later_deferred else [])
    assert split_layerwise([onboard, later]) == (want_now, want_deferred)


def test_split_looks_only_at_later_ops():
    """An offload from the onboard's destination *before* it (the eviction that made room) and
    an offload into its source before it (the block was demoted, then reused) are no hazard."""
    ops = [PageOp("offload", 0, 5, 2), PageOp("onboard", 0, 2, 5)]
    assert split_layerwise(ops) == ([ops[0]], [ops[1]])


# ---------------------------------------------------------------------------------- LayerwiseOnboard


HAZARDS = [
    PageOp("offload", 0, 3, 1),
    PageOp("onboard", 0, 1, 6),  # reads the host page just written: may follow every op
    PageOp("onboard", 0, 2, 3),
    PageOp("offload", 0, 3, 2),  # reads that onboard's device page and refills its host page
    PageOp("onboard_disk", 0, 0, 5),
    PageOp("spill", 0, 0, 0),  # refills that onboard's disk page
    PageOp("onboard_disk", 1, 1, 2),
    PageOp("copy", 1, 2, 7),  # reads that onboard's device page
    PageOp("onboard_disk", 0, 2, 4),
    PageOp("onboard", 0, 3, 4),  # writes that onboard's device page again
    PageOp("onboard", 1, 0, 6),
    PageOp("copy", 0, 1, 2),
]


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_ops_now_then_deferred_onboards_layer_by_layer_equal_every_op_in_order(dtype, tmp_path):
    layout = _layout(dtype)
    now, later = split_layerwise(HAZARDS)
    assert later == [HAZARDS[1], HAZARDS[9], HAZARDS[10]]
    in_order = _tiers(layout, tmp_path / "in_order")
    want = apply_page_ops(_pool(layout), layout, in_order, HAZARDS)
    split = _tiers(layout, tmp_path / "split")
    pool = apply_page_ops(_pool(layout), layout, split, now, end_step=False)  # before the loader starts reading
    got = LayerwiseOnboard(split, layout, later).finish(pool)
    _assert_same(got, want)
    for (_, _, a), (_, _, b) in zip(in_order.pools(), split.pools(), strict=True):  # the tiers too
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_layerwise_onboard_gives_the_pool_apply_page_ops_gives(dtype, tmp_path):
    layout = _layout(dtype)
    tiers = _tiers(layout, tmp_path)
    want = apply_page_ops(_pool(layout), layout, tiers, ONBOARDS)
    loader = LayerwiseOnboard(tiers, layout, ONBOARDS)
    got = loader.finish(_pool(layout))
    _assert_same(got, want)
    untouched = _pool(layout)
    assert any(
        not np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(untouched))
    )
    # one read per layer and tier of the layer's group: group 0 reads 2 host pages and 1 disk
    # page, group 1 one host page and 2 disk pages
    reads = sorted((e["layer"], e["tier"], e["pages"]) for e in loader.events)
    assert reads == sorted(
        (layer, tier, n)
        for layer in range(5)
        for tier, n in ((("host", 2), ("disk", 1)) if layer % 2 == 0 else (("host", 1), ("disk", 2)))
    )
    assert all(
        e["end_s"] >= e["start_s"] and e["bytes"] == e["pages"] * layout.bytes_per_page_layer for e in loader.events
    )


def test_layers_fetched_one_by_one_then_finished_match_apply_page_ops(tmp_path):
    layout = _layout()
    tiers = _tiers(layout, tmp_path)
    want = apply_page_ops(_pool(layout), layout, tiers, ONBOARDS)
    loader = LayerwiseOnboard(tiers, layout, ONBOARDS, depth=1)
    pool = _pool(layout)
    k, v = list(pool.k), list(pool.v)
    for layer in range(2):  # a prefill that stops after two layers
        k[layer], v[layer] = loader.fetch(layer, k[layer], v[layer])
    _assert_same(loader.finish(PagePool(k=tuple(k), v=tuple(v))), want)


def test_layerwise_onboard_of_no_group_leaves_the_pool(tmp_path):
    layout = _layout()
    tiers = _tiers(layout, tmp_path)
    loader = LayerwiseOnboard(tiers, layout, [PageOp("onboard", 1, 0, 3)])
    want = apply_page_ops(_pool(layout), layout, tiers, [PageOp("onboard", 1, 0, 3)])
    _assert_same(loader.finish(_pool(layout)), want)
    assert [e["layer"] for e in loader.events] == [1, 3]  # group 1's layers only


def test_fetch_out_of_order_raises(tmp_path):
    layout = _layout()
    tiers = _tiers(layout, tmp_path)
    with pytest.raises(ValueError, match=r"depth=0 must be >= 1"):
        LayerwiseOnboard(tiers, layout, ONBOARDS, depth=0)
    loader = LayerwiseOnboard(tiers, layout, ONBOARDS)
    pool = _pool(layout)
    with pytest.raises(ValueError, match=r"layer=1 must be the next layer to fetch, 0"):
        loader.fetch(1, pool.k[1], pool.v[1])
    k, v = list(pool.k), list(pool.v)
    k[0], v[0] = loader.fetch(0, k[0], v[0])
    with pytest.raises(ValueError, match=r"layer=0 must be the next layer to fetch, 1"):
        loader.fetch(0, k[0], v[0])
    _assert_same(
        loader.finish(PagePool(k=tuple(k), v=tuple(v))), apply_page_ops(_pool(layout), layout, tiers, ONBOARDS)
    )


def test_a_failed_read_is_raised_where_its_layer_is_fetched(tmp_path):
    layout = _layout()
    tiers = _tiers(layout, tmp_path)
    ops = [PageOp("onboard", 0, 1, 2), PageOp("onboard_disk", 1, 3, 4)]  # disk page 3 was never written
    loader = LayerwiseOnboard(tiers, layout, ops)
    pool = _pool(layout)
    k, v = list(pool.k), list(pool.v)
    k[0], v[0] = loader.fetch(0, k[0], v[0])  # group 0 reads the host tier only
    with pytest.raises(LostPageError, match=r"disk page 3 of .*disk_g001\.bin"):
        loader.fetch(1, k[1], v[1])
    loader.finish(PagePool(k=tuple(k), v=tuple(v)))  # the loader has stopped: finish joins it
    assert not loader._thread.is_alive() and isinstance(loader.error, LostPageError)


def test_a_read_failing_after_the_prefill_stopped_is_kept_and_the_pool_handed_back(tmp_path):
    layout = _layout()
    tiers = _tiers(layout, tmp_path)
    ops = [PageOp("onboard", 0, 1, 2), PageOp("onboard_disk", 1, 3, 4)]  # disk page 3 was never written
    want = apply_page_ops(_pool(layout), layout, tiers, ops[:1])
    loader = LayerwiseOnboard(tiers, layout, ops)
    pool = loader.finish(_pool(layout))  # a prefill that failed before its first layer: nothing raised over its error
    assert isinstance(loader.error, LostPageError) and not loader._thread.is_alive()
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(pool))
    # layer 0 (before the failure) was onboarded
    np.testing.assert_array_equal(np.asarray(pool.k[0]), np.asarray(want.k[0]))
