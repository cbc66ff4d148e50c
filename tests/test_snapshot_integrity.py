"""Snapshots verify everything they restore (tiny model, CPU): single-bit damage in any file,
the model's weights, existing steps and bad arguments."""

from __future__ import annotations

import os
import pathlib
import re

import ml_dtypes
import numpy as np
import pytest

import kvjax.snapshot as snapshot
from kvjax.config import KvCacheConfig, SchedulerConfig
from kvjax.engine import Engine
from kvjax.manager import SnapshotError
from kvjax.model.registry import Model
from kvjax.sampling import SamplingParams
from kvjax.snapshot import restore_snapshot, save_snapshot
from kvjax.testing.tiny import tiny_model

GREEDY = SamplingParams(max_new_tokens=4, ignore_eos=True)


def tiny(seed: int) -> Model:
    cfg, params = tiny_model(seed)
    return Model(config=cfg, params=params, tokenizer=None, path=pathlib.Path("tiny"))


def make_engine(model: Model) -> Engine:
    """12 device pages of 4 tokens and 8 host pages: five 13-token prompts spill to the host."""
    cfg = model.config
    page_bytes = cfg.num_layers * 2 * 4 * cfg.num_kv_heads * cfg.head_dim * 4
    kv = KvCacheConfig(tokens_per_block=4, max_tokens=4 * 12, host_cache_size=8 * page_bytes)
    return Engine(model, kv, SchedulerConfig(max_num_tokens=64, prefill_chunk_size=32), max_seq_len=32)


def cache_arrays(engine: Engine) -> list[np.ndarray]:
    return [np.asarray(a) for a in (*engine.pool.k, *engine.pool.v)] + [np.asarray(h) for h in engine.host_pool.host]


def assert_same_cache(engine: Engine, state: dict, arrays: list[np.ndarray], context: str = "") -> None:
    assert engine.manager.state_dict() == state, context
    got = cache_arrays(engine)
    assert len(got) == len(arrays) and all(np.array_equal(a, b) for a, b in zip(got, arrays)), context


@pytest.fixture(scope="module")
def model() -> Model:
    return tiny(0)


@pytest.fixture(scope="module")
def busy(model) -> Engine:
    """An idle engine whose cache holds device and host blocks."""
    engine = make_engine(model)
    for s in range(5):
        engine.generate([list(range(1 + 19 * s, 14 + 19 * s))], GREEDY)
    assert engine.manager.num_cached_blocks(0, "host") > 0 and engine.manager.num_cached_blocks(0) > 0
    return engine


def flips(path: pathlib.Path, blob: bytes) -> list[tuple[int, int]]:
    """(byte, bit) pairs: eight spread over the file (first and last byte included), and in the
    JSON metadata also the first digit of a radix-tree block's token ids and of each digest."""
    n = len(blob)
    out = [(round(i * (n - 1) / 7), i) for i in range(8)]
    if path.name == "metadata":
        for key in (rb"token_ids", rb"arrays_blake3", rb"blake3", rb"weights_digest"):
            out.append((re.search(rb'"' + key + rb'": ?[\["](.)', blob).start(1), 0))
    return out


# A failed orbax read can leave a tensorstore callback that fires after its event loop closed.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_single_bit_flips_in_any_file_are_refused_or_change_nothing(model, busy, tmp_path):
    step = save_snapshot(busy, tmp_path)
    state, arrays = busy.manager.state_dict(), cache_arrays(busy)
    empty = make_engine(model)
    empty_state, empty_arrays = empty.manager.state_dict(), cache_arrays(empty)
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert tmp_path / str(step) / "meta" / "metadata" in files
    refused = {}
    for path in files:
        blob = path.read_bytes()
        for byte, bit in flips(path, blob):
            where = f"{path.relative_to(tmp_path)} byte {byte} bit {bit}"
            damaged = bytearray(blob)
            damaged[byte] ^= 1 << bit
            path.write_bytes(bytes(damaged))
            engine = make_engine(model)
            try:
                restore_snapshot(engine, tmp_path)
            except SnapshotError:
                refused[path.name] = refused.get(path.name, 0) + 1
                assert_same_cache(engine, empty_state, empty_arrays, where)  # refused before changing anything
            else:
                assert_same_cache(engine, state, arrays, where)
            finally:
                path.write_bytes(blob)
    metadata = tmp_path / str(step) / "meta" / "metadata"
    assert refused["metadata"] == len(flips(metadata, metadata.read_bytes()))  # every change to the JSON
    assert refused.get("manifest.ocdbt", 0) > 0
    restored = make_engine(model)
    restore_snapshot(restored, tmp_path)
    assert_same_cache(restored, state, arrays)


def test_a_flipped_token_id_in_the_radix_tree_is_refused(model, busy, tmp_path):
    step = save_snapshot(busy, tmp_path)
    path = tmp_path / str(step) / "meta" / "metadata"
    blob = bytearray(path.read_bytes())
    blob[re.search(rb'"token_ids": ?\[(\d)', blob).start(1)] ^= 1  # another digit: still valid JSON
    path.write_bytes(bytes(blob))
    with pytest.raises(SnapshotError, match=rf"snapshot step {step} .* is damaged: its metadata does not match"):
        restore_snapshot(make_engine(model), tmp_path)


def test_weights_digest_identifies_weights_not_names(model):
    assert tiny(0).weights_digest == model.weights_digest != tiny(1).weights_digest
    assert tiny(1).config.name == model.config.name
    assert re.fullmatch(r"[0-9a-f]{64}", model.weights_digest)


def test_snapshot_of_another_model_with_the_same_name_is_refused(model, busy, tmp_path):
    save_snapshot(busy, tmp_path)
    other = make_engine(tiny(1))
    before, arrays = other.manager.state_dict(), cache_arrays(other)
    digests = rf"model.weights_digest: snapshot has '{model.weights_digest}', engine has '{other.model.weights_digest}'"
    with pytest.raises(SnapshotError, match=rf"does not fit this engine: {digests}"):
        restore_snapshot(other, tmp_path)
    assert_same_cache(other, before, arrays)


def test_existing_step_is_refused_unless_overwrite_replaces_it(model, busy, tmp_path):
    step = save_snapshot(busy, tmp_path)
    with pytest.raises(SnapshotError, match=rf"snapshot step {step} already exists .*; pass overwrite=True"):
        save_snapshot(make_engine(model), tmp_path, step)
    newer = make_engine(model)
    restore_snapshot(newer, tmp_path)
    newer.generate([[90, 91, 92, 93, 94, 95, 96, 1, 2]], GREEDY)
    state, arrays = newer.manager.state_dict(), cache_arrays(newer)
    assert state != busy.manager.state_dict()
    assert save_snapshot(newer, tmp_path, step, overwrite=True) == step
    assert sorted(p.name for p in tmp_path.iterdir()) == [str(step)]  # no staging or replaced folder left
    restored = make_engine(model)
    assert restore_snapshot(restored, tmp_path) == step
    assert_same_cache(restored, state, arrays)


def test_a_crash_during_overwrite_keeps_the_old_step(model, busy, tmp_path, monkeypatch):
    step = save_snapshot(busy, tmp_path)
    state, arrays = busy.manager.state_dict(), cache_arrays(busy)
    real_rename = os.rename

    def power_cut(src: str | os.PathLike, dst: str | os.PathLike) -> None:
        if pathlib.Path(dst) == tmp_path / str(step):  # the rename that swaps the new step in
            raise OSError("power cut during the swap")
        real_rename(src, dst)

    monkeypatch.setattr(snapshot.os, "rename", power_cut)
    with pytest.raises(SnapshotError, match="cannot write a snapshot under .*power cut"):
        save_snapshot(make_engine(model), tmp_path, step, overwrite=True)
    monkeypatch.undo()
    assert not (tmp_path / str(step)).exists()  # the old step was moved aside, the new one not in place
    restored = make_engine(model)
    assert restore_snapshot(restored, tmp_path) == step
    assert_same_cache(restored, state, arrays)
    assert sorted(p.name for p in tmp_path.iterdir()) == [str(step)]


def test_bad_steps_and_directories_are_clear_errors(model, busy, tmp_path):
    engine = make_engine(model)
    for step in (-1, True, "1", 1.0):
        with pytest.raises(ValueError, match=rf"step={step!r} must be None or an int >= 0"):
            save_snapshot(busy, tmp_path, step)
        with pytest.raises(ValueError, match=rf"step={step!r} must be None or an int >= 0"):
            restore_snapshot(engine, tmp_path, step)
    assert save_snapshot(busy, tmp_path, 5) == 5
    assert save_snapshot(busy, tmp_path) == 6
    with pytest.raises(SnapshotError, match=r"step=2 is below the latest step 6 .*: a new step must exceed it"):
        save_snapshot(busy, tmp_path, 2)
    with pytest.raises(SnapshotError, match=r"no snapshot step 2 under .*; steps there: \[5, 6\]"):
        restore_snapshot(engine, tmp_path, 2)
    file = tmp_path / "file"
    file.write_text("not a folder")
    with pytest.raises(SnapshotError, match="is not a directory"):
        save_snapshot(busy, file)
    with pytest.raises(SnapshotError, match="is not a directory"):
        restore_snapshot(engine, file)
    assert engine.manager.num_cached_blocks(0) == 0


def test_array_digest_reads_bfloat16_and_tells_dtypes_apart():
    bf16 = np.ones(4, ml_dtypes.bfloat16)
    as_f16 = bf16.view(np.float16)  # the same bytes, another dtype
    assert snapshot._arrays_digest({"x": bf16}) != snapshot._arrays_digest({"x": as_f16})


def test_a_refused_restore_changes_nothing(model, busy, tmp_path):
    save_snapshot(busy, tmp_path)
    kv = KvCacheConfig(tokens_per_block=4, max_tokens=4 * 12, use_kv_cache_manager_v2="true")
    v2 = Engine(model, kv, SchedulerConfig(max_num_tokens=64, prefill_chunk_size=32), max_seq_len=32)
    prompt = list(range(1, 14))
    [first] = v2.generate([prompt], GREEDY)
    with pytest.raises(ValueError, match=r"restore_snapshot"
                       r" needs the V1 manager .*KVCacheManagerV2 .*use_kv_cache_manager_v2='false'"):
        restore_snapshot(v2, tmp_path)
    with pytest.raises(ValueError, match=r"save_snapshot"
                       r" needs the V1 manager .*KVCacheManagerV2 .*use_kv_cache_manager_v2='false'"):
        save_snapshot(v2, tmp_path / "v2")
    [again] = v2.generate([prompt], GREEDY)
    assert again.output == first.output and again.num_reused_tokens == 12


def test_the_latest_complete_step_is_restored_past_an_empty_one(model, busy, tmp_path):
    step = save_snapshot(busy, tmp_path)
    (tmp_path / str(step + 4)).mkdir()  # a step folder a crash or an operator left empty
    state, arrays = busy.manager.state_dict(), cache_arrays(busy)
    restored = make_engine(model)
    assert restore_snapshot(restored, tmp_path) == step
    assert_same_cache(restored, state, arrays)


def test_a_snapshot_that_cannot_be_written_names_the_folder(busy, tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(SnapshotError, match=r"cannot write a snapshot under '.*/file/snap'"):
        save_snapshot(busy, tmp_path / "file" / "snap")
