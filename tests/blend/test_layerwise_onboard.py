"""Layer-wise onboarding under the blended prefill on the real SmolLM2-135M: chunk blocks pushed
to the host or disk tier (``manager.demote_cached``) come back layer by layer while the prefill
computes (``ChunkReuse.pipelined``) and give exactly what onboarding them all first gives, also
with a throttled tier; the timeline shows each layer loaded before it computes (float32,
chunks of 64, 64 and 48 tokens, a 15 % recompute ratio)."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.blend import selection
from kvjax.blend.chunk_store import ChunkStore
from kvjax.blend.engine_blend import ChunkReuse
from kvjax.blend.prompt import BlendPrompt
from kvjax.config import KvCacheConfig, SchedulerConfig
from kvjax.engine import Engine, RequestOutput
from kvjax.sampling import SamplingParams
from kvjax.testing.blend import random_prompt

pytestmark = pytest.mark.real_model
PAGE = 16
GREEDY = SamplingParams(max_new_tokens=3, ignore_eos=True, return_logits=True)
SELECTION = selection.SelectionConfig(recompute_ratio=0.15)


@pytest.fixture(scope="module")
def prompt(smollm2) -> BlendPrompt:
    return random_prompt(np.random.default_rng(3), smollm2.config.vocab_size, 16, [64, 64, 48], 16)


def blend_from(model, prompt: BlendPrompt, tier: str, *, pipelined: bool, tmp_path, **throttle) -> RequestOutput:
    """A fresh engine whose chunk blocks were stored, then all moved to ``tier``; the output of
    one blended request over them (with a timeline)."""
    page_bytes = 2 * model.config.num_layers * model.config.num_kv_heads * model.config.head_dim * 4 * PAGE
    kv = KvCacheConfig(tokens_per_block=PAGE, max_tokens=1024, host_cache_size=48 * page_bytes,
                       disk_cache_size=48 * page_bytes if tier == "disk" else 0, disk_cache_dir=str(tmp_path),
                       event_buffer_max_size=0, **throttle)
    engine = Engine(model, kv, SchedulerConfig(prefill_chunk_size=512), max_seq_len=512)
    store = ChunkStore(engine, variant="system", prefix_tokens=prompt.prefix)
    for chunk in prompt.chunks:
        store.put(chunk)
    assert engine.manager.demote_cached(tier) > 0
    engine.execute_page_ops()
    assert engine.manager.num_cached_blocks(0, "device") == 0 and engine.manager.num_cached_blocks(0, tier) > 0
    reuse = ChunkReuse(store, prompt.roles.chunk_spans, SELECTION, pipelined=pipelined, timeline=True)
    engine.submit(prompt.tokens.tolist(), GREEDY, chunks=reuse)
    out = engine.run()[0]
    engine.manager.check_consistency()
    return out


def assert_layers_loaded_before_they_compute(timeline: dict, num_layers: int, tier: str) -> None:
    loads = sorted(timeline["load"], key=lambda e: e["layer"])
    assert [(e["layer"], e["tier"]) for e in loads] == [(layer, tier) for layer in range(num_layers)]
    covered = [layer for e in timeline["compute"] for layer in range(*e["layers"])]
    assert sorted(covered) == list(range(num_layers))
    for e in timeline["compute"]:
        for load in loads[slice(*e["layers"])]:
            assert load["start_s"] < e["end_s"] and e["start_s"] >= load["end_s"]


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_pipelined_onboarding_gives_the_output_of_onboarding_first(smollm2, prompt, tier, tmp_path):
    first = blend_from(smollm2, prompt, tier, pipelined=False, tmp_path=tmp_path / "first")
    pipelined = blend_from(smollm2, prompt, tier, pipelined=True, tmp_path=tmp_path / "pipelined")
    assert first.output == pipelined.output
    for a, b in zip(first.logits, pipelined.logits, strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-6)
    before, during = first.blend_report, pipelined.blend_report
    assert before.onboarded_pages == during.onboarded_pages > 0
    assert before.chunk_hit == during.chunk_hit == sum(len(c) for c in prompt.chunks)
    assert before.layerwise_pages == 0 and before.timeline["load"] == []
    assert during.layerwise_pages == during.onboarded_pages  # nothing else moved in that step
    assert {e["pages"] for e in during.timeline["load"]} == {during.layerwise_pages}
    assert_layers_loaded_before_they_compute(during.timeline, smollm2.config.num_layers, tier)
    assert sorted(layer for e in before.timeline["compute"] for layer in range(*e["layers"])) == list(
        range(smollm2.config.num_layers)
    )


def test_a_throttled_host_tier_changes_only_the_time(smollm2, prompt, tmp_path):
    plain = blend_from(smollm2, prompt, "host", pipelined=True, tmp_path=tmp_path / "plain")
    slow = blend_from(
        smollm2, prompt, "host", pipelined=True, tmp_path=tmp_path / "slow", host_read_gbps=0.05, host_latency_ms=2
    )
    assert slow.output == plain.output
    for a, b in zip(plain.logits, slow.logits, strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-6)
    loads = slow.blend_report.timeline["load"]
    assert_layers_loaded_before_they_compute(slow.blend_report.timeline, smollm2.config.num_layers, "host")
    for e in loads:  # each read lasted at least its emulated time
        assert e["end_s"] - e["start_s"] >= 2e-3 + e["bytes"] / 0.05e9
