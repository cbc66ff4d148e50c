"""What the scheduler, the engine and the tools call on a KV cache manager, and its errors.

``CacheManager`` is what every manager answers: admission, growth, commits, block tables,
counters. Two managers implement it, and each offers one extension of it:

- ``KVCacheManager`` (V1) is a ``TieredCacheManager``: its reuse index lives on the host
  (radix tree, host and disk tiers, events, retention priorities, speculative slots, chunk
  scopes, recurrent-state snapshots, snapshots of its own state);
- ``KVCacheManagerV2`` is a ``DeviceBlockPoolManager`` (``kvjax.engine.manager_v2``): its
  allocation state lives on the device, where the on-device decode loop takes pages itself.

No member raises ``NotImplementedError``: a feature that needs an extension asks for it with
``require_tiered``, whose error names the feature and the switch. The choice between the two
is made once, by ``kvjax.engine.manager_choice.build_manager``; nothing else asks which one
it has.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from kvjax.cache.layout import CacheLayout
from kvjax.config import KvCacheRetentionConfig
from kvjax.manager.events import KVCacheEvent
from kvjax.manager.hashing import NO_EXTRAS, BlockKey, KeyExtras
from kvjax.manager.stats import CacheStats, RequestStats
from kvjax.manager.tiers import PageOp

if TYPE_CHECKING:
    from kvjax.manager.state_snapshots import StateSnapshotIndex


class OutOfPagesError(RuntimeError):
    """A layer group's device pool cannot provide the pages a call needs (the manager's state
    is as before the call; the scheduler preempts a request and retries)."""


@runtime_checkable
class CacheManager(Protocol):
    """A paged KV cache's bookkeeping: which pages each request holds and which cached blocks
    a prompt can reuse. Token counts are tokens; ``group`` is a layer-group index; a prompt's
    ``extras`` (salt, adapter, multimodal items) enter its block keys with its tokens."""

    @property
    def tokens_per_block(self) -> int: ...

    @property
    def max_seq_len(self) -> int: ...

    @property
    def layer_windows(self) -> tuple[int, ...]: ...

    @property
    def group_windows(self) -> tuple[int, ...]: ...

    @property
    def stats(self) -> CacheStats: ...

    # ------------------------------------------------------------------ admission and growth

    def prompt_block_keys(self, prompt_token_ids: Sequence[int], extras: KeyExtras = NO_EXTRAS) -> list[BlockKey]:
        """Keys of the prompt's full blocks (validates the prompt)."""

    def estimate_reusable_tokens(self, prompt_token_ids: Sequence[int], extras: KeyExtras = NO_EXTRAS) -> int:
        """Tokens ``add_request`` would reuse now."""

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        extras: KeyExtras = NO_EXTRAS,
        *,
        retention: KvCacheRetentionConfig | None = None,
        admit: Callable[[int], bool] | None = None,
    ) -> int | None:
        """Registers a request, reserving its reusable prefix; returns the reused tokens.

        ``admit``, if given, is called once with the tokens the request would reuse, after the
        match and before anything is reserved: if it returns False nothing is registered and
        ``add_request`` returns None (the scheduler's admission asks the manager once).
        """

    def allocate(self, request_id: str, num_total_tokens: int) -> None:
        """Pages for the request's first ``num_total_tokens`` tokens (``OutOfPagesError``: none changed)."""

    def commit_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Records computed tokens; full blocks enter the reuse index."""

    def free_request(self, request_id: str) -> None:
        """Releases the request's pages (its committed full blocks stay cached)."""

    # ------------------------------------------------------------------ what the step reads

    def block_table(self, request_id: str, group: int) -> list[int]:
        """The request's device page per block of ``group``."""

    def take_page_ops(self) -> list[PageOp]:
        """Drains the page copies to execute before the next forward."""

    def num_free_pages(self, group: int) -> int: ...

    def num_cached_blocks(self, group: int, tier: str = "device") -> int: ...

    def num_tokens(self, request_id: str) -> int: ...

    def request_stats(self, request_id: str) -> RequestStats: ...

    def request_ids(self) -> list[str]: ...

    def check_consistency(self) -> None:
        """Raises ``AssertionError`` (or ``ConsistencyError``) if the bookkeeping breaks an invariant."""


@runtime_checkable
class TieredCacheManager(CacheManager, Protocol):
    """A manager whose reuse index lives on the host (``KVCacheManager``): speculative slots,
    KV cache events, host and disk tiers, chunk scopes, recurrent-state snapshots and
    snapshots of its own state."""

    def allocate_drafts(self, request_id: str, num_total_tokens: int) -> int:
        """Speculative decoding: pages for draft tokens; returns the drafts that fit."""

    def rollback(self, request_id: str, num_tokens: int) -> None:
        """Speculative decoding: forgets the last ``num_tokens`` uncommitted slots."""

    def reusable_tiers(self, prompt_token_ids: Sequence[int], extras: KeyExtras = NO_EXTRAS) -> list[str]:
        """The tier ("device", "host", "disk") of each reusable block of the prompt, in order."""

    def get_kv_cache_events(self) -> list[KVCacheEvent]: ...

    def attach_state_snapshots(self, snapshots: StateSnapshotIndex) -> None: ...

    def attach_disk_check(self, check: Callable[[int, int], bool]) -> None: ...

    def drop_lost_disk_blocks(self) -> int: ...

    def clear_cache(self) -> None: ...

    def state_dict(self) -> dict: ...


def require_tiered(manager: CacheManager, feature: str) -> TieredCacheManager:
    """``manager`` as a ``TieredCacheManager``, or a ``ValueError`` naming ``feature`` (the
    field or call that needs it) and the switch that gives an engine one."""
    if isinstance(manager, TieredCacheManager):
        return manager
    raise ValueError(
        f"{feature} needs the V1 manager (a host reuse index); this engine runs {type(manager).__name__} "
        "(use_kv_cache_manager_v2, or 'auto' choosing V2): build it with use_kv_cache_manager_v2='false'"
    )


class LayoutGeometry:
    """The geometry both managers read from their ``layout`` (a base class of each)."""

    layout: CacheLayout

    @property
    def tokens_per_block(self) -> int:
        """Tokens per page and block."""
        return self.layout.tokens_per_block

    @property
    def max_seq_len(self) -> int:
        return self.layout.max_seq_len

    @property
    def layer_windows(self) -> tuple[int, ...]:
        return self.layout.layer_windows

    def check_num_tokens(self, num_total_tokens: object) -> None:
        """A ``ValueError`` naming ``num_total_tokens`` unless it is an int in [0, max_seq_len]."""
        if not isinstance(num_total_tokens, int) or not 0 <= num_total_tokens <= self.max_seq_len:
            raise ValueError(f"num_total_tokens={num_total_tokens!r} must be an int in [0, {self.max_seq_len}]")

    @property
    def group_windows(self) -> tuple[int, ...]:
        """Distinct windows in order of first appearance; group g holds the layers of window g."""
        return self.layout.group_windows
