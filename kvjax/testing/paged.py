"""Running one sequence through the paged model in chunks, with a shuffled page table."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kvjax.cache import CacheLayout, PagePool, init_pool
from kvjax.model.config import ModelConfig
from kvjax.model.transformer import CompileUnit, Params, forward_for


def single_group_layout(
    cfg: ModelConfig, num_pages: int, tokens_per_block: int, windows: tuple[int, ...] | None = None
) -> CacheLayout:
    windows = windows or cfg.layer_windows
    groups = len(dict.fromkeys(windows))
    return CacheLayout(
        layer_windows=windows, num_pages=(num_pages,) * groups, tokens_per_block=tokens_per_block,
        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, max_seq_len=cfg.max_seq_len,
    )


def chunked_logits(
    params: Params,
    cfg: ModelConfig,
    tokens: np.ndarray,
    chunks: list[int],
    *,
    tokens_per_block: int = 16,
    seed: int = 0,
    attn_impl: str = "auto",
    compile_unit: CompileUnit = "model",
) -> tuple[np.ndarray, PagePool, np.ndarray]:
    """Prefills ``tokens`` chunk by chunk (sizes ``chunks``, summing to len(tokens)) and
    returns every position's logits [T, V], the pool and the (randomly permuted) page table.
    A chunk of size 1 is a decode step; ``compile_unit`` picks the forward
    (``kvjax.model.transformer.forward_for``)."""
    if sum(chunks) != len(tokens):
        raise ValueError(f"chunks sum to {sum(chunks)}, expected len(tokens)={len(tokens)}")
    pages_per_seq = -(-len(tokens) // tokens_per_block)
    layout = single_group_layout(cfg, pages_per_seq + 3, tokens_per_block)
    rng = np.random.default_rng(seed)
    table = (rng.permutation(pages_per_seq + 2)[:pages_per_seq] + 1).astype(np.int32)[None]
    pool = init_pool(layout)
    tables = (jnp.asarray(table),) * layout.num_groups
    out, start, forward = [], 0, forward_for(compile_unit)
    for size in chunks:
        toks = jnp.asarray(np.asarray(tokens[start : start + size], np.int32)[None])
        pos = jnp.arange(start, start + size, dtype=jnp.int32)[None]
        logits, pool = forward(
            params, pool, toks, pos, tables, jnp.array([start + size], jnp.int32),
            cfg=cfg, layout=layout, logits_mode="all", attn_impl=attn_impl,
        )
        out.append(np.asarray(logits[0]))
        start += size
    return np.concatenate(out), pool, table
