"""The model: parity with HF transformers and with an independent numpy forward, paged
prefill / chunked prefill / decode equal to an unpaged run, on real weights and tiny ones."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from kvjax.config import KvCacheConfig
from kvjax.engine import Engine
from kvjax.sampling import SamplingParams
from kvjax.testing.numpy_forward import numpy_logits
from kvjax.testing.paged import chunked_logits
from kvjax.testing.tiny import tiny_model


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def test_tokenizer_matches_reference_ids(smollm2, hf_reference, reference_text):
    ids = smollm2.tokenizer.encode(reference_text)
    np.testing.assert_array_equal(ids, hf_reference["token_ids"])
    assert smollm2.tokenizer.decode(ids) == reference_text


def test_chat_template_is_chatml(smollm2):
    text = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    ids = smollm2.tokenizer.encode(text)
    assert ids.count(smollm2.tokenizer.backend.token_to_id("<|im_start|>")) == 3


def test_logits_match_hf_transformers_on_546_tokens(smollm2, hf_reference):
    """Parity with an independent implementation (HF transformers) on real text: a wrong
    RoPE layout or weight permutation fails here even though short prompts look fine."""
    tokens = hf_reference["token_ids"]
    logits, _, _ = chunked_logits(smollm2.params, smollm2.config, tokens, [len(tokens)])
    at = hf_reference["logit_positions"]
    assert rel_err(logits[at], hf_reference["logits_at_positions"]) < 1e-3
    np.testing.assert_array_equal(logits.argmax(-1), hf_reference["argmax"])
    logprobs = np.asarray(jax.nn.log_softmax(logits[:-1], axis=-1))[np.arange(len(tokens) - 1), tokens[1:]]
    np.testing.assert_allclose(logprobs, hf_reference["next_token_logprob"], atol=2e-3)
    assert abs(np.exp(-logprobs.mean()) - 28.39) < 0.05


def test_logits_match_numpy_forward_on_546_tokens(smollm2, hf_reference):
    tokens = hf_reference["token_ids"]
    logits, _, _ = chunked_logits(smollm2.params, smollm2.config, tokens, [len(tokens)])
    expected = numpy_logits(smollm2.params, smollm2.config, tokens, dtype=np.float32)
    assert rel_err(logits, expected) < 1e-3


def test_chunked_prefill_and_decode_equal_one_prefill(smollm2, hf_reference):
    """Same logits whether the 546 tokens arrive at once, in uneven chunks, or as a
    prefill followed by single-token decode steps, with a shuffled page table."""
    tokens = hf_reference["token_ids"]
    whole, _, _ = chunked_logits(smollm2.params, smollm2.config, tokens, [546], tokens_per_block=32)
    chunked, _, _ = chunked_logits(smollm2.params, smollm2.config, tokens, [100, 37, 200, 1, 200, 1, 1, 1, 1, 1, 1, 1, 1], tokens_per_block=16, seed=3)
    assert rel_err(chunked, whole) < 1e-4
    np.testing.assert_array_equal(chunked.argmax(-1), whole.argmax(-1))


def test_engine_greedy_continuation_matches_hf(smollm2, hf_reference):
    engine = Engine(smollm2, KvCacheConfig(tokens_per_block=16, max_tokens=1024), max_seq_len=512)
    prompt = hf_reference["token_ids"][:64].tolist()
    [out] = engine.generate([prompt], SamplingParams(max_new_tokens=16, ignore_eos=True))
    np.testing.assert_array_equal(out.output, hf_reference["greedy_from_64"][:16])


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (4, 1)])
def test_tiny_paged_equals_numpy_mha_gqa_mqa(num_heads, num_kv_heads):
    cfg, params = tiny_model(seed=num_kv_heads, num_heads=num_heads, num_kv_heads=num_kv_heads)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, 70)
    logits, _, _ = chunked_logits(params, cfg, tokens, [33, 1, 30, 1, 5], tokens_per_block=8)
    assert rel_err(logits, numpy_logits(params, cfg, tokens)) < 1e-4


def test_tiny_sliding_window_gemma_style_equals_numpy():
    cfg, params = tiny_model(
        seed=7, num_layers=3, num_kv_heads=1, sliding_window=8, global_layer_period=3,
        rope_local_theta=10_000.0, rope_theta=1_000_000.0, qk_norm=True, sandwich_norm=True,
        embed_scale=True, activation="gelu_tanh", query_scale=0.2,
    )
    assert cfg.layer_windows == (8, 8, cfg.max_seq_len)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, 50)
    logits, _, _ = chunked_logits(params, cfg, tokens, [20, 1, 1, 28], tokens_per_block=4)
    assert rel_err(logits, numpy_logits(params, cfg, tokens)) < 1e-4
