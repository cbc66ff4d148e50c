"""Fixtures for the manager tests: a tiny pool (4 tokens per page) and a fake clock."""

from __future__ import annotations

import dataclasses

import pytest

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


@pytest.fixture
def make(clock):
    """make(num_device_pages=8, windows=(64,), host=0, disk=0, **config) -> KVCacheManager."""

    def _make(num_device_pages: int = 8, windows: tuple[int, ...] = (64,), host: int = 0, disk: int = 0, max_seq_len: int = 64,
              bytes_per_page: int = 0, **config) -> KVCacheManager:
        config.setdefault("tokens_per_block", 4)
        config.setdefault("event_buffer_max_size", 1000)
        if host:
            config.setdefault("host_cache_size", host * 1024)
        if disk:
            config.setdefault("disk_cache_size", disk * 1024)
        return KVCacheManager(
            KvCacheConfig(**config),
            layer_windows=windows,
            num_device_pages=num_device_pages,
            num_host_pages=host,
            num_disk_pages=disk,
            max_seq_len=max_seq_len,
            bytes_per_page=bytes_per_page,
            clock=clock,
        )

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
