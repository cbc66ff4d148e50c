"""Fixtures for the manager tests: a tiny pool (4 tokens per page) and a fake clock."""

from __future__ import annotations

import dataclasses

import pytest

from kvjax.cache import CacheLayout
from kvjax.config import KvCacheConfig
from kvjax.manager import KVCacheManager


@dataclasses.dataclass
class FakeClock:
    """Seconds; advance it by hand."""

    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def _tiny_layout(num_device_pages: int = 8, windows: tuple[int, ...] = (64,), host: int = 0, disk: int = 0,
                max_seq_len: int = 64, head_dim: int = 1, tokens_per_block: int = 4) -> CacheLayout:
    """A float32 layout with one KV head: one layer per window (windows capped at max_seq_len),
    ``num_device_pages`` device pages per group; a page of a group of n layers is
    2 · tokens_per_block · head_dim · 4 · n bytes."""
    windows = tuple(min(w, max_seq_len) for w in windows)
    return CacheLayout(
        layer_windows=windows, num_pages=(num_device_pages,) * len(dict.fromkeys(windows)), tokens_per_block=tokens_per_block,
        num_kv_heads=1, head_dim=head_dim, max_seq_len=max_seq_len, num_host_pages=host, num_disk_pages=disk,
    )


@pytest.fixture
def tiny_layout():
    """The ``CacheLayout`` builder the ``make`` fixture uses (same arguments and defaults)."""
    return _tiny_layout


@pytest.fixture
def make(clock):
    """make(num_device_pages=8, windows=(64,), host=0, disk=0, max_seq_len=64, head_dim=1, **config)
    -> KVCacheManager on ``tiny_layout`` (4 tokens per page unless config sets tokens_per_block)."""

    def _make(num_device_pages: int = 8, windows: tuple[int, ...] = (64,), host: int = 0, disk: int = 0,
              max_seq_len: int = 64, head_dim: int = 1, **config) -> KVCacheManager:
        config.setdefault("tokens_per_block", 4)
        config.setdefault("event_buffer_max_size", 1000)
        layout = _tiny_layout(num_device_pages, windows, host, disk, max_seq_len, head_dim, config["tokens_per_block"])
        return KVCacheManager(KvCacheConfig(**config), layout, clock=clock)

    return _make


def run_prompt(mgr: KVCacheManager, request_id: str, prompt, *, free: bool = True, **kwargs) -> int:
    """Adds a request, computes and commits its whole prompt, optionally frees it; returns reuse."""
    reused = mgr.add_request(request_id, prompt, **kwargs)
    mgr.allocate(request_id, len(prompt))
    mgr.commit_tokens(request_id, prompt[reused:])
    mgr.check_consistency()
    if free:
        mgr.free_request(request_id)
        mgr.check_consistency()
    return reused


@pytest.fixture
def run():
    return run_prompt
