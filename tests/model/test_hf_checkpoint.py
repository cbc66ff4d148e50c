"""Hugging Face checkpoint folders: round trips through ``save_hf`` / ``load_hf`` on tiny models of
every family shape, the refusals (architecture, RoPE type, missing shard, truncated file), and
the SmolLM2 round trip (GGUF weights written as an HF folder load back with identical logits)."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.model.hf_checkpoint import load_hf, save_hf
from kvjax.model.registry import load_model
from kvjax.model.rope import RopeScaling
from kvjax.model.transformer import Params
from kvjax.testing.numpy_forward import numpy_logits
from kvjax.testing.tiny import init_params, tiny_config

TOKENS = np.random.default_rng(0).integers(3, 97, 600)


def _with_extras(params: Params, *, bias: bool = False, lm_head: bool = False) -> Params:
    """Adds q/k/v biases and an untied output head (random) to tiny params."""
    rng = np.random.default_rng(1)
    layers = params.layers
    if bias:
        layers = tuple(
            dataclasses.replace(lp, **{name: jnp.asarray(rng.normal(0, 0.1, getattr(lp, w).shape[1]), jnp.float32)
                                       for name, w in (("bq", "wq"), ("bk", "wk"), ("bv", "wv"))})
            for lp in layers
        )
    head = jnp.asarray(rng.normal(0, 1, params.embed.shape), jnp.float32) if lm_head else None
    return dataclasses.replace(params, layers=layers, lm_head=head)


FAMILIES = {
    "llama": (dict(), {}),
    "llama3_scaled": (
        dict(rope_theta=500_000.0, rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 128)),
        dict(lm_head=True),
    ),
    "linear_scaled": (dict(rope_scaling=RopeScaling("linear", 4.0)), {}),
    "mistral_window": (dict(sliding_window=128), dict(lm_head=True)),
    "qwen2_bias": (dict(), dict(bias=True)),
    "qwen3_qk_norm": (dict(qk_norm=True), dict(lm_head=True)),
    "gemma3": (
        dict(
            num_layers=6,
            sliding_window=128,
            global_layer_period=3,
            rope_local_theta=10_000.0,
            rope_theta=1_000_000.0,
            activation="gelu_tanh",
            qk_norm=True,
            sandwich_norm=True,
            embed_scale=True,
            query_scale=24.0**-0.5,
        ),
        {},
    ),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_save_then_load_gives_the_same_model(tmp_path, family):
    """The folder ``save_hf`` writes loads back to the same config and weights, and the
    logits over 600 tokens (past the windows and llama3's 128 original positions) match."""
    overrides, extras = FAMILIES[family]
    cfg = tiny_config(name=family, **overrides)
    params = _with_extras(init_params(cfg, 3), **extras)
    folder = save_hf(cfg, params, None, tmp_path / family)
    hf = json.loads((folder / "config.json").read_text())
    loaded_cfg, loaded = load_hf(folder)
    assert loaded_cfg == cfg, (hf, loaded_cfg)
    for (path, a), (_, b) in zip(
        jax.tree_util.tree_flatten_with_path(params)[0], jax.tree_util.tree_flatten_with_path(loaded)[0]
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    assert jax.tree.structure(params) == jax.tree.structure(loaded)
    np.testing.assert_allclose(numpy_logits(loaded, loaded_cfg, TOKENS, np.float32, rows=[0, 599]),
                               numpy_logits(params, cfg, TOKENS, np.float32, rows=[0, 599]), atol=1e-4)


def test_rope_scaling_changes_the_logits_past_the_original_context():
    """The scaled and the plain model differ at position 599 (so the parity above tests the
    scaling), and agree at position 0 (RoPE of position 0 is the identity)."""
    plain = tiny_config(rope_theta=500_000.0)
    scaled = dataclasses.replace(plain, rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 128))
    params = init_params(plain, 3)
    a = numpy_logits(params, plain, TOKENS, np.float32, rows=[0, 599])
    b = numpy_logits(params, scaled, TOKENS, np.float32, rows=[0, 599])
    np.testing.assert_allclose(a[0], b[0], atol=1e-5)
    assert np.abs(a[1] - b[1]).max() > 1e-2


def _folder(tmp_path: pathlib.Path) -> pathlib.Path:
    cfg = tiny_config()
    return save_hf(cfg, init_params(cfg, 0), None, tmp_path / "tiny")


def _edit_config(folder: pathlib.Path, **changes) -> None:
    hf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf, **changes}))


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            dict(architectures=["FalconForCausalLM"]),
            r"architectures=\['FalconForCausalLM'\] is not supported; supported: \(",
        ),
        (
            dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
            r"rope_type='yarn' is not supported; supported: 'default', 'linear', 'llama3'",
        ),
        (dict(hidden_act="gelu"), r"hidden_act='gelu' is not supported for LlamaForCausalLM; supported: 'silu'"),
        (dict(final_logit_softcapping=30.0), r"final_logit_softcapping=30.0 is not supported"),
        (dict(num_attention_heads=None), r"config.json has no 'num_attention_heads'"),
        (dict(hidden_size=64), r"model.embed_tokens.weight has shape \(97, 32\); config.json says \(97, 64\)"),
    ],
)
def test_an_unsupported_or_inconsistent_config_is_a_clear_error(tmp_path, changes, message):
    folder = _folder(tmp_path)
    _edit_config(folder, **changes)
    with pytest.raises(ValueError, match=message):
        load_hf(folder)


def test_missing_and_broken_files_are_clear_errors(tmp_path):
    folder = _folder(tmp_path)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model.safetensors' is not a readable safetensors file"):
        load_hf(folder)
    weights.unlink()
    with pytest.raises(FileNotFoundError, match=r"has neither model.safetensors nor model.safetensors.index.json"):
        load_hf(folder)
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(FileNotFoundError, match=r"lists shard\(s\) \['model-00001-of-00002.safetensors'\]"):
        load_hf(folder)
    (folder / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"needs config.json"):
        load_hf(folder)
    with pytest.raises(ValueError, match=r"param_dtype='float16' must be None or one of"):
        load_hf(folder, param_dtype="float16")
    with pytest.raises(ValueError, match=r"model='/nonexistent/folder' is unknown"):
        load_model("/nonexistent/folder")


def test_sharded_checkpoints_load_through_their_index(tmp_path):
    """A checkpoint split over two safetensors files and an index loads like the single file."""
    from safetensors.numpy import load_file, save_file

    folder = _folder(tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, part in halves.items():
        save_file({n: tensors[n] for n in part}, str(folder / shard))
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {n: shard for shard, part in halves.items() for n in part}})
    )
    _, params = load_hf(folder)
    ref_cfg = tiny_config()
    np.testing.assert_array_equal(np.asarray(params.layers[1].wq), np.asarray(init_params(ref_cfg, 0).layers[1].wq))


def test_bfloat16_weights_on_request(tmp_path):
    _, params = load_hf(_folder(tmp_path), param_dtype="bfloat16")
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}


@pytest.mark.real_model
def test_smollm2_written_as_an_hf_folder_loads_back_with_identical_logits(smollm2, tmp_path, reference_text):
    """SmolLM2's GGUF weights, written with HF's names and q/k layout, load back through the
    HF path: same config, same tokenizer ids, identical logits."""
    folder = save_hf(smollm2.config, smollm2.params, smollm2.tokenizer, tmp_path / "smollm2")
    model = load_model(str(folder))
    assert dataclasses.replace(model.config, name=smollm2.config.name) == smollm2.config
    ids = smollm2.tokenizer.encode(reference_text)[:520]
    assert model.tokenizer.encode(reference_text)[:520] == ids
    assert model.tokenizer.eos_ids == smollm2.tokenizer.eos_ids
    from kvjax.testing.numpy_forward import numpy_logits as reference

    rows = [0, 255, 519]
    np.testing.assert_array_equal(reference(model.params, model.config, ids, np.float32, rows=rows),
                                  reference(smollm2.params, smollm2.config, ids, np.float32, rows=rows))


@pytest.mark.real_model
def test_eos_falls_back_to_the_tokenizer_config_then_is_refused(smollm2, tmp_path, caplog):
    """A folder whose config.json names no eos_token_id (as transformers 5 writes some Qwen
    folders) takes tokenizer_config.json's eos_token, saying so; with no eos anywhere it is refused."""
    folder = save_hf(smollm2.config, smollm2.params, smollm2.tokenizer, tmp_path / "smollm2")
    config = json.loads((folder / "config.json").read_text())
    config.pop("eos_token_id")
    (folder / "config.json").write_text(json.dumps(config))
    with caplog.at_level("INFO", logger="kvjax.model.hf_checkpoint"):
        cfg, _ = load_hf(folder)
    assert cfg.eos_ids == smollm2.config.eos_ids[:1]
    assert "using tokenizer_config.json's eos_token '<|im_end|>'" in caplog.text
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings.pop("eos_token")
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    with pytest.raises(ValueError, match="no eos token: config.json and generation_config.json have no eos_token_id"):
        load_hf(folder)
