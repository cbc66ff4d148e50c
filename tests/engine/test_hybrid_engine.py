"""The engine on a hybrid recurrent model: decode equal to full recompute, recurrent-state
snapshots resumed exactly (periodic, decode-time, per_conversation), preemption, events,
orbax snapshots, unsupported combinations; SmolLM2 unchanged by the snapshot settings."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from kvjax.config import KvCacheConfig, SchedulerConfig, SpeculativeConfig
from kvjax.engine import Engine
from kvjax.model.model import Model
from kvjax.sampling import SamplingParams
from kvjax.snapshot import restore_snapshot, save_snapshot
from kvjax.testing.numpy_forward import numpy_logits
from kvjax.testing.tiny import init_params, tiny_hybrid_config

GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True, return_logits=True)
PAGE = 16


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.fixture(scope="module")
def hybrid() -> Model:
    cfg = tiny_hybrid_config()
    return Model(config=cfg, params=init_params(cfg, seed=2), tokenizer=None, path=pathlib.Path("tiny-hybrid"))


def make_engine(model: Model, max_tokens: int = 4096, max_seq_len: int = 1024, **kv) -> Engine:
    config = KvCacheConfig(tokens_per_block=PAGE, max_tokens=max_tokens, **kv)
    scheduler = SchedulerConfig(max_num_tokens=512, prefill_chunk_size=256, max_batch_size=4)
    return Engine(model, config, scheduler, max_seq_len=max_seq_len)


def prompt(seed: int, n: int, vocab: int = 97) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def assert_matches_recompute(model: Model, out) -> None:
    """Each generated token's logits equal the numpy oracle's over prompt + outputs (1e-5)."""
    tokens = np.asarray(out.prompt + out.output[:-1])
    rows = np.arange(len(out.prompt) - 1, len(tokens))
    expected = numpy_logits(model.params, model.config, tokens, rows=rows)
    assert rel_err(np.stack(out.logits), expected) < 1e-5
    assert out.output == expected.argmax(-1).tolist()


def test_chunked_prefill_and_decode_equal_full_recompute(hybrid):
    """600-token prompts prefilled in 256-token chunks, batched decode of two sequences."""
    outs = make_engine(hybrid).generate([prompt(0, 600), prompt(1, 530)], GREEDY)
    for out in outs:
        assert out.num_reused_tokens == 0
        assert_matches_recompute(hybrid, out)


def test_resume_from_periodic_snapshot_is_exact(hybrid):
    """A prompt sharing 550 tokens with an earlier one: the attention match is 34 blocks (544
    tokens) but the deepest snapshot (interval 64) is at 512: 512 tokens are reused, the rest
    recomputed, and the logits equal full recompute."""
    engine = make_engine(hybrid, mamba_state_config={"periodic_snapshot_interval": 64})
    first = prompt(3, 600)
    engine.generate([first], GREEDY)
    [warm] = engine.generate([first[:550] + prompt(4, 40)], GREEDY)
    assert warm.num_reused_tokens == 512
    assert_matches_recompute(hybrid, warm)
    no_snapshots = make_engine(hybrid)
    no_snapshots.generate([first], GREEDY)
    [cold] = no_snapshots.generate([first[:550] + prompt(4, 40)], GREEDY)
    assert cold.num_reused_tokens == 0 and cold.output == warm.output


def test_decode_time_snapshot_serves_the_next_turn(hybrid):
    """Periodic snapshots are also taken while decoding: the next turn (prompt + output +
    new tokens) resumes past the end of the first prompt."""
    engine = make_engine(hybrid, mamba_state_config={"periodic_snapshot_interval": 32})
    sampling = SamplingParams(max_new_tokens=40, ignore_eos=True, return_logits=True)
    [turn1] = engine.generate([prompt(5, 520)], sampling)  # 520 + 40: boundaries 544 in decode
    [turn2] = engine.generate([turn1.prompt + turn1.output + prompt(6, 30)], GREEDY)
    assert turn2.num_reused_tokens == 544
    assert_matches_recompute(hybrid, turn2)


def test_per_conversation_resumes_each_turn_at_its_prompt_end(hybrid):
    config = dict(
        block_reuse_config={"policy": "per_conversation", "max_num_turns": 2},
        mamba_state_config={"periodic_snapshot_interval": 64, "additional_snapshot_offsets_from_end": [0]},
        event_buffer_max_size=1000,
    )
    engine = make_engine(hybrid, **config)
    history = prompt(7, 300)
    prompt_ends: list[int] = []
    for turn in range(4):
        [out] = engine.generate([history], GREEDY)
        assert out.num_reused_tokens == (prompt_ends[-1] if prompt_ends else 0)  # the previous prompt's end
        if turn == 3:
            assert_matches_recompute(hybrid, out)
        prompt_ends.append(len(history) // PAGE * PAGE)
        history = history + out.output + prompt(8 + turn, 50)
    snapshots = engine.recurrent.index.snapshots()
    assert sorted(s.turn for s in snapshots) == [3, 4]  # max_num_turns=2 of one conversation
    assert all(s.num_tokens % PAGE == 0 for s in snapshots)
    events = [e for e in engine.manager.get_kv_cache_events() if e.state_snapshot]
    assert [e.kind for e in events].count("stored") == 4 and [e.kind for e in events].count("removed") == 2
    assert all(e.group == engine.layout.num_groups and e.block_key is not None for e in events)


def test_preemption_recomputes_the_state(hybrid):
    """Three 200-token prompts fit the 48-page cache, their decodes to 320 tokens do not: the
    newest is preempted (its state slot returned) and later restarted; outputs equal a roomy run."""
    sampling = SamplingParams(max_new_tokens=120, ignore_eos=True)
    prompts = [prompt(20 + i, 200) for i in range(3)]
    roomy = make_engine(hybrid, enable_block_reuse=False).generate(prompts, sampling)
    tight = make_engine(hybrid, max_tokens=PAGE * 48, max_seq_len=512, enable_block_reuse=False)
    outs = tight.generate(prompts, sampling)
    assert sum(tight.requests[o.request_id].num_preemptions for o in outs) > 0
    assert [o.output for o in outs] == [o.output for o in roomy]


def test_orbax_snapshot_carries_the_state_pool(hybrid, tmp_path):
    config = dict(mamba_state_config={"periodic_snapshot_interval": 64})
    engine = make_engine(hybrid, **config)
    first = prompt(30, 400)
    engine.generate([first], GREEDY)
    save_snapshot(engine, tmp_path / "snap")
    follow = first[:390] + prompt(31, 20)
    [expected] = engine.generate([follow], GREEDY)
    restored = make_engine(hybrid, **config)
    restore_snapshot(restored, tmp_path / "snap")
    [resumed] = restored.generate([follow], GREEDY)
    assert resumed.num_reused_tokens == expected.num_reused_tokens == 384
    assert resumed.output == expected.output
    assert rel_err(np.stack(resumed.logits), np.stack(expected.logits)) < 1e-6


def test_unsupported_combinations_are_clear_errors(hybrid):
    with pytest.raises(ValueError, match="speculative decoding is not supported for the hybrid model"):
        Engine(hybrid, KvCacheConfig(tokens_per_block=PAGE, max_tokens=4096), max_seq_len=1024,
               speculative=SpeculativeConfig(method="ngram"))


def test_smollm2_ignores_the_recurrent_state_settings(smollm2, reference_text):
    """A pure-attention model: no state pool, and the snapshot settings change nothing."""
    ids = smollm2.tokenizer.encode(reference_text)[:200]
    kv = dict(tokens_per_block=16, max_tokens=2048)
    scheduler = SchedulerConfig(max_num_tokens=512, prefill_chunk_size=128)
    plain = Engine(smollm2, KvCacheConfig(**kv), scheduler, max_seq_len=512)
    tuned = Engine(smollm2, KvCacheConfig(
        **kv, block_reuse_config={"policy": "per_conversation"},
        mamba_state_config={"additional_snapshot_offsets_from_end": [0], "periodic_snapshot_interval": 64},
    ), scheduler, max_seq_len=512)
    assert tuned.recurrent is None
    outs = [[e.generate([ids], GREEDY)[0], e.generate([ids[:150] + [13, 14]], GREEDY)[0]] for e in (plain, tuned)]
    for a, b in zip(*outs):
        assert a.output == b.output and a.num_reused_tokens == b.num_reused_tokens
        assert rel_err(np.stack(a.logits), np.stack(b.logits)) < 1e-6
    assert outs[1][1].num_reused_tokens > 0  # prefix reuse (partial block included) as without the settings


def test_resume_with_windowed_attention_layers_is_exact():
    """Attention layers with a 128-token window (their blocks before the window are released
    as the sequence grows): a resumed request still equals full recompute."""
    cfg = tiny_hybrid_config(num_layers=4, layer_types=("recurrent", "attention"), sliding_window=128)
    model = Model(config=cfg, params=init_params(cfg, seed=5), tokenizer=None, path=pathlib.Path("tiny-hybrid-window"))
    engine = make_engine(model, mamba_state_config={"periodic_snapshot_interval": 128})
    assert engine.layout.num_groups == 1 and engine.layout.group_windows == (128,)
    first = prompt(40, 560)
    engine.generate([first], GREEDY)
    [warm] = engine.generate([first[:530] + prompt(41, 20)], GREEDY)
    assert warm.num_reused_tokens == 512
    assert_matches_recompute(model, warm)


@pytest.mark.parametrize("name", ["additional_snapshot_offsets_from_end", "additional_snapshot_offsets_from_start"])
def test_snapshot_offsets_past_max_seq_len_are_refused(hybrid, name):
    with pytest.raises(
        ValueError,
        match=rf"mamba_state_config.{name}=\[0, 1000000000\] holds \[1000000000\], at or past "
        r"the engine's max_seq_len=1024: .* each must be in \[0, 1024\)",
    ):
        make_engine(hybrid, mamba_state_config={name: [0, 10**9]})
    make_engine(hybrid, mamba_state_config={name: [0, 1023]})  # the last position still counts
