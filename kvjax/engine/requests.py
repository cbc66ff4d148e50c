"""What a submission is checked against before any engine state changes: prompt token ids,
optional string fields, the ``ChunkedPrompt`` protocol of a blended request, and the request
features Manager V2 lacks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import jax

from kvjax.config import KvCacheRetentionConfig, as_retention_config
from kvjax.manager import hashing

if TYPE_CHECKING:
    from kvjax.engine.engine import Engine


def check_token_ids(token_ids: object, vocab_size: int, field: str = "prompt_token_ids") -> tuple[int, ...]:
    """A prompt's ids as a tuple of Python ints, or a ``ValueError`` naming ``field``.

    The manager's id check (``kvjax.manager.hashing.check_token_ids``: ints only, no bools or
    floats, in ``[0, vocab_size)``) plus what a prompt needs besides: not empty, and an array
    only if it is 1-D.
    """
    if hasattr(token_ids, "ndim") and token_ids.ndim != 1:
        raise ValueError(f"{field} must be a 1-D sequence of token ids, got shape {token_ids.shape}")
    ids = hashing.check_token_ids(token_ids, field, vocab_size)
    if not ids:
        raise ValueError(f"{field} must not be empty")
    return ids


class ChunkedPrompt(Protocol):
    """What a blended request brings: the scope its blocks live in, its validation, its
    scheduler charge and the prefill that computes its whole prompt (implemented by
    ``kvjax.blend.engine_blend.ChunkReuse``)."""

    @property
    def salt(self) -> str:
        """Cache scope of the request's blocks (used as its ``cache_salt``)."""

    def check(self, engine: Engine, prompt: Sequence[int]) -> None:
        """Raises ``ValueError`` naming the field that does not fit ``prompt`` on ``engine``."""

    def num_rows(self, num_tokens: int, num_layers: int) -> int:
        """Rows the prefill of a ``num_tokens`` prompt recomputes, averaged over layers."""

    def prefill(
        self, engine: Engine, request_id: str, prompt: Sequence[int], num_cached: int
    ) -> tuple[jax.Array, dict | None, object]:
        """Runs the prompt (``num_cached`` leading tokens already in its pages) on the request's
        pages; returns (the last prompt positions' logits [R, V], a trace or None, a report)."""


def check_optional_str(field: str, value: object) -> None:
    if value is not None and not (isinstance(value, str) and value):
        raise ValueError(f"{field}={value!r} must be None or a non-empty str")


def check_v2_request(retention: KvCacheRetentionConfig | dict | None, chunks: ChunkedPrompt | None) -> None:
    """Raises ValueError for a request feature Manager V2 lacks (retention priorities, CacheBlend chunks)."""
    if retention is not None and as_retention_config(retention) != KvCacheRetentionConfig():
        raise ValueError("retention: per-request retention priorities need the V1 manager (use_kv_cache_manager_v2='false')")
    if chunks is not None:
        raise ValueError("chunks: CacheBlend chunk reuse needs the V1 manager (use_kv_cache_manager_v2='false')")
