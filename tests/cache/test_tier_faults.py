"""Fault injection into the disk tier (tiny model, CPU): whatever happens to the page files —
random bytes, zeroed pages, single bit flips, truncation, deletion, a full disk — a request
that wanted those pages gets the output of a cold engine, the damaged blocks leave the tree
("removed" events, ``lost_disk_pages``), and the process lives on."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvjax.cache import HostPool
from kvjax.config import KvCacheConfig
from kvjax.engine import Engine
from kvjax.manager.block_pool import FreeList
from kvjax.model.registry import Model
from kvjax.sampling import SamplingParams
from kvjax.testing.tiny import tiny_model

GREEDY = SamplingParams(max_new_tokens=4, ignore_eos=True, return_logits=True)
REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model() -> Model:
    cfg, params = tiny_model(0)
    return Model(config=cfg, params=params, tokenizer=None, path=pathlib.Path("tiny"))


@pytest.fixture(scope="module")
def prompts(model) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(1, model.config.vocab_size, 100).tolist() for _ in range(3)]


def tiered(model: Model, disk_dir: pathlib.Path) -> Engine:
    """An engine whose device holds one 100-token prompt and whose host holds two blocks, so the
    first of three prompts ends up on the disk tier."""
    kv = KvCacheConfig(tokens_per_block=16, max_tokens=160, host_cache_size=2 * 8192, disk_cache_size=64 * 8192,
                       disk_cache_dir=str(disk_dir), event_buffer_max_size=4096)
    return Engine(model, kv, max_seq_len=128)


@pytest.fixture(scope="module")
def cold(model, prompts):
    """The first prompt's output on an engine without reuse."""
    engine = Engine(
        model, KvCacheConfig(tokens_per_block=16, max_tokens=160, enable_block_reuse=False), max_seq_len=128
    )
    return engine.generate([prompts[0]], GREEDY)[0]


def spilled(model: Model, prompts: list[list[int]], disk_dir: pathlib.Path) -> tuple[Engine, list[pathlib.Path]]:
    engine = tiered(model, disk_dir)
    for p in prompts:
        engine.generate([p], GREEDY)
    assert engine.manager.num_cached_blocks(0, "disk") > 0
    engine.manager.get_kv_cache_events()
    return engine, sorted(disk_dir.rglob("*.bin"))


def _random(f: pathlib.Path) -> None:
    f.write_bytes(os.urandom(f.stat().st_size))


def _zeroed(f: pathlib.Path) -> None:
    f.write_bytes(bytes(f.stat().st_size))


def _bit_flips(f: pathlib.Path) -> None:
    data = bytearray(f.read_bytes())
    for offset in range(3, len(data), 4096):  # one bit per 4 KiB: the exponent bits of float32 values
        data[offset] ^= 0x40
    f.write_bytes(bytes(data))


def _truncated(f: pathlib.Path) -> None:
    os.truncate(f, 0)


def _half_truncated(f: pathlib.Path) -> None:
    os.truncate(f, f.stat().st_size // 2 + 7)


@pytest.mark.parametrize("damage", [_random, _zeroed, _bit_flips, _truncated, _half_truncated])
def test_a_damaged_page_file_is_never_served(model, prompts, cold, tmp_path, damage):
    engine, files = spilled(model, prompts, tmp_path)
    for f in files:
        damage(f)
    [out] = engine.generate([prompts[0]], GREEDY)
    assert out.error is None and out.output == cold.output
    np.testing.assert_allclose(np.stack(out.logits), np.stack(cold.logits), rtol=1e-4, atol=1e-4)
    stats = engine.manager.stats
    assert stats.lost_disk_pages >= 1 and stats.disk_onboarded_pages == 0
    removed = [e for e in engine.manager.get_kv_cache_events() if e.kind == "removed" and e.tier == "disk"]
    assert removed, "the dropped disk blocks are reported"
    engine.manager.check_consistency()
    [again] = engine.generate([prompts[0]], GREEDY)  # recomputed, stored afresh, reused
    assert again.output == cold.output and again.num_reused_tokens > 0


def test_a_deleted_folder_keeps_the_open_page_files(model, prompts, cold, tmp_path):
    engine, _ = spilled(model, prompts, tmp_path / "tier")
    shutil.rmtree(tmp_path / "tier")
    [out] = engine.generate([prompts[0]], GREEDY)
    assert out.output == cold.output and out.num_reused_tokens > 0
    assert engine.manager.stats.disk_onboarded_pages > 0 and engine.manager.stats.lost_disk_pages == 0


def test_a_snapshot_drops_lost_disk_blocks_before_saving(model, prompts, cold, tmp_path):
    from kvjax.snapshot import restore_snapshot, save_snapshot

    engine, files = spilled(model, prompts, tmp_path / "a")
    for f in files:
        _zeroed(f)
    save_snapshot(engine, tmp_path / "snap")
    assert engine.manager.num_cached_blocks(0, "disk") == 0 and engine.manager.stats.lost_disk_pages >= 1
    restored = tiered(model, tmp_path / "b")
    restore_snapshot(restored, tmp_path / "snap")
    [out] = restored.generate([prompts[0]], GREEDY)
    assert out.output == cold.output


_FULL_DISK = textwrap.dedent(
    """
    import json, pathlib, resource, sys
    import numpy as np
    from kvjax.config import KvCacheConfig
    from kvjax.engine import Engine
    from kvjax.model.registry import Model
    from kvjax.sampling import SamplingParams
    from kvjax.testing.tiny import tiny_model

    cfg, params = tiny_model(0)
    model = Model(config=cfg, params=params, tokenizer=None, path=pathlib.Path("tiny"))
    g = SamplingParams(max_new_tokens=4, ignore_eos=True)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, cfg.vocab_size, 100).tolist() for _ in range(3)]
    cold = Engine(model, KvCacheConfig(tokens_per_block=16, max_tokens=160, enable_block_reuse=False), max_seq_len=128)
    want = [cold.generate([p], g)[0].output for p in prompts]
    kv = KvCacheConfig(tokens_per_block=16, max_tokens=160, host_cache_size=2 * 8192, disk_cache_size=64 * 8192,
                       disk_cache_dir=sys.argv[1])
    engine = Engine(model, kv, max_seq_len=128)
    resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))  # the page file may not grow past one page
    got = [engine.generate([p], g)[0].output for p in prompts + prompts]
    print(json.dumps({"want": want + want, "got": got,
                      "write_errors": sum(f.write_errors for f in engine.host_pool.disk),
                      "lost": engine.manager.stats.lost_disk_pages}))
    """
)


def test_a_full_disk_loses_pages_but_not_requests(tmp_path):
    """RLIMIT_FSIZE stands in for a full disk: writes past the limit fail (Python ignores SIGXFSZ)."""
    done = subprocess.run([sys.executable, "-c", _FULL_DISK, str(tmp_path)], capture_output=True, text=True,
                          cwd=REPO, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["got"] == result["want"]
    assert result["write_errors"] > 0 and result["lost"] > 0


def test_sizes_are_checked_before_anything_is_built(model, tmp_path):
    kv = KvCacheConfig(tokens_per_block=16, max_tokens=160, host_cache_size=2 * 8192, disk_cache_size=10**18,
                       disk_cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"kv_cache_config.disk_cache_size: the disk tier's .* pages need"):
        Engine(model, kv, max_seq_len=128)
    assert list(tmp_path.iterdir()) == []  # the folder made for the files was removed again


def test_free_lists_cost_nothing_per_empty_page():
    free = FreeList(1, 10**15)
    assert len(free) == 10**15 - 1 and free.popleft() == 1 and free.popleft() == 2
    free.append(1)
    assert len(free) == 10**15 - 2
    small, reference = FreeList(0, 3), [0, 1, 2]
    for _ in range(3):
        assert small.popleft() == reference.pop(0)
    small.append(2), small.append(0)
    assert list(small) == [2, 0] and small.popleft() == 2 and len(small) == 1
    restored = FreeList(0, 0)
    restored.load_state(small.state())
    assert list(restored) == list(small)


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(host_cache_size=100), r"host_cache_size=100 holds no block: one block .* takes 8,192 bytes"),
        (dict(host_cache_size=8192, disk_cache_size=100), r"disk_cache_size=100 holds no block"),
    ],
)
def test_tiers_smaller_than_a_block_are_refused(model, fields, message):
    with pytest.raises(ValueError, match=message):
        Engine(model, KvCacheConfig(tokens_per_block=16, max_tokens=160, **fields), max_seq_len=128)


def test_disk_cache_dir_is_expanded_and_absolute(model, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert KvCacheConfig(disk_cache_dir="~/tier").disk_cache_dir == str(tmp_path / "home" / "tier")
    monkeypatch.chdir(tmp_path)
    config = KvCacheConfig(tokens_per_block=16, max_tokens=160, host_cache_size=8192, disk_cache_size=8 * 8192,
                           disk_cache_dir="relative")
    assert config.disk_cache_dir == str(tmp_path / "relative")
    engine = Engine(model, config, max_seq_len=128)
    folder = engine.host_pool.disk[0].path.parent
    assert folder.is_absolute() and folder.parent == tmp_path / "relative"
    monkeypatch.chdir("/")
    del engine
    import gc

    gc.collect()
    assert not folder.exists()


def test_disk_cache_dir_that_is_a_file_is_named(model, tmp_path):
    (tmp_path / "f").write_text("x")
    kv = KvCacheConfig(tokens_per_block=16, max_tokens=160, host_cache_size=8192, disk_cache_size=8 * 8192,
                       disk_cache_dir=str(tmp_path / "f"))
    with pytest.raises(ValueError, match=r"disk_cache_dir='.*/f' is a file, not a folder"):
        Engine(model, kv, max_seq_len=128)


def test_host_pool_checks_what_it_restores(model, tmp_path):
    engine = tiered(model, tmp_path)
    pools: HostPool = engine.host_pool
    saved = {ids: pages for ids, (_, _, pages) in zip(pools.pool_ids(), pools.pools())}
    with pytest.raises(ValueError, match=r"saved disk pages of group 0 have shape"):
        pools.check_restore("disk", 0, saved[("host", 0)])
