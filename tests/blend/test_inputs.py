"""Bad CacheBlend inputs fail at the call that carries them, naming the field and range, and
leave everything usable (tiny model, CPU): prompt length against the engine's ``max_seq_len``,
token ids against the vocabulary, chunk spans and lengths, prompts without chunks, and
internal scopes out of reach of user salts."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from experiments.blender import FULL_RECOMPUTE, Blender, make_blender
from kvjax.blend import selection
from kvjax.blend.chunk_store import ChunkStore
from kvjax.blend.engine_blend import ChunkReuse
from kvjax.blend.prompt import BlendPrompt
from kvjax.manager import KeyExtras
from kvjax.sampling import SamplingParams
from kvjax.testing.blend import random_prompt, submit_blended, tiny_engine
from kvjax.testing.tiny import tiny_model

RTOL = 1e-5
GREEDY = SamplingParams(max_new_tokens=3, ignore_eos=True, return_logits=True)
FULL = selection.SelectionConfig(recompute_ratio=1.0, check_layers=(1,), budgets=(1.0,), row_bucket=16)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.fixture(scope="module")
def small():
    """A 2-layer tiny model with a 160-token context."""
    return tiny_model(0, max_seq_len=160)


@pytest.fixture(scope="module")
def prompt(small) -> BlendPrompt:
    """139 tokens: prefix 5 + chunks [60, 60] + suffix 14."""
    return random_prompt(np.random.default_rng(0), small[0].vocab_size, 5, [60, 60], 14)


def test_blend_prompt_rejects_malformed_parts():
    with pytest.raises(ValueError, match=r"chunks\[1\] is empty"):
        BlendPrompt((1,), ((2, 3), ()), (4,))
    with pytest.raises(ValueError, match=r"chunks\[0\]\[1\]=-5 must be an int token id"):
        BlendPrompt((), ((2, -5),), (4,))
    with pytest.raises(ValueError, match=r"prefix\[0\]=1.5 must be an int token id"):
        BlendPrompt((1.5,), (), (4,))
    with pytest.raises(ValueError, match="suffix must hold at least one token"):
        BlendPrompt((1,), ((2,),), ())
    assert BlendPrompt(np.arange(3), [np.arange(4, 6)], [7]).chunks == ((4, 5),)


def test_prompt_past_max_seq_len_is_refused_and_the_blender_stays_exact(small, prompt):
    cfg, params = small
    blender = make_blender(cfg, params, prompt, max_tokens=96)
    for policy in (FULL_RECOMPUTE, FULL):
        with pytest.raises(
            ValueError, match=r"holds 139 tokens \(prefix 5 \+ chunks \[60, 60\] \+ suffix 14\).*max_seq_len is 96"
        ):
            blender.run(prompt, policy)
    assert not blender.engine.has_work and not blender.engine.manager.request_ids()
    fits = BlendPrompt(prompt.prefix, (prompt.chunks[0][:40],), prompt.suffix[:10])
    blender.store.put(fits.chunks[0])
    assert rel_err(blender.run(fits, FULL).logits[-1], blender.run(fits, FULL_RECOMPUTE).logits[0]) < RTOL


def test_token_ids_and_chunk_lengths_are_checked_on_the_blend_path(small, prompt):
    cfg, params = small
    blender = make_blender(cfg, params, prompt, max_tokens=160)
    bad = BlendPrompt(prompt.prefix, (prompt.chunks[0], (*prompt.chunks[1][:-1], cfg.vocab_size)), prompt.suffix)
    message = rf"prompt.chunks\[1\]\[59\]={cfg.vocab_size} must be an int token id in \[0, {cfg.vocab_size - 1}\]"
    with pytest.raises(ValueError, match=message):
        blender.run(bad, FULL)
    store = blender.store
    with pytest.raises(ValueError, match=rf"tokens\[0\]={cfg.vocab_size + 5} must be an int token id"):
        store.put([cfg.vocab_size + 5, 3])
    with pytest.raises(
        ValueError, match=r"a chunk of 156 tokens must hold between 1 and engine.max_seq_len=160 - 5 .* = 139"
    ):
        store.put([3] * 156)
    with pytest.raises(ValueError, match=r"prefix_tokens\[1\]=-1 must be an int token id"):
        ChunkStore(store.engine, prefix_tokens=(3, -1))
    assert store.stats.computed == len(prompt.chunks)  # nothing computed by the refused calls


def test_prompt_without_chunks_blends_exactly(small):
    cfg, params = small
    prompt = random_prompt(np.random.default_rng(1), cfg.vocab_size, 7, [], 9)
    blender = make_blender(cfg, params, prompt, max_tokens=64)
    full = blender.run(prompt, FULL_RECOMPUTE).logits[0]
    assert (
        rel_err(blender.run(prompt, selection.SelectionConfig(selector="none", row_bucket=16)).logits[-1], full) < RTOL
    )


# ---------------------------------------------------------------------- through the engine
@pytest.fixture(scope="module")
def engine_store(small):
    cfg, params = small
    engine = tiny_engine(cfg, params, max_tokens=2048, max_seq_len=160)
    engine.requests.max_finished = 2
    return engine, ChunkStore(engine, variant="system", prefix_tokens=tuple(range(3, 8)))


def test_submit_with_chunks_refuses_bad_inputs_before_touching_anything(small, engine_store):
    cfg, _ = small
    engine, store = engine_store
    rng = np.random.default_rng(4)
    draw = lambda n: tuple(int(t) for t in rng.integers(3, cfg.vocab_size, n))
    prefix = store.prefix_tokens
    puts, free = store.stats.puts, engine.manager.num_free_pages(0)
    tokens = [*prefix, *draw(30)]
    cases = [
        (
            (*prefix, *draw(5), cfg.vocab_size, 3),
            ChunkReuse(store, ((5, 10),), FULL),
            GREEDY,
            rf"prompt_token_ids\[\d+\]={cfg.vocab_size} must be an int token id in \[0, {cfg.vocab_size - 1}\]",
        ),
        (tokens, ChunkReuse(store, ((5, 40),), FULL), GREEDY, r"chunks.spans\[0\]=\(5, 40\) must be non-empty.*<= 34"),
        (tokens, ChunkReuse(store, ((5, 20), (10, 30)), FULL), GREEDY, r"chunks.spans\[1\]=\(10, 30\).*>= 20"),
        (tokens, ChunkReuse(store, ((5, 30),), FULL, num_prompt_logits=9), GREEDY, r"chunks.num_prompt_logits=9"),
        (
            tokens,
            ChunkReuse(store, ((5, 30),), dataclasses.replace(FULL, selector="oracle")),
            GREEDY,
            r"needs chunks.scores",
        ),
        (tokens, ChunkReuse(store, ((5, 30),), FULL), SamplingParams(max_new_tokens=150), r"exceeds max_seq_len=160"),
        (
            tokens,
            ChunkReuse(store, ((5, 30),), FULL),
            SamplingParams(stop_token_id=cfg.vocab_size),
            rf"sampling.stop_token_id={cfg.vocab_size} must be in \[0, {cfg.vocab_size}\)",
        ),
    ]
    for prompt, chunks, sampling, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.submit(prompt, sampling, chunks=chunks)
        assert store.stats.puts == puts and not engine.manager.request_ids()
        assert engine.manager.num_free_pages(0) == free and not engine.has_work
    with pytest.raises(ValueError, match="takes no cache_salt"):
        engine.submit(tokens, GREEDY, chunks=ChunkReuse(store, ((5, 30),), FULL), cache_salt="x")
    other = ChunkStore(tiny_engine(cfg, small[1], max_tokens=2048, max_seq_len=160), variant="pos0")
    for wrong in (other, "store"):  # another engine's store, or no store at all
        with pytest.raises(ValueError, match="chunks.store must be a ChunkStore of this engine"):
            engine.submit(tokens, GREEDY, chunks=ChunkReuse(wrong, ((5, 30),), FULL))
    with pytest.raises(ValueError, match=r"a chunk of 155 tokens must hold between 1 and engine.max_seq_len=160 - 5"):
        store.put(draw(155))
    with pytest.raises(ValueError, match=rf"tokens\[0\]={cfg.vocab_size} must be an int token id"):
        store.put([cfg.vocab_size])


def test_engine_blend_without_chunks_and_many_stored_chunks(small, engine_store):
    cfg, _ = small
    engine, store = engine_store
    rng = np.random.default_rng(5)
    draw = lambda n: tuple(int(t) for t in rng.integers(3, cfg.vocab_size, n))
    for _ in range(4):  # more store requests than the engine's finished history holds
        store.put(draw(20))
    prompt = BlendPrompt(store.prefix_tokens, (), draw(11))
    exact = engine.generate([prompt.tokens.tolist()], GREEDY)[0]
    rid = submit_blended(store, prompt, FULL, GREEDY)
    out = engine.run()[0]
    assert out.request_id == rid and out.output == exact.output
    assert rel_err(out.logits[0], exact.logits[0]) < RTOL
    engine.manager.check_consistency()


def test_user_salts_cannot_reach_chunk_or_blend_scopes(small, engine_store):
    cfg, _ = small
    engine, store = engine_store
    rng = np.random.default_rng(6)
    draw = lambda n: tuple(int(t) for t in rng.integers(3, cfg.vocab_size, n))
    chunk = draw(40)
    store.put(chunk)
    stored = list(store.stored_tokens(chunk))
    assert engine.manager.estimate_reusable_tokens(stored + [0], extras=KeyExtras(cache_salt=store.salt)) >= 32
    user = engine.generate([stored], SamplingParams(max_new_tokens=1), cache_salt=str(store.salt))[0]
    assert user.num_reused_tokens == 0
    prompt = BlendPrompt(store.prefix_tokens, (chunk,), draw(6))
    rid = submit_blended(store, prompt, selection.SelectionConfig(recompute_ratio=0.15, check_layers=(1,),
                                                                    budgets=(1.0,), row_bucket=16), GREEDY)
    engine.run()
    salt = engine.requests[rid].sched.extras.cache_salt
    tokens = prompt.tokens.tolist()
    assert engine.manager.estimate_reusable_tokens(tokens, extras=KeyExtras(cache_salt=salt)) >= 32
    assert engine.generate([tokens], SamplingParams(max_new_tokens=1), cache_salt=str(salt))[0].num_reused_tokens == 0


def test_snapshots_hold_chunk_blocks(small, tmp_path):
    from kvjax.snapshot import restore_snapshot, save_snapshot

    cfg, params = small
    prompt = random_prompt(np.random.default_rng(8), cfg.vocab_size, 5, [40, 30], 6)
    blender = make_blender(cfg, params, prompt, max_tokens=128)
    before = blender.run(prompt, FULL).logits
    save_snapshot(blender.engine, tmp_path)
    restored = ChunkStore(tiny_engine(cfg, params, max_seq_len=128), variant="system", prefix_tokens=prompt.prefix)
    restore_snapshot(restored.engine, tmp_path)
    assert all(restored.num_cached(c) == len(c) for c in prompt.chunks)
    run = Blender(restored, token_bucket=64).run(prompt, FULL)
    assert run.report.chunk_hit == sum(len(c) for c in prompt.chunks) and restored.stats.computed == 0
    np.testing.assert_array_equal(run.logits, before)
