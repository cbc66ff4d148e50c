"""Validated, frozen configuration of the KV cache, its retention policy, the scheduler and
speculative decoding.

Field names and defaults follow TensorRT-LLM's ``KvCacheConfig``. Every
dataclass validates itself at construction: a bad value raises ``ConfigError`` naming the
field, the value and what is allowed, so no half-built cache ever exists.

A mapping in the shape of TensorRT-LLM's YAML (``kv_cache_config:`` / ``scheduler_config:``)
loads with :func:`load_llm_config`.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import yaml

DEFAULT_PRIORITY = 35
"""Priority of a block that no retention rule covers (TensorRT-LLM's default)."""
MIN_PRIORITY = 0
MAX_PRIORITY = 100

KV_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8")
KV_SCALE_GRANULARITIES = ("token", "page")


class ConfigError(ValueError):
    """A configuration value is outside its allowed range."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def check_optional_str(field: str, value: object) -> None:
    """A ``ValueError`` naming ``field`` unless ``value`` is None or a non-empty string."""
    if value is not None and not (isinstance(value, str) and value):
        raise ValueError(f"{field}={value!r} must be None or a non-empty str")


def _is_int(value: Any) -> bool:
    """An integer that is not a bool (``True`` is an ``int`` in Python, never a size here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _as_tuple(field: str, value: Any, what: str) -> tuple:
    """``value`` as a tuple when it is a list or tuple; else a ConfigError naming ``field``."""
    _require(isinstance(value, (list, tuple)), f"{field}={value!r} must be a list of {what}")
    return tuple(value)


def _check_priority(field: str, value: Any) -> None:
    _require(
        _is_int(value) and MIN_PRIORITY <= value <= MAX_PRIORITY,
        f"{field}={value!r} must be an int in [{MIN_PRIORITY}, {MAX_PRIORITY}] (100 = most important)",
    )


def _check_duration(field: str, value: Any) -> None:
    _require(
        value is None or (_is_number(value) and value > 0 and value != float("inf")),
        f"{field}={value!r} must be None (no expiry) or a positive number of milliseconds",
    )


def _from_mapping(cls: type, mapping: Mapping[str, Any], where: str) -> Any:
    _require(isinstance(mapping, Mapping), f"{where}={mapping!r} must be a mapping of field names to values")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(mapping) - names)
    _require(not unknown, f"{where}: unknown field(s) {unknown}; allowed: {sorted(names)}")
    return cls(**mapping)


@dataclasses.dataclass(frozen=True, slots=True)
class TokenRangeRetentionConfig:
    """Priority for the tokens ``[token_start, token_end)`` of a request's prompt.

    Attributes:
      token_start: first token index covered, >= 0.
      token_end: one past the last token covered, > token_start; None covers to the end
        of the sequence (prompt and generated tokens).
      priority: 0..100, 100 = evicted last.
      duration_ms: after this many milliseconds the blocks fall back to the default
        priority (35); None keeps the priority until the block is evicted.
    """

    token_start: int
    token_end: int | None
    priority: int
    duration_ms: float | None = None

    def __post_init__(self) -> None:
        _require(
            _is_int(self.token_start) and self.token_start >= 0,
            f"token_start={self.token_start!r} must be an int >= 0",
        )
        _require(
            self.token_end is None or (_is_int(self.token_end) and self.token_end > self.token_start),
            f"token_end={self.token_end!r} must be None (to the end) or an int > token_start={self.token_start}",
        )
        _check_priority("priority", self.priority)
        _check_duration("duration_ms", self.duration_ms)


@dataclasses.dataclass(frozen=True, slots=True)
class KvCacheRetentionConfig:
    """A request's retention policy: priorities for prompt token ranges and generated tokens.

    Attributes:
      token_range_retention_configs: non-overlapping token ranges, each with a priority.
      decode_retention_priority: priority of blocks filled by generated tokens.
      decode_duration_ms: expiry of the decode priority (None = never).
    """

    token_range_retention_configs: tuple[TokenRangeRetentionConfig, ...] = ()
    decode_retention_priority: int = DEFAULT_PRIORITY
    decode_duration_ms: float | None = None

    def __post_init__(self) -> None:
        given = _as_tuple("token_range_retention_configs", self.token_range_retention_configs, "token ranges")
        ranges = tuple(
            r
            if isinstance(r, TokenRangeRetentionConfig)
            else _from_mapping(TokenRangeRetentionConfig, r, "token range")
            for r in given
        )
        object.__setattr__(self, "token_range_retention_configs", ranges)
        _check_priority("decode_retention_priority", self.decode_retention_priority)
        _check_duration("decode_duration_ms", self.decode_duration_ms)
        ordered = sorted(ranges, key=lambda r: r.token_start)
        for a, b in itertools.pairwise(ordered):
            _require(
                a.token_end is not None and a.token_end <= b.token_start,
                f"token_range_retention_configs overlap: [{a.token_start}, {a.token_end}) and "
                f"[{b.token_start}, {b.token_end}); ranges must be disjoint",
            )

    def priority_at(self, token_index: int) -> tuple[int, float | None]:
        """(priority, duration_ms) of the prompt token at ``token_index``."""
        for r in self.token_range_retention_configs:
            if r.token_start <= token_index and (r.token_end is None or token_index < r.token_end):
                return r.priority, r.duration_ms
        return DEFAULT_PRIORITY, None


REUSE_POLICIES = ("all_reusable", "per_conversation")


@dataclasses.dataclass(frozen=True, slots=True)
class BlockReuseConfig:
    """Which recurrent-state snapshots of a hybrid model are kept for reuse.

    Attributes:
      policy: "all_reusable" keeps snapshots at every configured position (periodic and
        offsets) of every request; "per_conversation" keeps only the offset boundaries
        (``MambaStateConfig.additional_snapshot_offsets_from_start`` / ``_from_end``; the
        periodic interval is ignored) and, per conversation, only those of its last
        ``max_num_turns`` turns. A conversation is a chain of requests in which each prompt
        extends a finished request's prompt + output; a request extending none starts one.
      max_num_turns: turns of one conversation whose snapshots are kept, >= 1
        ("per_conversation" only).
    """

    policy: str = "all_reusable"
    max_num_turns: int = 8

    def __post_init__(self) -> None:
        _require(
            self.policy in REUSE_POLICIES, f"block_reuse_config.policy={self.policy!r} must be one of {REUSE_POLICIES}"
        )
        _require(
            _is_int(self.max_num_turns) and self.max_num_turns >= 1,
            f"block_reuse_config.max_num_turns={self.max_num_turns!r} must be an int >= 1",
        )


@dataclasses.dataclass(frozen=True, slots=True)
class MambaStateConfig:
    """Where the recurrent state of a hybrid model is snapshotted for reuse (positions in tokens).

    A snapshot is the state after the first p tokens of a sequence, p a block boundary
    (a multiple of ``tokens_per_block``), keyed by the block key of the block ending at p; a
    new request resumes from the deepest snapshot its cached prefix reaches.

    Attributes:
      periodic_snapshot_interval: a snapshot every this many tokens (prompt and generated);
        0 = off; a multiple of ``tokens_per_block``. Ignored by the "per_conversation" policy.
      additional_snapshot_offsets_from_start: positions p >= 0 counted from the sequence
        start, rounded down to a block boundary (p < tokens_per_block takes none).
      additional_snapshot_offsets_from_end: offsets o >= 0 counted back from the end of the
        prompt: the snapshot is at len(prompt) - o rounded down to a block boundary. 0 = the
        last full block of the prompt, the boundary the next turn of a chat reuses.
      max_snapshots: snapshot slots of the state pool (each holds one state of every
        recurrent layer), >= 1; the least recently used snapshot goes first when full,
        after snapshots whose block has left the cache.
    """

    periodic_snapshot_interval: int = 0
    additional_snapshot_offsets_from_start: tuple[int, ...] = ()
    additional_snapshot_offsets_from_end: tuple[int, ...] = ()
    max_snapshots: int = 256

    def __post_init__(self) -> None:
        _require(
            _is_int(self.periodic_snapshot_interval) and self.periodic_snapshot_interval >= 0,
            f"mamba_state_config.periodic_snapshot_interval={self.periodic_snapshot_interval!r} must be an int >= 0 "
            "(tokens; 0 = off)",
        )
        for name in ("additional_snapshot_offsets_from_start", "additional_snapshot_offsets_from_end"):
            offsets = _as_tuple(f"mamba_state_config.{name}", getattr(self, name), "ints >= 0 (tokens)")
            _require(
                all(_is_int(o) and o >= 0 for o in offsets),
                f"mamba_state_config.{name}={offsets!r} must be a list of ints >= 0 (tokens)",
            )
            object.__setattr__(self, name, offsets)
        _require(
            _is_int(self.max_snapshots) and self.max_snapshots >= 1,
            f"mamba_state_config.max_snapshots={self.max_snapshots!r} must be an int >= 1",
        )


def _nested(cls: type, value: Any, field: str) -> Any:
    """``value`` as a ``cls``: itself, or built from a mapping; else a ConfigError naming ``field``."""
    if isinstance(value, cls):
        return value
    _require(isinstance(value, Mapping), f"{field}={value!r} must be a {cls.__name__} or a mapping of its fields")
    return _from_mapping(cls, value, field)


@dataclasses.dataclass(frozen=True, slots=True)
class KvCacheConfig:
    """The KV cache: sizing, dtype, reuse, offload, windows and events.

    Attributes:
      tokens_per_block: tokens in one page/block (power of two, 1..1024).
      dtype: "auto" (the model's dtype), "float32", "bfloat16", "float16", or quantized
        "int8" / "fp8" (float8_e4m3fn): quantized values plus float32 scales, quantized when
        KV is written and dequantized inside attention.
      scale_granularity: scales of a quantized dtype: "token" (one per token and KV head,
        4 bytes per token, layer and KV head) or "page" (one per page and KV head, the
        page's running absmax); ignored by the float dtypes.
      free_gpu_memory_fraction: share of free device memory given to the cache, in (0, 1).
      max_tokens: cap on cached tokens; with the fraction, the smaller size wins.
      free_memory_bytes: the free memory to size against where the backend cannot tell
        (CPU); None measures it.
      enable_block_reuse: reuse blocks across requests through the radix tree.
      host_cache_size: bytes of the host (secondary) tier; 0 disables offload, else at least
        one block (a page of every layer group; checked when the engine is built).
      disk_cache_size: bytes of the disk tier below the host tier (host victims spill there
        instead of being dropped); 0 disables it, else at least one block; needs
        host_cache_size > 0.
      disk_cache_dir: folder of the disk tier's page files (created; they are removed when
        the engine is garbage-collected); ``~`` is expanded and a relative path is made
        absolute here, against the working directory of this call. None = a fresh folder
        under the system temp dir.
      secondary_offload_min_priority: blocks with priority below this are dropped, not offloaded.
      host_read_gbps, disk_read_gbps: emulated read bandwidth (GB/s, 1e9 bytes) of the host and
        disk tiers; 0 = as fast as this machine reads them. For experiments on a machine whose
        page cache makes every tier memory-speed: a read of ``n`` bytes is made to last
        ``latency + n / bandwidth`` by sleeping after the real copy (no CPU is used while it
        waits). ``kvjax.cache.host_pool.TierThrottle``.
      host_latency_ms, disk_latency_ms: emulated latency (ms) of each read of the tier, >= 0.
      enable_partial_reuse: reuse a block whose tokens match only in part.
      copy_on_partial_reuse: copy the matching tokens into a fresh block (else reuse the
        partially matched block only when no other request holds it).
      max_attention_window: attention window per layer, cycled over the layers; None = full.
      pool_ratio: one positive weight per layer group (groups = distinct windows in order of
        first appearance), normalised: the share of the device cache's bytes each group's
        page pool gets. None = see ``avg_seq_len``.
      avg_seq_len: expected tokens per sequence (positive), used when ``pool_ratio`` is None:
        each group's share is its layers times the tokens a sequence of this length keeps
        there (min(window, avg_seq_len)). With neither set, hybrid recurrent models log a
        warning and use half of ``max_seq_len``; other models give every group the same
        page count.
      event_buffer_max_size: capacity of the KV cache event buffer; 0 disables events.
      use_kv_cache_manager_v2: "auto", "true" or "false" (booleans accepted).
      block_reuse_config: recurrent-state reuse policy of hybrid models (a mapping is accepted).
      mamba_state_config: recurrent-state snapshot positions of hybrid models (a mapping is
        accepted); its periodic interval must be a multiple of tokens_per_block, and the
        "per_conversation" policy needs at least one offset.
    """

    tokens_per_block: int = 32
    dtype: str = "auto"
    scale_granularity: str = "token"
    free_gpu_memory_fraction: float = 0.9
    max_tokens: int | None = None
    free_memory_bytes: int | None = None
    enable_block_reuse: bool = True
    host_cache_size: int = 0
    disk_cache_size: int = 0
    disk_cache_dir: str | None = None
    secondary_offload_min_priority: int = DEFAULT_PRIORITY
    host_read_gbps: float = 0.0
    host_latency_ms: float = 0.0
    disk_read_gbps: float = 0.0
    disk_latency_ms: float = 0.0
    enable_partial_reuse: bool = True
    copy_on_partial_reuse: bool = True
    max_attention_window: tuple[int, ...] | None = None
    pool_ratio: tuple[float, ...] | None = None
    avg_seq_len: int | None = None
    event_buffer_max_size: int = 0
    use_kv_cache_manager_v2: Literal["auto", "true", "false"] = "auto"
    block_reuse_config: BlockReuseConfig = BlockReuseConfig()
    mamba_state_config: MambaStateConfig = MambaStateConfig()

    def __post_init__(self) -> None:
        t = self.tokens_per_block
        _require(
            _is_int(t) and 1 <= t <= 1024 and (t & (t - 1)) == 0,
            f"tokens_per_block={t!r} must be a power of two in [1, 1024]",
        )
        _require(
            isinstance(self.dtype, str) and self.dtype in KV_DTYPES, f"dtype={self.dtype!r} must be one of {KV_DTYPES}"
        )
        _require(
            isinstance(self.scale_granularity, str) and self.scale_granularity in KV_SCALE_GRANULARITIES,
            f"scale_granularity={self.scale_granularity!r} must be one of {KV_SCALE_GRANULARITIES}",
        )
        f = self.free_gpu_memory_fraction
        _require(
            _is_number(f) and 0.0 < f < 1.0,
            f"free_gpu_memory_fraction={f!r} must be a float in the open interval (0, 1)",
        )
        _require(
            self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens > 0),
            f"max_tokens={self.max_tokens!r} must be None or a positive int",
        )
        _require(
            self.free_memory_bytes is None or (_is_int(self.free_memory_bytes) and self.free_memory_bytes > 0),
            f"free_memory_bytes={self.free_memory_bytes!r} must be None (measure) or a positive int",
        )
        for name in ("enable_block_reuse", "enable_partial_reuse", "copy_on_partial_reuse"):
            _require(isinstance(getattr(self, name), bool), f"{name}={getattr(self, name)!r} must be a bool")
        _require(
            _is_int(self.host_cache_size) and self.host_cache_size >= 0,
            f"host_cache_size={self.host_cache_size!r} must be an int >= 0 (bytes)",
        )
        _require(
            _is_int(self.disk_cache_size) and self.disk_cache_size >= 0,
            f"disk_cache_size={self.disk_cache_size!r} must be an int >= 0 (bytes)",
        )
        _require(
            not self.disk_cache_size or self.host_cache_size > 0,
            f"disk_cache_size={self.disk_cache_size} needs host_cache_size > 0: blocks reach the disk tier "
            "only from the host tier",
        )
        _require(
            self.disk_cache_dir is None or (isinstance(self.disk_cache_dir, str) and self.disk_cache_dir != ""),
            f"disk_cache_dir={self.disk_cache_dir!r} must be None or a non-empty path string",
        )
        if self.disk_cache_dir is not None:
            object.__setattr__(self, "disk_cache_dir", os.path.abspath(os.path.expanduser(self.disk_cache_dir)))
        _check_priority("secondary_offload_min_priority", self.secondary_offload_min_priority)
        for name, unit in (("host_read_gbps", "GB/s; 0 = unthrottled"), ("host_latency_ms", "ms"),
                           ("disk_read_gbps", "GB/s; 0 = unthrottled"), ("disk_latency_ms", "ms")):
            value = getattr(self, name)
            _require(
                _is_number(value) and 0.0 <= value < float("inf"),
                f"{name}={value!r} must be a finite number >= 0 ({unit})",
            )
        for name, kind, is_kind, meaning in (
            ("max_attention_window", "ints", _is_int, "one window per layer, cycled"),
            ("pool_ratio", "numbers", _is_number, "one weight per layer group"),
        ):
            if getattr(self, name) is not None:
                values = _as_tuple(name, getattr(self, name), f"positive {kind} ({meaning})")
                object.__setattr__(self, name, values)
                _require(
                    len(values) > 0 and all(is_kind(v) and v > 0 for v in values),
                    f"{name}={values!r} must be a non-empty list of positive {kind} ({meaning})",
                )
        _require(
            self.avg_seq_len is None or (_is_int(self.avg_seq_len) and self.avg_seq_len > 0),
            f"avg_seq_len={self.avg_seq_len!r} must be None or a positive int (tokens)",
        )
        _require(
            _is_int(self.event_buffer_max_size) and self.event_buffer_max_size >= 0,
            f"event_buffer_max_size={self.event_buffer_max_size!r} must be an int >= 0",
        )
        v2 = self.use_kv_cache_manager_v2
        if isinstance(v2, bool):
            object.__setattr__(self, "use_kv_cache_manager_v2", "true" if v2 else "false")
        _require(
            self.use_kv_cache_manager_v2 in ("auto", "true", "false"),
            f"use_kv_cache_manager_v2={v2!r} must be 'auto', 'true' or 'false'",
        )
        reuse = _nested(BlockReuseConfig, self.block_reuse_config, "block_reuse_config")
        mamba = _nested(MambaStateConfig, self.mamba_state_config, "mamba_state_config")
        object.__setattr__(self, "block_reuse_config", reuse)
        object.__setattr__(self, "mamba_state_config", mamba)
        interval = mamba.periodic_snapshot_interval
        _require(
            interval % t == 0,
            f"mamba_state_config.periodic_snapshot_interval={interval} must be a multiple of tokens_per_block={t}",
        )
        _require(
            reuse.policy != "per_conversation"
            or mamba.additional_snapshot_offsets_from_start
            or mamba.additional_snapshot_offsets_from_end,
            "block_reuse_config.policy='per_conversation' turns periodic snapshots off, so "
            "mamba_state_config.additional_snapshot_offsets_from_end (usually [0]) or "
            "additional_snapshot_offsets_from_start must name at least one boundary",
        )

    def content_fields(self) -> dict[str, Any]:
        """The fields that decide what the cache holds, JSON-ready: every field but
        ``disk_cache_dir`` (where the disk tier's file lives). Snapshots must match on these."""
        fields = dataclasses.asdict(self)
        del fields["disk_cache_dir"]
        for name in ("max_attention_window", "pool_ratio"):
            if fields[name] is not None:
                fields[name] = list(fields[name])
        mamba = fields["mamba_state_config"]
        for name in ("additional_snapshot_offsets_from_start", "additional_snapshot_offsets_from_end"):
            mamba[name] = list(mamba[name])
        return fields

    def windows_for(self, num_layers: int, max_seq_len: int) -> tuple[int, ...]:
        """Attention window of every layer: the list cycled to ``num_layers``, capped at max_seq_len."""
        pattern = self.max_attention_window or (max_seq_len,)
        return tuple(min(pattern[i % len(pattern)], max_seq_len) for i in range(num_layers))

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any]) -> KvCacheConfig:
        return _from_mapping(cls, mapping, "kv_cache_config")


MAX_DECODE_STEPS_PER_DISPATCH = 1024
"""Most decode steps one device dispatch runs (``SchedulerConfig.num_decode_steps_per_dispatch``)."""


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Step scheduling.

    Attributes:
      enable_prefix_aware_scheduling: defer a context request whose first chunk duplicates
        one in flight, and charge only non-reused tokens to the budget.
      max_num_tokens: token budget of one engine step (prefill chunks + decode tokens).
      max_batch_size: most sequences in one step.
      prefill_chunk_size: longest prefill chunk of one request in one step (tokens).
      num_decode_steps_per_dispatch: with Manager V2, decode steps the engine runs in one
        device dispatch when every running request is decoding (allocation, forward,
        sampling, stop tokens and length limits on the device), in [1, 1024]; V1 ignores it.
    """

    enable_prefix_aware_scheduling: bool = True
    max_num_tokens: int = 2048
    max_batch_size: int = 8
    prefill_chunk_size: int = 1024
    num_decode_steps_per_dispatch: int = 1

    def __post_init__(self) -> None:
        _require(
            isinstance(self.enable_prefix_aware_scheduling, bool),
            f"enable_prefix_aware_scheduling={self.enable_prefix_aware_scheduling!r} must be a bool",
        )
        for name in ("max_num_tokens", "max_batch_size", "prefill_chunk_size"):
            value = getattr(self, name)
            _require(_is_int(value) and value > 0, f"{name}={value!r} must be a positive int")
        n = self.num_decode_steps_per_dispatch
        _require(
            _is_int(n) and 1 <= n <= MAX_DECODE_STEPS_PER_DISPATCH,
            f"num_decode_steps_per_dispatch={n!r} must be an int in [1, {MAX_DECODE_STEPS_PER_DISPATCH}]",
        )
        _require(
            self.prefill_chunk_size <= self.max_num_tokens,
            f"prefill_chunk_size={self.prefill_chunk_size} must be <= max_num_tokens={self.max_num_tokens}",
        )

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any]) -> SchedulerConfig:
        return _from_mapping(cls, mapping, "scheduler_config")


SPECULATIVE_METHODS = ("ngram", "early_exit")
MAX_DRAFT_TOKENS = 16
"""Longest draft a step verifies (the verification forward runs 1 + k query rows per sequence)."""


@dataclasses.dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding: a drafter proposes tokens, one forward of the model verifies them.

    Attributes:
      method: "ngram" (prompt lookup: the tokens that followed the most recent earlier
        occurrence of the context's last n tokens) or "early_exit" (self-speculation: the
        model's first ``exit_layer`` layers and its LM head, over the same paged cache).
      num_draft_tokens: tokens drafted per decode step, in [1, MAX_DRAFT_TOKENS].
      ngram_sizes: (min, max) n of the prompt lookup, 1 <= min <= max; the longest n that
        matches wins ("ngram" only).
      exit_layer: m, layers the early-exit drafter runs, in [1, num_layers - 1] (checked
        against the model by the engine; "early_exit" only).
    """

    method: Literal["ngram", "early_exit"] = "ngram"
    num_draft_tokens: int = 4
    ngram_sizes: tuple[int, int] = (1, 3)
    exit_layer: int = 8

    def __post_init__(self) -> None:
        _require(self.method in SPECULATIVE_METHODS, f"method={self.method!r} must be one of {SPECULATIVE_METHODS}")
        k = self.num_draft_tokens
        _require(
            _is_int(k) and 1 <= k <= MAX_DRAFT_TOKENS,
            f"num_draft_tokens={k!r} must be an int in [1, {MAX_DRAFT_TOKENS}]",
        )
        sizes = _as_tuple("ngram_sizes", self.ngram_sizes, "two ints (min n, max n)")
        object.__setattr__(self, "ngram_sizes", sizes)
        _require(
            len(sizes) == 2 and all(_is_int(n) for n in sizes) and 1 <= sizes[0] <= sizes[1],
            f"ngram_sizes={sizes!r} must be two ints (min n, max n) with 1 <= min <= max",
        )
        _require(
            _is_int(self.exit_layer) and self.exit_layer >= 1, f"exit_layer={self.exit_layer!r} must be an int >= 1"
        )

    def check_model(self, num_layers: int) -> None:
        """Raises ConfigError if ``exit_layer`` does not leave at least one layer to skip."""
        _require(
            self.method != "early_exit" or self.exit_layer <= num_layers - 1,
            f"exit_layer={self.exit_layer} must be in [1, {num_layers - 1}] for a model of {num_layers} layers",
        )


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a mapping that repeats a key (plain YAML keeps the last one)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            _require(key not in seen, f"duplicate key {key!r} at line {key_node.start_mark.line + 1} of the config")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_llm_config(source: Mapping[str, Any] | str) -> tuple[KvCacheConfig, SchedulerConfig]:
    """Reads ``kv_cache_config`` and ``scheduler_config`` from a mapping or a YAML string.

    >>> kv, sched = load_llm_config("kv_cache_config:\\n  enable_block_reuse: true\\n"
    ...                             "scheduler_config:\\n  enable_prefix_aware_scheduling: false\\n")
    >>> kv.enable_block_reuse, sched.enable_prefix_aware_scheduling
    (True, False)
    """
    mapping = yaml.load(source, Loader=_UniqueKeyLoader) if isinstance(source, str) else source
    _require(isinstance(mapping, Mapping), f"config source must be a mapping, got {type(mapping).__name__}")
    unknown = sorted(set(mapping) - {"kv_cache_config", "scheduler_config"})
    _require(not unknown, f"unknown section(s) {unknown}; allowed: ['kv_cache_config', 'scheduler_config']")
    sections = {name: mapping.get(name) for name in ("kv_cache_config", "scheduler_config")}
    for name, section in sections.items():
        _require(
            section is None or isinstance(section, Mapping),
            f"{name}={section!r} must be a mapping of field names to values (or absent for the defaults)",
        )
    kv = KvCacheConfig.from_dict(sections["kv_cache_config"] or {})
    sched = SchedulerConfig.from_dict(sections["scheduler_config"] or {})
    return kv, sched


def as_retention_config(value: KvCacheRetentionConfig | Mapping[str, Any] | Sequence | None) -> KvCacheRetentionConfig:
    """Normalises a retention config given as a dataclass, a mapping or None."""
    if value is None:
        return KvCacheRetentionConfig()
    if isinstance(value, KvCacheRetentionConfig):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(f"retention_config={value!r} must be a KvCacheRetentionConfig or a mapping")
    return _from_mapping(KvCacheRetentionConfig, value, "retention_config")
