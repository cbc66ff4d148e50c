"""The model: parity with HF transformers and with an independent numpy forward, paged
prefill / chunked prefill / decode equal to an unpaged run, on real weights and tiny ones."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache import init_pool
from kvjax.config import KvCacheConfig
from kvjax.engine import Engine
from kvjax.model.transformer import CONV_MAX_ROWS, forward, forward_by_layer, forward_for, layer_kind, linear, unembed
from kvjax.sampling import SamplingParams
from kvjax.testing.numpy_forward import numpy_logits
from kvjax.testing.paged import chunked_logits, single_group_layout
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
    chunked, _, _ = chunked_logits(
        smollm2.params,
        smollm2.config,
        tokens,
        [100, 37, 200, 1, 200, 1, 1, 1, 1, 1, 1, 1, 1],
        tokens_per_block=16,
        seed=3,
    )
    assert rel_err(chunked, whole) < 1e-4
    np.testing.assert_array_equal(chunked.argmax(-1), whole.argmax(-1))


def test_engine_greedy_continuation_matches_hf(smollm2, hf_reference):
    engine = Engine(smollm2, KvCacheConfig(tokens_per_block=16, max_tokens=1024), max_seq_len=512)
    prompt = hf_reference["token_ids"][:64].tolist()
    [out] = engine.generate([prompt], SamplingParams(max_new_tokens=16, ignore_eos=True))
    np.testing.assert_array_equal(out.output, hf_reference["greedy_from_64"][:16])


@pytest.mark.parametrize("seqs,tokens", [(1, 1), (8, 1), (4, 8), (1, CONV_MAX_ROWS), (1, CONV_MAX_ROWS + 1), (3, 16)])
def test_few_row_products_run_as_convolutions_and_equal_the_dot(seqs, tokens):
    """``linear`` and ``unembed`` give the dot's values; on CPU they lower to a convolution
    exactly when the product has at most CONV_MAX_ROWS rows."""
    rng = np.random.default_rng(seqs * 100 + tokens)
    x = jnp.asarray(rng.standard_normal((seqs, tokens, 96), np.float32))
    w = jnp.asarray(rng.standard_normal((96, 160), np.float32))
    embed = jnp.asarray(rng.standard_normal((320, 96), np.float32))
    np.testing.assert_allclose(linear(x, w), np.asarray(x) @ np.asarray(w), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(unembed(x, embed), np.asarray(x) @ np.asarray(embed).T, rtol=2e-5, atol=2e-5)
    assert linear(x, w).shape == (seqs, tokens, 160) and unembed(x, embed).shape == (seqs, tokens, 320)
    as_convolution = seqs * tokens <= CONV_MAX_ROWS and jax.default_backend() == "cpu"
    for fn, weight in ((linear, w), (unembed, embed)):
        hlo = jax.jit(fn).lower(x, weight).as_text()
        assert ("convolution" in hlo) == as_convolution, (fn.__name__, seqs * tokens)


def test_batch8_decode_step_equals_prefill_on_513_tokens(smollm2, hf_reference):
    """A batch-8 decode step (few rows: the convolution form on CPU) gives the logits that
    one 513-token prefill (the plain dot) gives at its last position, for 8 different
    sequences of the real text."""
    cfg = smollm2.config
    seqs = np.stack([hf_reference["token_ids"][i * 3 : i * 3 + 513] for i in range(8)]).astype(np.int32)
    layout = single_group_layout(cfg, 8 * 33 + 1, 16)
    tables = (jnp.asarray(1 + np.arange(8 * 33, dtype=np.int32).reshape(8, 33)),) * layout.num_groups
    positions = jnp.broadcast_to(jnp.arange(513, dtype=jnp.int32), (8, 513))
    lengths = jnp.full((8,), 513, jnp.int32)
    whole, _ = forward(
        smollm2.params, init_pool(layout), jnp.asarray(seqs), positions, tables, lengths, cfg=cfg, layout=layout
    )
    _, pool = forward(
        smollm2.params, init_pool(layout), jnp.asarray(seqs[:, :512]), positions[:, :512], tables, lengths - 1,
        cfg=cfg, layout=layout, logits_mode="none",
    )
    step, _ = forward(
        smollm2.params, pool, jnp.asarray(seqs[:, 512:]), positions[:, 512:], tables, lengths, cfg=cfg, layout=layout
    )
    assert rel_err(np.asarray(step), np.asarray(whole)) < 1e-4
    np.testing.assert_array_equal(np.asarray(step).argmax(-1), np.asarray(whole).argmax(-1))


def test_forward_by_layer_equals_forward_on_546_tokens(smollm2, hf_reference):
    """The layer-by-layer forward (one compiled program per layer kind) gives the whole-model
    forward's logits and pages on the real text, through chunked prefill and decode steps."""
    tokens = hf_reference["token_ids"]
    chunks = [300, 1, 200, 1, len(tokens) - 502]
    whole, whole_pool, _ = chunked_logits(smollm2.params, smollm2.config, tokens, chunks, compile_unit="model")
    by_layer, pool, _ = chunked_logits(smollm2.params, smollm2.config, tokens, chunks, compile_unit="layer")
    assert rel_err(by_layer, whole) < 1e-5
    np.testing.assert_array_equal(by_layer.argmax(-1), whole.argmax(-1))
    for a, b in zip(pool.k + pool.v, whole_pool.k + whole_pool.v):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    assert {layer_kind(smollm2.config, single_group_layout(smollm2.config, 4, 16), i) for i in range(30)} == {0}


def test_forward_for_picks_the_compile_unit():
    assert forward_for("model") is forward and forward_for("layer") is forward_by_layer
    assert forward_for("auto") is (forward_by_layer if jax.default_backend() == "cpu" else forward)
    with pytest.raises(ValueError, match=r"compile_unit='scan' must be one of \('auto', 'model', 'layer'\)"):
        forward_for("scan")


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (4, 1)])
def test_tiny_paged_equals_numpy_mha_gqa_mqa(num_heads, num_kv_heads):
    cfg, params = tiny_model(seed=num_kv_heads, num_heads=num_heads, num_kv_heads=num_kv_heads)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, 70)
    logits, _, _ = chunked_logits(params, cfg, tokens, [33, 1, 30, 1, 5], tokens_per_block=8)
    assert rel_err(logits, numpy_logits(params, cfg, tokens)) < 1e-4


@pytest.mark.parametrize("compile_unit", ["model", "layer"])
def test_tiny_sliding_window_gemma_style_equals_numpy(compile_unit):
    cfg, params = tiny_model(
        seed=7, num_layers=3, num_kv_heads=1, sliding_window=8, global_layer_period=3,
        rope_local_theta=10_000.0, rope_theta=1_000_000.0, qk_norm=True, sandwich_norm=True,
        embed_scale=True, activation="gelu_tanh", query_scale=0.2,
    )
    assert cfg.layer_windows == (8, 8, cfg.max_seq_len)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, 50)
    logits, _, _ = chunked_logits(params, cfg, tokens, [20, 1, 1, 28], tokens_per_block=4, compile_unit=compile_unit)
    assert rel_err(logits, numpy_logits(params, cfg, tokens)) < 1e-4
    layout = single_group_layout(cfg, 4, 4)
    # local layers share a program, the global one has its own
    assert [layer_kind(cfg, layout, i) for i in range(3)] == [0, 0, 2]
