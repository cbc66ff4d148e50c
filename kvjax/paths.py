"""Where kvjax keeps files it downloads or builds: converted weights, installed model packages,
data sets and compiled XLA programs, all under one cache folder."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
from collections.abc import Iterator


def cache_dir() -> pathlib.Path:
    """The kvjax cache folder: ``$KVJAX_CACHE_DIR``, default ``~/.cache/kvjax``."""
    return pathlib.Path(os.environ.get("KVJAX_CACHE_DIR", pathlib.Path.home() / ".cache" / "kvjax"))


@contextlib.contextmanager
def cache_lock(name: str) -> Iterator[None]:
    """Holds an exclusive lock on ``<cache>/locks/<name>.lock`` for the ``with`` block.

    Processes that fill the same cache entry on first use (test workers, parallel experiment
    runs) take it around the check-and-fill, so one of them fills the entry and the others
    wait and then find it filled. The lock is released when the block exits or the process dies.
    """
    locks = cache_dir() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
