"""The fidelity gate for blending (``kvjax.blend.fidelity``): a model passes or is refused by
its measured re-rotation error and blended KL, the error names the check and the value, and
the result is kept (in the process and in the cache folder) so the checks run once."""

from __future__ import annotations

import json
import re

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.blend import fidelity
from kvjax.blend.chunk_store import ChunkStore
from kvjax.blend.fidelity import FidelityConfig, FidelityError
from kvjax.model.rope import RopeScaling, apply_rope
from kvjax.testing.blend import tiny_engine
from kvjax.testing.tiny import tiny_model


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty kvjax cache folder and no report kept in this process."""
    monkeypatch.setenv("KVJAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(fidelity, "_REPORTS", {})
    return tmp_path


def test_a_tiny_model_passes_once_and_the_result_is_kept(fresh_cache, monkeypatch):
    cfg, params = tiny_model(0)
    engine = tiny_engine(cfg, params)
    report = ChunkStore(engine, variant="pos0").fidelity
    assert report.failure is None
    assert len(report.rotation_error) == cfg.num_layers
    assert 0 <= max(report.rotation_error) <= report.rotation_tolerance
    assert 0 <= report.kl <= report.max_kl
    saved = json.loads((fresh_cache / "fidelity" / f"{report.key}.json").read_text())
    assert saved["kl"] == report.kl

    def never(*_, **__):
        raise AssertionError("the gate ran its checks again")

    monkeypatch.setattr(fidelity, "check", never)
    assert ChunkStore(engine, variant="pos0").fidelity == report  # kept in the process
    monkeypatch.setattr(fidelity, "_REPORTS", {})
    assert ChunkStore(engine, variant="pos0").fidelity == report  # read back from the cache folder


def test_the_calibration_runs_on_an_engine_of_its_own(fresh_cache):
    cfg, params = tiny_model(0)
    engine = tiny_engine(cfg, params)
    before = engine.manager.num_free_pages(0)
    store = ChunkStore(engine, variant="pos0")
    assert store.fidelity is not None
    assert engine.manager.num_free_pages(0) == before and engine.manager.num_cached_blocks(0) == 0


def test_blended_kl_over_the_bound_is_refused_naming_the_check_and_value(fresh_cache):
    cfg, params = tiny_model(0)
    engine = tiny_engine(cfg, params)
    strict = FidelityConfig(max_kl=1e-12)
    with pytest.raises(FidelityError, match=r"blended KL against full recompute \S+ nats > max_kl=1e-12") as err:
        ChunkStore(engine, variant="pos0", fidelity=strict)
    measured = float(str(err.value).split("recompute ")[1].split(" nats")[0])
    assert measured > 1e-12
    with pytest.raises(FidelityError, match="max_kl=1e-12"):  # the refusal is kept too
        ChunkStore(engine, variant="pos0", fidelity=strict)
    assert ChunkStore(engine, variant="pos0", fidelity=None).fidelity is None  # no gate, no refusal


def test_a_rotation_that_does_not_compose_is_refused(fresh_cache, monkeypatch):
    """Re-rotation that forgets the layer's RoPE scaling (what a scaling the re-rotation does not
    model would do) leaves keys far from keys computed in place: refused at layer 0."""
    cfg, params = tiny_model(0, rope_scaling=RopeScaling("linear", 4.0))

    def unscaled(keys, deltas, theta, scaling=None):
        return apply_rope(keys, deltas, theta, None)

    monkeypatch.setattr(fidelity, "reposition_keys", unscaled)
    with pytest.raises(FidelityError, match=r"keys computed in place at layer \d+: relative error \S+ > "):
        ChunkStore(tiny_engine(cfg, params), variant="pos0")


def test_rotation_errors_of_a_composing_rope_are_float_rounding():
    cfg, params = tiny_model(0, rope_scaling=RopeScaling("llama3", 8.0, original_max_positions=64))
    tokens = np.random.default_rng(0).integers(3, cfg.vocab_size, 48).tolist()
    errors = fidelity.rotation_errors(params, cfg, tokens, [1, 300, 4000])
    assert errors.shape == (cfg.num_layers,)
    assert np.all(errors <= fidelity.rotation_tolerance("float32", 4048)), errors
    assert np.all(errors > 0)  # the comparison saw the keys (not two zero arrays)


BAD_SETTINGS = [
    ("recompute_ratio", 0.0, "in (0, 1]"), ("max_kl", -1.0, "> 0"), ("chunk_tokens", 8, "an int >= 16"),
    ("num_chunks", 1, "an int >= 2"), ("suffix_tokens", True, "an int >= 1"),
]


@pytest.mark.parametrize("field, value, allowed", BAD_SETTINGS)
def test_bad_settings_name_the_field_and_the_allowed_range(field, value, allowed):
    with pytest.raises(ValueError, match=re.escape(f"fidelity.{field}={value!r} must be {allowed}")):
        FidelityConfig(**{field: value})


def test_smollm2_passes_the_gate(smollm2, fresh_cache):
    from kvjax.config import KvCacheConfig
    from kvjax.engine import Engine

    engine = Engine(smollm2, KvCacheConfig(tokens_per_block=16, max_tokens=4096), max_seq_len=2048)
    report = ChunkStore(engine, variant="pos0").fidelity
    assert report.failure is None, report
    assert max(report.rotation_error) < 1e-3 and report.kl < 0.5 * report.max_kl, report
    assert jnp.dtype(smollm2.params.embed.dtype) == jnp.float32
