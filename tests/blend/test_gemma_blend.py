"""CacheBlend on Gemma 3 270M: two layer groups (sliding window 512 on 5 of 6 layers, full
attention on the rest), each with its own pages. A 628-token prompt reaches past the window,
so the windowed layers' rows really mask by window. Recomputing every row equals full
recompute, recomputing none equals full KV reuse; a chunk too long for the window is refused."""

from __future__ import annotations

import numpy as np
import pytest

from experiments.blender import FULL_RECOMPUTE, Blender
from kvjax.blend.chunk_store import ChunkStore
from kvjax.blend.selection import SelectionConfig
from kvjax.config import KvCacheConfig, SchedulerConfig
from kvjax.engine import Engine
from kvjax.testing.blend import random_prompt

pytestmark = pytest.mark.real_model

RTOL = 1e-5


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.fixture(scope="module")
def setup():
    from kvjax.model.registry import load_model

    model = load_model("gemma3-270m")
    engine = Engine(
        model,
        KvCacheConfig(tokens_per_block=32, max_tokens=8192),
        SchedulerConfig(max_num_tokens=2048, prefill_chunk_size=2048),
        max_seq_len=1024,
    )
    assert engine.layout.num_groups == 2
    prompt = random_prompt(np.random.default_rng(0), 32000, 8, [200, 190, 210], 20)
    store = ChunkStore(engine, variant="system", prefix_tokens=prompt.prefix)
    for chunk in prompt.chunks:
        store.put(chunk)
    blender = Blender(store, token_bucket=64)
    full = blender.run(prompt, FULL_RECOMPUTE)
    assert prompt.roles.num_tokens > min(engine.manager.group_windows)
    return prompt, blender, full


def test_ratio_one_equals_full_recompute(setup):
    prompt, blender, full = setup
    run = blender.run(prompt, SelectionConfig(recompute_ratio=1.0, check_layers=(1,), budgets=(1.0,), row_bucket=64))
    assert run.report.chunk_hit == sum(len(c) for c in prompt.chunks) and run.report.num_missed == 0
    assert rel_err(run.logits[0], full.logits[0]) < RTOL


def test_ratio_zero_equals_full_reuse(setup):
    prompt, blender, full = setup
    reuse = blender.run(prompt, SelectionConfig(selector="none", row_bucket=64)).logits[0]
    zero = blender.run(prompt, SelectionConfig(recompute_ratio=0.0, check_layers=(1,), budgets=(1.0,), row_bucket=64))
    assert rel_err(zero.logits[0], reuse) < RTOL
    assert rel_err(reuse, full.logits[0]) > 1e-3  # the chunks really miss cross-attention


def test_chunk_longer_than_the_window_is_refused(setup):
    _, blender, _ = setup
    with pytest.raises(ValueError, match="windowed layer group keeps only the blocks inside its window"):
        blender.store.put(list(range(100, 700)))
