"""Bad CacheBlend inputs fail at the call that carries them, naming the field and range, and
leave everything usable (tiny model, CPU): prompt length against ``max_tokens``, token ids
against the vocabulary, chunk lengths against ``max_seq_len``, prompts without chunks, damaged
or swapped disk chunk files, and internal scopes out of reach of user salts."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from kvjax.blend import selection
from kvjax.blend.blender import Blender, BlendPrompt
from kvjax.blend.chunk_store import ChunkIntegrityError, ChunkStore
from kvjax.blend.engine_blend import submit_blended
from kvjax.blend.managed_store import ManagedChunkStore
from kvjax.config import KvCacheConfig, SchedulerConfig
from kvjax.engine import Engine
from kvjax.model.registry import Model
from kvjax.sampling import SamplingParams
from kvjax.testing.blend import make_blender, random_prompt
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


def test_prompt_past_max_tokens_is_refused_and_the_blender_stays_exact(small, prompt):
    cfg, params = small
    blender = make_blender(cfg, params, prompt, max_tokens=64)
    roles = prompt.roles
    for call in (
        lambda: blender.full_recompute(prompt),
        lambda: blender.prefix_caching(prompt),
        lambda: blender.blend(prompt, selection.select_all(roles, 64)),
        lambda: blender.reused_kv(prompt, 192),
    ):
        with pytest.raises(ValueError, match=r"holds 139 tokens \(prefix 5 \+ chunks \[60, 60\] \+ suffix 14\).*max_tokens=64"):
            call()
    with pytest.raises(ValueError, match=r"positions \[60, 66\), past max_tokens=64"):
        blender.decode(3, 60, 6)
    with pytest.raises(ValueError, match=r"positions \[60, 65\), past max_tokens=64"):
        blender.teacher_force(60, np.arange(3, 9))
    fits = BlendPrompt(prompt.prefix, (prompt.chunks[0][:40],), prompt.suffix[:10])
    big = Blender(params, cfg, blender.store, prompt.prefix, max_tokens=160, page_size=16, token_bucket=64)
    assert rel_err(blender.full_recompute(fits), big.full_recompute(fits)) < RTOL
    with pytest.raises(ValueError, match=r"max_tokens=161 must be an int in \[1, cfg.max_seq_len=160\]"):
        Blender(params, cfg, blender.store, prompt.prefix, max_tokens=161)


def test_token_ids_and_chunk_lengths_are_checked_on_the_blend_path(small, prompt):
    cfg, params = small
    blender = make_blender(cfg, params, prompt, max_tokens=160)
    bad = BlendPrompt(prompt.prefix, (prompt.chunks[0], (*prompt.chunks[1][:-1], cfg.vocab_size)), prompt.suffix)
    message = rf"prompt.chunks\[1\]\[59\]={cfg.vocab_size} must be an int token id in \[0, {cfg.vocab_size - 1}\]"
    with pytest.raises(ValueError, match=message):
        blender.blend(bad, selection.select_none(bad.roles, 16))
    store = blender.store
    with pytest.raises(ValueError, match=rf"tokens\[0\]={cfg.vocab_size + 5} must be an int token id"):
        store.put([cfg.vocab_size + 5, 3])
    with pytest.raises(ValueError, match=r"a chunk of 156 tokens must hold between 1 and cfg.max_seq_len=160 - 5 .* = 155"):
        store.put([3] * 156)
    with pytest.raises(ValueError, match=r"prefix_tokens\[1\]=-1 must be an int token id"):
        ChunkStore(params, cfg, prefix_tokens=(3, -1))
    assert store.computed == len(prompt.chunks)  # nothing computed by the refused calls


@pytest.mark.parametrize("tier", ["device", "host", "disk"])
def test_prompt_without_chunks_blends_exactly(small, tmp_path, tier):
    cfg, params = small
    prompt = random_prompt(np.random.default_rng(1), cfg.vocab_size, 7, [], 9)
    blender = make_blender(cfg, params, prompt, tier=tier, tmp_path=tmp_path, max_tokens=64)
    full = blender.full_recompute(prompt)
    logits, _ = blender.blend(prompt, selection.select_none(prompt.roles, 16))
    assert rel_err(logits, full) < RTOL


def _disk_blender(cfg, params, tmp_path: pathlib.Path) -> tuple[Blender, BlendPrompt]:
    prompt = random_prompt(np.random.default_rng(2), cfg.vocab_size, 4, [20, 20, 12], 5)
    return make_blender(cfg, params, prompt, tier="disk", tmp_path=tmp_path, max_tokens=64), prompt


def test_flipped_bit_in_a_disk_chunk_is_caught_and_the_chunk_recomputed(small, tmp_path):
    cfg, params = small
    blender, prompt = _disk_blender(cfg, params, tmp_path)
    good = [np.asarray(a) for a in blender.reused_kv(prompt, 64)]
    key = blender.store.get(prompt.chunks[1]).key
    path = tmp_path / f"{key.hex()}.k.npy"
    data = bytearray(path.read_bytes())
    data[-2] ^= 0x40  # the exponent's top bit of the last float32 (little-endian)
    path.write_bytes(bytes(data))
    with pytest.raises(ChunkIntegrityError, match=rf"disk chunk {key.hex()} \(20 tokens.*layer 1 does not match"):
        blender.reused_kv(prompt, 64)
    assert prompt.chunks[1] not in blender.store and not path.exists()
    blender.store.put(prompt.chunks[1])
    again = [np.asarray(a) for a in blender.reused_kv(prompt, 64)]
    np.testing.assert_array_equal(again[0], good[0])
    np.testing.assert_array_equal(again[1], good[1])


def test_another_chunks_files_of_the_same_length_are_rejected(small, tmp_path):
    cfg, params = small
    blender, prompt = _disk_blender(cfg, params, tmp_path)
    src, dst = (blender.store.get(c).key.hex() for c in prompt.chunks[:2])
    for suffix in (".k.npy", ".v.npy", ".b3"):  # files and digests both: the digest binds the key
        (tmp_path / f"{dst}{suffix}").write_bytes((tmp_path / f"{src}{suffix}").read_bytes())
    with pytest.raises(ChunkIntegrityError, match=rf"disk chunk {dst} .*layer 0 does not match"):
        blender.store.read_host(blender.store.get(prompt.chunks[1]), layer=0)
    chunk = blender.store.get(prompt.chunks[2])
    (tmp_path / f"{chunk.key.hex()}.b3").unlink()
    with pytest.raises(ChunkIntegrityError, match=rf"disk chunk {chunk.key.hex()} .*unreadable"):
        blender.store.read_host(chunk)


def test_pipeline_raises_a_loader_error_instead_of_hanging(small, tmp_path, monkeypatch):
    from kvjax.blend.pipeline import pipelined_blend

    cfg, params = small
    prompt = random_prompt(np.random.default_rng(3), cfg.vocab_size, 4, [20], 5)
    blender = make_blender(cfg, params, prompt, tier="host", max_tokens=64)
    read, calls = blender.store.read_host, []

    def failing_read(chunk, layer=None):
        calls.append(layer)
        if len(calls) > cfg.num_layers:  # the sequential baseline passes, the pipelined loader fails
            raise ChunkIntegrityError("damaged")
        return read(chunk, layer)

    monkeypatch.setattr(blender.store, "read_host", failing_read)
    with pytest.raises(ChunkIntegrityError, match="damaged"):
        pipelined_blend(blender, prompt, selection.select_none(prompt.roles, 16))
    monkeypatch.undo()
    logits, _ = pipelined_blend(blender, prompt, selection.select_none(prompt.roles, 16))
    assert np.all(np.isfinite(np.asarray(logits)))


# ---------------------------------------------------------------------- through the engine
@pytest.fixture(scope="module")
def engine_store(small):
    cfg, params = small
    model = Model(config=cfg, params=params, tokenizer=None, path=pathlib.Path("tiny"))
    engine = Engine(model, KvCacheConfig(tokens_per_block=16, max_tokens=2048), SchedulerConfig(prefill_chunk_size=64),
                    max_seq_len=160, max_finished_requests=2)
    return engine, ManagedChunkStore(engine, variant="system", prefix_tokens=tuple(range(3, 8)))


def test_submit_blended_refuses_bad_inputs_before_touching_anything(small, engine_store):
    cfg, _ = small
    engine, store = engine_store
    rng = np.random.default_rng(4)
    draw = lambda n: tuple(int(t) for t in rng.integers(3, cfg.vocab_size, n))  # noqa: E731
    prefix = store.prefix_tokens
    puts, free = store.stats.puts, engine.manager.num_free_pages(0)
    cases = [
        (BlendPrompt(prefix, (draw(20), (*draw(5), cfg.vocab_size)), draw(4)), GREEDY,
         rf"prompt.chunks\[1\]\[5\]={cfg.vocab_size} must be an int token id in \[0, {cfg.vocab_size - 1}\]"),
        (BlendPrompt(prefix, (draw(100), draw(50)), draw(4)), GREEDY,
         r"len\(prompt\)=159 \(prefix 5 \+ chunks \[100, 50\] \+ suffix 4\) \+ sampling.max_new_tokens=3 "
         r"exceeds engine.max_seq_len=160"),
        (BlendPrompt(prefix, (draw(20),), draw(4)), SamplingParams(stop_token_id=cfg.vocab_size),
         rf"sampling.stop_token_id={cfg.vocab_size} must be in \[0, {cfg.vocab_size}\)"),
    ]
    for prompt, sampling, message in cases:
        with pytest.raises(ValueError, match=message):
            submit_blended(store, prompt, FULL, sampling)
        assert store.stats.puts == puts and not engine.manager.request_ids()
        assert engine.manager.num_free_pages(0) == free and not engine.has_work
    with pytest.raises(ValueError, match=r"a chunk of 155 tokens must hold between 1 and engine.max_seq_len=160 - 5"):
        store.put(draw(155))
    with pytest.raises(ValueError, match=rf"tokens\[0\]={cfg.vocab_size} must be an int token id"):
        store.put([cfg.vocab_size])


def test_engine_blend_without_chunks_and_many_stored_chunks(small, engine_store):
    cfg, _ = small
    engine, store = engine_store
    rng = np.random.default_rng(5)
    draw = lambda n: tuple(int(t) for t in rng.integers(3, cfg.vocab_size, n))  # noqa: E731
    for _ in range(4):  # more store requests than the engine's finished history holds
        store.put(draw(20))
    prompt = BlendPrompt(store.prefix_tokens, (), draw(11))
    exact = engine.generate([prompt.tokens.tolist()], GREEDY)[0]
    report = submit_blended(store, prompt, FULL, GREEDY)
    out = engine.run()[0]
    assert out.request_id == report.request_id and out.output == exact.output
    assert rel_err(out.logits[0], exact.logits[0]) < RTOL
    engine.manager.check_consistency()


def test_user_salts_cannot_reach_chunk_or_blend_scopes(small, engine_store):
    cfg, _ = small
    engine, store = engine_store
    rng = np.random.default_rng(6)
    draw = lambda n: tuple(int(t) for t in rng.integers(3, cfg.vocab_size, n))  # noqa: E731
    chunk = draw(40)
    store.put(chunk)
    stored = list(store.stored_tokens(chunk))
    assert engine.manager.estimate_reusable_tokens(stored + [0], cache_salt=store.salt) >= 32
    user = engine.generate([stored], SamplingParams(max_new_tokens=1), cache_salt=str(store.salt))[0]
    assert user.num_reused_tokens == 0
    prompt = BlendPrompt(store.prefix_tokens, (chunk,), draw(6))
    report = submit_blended(store, prompt, selection.SelectionConfig(recompute_ratio=0.15, check_layers=(1,),
                                                                       budgets=(1.0,), row_bucket=16), GREEDY)
    engine.run()
    salt = engine.requests[report.request_id].sched.cache_salt
    tokens = prompt.tokens.tolist()
    assert engine.manager.estimate_reusable_tokens(tokens, cache_salt=salt) >= 32
    assert engine.generate([tokens], SamplingParams(max_new_tokens=1), cache_salt=str(salt))[0].num_reused_tokens == 0
