"""The generate config runs a Hugging Face checkpoint folder as its model (``--config.model=<folder>``),
in float32 and, on request, in bfloat16 weights with a bfloat16 KV cache (``dtype="auto"``)."""

from __future__ import annotations

import pathlib

import pytest

from configs import generate as generate_config
from experiments import generate

QWEN2 = pathlib.Path(__file__).parents[1] / "fixtures" / "hf" / "qwen2"


@pytest.mark.parametrize("param_dtype, bytes_per_value", [("", 4), ("bfloat16", 2)])
def test_generate_runs_a_checkpoint_folder(tmp_path, param_dtype, bytes_per_value):
    config = generate_config.get_config("tiny")
    config.update(model=str(QWEN2), param_dtype=param_dtype, chat=False, prompt="a b c d")
    results = generate.run(config, tmp_path)
    assert len(results["output_tokens"]) == config.max_new_tokens
    # 2 layers x (K + V) x 2 KV heads x head_dim 16 values per token
    assert results["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * bytes_per_value
    assert (tmp_path / "summary.md").is_file()
