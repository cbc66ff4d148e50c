"""Speculative decoding on SmolLM2: greedy outputs token for token equal to non-speculative
decoding (256 generated tokens with prompt lookup, 64 with the early-exit drafter, whose
drafts are mostly rejected and cost a step each), and the same tree, events and hits.
Gemma 3's prompt lookup is in ``tests/model/test_gemma3.py`` (one model per module)."""

from __future__ import annotations

import pytest

from kvjax.config import KvCacheConfig, SchedulerConfig, SpeculativeConfig
from kvjax.engine import Engine
from kvjax.model.registry import Model
from kvjax.sampling import SamplingParams

pytestmark = pytest.mark.real_model

GREEDY = SamplingParams(max_new_tokens=256, ignore_eos=True)


def make_engine(model: Model, speculative: SpeculativeConfig | None) -> Engine:
    kv = KvCacheConfig(tokens_per_block=16, max_tokens=4096, event_buffer_max_size=100_000)
    return Engine(model, kv, SchedulerConfig(max_num_tokens=512, prefill_chunk_size=512), max_seq_len=1024,
                  speculative=speculative)


def two_turns(
    engine: Engine, prompt: list[int], follow_up: list[int], max_new_tokens: int = 256
) -> tuple[list[list[int]], list, int]:
    """A request, then one whose prompt continues the first's prompt and output (a second
    chat turn); returns (outputs, stored block events, reused blocks)."""
    [first] = engine.generate([prompt], SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
    [second] = engine.generate([prompt + first.output + follow_up], SamplingParams(max_new_tokens=16, ignore_eos=True))
    stored = sorted((e.block_key, e.token_ids) for e in engine.manager.get_kv_cache_events() if e.kind == "stored")
    return [first.output, second.output], stored, engine.manager.stats.reused_blocks


@pytest.fixture(scope="module")
def smollm2_prompts(smollm2, reference_text) -> tuple[list[int], list[int]]:
    ids = smollm2.tokenizer.encode(reference_text)
    return ids[:200], ids[400:420]


@pytest.mark.parametrize(
    "spec, max_new_tokens",
    [(SpeculativeConfig("ngram", num_draft_tokens=4, ngram_sizes=(1, 3)), 256),
     (SpeculativeConfig("early_exit", num_draft_tokens=2, exit_layer=12), 64)],
    ids=["ngram", "early_exit"],
)
def test_smollm2_greedy_speculation_is_exact_and_keeps_the_tree(smollm2, smollm2_prompts, spec, max_new_tokens):
    prompt, follow_up = smollm2_prompts
    outputs, stored, reused = two_turns(make_engine(smollm2, None), prompt, follow_up, max_new_tokens)
    engine = make_engine(smollm2, spec)
    spec_outputs, spec_stored, spec_reused = two_turns(engine, prompt, follow_up, max_new_tokens)
    assert spec_outputs == outputs
    assert engine.timings["spec_drafted"] > engine.timings["spec_accepted"] > 0
    assert spec_stored == stored  # no block of rejected drafts, no block missing
    assert spec_reused == reused > 0
    engine.manager.check_consistency()
