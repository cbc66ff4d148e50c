"""Orbax snapshots of the whole cache state on the real model."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from kvjax.config import KvCacheConfig, SchedulerConfig
from kvjax.engine import Engine
from kvjax.manager import SnapshotError
from kvjax.sampling import SamplingParams
from kvjax.snapshot import restore_snapshot, save_snapshot

GREEDY = SamplingParams(max_new_tokens=4, ignore_eos=True, return_logits=True)


def make_engine(model, **kv) -> Engine:
    page_bytes = model.config.num_layers * 2 * 16 * model.config.num_kv_heads * model.config.head_dim * 4
    kv = {"tokens_per_block": 16, "max_tokens": 16 * 24, "host_cache_size": 16 * page_bytes, **kv}
    return Engine(
        model, KvCacheConfig(**kv), SchedulerConfig(max_num_tokens=256, prefill_chunk_size=128), max_seq_len=256
    )


@pytest.fixture(scope="module")
def prompts(smollm2, reference_text):
    ids = smollm2.tokenizer.encode(reference_text)
    return ids[:150], ids[150:280], ids[280:400]


def test_restore_reproduces_reuse_including_host_blocks(smollm2, prompts, tmp_path):
    engine = make_engine(smollm2)
    for p in prompts:  # the third prompt pushes part of the first to the host tier
        engine.generate([p], GREEDY)
    assert engine.manager.num_cached_blocks(0, "host") > 0
    step = save_snapshot(engine, tmp_path)
    restored = make_engine(smollm2)
    assert restore_snapshot(restored, tmp_path) == step
    assert restored.manager.state_dict() == engine.manager.state_dict()
    query = list(prompts[0]) + [30, 31, 32]
    [warm] = restored.generate([query], GREEDY)
    [cold] = make_engine(smollm2, enable_block_reuse=False).generate([query], GREEDY)
    assert warm.num_reused_tokens >= 144
    assert restored.manager.stats.onboarded_pages > 0
    assert warm.output == cold.output
    assert np.max(np.abs(np.stack(warm.logits) - np.stack(cold.logits))) / np.max(np.abs(cold.logits[0])) < 1e-5


def test_restore_carries_the_disk_tier(smollm2, prompts, tmp_path):
    page_bytes = smollm2.config.num_layers * 2 * 16 * smollm2.config.num_kv_heads * smollm2.config.head_dim * 4
    tiers = {"max_tokens": 16 * 16, "host_cache_size": 2 * page_bytes, "disk_cache_size": 16 * page_bytes}
    engine = make_engine(smollm2, **tiers, disk_cache_dir=str(tmp_path / "disk_a"))
    for p in prompts:  # the first prompt's blocks go device -> host -> disk
        engine.generate([p], GREEDY)
    assert engine.manager.num_cached_blocks(0, "disk") > 0
    step = save_snapshot(engine, tmp_path / "snap")
    restored = make_engine(smollm2, **tiers, disk_cache_dir=str(tmp_path / "disk_b"))  # another folder: same cache
    assert restore_snapshot(restored, tmp_path / "snap") == step
    assert restored.manager.state_dict() == engine.manager.state_dict()
    for (_, _, mine), (_, _, theirs) in zip(restored.host_pool.pools(), engine.host_pool.pools()):
        np.testing.assert_array_equal(mine, theirs)
    query = list(prompts[0]) + [30, 31, 32]
    [warm] = restored.generate([query], GREEDY)
    [cold] = make_engine(smollm2, enable_block_reuse=False).generate([query], GREEDY)
    assert warm.num_reused_tokens >= 144 and restored.manager.stats.disk_onboarded_pages > 0
    assert warm.output == cold.output
    assert np.max(np.abs(np.stack(warm.logits) - np.stack(cold.logits))) / np.max(np.abs(cold.logits[0])) < 1e-5


def test_mismatched_config_is_refused(smollm2, prompts, tmp_path):
    engine = make_engine(smollm2)
    engine.generate([prompts[0]], GREEDY)
    save_snapshot(engine, tmp_path)
    other = make_engine(smollm2, max_tokens=16 * 32)
    before = other.manager.state_dict()
    with pytest.raises(SnapshotError, match="max_tokens: snapshot has 384, engine has 512"):
        restore_snapshot(other, tmp_path)
    assert other.manager.state_dict() == before


def test_damaged_snapshot_is_refused(smollm2, prompts, tmp_path):
    engine = make_engine(smollm2)
    engine.generate([prompts[0]], GREEDY)
    step = save_snapshot(engine, tmp_path)
    data_files = sorted(
        p for p in (tmp_path / str(step) / "arrays").rglob("*") if p.is_file() and p.stat().st_size > 4096
    )
    victim = data_files[-1]
    blob = bytearray(victim.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    victim.write_bytes(bytes(blob))
    with pytest.raises(SnapshotError, match="damaged"):
        restore_snapshot(make_engine(smollm2), tmp_path)


def test_interrupted_save_keeps_the_previous_snapshot(smollm2, prompts, tmp_path, monkeypatch):
    engine = make_engine(smollm2)
    engine.generate([prompts[0]], GREEDY)
    first = save_snapshot(engine, tmp_path)
    engine.generate([prompts[1]], GREEDY)
    import kvjax.snapshot as snapshot

    class PowerCut:
        """An array that fails while orbax is writing it, after the others were written."""

        shape, dtype, ndim, size = (4,), np.dtype(np.float32), 1, 4

        def __array__(self, *args, **kwargs):
            raise OSError("power cut during the save")

    real_save = snapshot.ocp.args.StandardSave
    monkeypatch.setattr(
        snapshot.ocp.args, "StandardSave", lambda arrays: real_save({**arrays, "zz_power_cut": PowerCut()})
    )
    with pytest.raises(Exception, match="power cut"):
        save_snapshot(engine, tmp_path)
    monkeypatch.undo()
    # Whether orbax's background writer left the torn step's temporary folder depends on its timing
    # (seen both ways); either way the latest complete step is the first one.
    restored = make_engine(smollm2)
    assert restore_snapshot(restored, tmp_path) == first
    assert restored.manager.num_cached_blocks(0) == 150 // 16


def test_no_snapshot_is_a_clear_error(smollm2, tmp_path):
    with pytest.raises(SnapshotError, match="no complete snapshot"):
        restore_snapshot(make_engine(smollm2), pathlib.Path(tmp_path) / "empty")
