"""configs/kv_quant.py:tiny end to end on a 2-layer random model with SmolLM2's tokenizer (the
experiment's every part, fast); the real model's deviation is tested in ``test_kv_quant``."""

from __future__ import annotations

import json
import pathlib

import pytest

from configs import kv_quant as kv_quant_config
from experiments import kv_quant
from kvjax.model.registry import Model
from kvjax.testing.tiny import tiny_model

pytestmark = pytest.mark.slow  # an end-to-end run or subprocesses: the full suite, not the fast loop


@pytest.fixture
def tiny_smollm2(smollm2, monkeypatch) -> Model:
    cfg, params = tiny_model(vocab_size=smollm2.config.vocab_size, bos_id=smollm2.config.bos_id,
                             eos_ids=smollm2.config.eos_ids, name="tiny-smollm2")
    model = Model(config=cfg, params=params, tokenizer=smollm2.tokenizer, path=pathlib.Path("tiny"))
    monkeypatch.setattr(kv_quant, "load_model", lambda name: model)
    return model


def test_tiny_preset_writes_every_part(tiny_smollm2, tmp_path):
    config = kv_quant_config.get_config("tiny")
    with config.unlocked():
        config.blend.check_layers, config.blend.budgets = (1,), (1.0,)  # the tiny model has 2 layers
    results = kv_quant.run(config, tmp_path)
    quality = {(r["part"], r["dtype"], r["scales"]): r for r in results["quality"]}
    assert set(quality) == {(part, d, "token") for part in ("rag", "long") for d in ("int8", "fp8")}
    for row in quality.values():
        assert row["kl_lo"] <= row["kl"] <= row["kl_hi"] and row["kl"] > 0
        assert 0 <= row["top1"] <= 1 and 0 <= row["divergence"] <= row["positions"]
        assert row["bytes_per_token"] == 2 * 2 * 2 * (16 + 4)  # layers x K/V x kv_heads x (int8 values + f32 scale)
    blend = {(r["policy"], r["dtype"]): r for r in results["blend"]}
    assert set(blend) == {(p, d) for p in ("full_recompute", "cacheblend") for d in ("float32", "int8", "fp8")}
    assert blend[("full_recompute", "float32")]["kl"] == 0 and blend[("full_recompute", "float32")]["top1"] == 1
    assert blend[("full_recompute", "int8")]["kl"] > 0
    speed = {(r["dtype"], r["batch"]) for r in results["speed"]}
    assert speed == {(d, b) for d in ("float32", "int8", "fp8") for b in (1, 2)}
    assert all(r["ms_per_token"] > 0 for r in results["speed"])
    json.dumps(results)
    summary = (tmp_path / "summary.md").read_text()
    assert "CacheBlend 15% on quantized vs float32 chunk KV" in summary
    assert (tmp_path / "per_prompt.csv").exists()


def test_unknown_preset_is_an_error():
    with pytest.raises(ValueError, match="preset='huge' must be '' or 'tiny'"):
        kv_quant_config.get_config("huge")
