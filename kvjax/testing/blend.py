"""Random blended prompts and small Blenders for CacheBlend tests (tiny models)."""

from __future__ import annotations

import pathlib

import numpy as np

from kvjax.blend.blender import Blender, BlendPrompt
from kvjax.blend.chunk_store import ChunkStore, Tier, Variant
from kvjax.model.config import ModelConfig
from kvjax.model.transformer import Params


def random_prompt(
    rng: np.random.Generator, vocab: int, prefix_len: int, chunk_lens: list[int], suffix_len: int
) -> BlendPrompt:
    """A prompt of uniform random token ids in [3, vocab) with the given part lengths."""
    draw = lambda n: tuple(int(t) for t in rng.integers(3, vocab, n))  # noqa: E731
    return BlendPrompt(prefix=draw(prefix_len), chunks=tuple(draw(n) for n in chunk_lens), suffix=draw(suffix_len))


def make_blender(
    cfg: ModelConfig,
    params: Params,
    prompt: BlendPrompt,
    *,
    variant: Variant = "system",
    tier: Tier = "device",
    tmp_path: str | pathlib.Path | None = None,
    max_tokens: int = 512,
) -> Blender:
    """A Blender over a fresh store holding ``prompt``'s chunks (16-token pages, 64-token buckets).

    Args:
      tmp_path: the folder of the disk tier.
      max_tokens: the Blender's longest prompt plus continuation.
    """
    store = ChunkStore(params, cfg, variant=variant, prefix_tokens=prompt.prefix, tier=tier,
                       disk_dir=tmp_path, device_capacity=4096, page_size=16, token_bucket=32)
    for chunk in prompt.chunks:
        store.put(chunk)
    return Blender(params, cfg, store, prompt.prefix, max_tokens=max_tokens, page_size=16, token_bucket=64)
