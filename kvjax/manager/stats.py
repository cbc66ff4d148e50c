"""Reuse and traffic counters, per request and cumulative.

Hit rates count prompt tokens: a request's reusable prefix is at most ``len(prompt) - 1``
tokens (the last token is always computed), and a block hit is a *full* prompt block reused.
Bytes are pages times the engine's ``bytes_per_page`` of the group (0 when not given).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(slots=True)
class RequestStats:
    """Reuse of one request.

    Attributes:
      prompt_tokens: tokens in its prompt.
      reused_tokens: prompt tokens whose KV came from the cache (prefill skipped).
      prompt_blocks: full blocks in its prompt.
      reused_blocks: full prompt blocks matched in the tree.
      onboarded_pages: host or disk -> device page copies made for it (all groups).
      copied_pages: partial-reuse page copies made for it (all groups).
    """

    prompt_tokens: int = 0
    reused_tokens: int = 0
    prompt_blocks: int = 0
    reused_blocks: int = 0
    onboarded_pages: int = 0
    copied_pages: int = 0

    @property
    def token_hit_rate(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclasses.dataclass(slots=True)
class CacheStats:
    """Cumulative counters of a manager (all groups).

    Attributes:
      num_requests: requests added.
      prompt_tokens, reused_tokens, prompt_blocks, reused_blocks: sums of RequestStats.
      stored_blocks: blocks inserted into the tree.
      device_evictions: blocks that left the device tier to make room (offloaded or dropped).
      host_evictions: blocks that left the host tier to make room (spilled to disk or dropped).
      disk_evictions: blocks dropped from the disk tier to make room.
      offloaded_pages (device -> host), spilled_pages (host -> disk), onboarded_pages (host or
        disk -> device; disk_onboarded_pages of them from disk), copied_pages (device ->
        device): page operations queued, per kind.
      offloaded_bytes, spilled_bytes, onboarded_bytes, disk_onboarded_bytes, copied_bytes: the
        same in bytes (bytes_per_page).
      lost_disk_pages: disk blocks dropped because their page failed its check (damaged,
        truncated or unwritten file); each is recomputed by the request that wanted it.
    """

    num_requests: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    prompt_blocks: int = 0
    reused_blocks: int = 0
    stored_blocks: int = 0
    device_evictions: int = 0
    host_evictions: int = 0
    disk_evictions: int = 0
    offloaded_pages: int = 0
    spilled_pages: int = 0
    onboarded_pages: int = 0
    disk_onboarded_pages: int = 0
    copied_pages: int = 0
    offloaded_bytes: int = 0
    spilled_bytes: int = 0
    onboarded_bytes: int = 0
    disk_onboarded_bytes: int = 0
    copied_bytes: int = 0
    lost_disk_pages: int = 0

    @property
    def token_hit_rate(self) -> float:
        """Reused prompt tokens / prompt tokens."""
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def block_hit_rate(self) -> float:
        """Reused full prompt blocks / full prompt blocks."""
        return self.reused_blocks / self.prompt_blocks if self.prompt_blocks else 0.0

    def add_request(self, request: RequestStats) -> None:
        self.num_requests += 1
        self.prompt_tokens += request.prompt_tokens
        self.reused_tokens += request.reused_tokens
        self.prompt_blocks += request.prompt_blocks
        self.reused_blocks += request.reused_blocks
