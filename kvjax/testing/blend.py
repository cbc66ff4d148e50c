"""Random blended prompts, small engines and blended submissions for CacheBlend tests (tiny models)."""

from __future__ import annotations

import pathlib

import numpy as np
from jax.sharding import Mesh

from kvjax.blend.chunk_store import ChunkStore
from kvjax.blend.engine_blend import ChunkReuse
from kvjax.blend.prompt import BlendPrompt
from kvjax.blend.selection import SelectionConfig
from kvjax.config import KvCacheConfig, SchedulerConfig
from kvjax.engine import Engine
from kvjax.model.config import ModelConfig
from kvjax.model.model import Model
from kvjax.model.transformer import Params
from kvjax.sampling import SamplingParams


def random_prompt(
    rng: np.random.Generator, vocab: int, prefix_len: int, chunk_lens: list[int], suffix_len: int
) -> BlendPrompt:
    """A prompt of uniform random token ids in [3, vocab) with the given part lengths."""

    def draw(n: int) -> tuple[int, ...]:
        return tuple(int(t) for t in rng.integers(3, vocab, n))

    return BlendPrompt(prefix=draw(prefix_len), chunks=tuple(draw(n) for n in chunk_lens), suffix=draw(suffix_len))


def tiny_engine(
    cfg: ModelConfig,
    params: Params,
    *,
    max_tokens: int = 8176,
    max_seq_len: int = 512,
    tokens_per_block: int = 16,
    mesh: Mesh | None = None,
) -> Engine:
    """An engine over a tiny model (float32 cache of ``max_tokens`` tokens, one-step prefills; the
    default gives 512 pages with the null page, divisible by any mesh's page axis up to 512),
    sharded over ``mesh`` if given."""
    model = Model(config=cfg, params=params, tokenizer=None, path=pathlib.Path("tiny"))
    return Engine(
        model, KvCacheConfig(tokens_per_block=tokens_per_block, max_tokens=max_tokens, event_buffer_max_size=10_000),
        SchedulerConfig(max_num_tokens=4096, prefill_chunk_size=4096), max_seq_len=max_seq_len, mesh=mesh,
    )


def submit_blended(store: ChunkStore, prompt: BlendPrompt, selection: SelectionConfig, sampling: SamplingParams) -> str:
    """Submits ``prompt`` to ``store.engine`` as a blended request over its chunk spans; returns its id."""
    return store.engine.submit(
        prompt.tokens.tolist(), sampling, chunks=ChunkReuse(store, prompt.roles.chunk_spans, selection)
    )
