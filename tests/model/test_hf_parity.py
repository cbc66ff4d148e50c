"""Tiny Hugging Face checkpoints of every supported family against transformers' own outputs
(``tests/fixtures/hf/``, made by ``tests/fixtures/make_hf_fixtures.py``), through the paged
engine: logits over 640 tokens, greedy continuations from 64 and from 600 tokens (past the
Gemma window and llama3's original context); the older ``config.json`` spelling loads the same
model; and each feature runs end to end on a loaded checkpoint: prefix reuse, CacheBlend,
speculative decoding, snapshots and quantized KV."""

from __future__ import annotations

import dataclasses
import pathlib
import shutil

import numpy as np
import pytest

from experiments.blender import FULL_RECOMPUTE, make_blender
from kvjax.blend.prompt import BlendPrompt
from kvjax.blend.selection import SelectionConfig
from kvjax.config import KvCacheConfig, SchedulerConfig, SpeculativeConfig
from kvjax.engine import Engine
from kvjax.model.hf_checkpoint import load_hf
from kvjax.model.registry import load_model
from kvjax.sampling import SamplingParams
from kvjax.snapshot import restore_snapshot, save_snapshot

HF = pathlib.Path(__file__).parents[1] / "fixtures" / "hf"
FAMILIES = sorted(p.name for p in HF.iterdir() if (p / "reference.npz").is_file())
GREEDY = SamplingParams(max_new_tokens=1, ignore_eos=True)


def engine_for(model, **kv) -> Engine:
    return Engine(model, KvCacheConfig(tokens_per_block=16, max_tokens=4096, **kv),
                  SchedulerConfig(max_num_tokens=1024, prefill_chunk_size=1024), max_seq_len=1024)


def test_every_family_has_a_fixture():
    assert FAMILIES == ["gemma3", "llama", "llama3_scaled", "llama_linear", "mistral", "qwen2", "qwen3"]


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_greedy_tokens_equal_transformers(family):
    ref = np.load(HF / family / "reference.npz")
    model = load_model(str(HF / family))
    engine = engine_for(model)
    ids = ref["token_ids"].tolist()
    [out] = engine.generate([ids], dataclasses.replace(GREEDY, prompt_logits=len(ids)))
    logits = out.prompt_logits  # [640, V]
    np.testing.assert_allclose(logits[ref["logit_positions"]], ref["logits_at_positions"], rtol=0, atol=2e-3)
    sure = ref["argmax_margin"] > 1e-3  # near-ties may flip in float32
    assert (logits.argmax(-1)[sure] == ref["argmax"][sure]).all()
    [short] = engine.generate([ids[:64]], dataclasses.replace(GREEDY, max_new_tokens=32))
    [long] = engine.generate([ids[:600]], dataclasses.replace(GREEDY, max_new_tokens=16))
    assert short.output == ref["greedy_from_64"].tolist()
    assert long.output == ref["greedy_from_600"].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_the_older_config_spelling_loads_the_same_model(family, tmp_path):
    """Top-level ``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq`` /
    ``sliding_window_pattern`` (transformers 4) give the same config as ``rope_parameters``."""
    folder = shutil.copytree(HF / family, tmp_path / family)
    (folder / "config.json").write_text((folder / "config_v4.json").read_text())
    assert load_hf(folder)[0] == load_hf(HF / family)[0]


@pytest.fixture(scope="module")
def qwen2():
    return load_model(str(HF / "qwen2"))


def test_prefix_reuse_on_a_loaded_checkpoint_equals_a_cold_prefill(qwen2):
    ids = np.load(HF / "qwen2" / "reference.npz")["token_ids"].tolist()
    engine = engine_for(qwen2)
    sampling = dataclasses.replace(GREEDY, max_new_tokens=8, return_logits=True)
    engine.generate([ids[:400]], sampling)
    [warm] = engine.generate([ids[:400] + ids[500:540]], sampling)
    [cold] = engine_for(qwen2, enable_block_reuse=False).generate([ids[:400] + ids[500:540]], sampling)
    assert warm.num_reused_tokens == 400 and warm.output == cold.output
    np.testing.assert_allclose(np.stack(warm.logits), np.stack(cold.logits), atol=1e-4)


@pytest.fixture(scope="module")
def llama3_blend():
    """(blender, prompt, full recompute's and full reuse's last logits) on the llama3 checkpoint:
    a prefix, two stored chunks of 192 and 200 tokens, a suffix."""
    model = load_model(str(HF / "llama3_scaled"))
    ids = np.load(HF / "llama3_scaled" / "reference.npz")["token_ids"].tolist()
    prompt = BlendPrompt(
        prefix=tuple(ids[:8]), chunks=(tuple(ids[8:200]), tuple(ids[200:400])), suffix=tuple(ids[400:416])
    )
    blender = make_blender(model.config, model.params, prompt)
    full = blender.run(prompt, FULL_RECOMPUTE).logits[-1]
    reuse = blender.run(prompt, SelectionConfig(selector="none", row_bucket=16)).logits[-1]
    return blender, prompt, full, reuse


def test_cacheblend_on_a_loaded_checkpoint_keeps_its_identities(llama3_blend):
    """On llama3 (scaled RoPE: the chunk keys' re-rotation must scale too): selecting every
    token equals full recompute; a 15% blend lies between full reuse and full recompute."""
    blender, prompt, full, reuse = llama3_blend
    every = blender.run(prompt, SelectionConfig(selector="all", row_bucket=16)).logits[-1]
    blend = blender.run(
        prompt, SelectionConfig(recompute_ratio=0.15, check_layers=(1,), budgets=(1.0,), row_bucket=16)
    ).logits[-1]
    scale = np.abs(full).max()
    assert np.abs(every - full).max() / scale < 1e-5
    assert np.abs(blend - full).max() < np.abs(reuse - full).max()


def test_speculative_decoding_on_a_loaded_checkpoint_is_greedy_exact(qwen2):
    ids = np.load(HF / "qwen2" / "reference.npz")["token_ids"].tolist()
    prompt = ids[:100] + ids[:100]  # repeats: the n-gram drafter finds its drafts
    sampling = dataclasses.replace(GREEDY, max_new_tokens=24)
    [plain] = engine_for(qwen2).generate([prompt], sampling)
    spec = Engine(qwen2, KvCacheConfig(tokens_per_block=16, max_tokens=4096), SchedulerConfig(), max_seq_len=1024,
                  speculative=SpeculativeConfig(method="ngram", num_draft_tokens=4))
    [out] = spec.generate([prompt], sampling)
    assert out.output == plain.output and spec.timings["spec_accepted"] > 0


def test_snapshot_of_a_loaded_checkpoint_restores_its_reuse(qwen2, tmp_path):
    ids = np.load(HF / "qwen2" / "reference.npz")["token_ids"].tolist()
    engine = engine_for(qwen2)
    engine.generate([ids[:300]], GREEDY)
    save_snapshot(engine, tmp_path)
    restored = engine_for(qwen2)
    restore_snapshot(restored, tmp_path)
    [warm] = restored.generate([ids[:300] + ids[300:310]], GREEDY)
    assert warm.num_reused_tokens == 288


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_quantized_kv_on_a_loaded_checkpoint_stays_close(qwen2, dtype):
    """Quantized pages change the logits, a little (bounds for a random tiny model, whose logits
    are sharper than a trained one's; the real-model bounds are in tests/cache/test_kv_quant.py)."""
    ids = np.load(HF / "qwen2" / "reference.npz")["token_ids"].tolist()[:512]
    sampling = dataclasses.replace(GREEDY, prompt_logits=1)
    [exact] = engine_for(qwen2).generate([ids], sampling)
    [quant] = engine_for(qwen2, dtype=dtype).generate([ids], sampling)
    diff = np.abs(quant.prompt_logits - exact.prompt_logits).max() / np.abs(exact.prompt_logits).max()
    assert 0 < diff < (0.02 if dtype == "int8" else 0.25)


@pytest.mark.parametrize(
    "selector", ["cacheblend", "cacheblend_single", "epic", "query_aware", "query_aware_fused", "random"]
)
def test_every_selector_runs_on_a_loaded_checkpoint(llama3_blend, selector):
    """Each published selector's blended prefill on the llama3 checkpoint recomputes a share of
    the chunk tokens after its check layer and lands nearer full recompute than full reuse."""
    blender, prompt, full, reuse = llama3_blend
    run = blender.run(prompt, SelectionConfig(selector=selector, recompute_ratio=0.3, check_layers=(1,), budgets=(1.0,),
                                              row_bucket=16))
    chunk = np.zeros(len(prompt.tokens), bool)
    for s, e in prompt.roles.chunk_spans:
        chunk[s:e] = True
    share = run.report.recomputed[-1][chunk].mean()
    assert 0.1 < share < 0.6, share
    assert np.isfinite(run.logits[-1]).all()
    if selector != "random":
        assert np.abs(run.logits[-1] - full).max() < np.abs(reuse - full).max()
