"""Gemma 3 270M on real weights: tokenizer, parity with an independent implementation,
sliding-window layers bounded in memory, prefix reuse past the window, greedy prompt-lookup
speculation and Manager V2 equal to plain decoding and V1 across its two layer groups. The
engine-level Gemma tests live here so that no other module holds Gemma beside SmolLM2."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.cache import NULL_PAGE
from kvjax.config import KvCacheConfig, SchedulerConfig, SpeculativeConfig
from kvjax.engine import Engine
from kvjax.engine.manager_v2 import KVCacheManagerV2
from kvjax.sampling import SamplingParams
from kvjax.testing.numpy_forward import numpy_logits
from kvjax.testing.paged import chunked_logits
from kvjax.testing.sentencepiece_oracle import gemma_sentencepiece

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def gemma():
    from kvjax.model.registry import load_model

    return load_model("gemma3-270m")


@pytest.fixture(scope="module")
def long_ids(gemma, reference_text):
    return gemma.tokenizer.encode(reference_text + "\n\n" + reference_text)  # 1,065 tokens, BOS first


def test_architecture_from_gguf(gemma):
    cfg = gemma.config
    assert (cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (18, 640, 4, 1, 256)
    assert cfg.layer_windows == ((512,) * 5 + (32768,)) * 3
    assert cfg.layer_rope_theta[:6] == (10_000.0,) * 5 + (1_000_000.0,)
    assert cfg.sm_scale == 1 / 16


def test_tokenizer_round_trip_and_sentencepiece_parity(gemma, reference_text):
    reference = gemma_sentencepiece(gemma.path)
    space_runs = "def f():\n    return  1" + " " * 40
    for text in (reference_text, "a   b\t\tc\n\n\n naïve café — 東京 2024!", space_runs):
        ids = gemma.tokenizer.encode(text, add_bos=False)
        assert ids == reference.encode(text)
        assert gemma.tokenizer.decode(ids) == text
    assert gemma.tokenizer.encode("hi")[0] == gemma.config.bos_id == 2


def test_logits_match_numpy_forward_past_the_window(gemma, long_ids):
    """640 tokens: longer than the 512-token window, so local layers really drop keys."""
    tokens = np.asarray(long_ids[:640])
    logits, _, _ = chunked_logits(gemma.params, gemma.config, tokens, [300, 1, 339], tokens_per_block=32)
    rows = np.array([0, 255, 511, 512, 600, 639])
    expected = numpy_logits(gemma.params, gemma.config, tokens, dtype=np.float32, rows=rows)
    assert np.max(np.abs(logits[rows] - expected)) / np.max(np.abs(expected)) < 1e-3
    assert (logits[rows].argmax(-1) == expected.argmax(-1)).all()


def make_engine(model) -> Engine:
    kv = KvCacheConfig(tokens_per_block=32, max_tokens=32 * 80)
    return Engine(model, kv, SchedulerConfig(max_num_tokens=1024, prefill_chunk_size=256), max_seq_len=1536)


def test_windowed_group_memory_is_bounded_by_the_window(gemma, long_ids):
    engine = make_engine(gemma)
    assert engine.layout.group_windows == (512, 1536)
    rid = engine.submit(long_ids, SamplingParams(max_new_tokens=4, ignore_eos=True))
    most_local = 0
    while not engine.requests[rid].finished:
        engine.step()
        if not engine.requests[rid].finished:
            local = [p for p in engine.manager.block_table(rid, 0) if p != NULL_PAGE]
            full = [p for p in engine.manager.block_table(rid, 1) if p != NULL_PAGE]
            most_local = max(most_local, len(local))
    assert len(full) == -(-len(long_ids) // 32)  # the global layers keep every block
    assert most_local <= 512 // 32 + 1  # the local layers keep only the window's blocks


def test_prefix_reuse_past_the_window_gives_cold_logits(gemma, long_ids):
    sampling = SamplingParams(max_new_tokens=4, ignore_eos=True, return_logits=True)
    prompt = long_ids[:900]
    engine = make_engine(gemma)
    engine.generate([prompt], sampling)
    [warm] = engine.generate([prompt + long_ids[900:950]], sampling)
    [cold] = make_engine(gemma).generate([prompt + long_ids[900:950]], sampling)
    assert warm.num_reused_tokens >= 864
    assert warm.output == cold.output
    np.testing.assert_allclose(
        np.stack(warm.logits), np.stack(cold.logits), rtol=0, atol=1e-5 * np.abs(cold.logits[0]).max()
    )


def test_greedy_prompt_lookup_is_exact(gemma, reference_text):
    greedy = SamplingParams(max_new_tokens=256, ignore_eos=True)
    prompt = gemma.tokenizer.encode(reference_text)[:300]

    def make(speculative: SpeculativeConfig | None) -> Engine:
        kv = KvCacheConfig(tokens_per_block=16, max_tokens=4096, event_buffer_max_size=100_000)
        return Engine(gemma, kv, SchedulerConfig(max_num_tokens=512, prefill_chunk_size=512), max_seq_len=1024,
                      speculative=speculative)

    [plain] = make(None).generate([prompt], greedy)
    engine = make(SpeculativeConfig("ngram", num_draft_tokens=4))
    [spec] = engine.generate([prompt], greedy)  # 300 + 256 tokens: past the 512-token window
    assert spec.output == plain.output
    assert engine.timings["spec_drafted"] > engine.timings["spec_accepted"] > 0
    engine.manager.check_consistency()


def test_two_layer_groups_v2_equals_v1(gemma, reference_text):
    """The full and sliding-window (512) groups, a 600-token prompt past the window."""
    ids = gemma.tokenizer.encode(reference_text)
    prompts = [ids[:600], ids[50:130]]
    greedy = SamplingParams(max_new_tokens=40, ignore_eos=True)
    got = {}
    for v2 in ("false", "true", "auto"):
        config = KvCacheConfig(tokens_per_block=32, max_tokens=8192, use_kv_cache_manager_v2=v2)
        e = Engine(gemma, config, SchedulerConfig(num_decode_steps_per_dispatch=16), max_seq_len=1024)
        assert e.layout.num_groups == 2 and isinstance(e.manager, KVCacheManagerV2) == (v2 == "true")
        got[v2] = [o.output for o in e.generate(prompts, greedy)]
    assert got["true"] == got["false"] == got["auto"]
