"""Hybrid recurrent models: the JAX forward (chunked scan) against the numpy oracle (the plain
sequential recurrence), chunked prefill and decode against one-shot prefill, batch rows
independent, and the state pool ops."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache import init_pool
from kvjax.cache.state_pool import (
    NULL_SLOT,
    copy_slots,
    init_state_pool,
    read_slots,
    slot_bytes,
    state_shape,
    write_slots,
    zero_slots,
)
from kvjax.model.config import ModelConfig
from kvjax.model.recurrent import CHUNK
from kvjax.model.transformer import Params, forward, forward_for
from kvjax.testing.numpy_forward import numpy_logits, recurrent_layer_numpy
from kvjax.testing.paged import single_group_layout
from kvjax.testing.tiny import init_params, tiny_config, tiny_hybrid_config


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.fixture(scope="module")
def hybrid() -> tuple[ModelConfig, Params]:
    cfg = tiny_hybrid_config()
    return cfg, init_params(cfg, seed=1)


def zero_state(cfg: ModelConfig, rows: int) -> jnp.ndarray:
    return jnp.zeros(state_shape(len(cfg.recurrent_layers), rows, cfg.num_heads, cfg.head_dim), jnp.float32)


def run_chunks(params: Params, cfg: ModelConfig, tokens: np.ndarray, chunks: list[int], tokens_per_block: int = 16,
               compile_unit: str = "model"):
    """Every position's logits [T, V] and the final state [R, 1, H, d, d] of one sequence fed in ``chunks``."""
    pages = -(-len(tokens) // tokens_per_block)
    layout = single_group_layout(cfg, pages + 3, tokens_per_block)
    rng = np.random.default_rng(len(chunks))
    table = (jnp.asarray(rng.permutation(pages + 2)[:pages] + 1, jnp.int32)[None],) * layout.num_groups
    pool, state, out, start = init_pool(layout), zero_state(cfg, 1), [], 0
    for n in chunks:
        logits, pool, state = forward_for(compile_unit)(
            params,
            pool,
            jnp.asarray(tokens[None, start : start + n]),
            jnp.arange(start, start + n, dtype=jnp.int32)[None],
            table,
            jnp.array([start + n], jnp.int32),
            cfg=cfg,
            layout=layout,
            logits_mode="all",
            state=state,
        )
        out.append(np.asarray(logits[0]))
        start += n
    return np.concatenate(out), np.asarray(state)


def test_layer_types_cycle_and_validate():
    cfg = tiny_hybrid_config(num_layers=6, layer_types=("recurrent", "attention"))
    assert cfg.recurrent_layers == (0, 2, 4) and cfg.is_hybrid
    assert not tiny_config().is_hybrid and tiny_config().recurrent_layers == ()
    with pytest.raises(ValueError, match="layer_types="):
        tiny_hybrid_config(layer_types=("recurrent", "mamba"))
    with pytest.raises(ValueError, match="layer_types="):
        tiny_hybrid_config(layer_types=())


def test_forward_matches_numpy_oracle_on_600_tokens(hybrid):
    """The chunked scan (CHUNK-token chunks carried by lax.scan, a padded last chunk) equals the
    sequential float64 recurrence on 600 tokens: > 9 chunks, so an error in the carried state
    between chunks shows."""
    cfg, params = hybrid
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, 600).astype(np.int32)
    assert len(tokens) > 9 * CHUNK
    logits, _ = run_chunks(params, cfg, tokens, [600])
    assert rel_err(logits, numpy_logits(params, cfg, tokens)) < 1e-5


def test_final_state_matches_numpy_recurrence(hybrid):
    """The state forward returns is the oracle's state after the last token (first layer)."""
    cfg, params = hybrid
    tokens = np.random.default_rng(5).integers(0, cfg.vocab_size, 130).astype(np.int32)
    _, state = run_chunks(params, cfg, tokens, [130])
    lp = params.layers[0]
    x = np.asarray(params.embed, np.float64)[tokens]
    h = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.rms_eps) * np.asarray(lp.attn_norm, np.float64)
    _, expected = recurrent_layer_numpy(lp, cfg, h, np.zeros((cfg.num_heads, cfg.head_dim, cfg.head_dim)))
    assert rel_err(state[0, 0], expected) < 1e-5


@pytest.mark.parametrize("compile_unit", ["model", "layer"])
def test_chunked_prefill_then_decode_equals_one_shot(hybrid, compile_unit):
    """Also layer by layer: the recurrent layers' states pass between their own programs."""
    cfg, params = hybrid
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, 560).astype(np.int32)
    whole, whole_state = run_chunks(params, cfg, tokens, [560])
    chunks = [100, 37, 1, 200, 1, 1, 64, 150, 1, 1, 1, 1, 1, 1]
    parts, parts_state = run_chunks(params, cfg, tokens, chunks, compile_unit=compile_unit)
    assert rel_err(parts, whole) < 1e-5
    assert rel_err(parts_state, whole_state) < 1e-5


def test_batch_rows_are_independent(hybrid):
    """Rows of different lengths (padding at the end, -1 positions) and starting states give
    each row's own single-row result; padding leaves a row's state unchanged."""
    cfg, params = hybrid
    rng = np.random.default_rng(3)
    lengths = [90, 17, 64]
    prefixes = [30, 0, 5]
    seqs = [rng.integers(0, cfg.vocab_size, p + n).astype(np.int32) for p, n in zip(prefixes, lengths)]
    singles = [run_chunks(params, cfg, s, [p, len(s) - p] if p else [len(s)]) for s, p in zip(seqs, prefixes)]
    page = 16
    layout = single_group_layout(cfg, 3 * 8 + 2, page)
    t = max(lengths)
    tokens = np.zeros((3, t), np.int32)
    positions = np.full((3, t), -1, np.int32)
    table = np.zeros((3, 8), np.int32)
    states = []
    pool = init_pool(layout)
    for i, (s, p, n) in enumerate(zip(seqs, prefixes, lengths)):
        table[i] = np.arange(1 + 8 * i, 9 + 8 * i)
        tokens[i, :n], positions[i, :n] = s[p:], np.arange(p, p + n)
        if p:  # write the prefix's KV and get its state first
            _, pool, st = forward(
                params, pool, jnp.asarray(s[None, :p]), jnp.arange(p, dtype=jnp.int32)[None],
                (jnp.asarray(table[i : i + 1]),), jnp.array([p], jnp.int32), cfg=cfg, layout=layout,
                logits_mode="none", state=zero_state(cfg, 1),
            )
            states.append(st[:, 0])
        else:
            states.append(zero_state(cfg, 1)[:, 0])
    logits, _, state = forward(
        params, pool, jnp.asarray(tokens), jnp.asarray(positions), (jnp.asarray(table),),
        jnp.asarray([p + n for p, n in zip(prefixes, lengths)], jnp.int32), cfg=cfg, layout=layout,
        logits_mode="all", state=jnp.stack(states, axis=1),
    )
    for i, (n, (single, single_state)) in enumerate(zip(lengths, singles)):
        assert rel_err(np.asarray(logits[i, :n]), single[prefixes[i] :]) < 1e-5
        assert rel_err(np.asarray(state[:, i]), single_state[:, 0]) < 1e-5


def test_forward_requires_state_exactly_for_hybrid_models(hybrid):
    cfg, params = hybrid
    layout = single_group_layout(cfg, 4, 16)
    args = (jnp.zeros((1, 4), jnp.int32), jnp.arange(4, dtype=jnp.int32)[None], (jnp.ones((1, 1), jnp.int32),),
            jnp.array([4], jnp.int32))
    with pytest.raises(ValueError, match="state must be given for a hybrid model"):
        forward(params, init_pool(layout), *args, cfg=cfg, layout=layout)
    plain = tiny_config()
    plain_layout = single_group_layout(plain, 4, 16)
    with pytest.raises(ValueError, match="state must be given for a hybrid model and None otherwise"):
        forward(
            init_params(plain), init_pool(plain_layout), *args, cfg=plain, layout=plain_layout, state=zero_state(cfg, 1)
        )


def test_state_pool_ops(hybrid):
    cfg, _ = hybrid
    pool = init_state_pool(len(cfg.recurrent_layers), 6, cfg.num_heads, cfg.head_dim)
    assert pool.shape == (3, 6, 4, 16, 16) and slot_bytes(3, 4, 16) == 3 * 4 * 16 * 16 * 4
    values = jnp.arange(3 * 2 * 4 * 16 * 16, dtype=jnp.float32).reshape(3, 2, 4, 16, 16)
    pool = write_slots(pool, jnp.array([2, 4], jnp.int32), values)
    np.testing.assert_array_equal(read_slots(pool, jnp.array([4, 2], jnp.int32)), values[:, ::-1])
    pool = copy_slots(pool, jnp.array([4, NULL_SLOT], jnp.int32), jnp.array([5, NULL_SLOT], jnp.int32))
    np.testing.assert_array_equal(pool[:, 5], values[:, 1])
    pool = zero_slots(pool, jnp.array([4], jnp.int32))
    assert not np.asarray(pool[:, 4]).any() and np.asarray(pool[:, 2]).any()
    with pytest.raises(ValueError, match="num_slots=1 must be an int >= 2"):
        init_state_pool(3, 1, 4, 16)
    with pytest.raises(ValueError, match="num_recurrent_layers=0 must be an int >= 1"):
        init_state_pool(len(tiny_config().recurrent_layers), 4, 4, 16)


def test_gemma_style_hybrid_matches_numpy_oracle():
    """Recurrent layers beside windowed, QK-normed, sandwich-normed GeGLU attention layers."""
    cfg = tiny_hybrid_config(
        num_layers=6, layer_types=("recurrent", "attention", "attention"), sliding_window=64, global_layer_period=3,
        qk_norm=True, sandwich_norm=True, activation="gelu_tanh", embed_scale=True,
    )
    params = init_params(cfg, seed=4)
    tokens = np.random.default_rng(6).integers(0, cfg.vocab_size, 520).astype(np.int32)
    logits, _ = run_chunks(params, cfg, tokens, [300, 1, 219])
    assert rel_err(logits, numpy_logits(params, cfg, tokens)) < 1e-5
