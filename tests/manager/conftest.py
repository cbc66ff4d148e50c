"""Fixtures for the manager tests: ``run`` (a whole prompt through a manager); the tiny
manager (``make``), its layout and the fake clock are in ``tests/conftest.py``."""

from __future__ import annotations

import pytest

from kvjax.manager import KVCacheManager


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
