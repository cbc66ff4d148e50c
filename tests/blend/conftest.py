"""Fixtures of the blend tests: a tiny random model and random blended prompts."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.blend.blender import Blender, BlendPrompt
from kvjax.blend.chunk_store import ChunkStore
from kvjax.testing.tiny import tiny_model


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(0, num_layers=4)


def random_prompt(rng: np.random.Generator, vocab: int, prefix_len: int, chunk_lens: list[int], suffix_len: int) -> BlendPrompt:
    draw = lambda n: tuple(int(t) for t in rng.integers(3, vocab, n))  # noqa: E731
    return BlendPrompt(prefix=draw(prefix_len), chunks=tuple(draw(n) for n in chunk_lens), suffix=draw(suffix_len))


def make_blender(cfg, params, prompt: BlendPrompt, *, variant="system", tier="device", tmp_path=None, max_tokens=512):
    store = ChunkStore(params, cfg, variant=variant, prefix_tokens=prompt.prefix, tier=tier,
                       disk_dir=tmp_path, device_capacity=4096, page_size=16, token_bucket=32)
    for chunk in prompt.chunks:
        store.put(chunk)
    return Blender(params, cfg, store, prompt.prefix, max_tokens=max_tokens, page_size=16, token_bucket=64)
