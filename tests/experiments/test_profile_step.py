"""configs/profile_step.py:tiny on the real model: the trace's ops are joined with the compiled
HLO, and the dots found account for exactly the model's weight FLOPs."""

from __future__ import annotations

import csv

import pytest

from configs import profile_step as profile_step_config
from experiments import profile_step


@pytest.mark.real_model
def test_profile_labels_every_weight_matmul(tmp_path, smollm2):
    results = profile_step.run(profile_step_config.get_config("tiny"), tmp_path)
    rows = {r["row"]: r for r in results["rows"]}
    assert set(rows) == {"decode_b2", "prefill_64"}
    cfg = smollm2.config
    d, f = cfg.d_model, cfg.ffn_dim
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    with open(tmp_path / "ops_decode_b2.csv") as fh:
        ops = list(csv.DictReader(fh))
    # The gate and up projections of every layer were traced, each labelled with its weight's shape.
    gate_up = [o for o in ops if o["label"] == f"dot f32[2, {d}] x [{d}, {f}]"]
    assert len(gate_up) == 2 * cfg.num_layers and all(float(o["events_per_step"]) >= 1 for o in gate_up)
    # The traced weight matmuls (2-D right operand) are exactly the model's: 2 rows x 2 FLOPs per MAC.
    weight_dots = [o for o in ops if o["label"].startswith("dot") and o["label"].count(",") == 2]
    per_layer = d * (q + 2 * kv) + q * d + 3 * d * f
    assert sum(int(o["flops"]) for o in weight_dots) == 2 * 2 * (cfg.num_layers * per_layer + cfg.vocab_size * d)
    assert rows["decode_b2"]["dot_share"] > 0.5  # a decode step is its matmuls
    assert all(r["wall_ms"] > 0 and r["cpu_ms"] >= 0.5 * r["wall_ms"] for r in rows.values())
    assert any((tmp_path / "trace" / "decode_b2").glob("**/*.xplane.pb"))
    assert "decode_b2: ops grouped by label" in (tmp_path / "summary.md").read_text()
    # The components' weight products are the model's layer products at the row's rows: their
    # FLOPs (from the parameter sizes) equal the traced layer dots' (from the compiled HLO, less the head).
    parts = {p["row"]: p for p in results["components"]}
    decode = parts["decode_b2"]
    traced_layers = sum(int(o["flops"]) for o in weight_dots) - 2 * 2 * cfg.vocab_size * d
    assert decode["products_flops"] == traced_layers
    assert all(p["forward_ms"] > 0 and p["attention_ms"] > 0 and p["products_ms"] > 0 for p in parts.values())
    assert "Components (wall ms per forward" in (tmp_path / "summary.md").read_text()


def test_unknown_row_is_an_error():
    with pytest.raises(
        ValueError, match=r"row='decode_8' must be 'decode_b<batch>', 'prefill_<tokens>' or 'extend_<tokens>_<cached>'"
    ):
        profile_step.step_args(None, "decode_8", 16, 100)


def test_unknown_preset_is_an_error():
    with pytest.raises(ValueError, match="unknown preset 'huge'; allowed: '' \\(default\\) or 'tiny'"):
        profile_step_config.get_config("huge")
