"""What an engine's options and a submission are checked against before any state changes:
the options (``check_engine_options``), prompt token ids,
sampling, optional string fields, LoRA and multimodal items, the ``ChunkedPrompt`` protocol of
a blended request, and the request features that need a ``TieredCacheManager``; ``scheduler_request`` builds the
scheduler's entry from arguments that passed."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

import jax
from jax.sharding import Mesh

from kvjax import attention
from kvjax.config import (
    KvCacheConfig,
    KvCacheRetentionConfig,
    SpeculativeConfig,
    as_retention_config,
    check_optional_str,
)
from kvjax.engine.scheduler import SchedulerRequest
from kvjax.manager import hashing, require_tiered
from kvjax.manager.hashing import NO_EXTRAS, KeyExtras
from kvjax.model.config import ModelConfig
from kvjax.sampling import SamplingParams

if TYPE_CHECKING:
    from kvjax.engine.runner import StepContext


def check_token_ids(token_ids: object, vocab_size: int, field: str = "prompt_token_ids") -> tuple[int, ...]:
    """A prompt's ids as a tuple of Python ints, or a ``ValueError`` naming ``field``.

    The manager's id check (``kvjax.manager.hashing.check_token_ids``: ints only, no bools or
    floats, in ``[0, vocab_size)``) plus what a prompt needs besides: not empty, and an array
    only if it is 1-D.
    """
    if getattr(token_ids, "ndim", 1) != 1:
        raise ValueError(f"{field} must be a 1-D sequence of token ids, got shape {getattr(token_ids, 'shape', None)}")
    ids = hashing.check_token_ids(token_ids, field, vocab_size)  # type: ignore[arg-type]  # it checks the type
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

    def check(self, context: StepContext, prompt: Sequence[int]) -> None:
        """Raises ``ValueError`` naming the field that does not fit ``prompt`` on the engine
        whose step context is ``context``."""

    def num_rows(self, num_tokens: int, num_layers: int) -> int:
        """Rows the prefill of a ``num_tokens`` prompt recomputes, averaged over layers."""

    def batch_key(self, prompt: Sequence[int], num_cached: int) -> Hashable | None:
        """Blended requests of one step with equal keys prefill together (``prefill``); None = alone."""

    def prefill(
        self, context: StepContext, batch: Sequence[ChunkedWork]
    ) -> Sequence[tuple[jax.Array, dict | None, object]]:
        """Runs the prompts of ``batch`` (this request's first, the others with its
        ``batch_key``) on the requests' pages of ``context.pool``; returns per request (the
        last prompt positions' logits [R, V], a trace or None, a report)."""


@dataclasses.dataclass(frozen=True)
class ChunkedWork:
    """A blended request's prefill in a step: its id, prompt, the leading tokens its pages
    already hold (blend-scope match) and its chunks."""

    request_id: str
    prompt: tuple[int, ...]
    num_cached: int
    reuse: ChunkedPrompt


def check_request_features(
    context: StepContext,
    prompt: tuple[int, ...],
    retention: KvCacheRetentionConfig | dict | None,
    chunks: ChunkedPrompt | None,
    extras: KeyExtras,
    *,
    hybrid: bool,
) -> KeyExtras:
    """Raises ``ValueError`` for a request feature the engine lacks (retention priorities and
    CacheBlend chunks need a ``TieredCacheManager``; hybrid models take no chunks) or a
    blended request's bad field; returns the request's key extras (a blended request's are
    its scope ``chunks.salt`` alone)."""
    if retention is not None and as_retention_config(retention) != KvCacheRetentionConfig():
        require_tiered(context.manager, "retention (per-request retention priorities)")
    if chunks is None:
        return extras
    require_tiered(context.manager, "chunks (CacheBlend chunk reuse)")
    if hybrid:
        raise ValueError(f"chunks: CacheBlend chunk reuse is not supported for the hybrid model {context.cfg.name!r}")
    if extras != NO_EXTRAS:
        raise ValueError("a request with chunks takes no cache_salt, lora_id or mm_items (its scope is chunks.salt)")
    chunks.check(context, prompt)
    return KeyExtras(cache_salt=chunks.salt)


def scheduler_request(
    prompt: tuple[int, ...],
    sampling: SamplingParams,
    cfg: ModelConfig,
    ids: Iterator[int],
    *,
    request_id: str | None,
    retention: KvCacheRetentionConfig | dict | None,
    extras: KeyExtras,
) -> SchedulerRequest:
    """A request's scheduler entry from a checked prompt; raises ``ValueError`` (``ConfigError``
    for ``retention``) naming the first argument that does not fit ``cfg``'s model.

    Args:
      ids: the engine's counter of generated ids (``request_id=None`` takes ``req-<next>``).
    """
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    if sampling.stop_token_id is not None and sampling.stop_token_id >= cfg.vocab_size:
        raise ValueError(f"sampling.stop_token_id={sampling.stop_token_id} must be in [0, {cfg.vocab_size})")
    check_optional_str("request_id", request_id)
    retention = as_retention_config(retention)
    stop = None if sampling.ignore_eos else (
        sampling.stop_token_id if sampling.stop_token_id is not None else cfg.eos_ids[0]
    )
    return SchedulerRequest(
        request_id=request_id if request_id is not None else f"req-{next(ids)}",
        prompt_token_ids=prompt, max_new_tokens=sampling.max_new_tokens, eos_token_id=stop,
        retention=retention, extras=extras,
    )


def check_engine_options(
    cfg: ModelConfig,
    max_seq_len: int | None,
    attn_impl: str,
    max_finished_requests: int,
    speculative: SpeculativeConfig | None,
    mesh: Mesh | None = None,
    kv_config: KvCacheConfig | None = None,
) -> None:
    """Raises ``ValueError`` naming the first ``Engine`` option that does not fit ``cfg``'s model
    (or, with a device ``mesh``, a feature the sharded engine does not have yet)."""
    if speculative is not None and not isinstance(speculative, SpeculativeConfig):
        raise ValueError(f"speculative must be None or a SpeculativeConfig, got {type(speculative).__name__}")
    if (
        isinstance(max_finished_requests, bool)
        or not isinstance(max_finished_requests, int)
        or max_finished_requests < 1
    ):
        raise ValueError(f"max_finished_requests={max_finished_requests!r} must be an int >= 1")
    if max_seq_len is not None and (isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int)
                                    or not 1 <= max_seq_len <= cfg.max_seq_len):
        raise ValueError(
            f"max_seq_len={max_seq_len!r} must be None (the model's {cfg.max_seq_len}) or an int in "
            f"[1, {cfg.max_seq_len}] (the model's max_seq_len)"
        )
    if attn_impl not in attention.IMPLS:
        raise ValueError(f"attn_impl={attn_impl!r} must be one of {attention.IMPLS}")
    if cfg.is_hybrid and speculative is not None:
        raise ValueError(
            f"speculative decoding is not supported for the hybrid model {cfg.name!r}: a rejected draft "
            "cannot be rolled back out of a recurrent state; pass speculative=None"
        )
    if mesh is not None:
        if not isinstance(mesh, Mesh):
            raise ValueError(
                f"mesh must be None or a jax.sharding.Mesh (kvjax.distributed.make_mesh), got {type(mesh).__name__}"
            )
        lacking = [name for name, present in (
            ("speculative", speculative is not None), ("a hybrid model", cfg.is_hybrid),
            ("kv_cache_config.host_cache_size", kv_config is not None and kv_config.host_cache_size > 0),
        ) if present]
        if lacking:
            raise ValueError(
                f"an engine over a device mesh does not support {', '.join(lacking)} yet; drop the mesh or these"
            )
    if cfg.is_hybrid and kv_config is not None:
        limit = max_seq_len or cfg.max_seq_len
        mamba = kv_config.mamba_state_config
        for name in ("additional_snapshot_offsets_from_start", "additional_snapshot_offsets_from_end"):
            past = [o for o in getattr(mamba, name) if o >= limit]
            if past:
                raise ValueError(
                    f"kv_cache_config.mamba_state_config.{name}={list(getattr(mamba, name))!r} holds {past}, at or "
                    f"past "
                    f"the engine's max_seq_len={limit}: no sequence reaches them; each must be in [0, {limit})"
                )
