"""Where kvjax keeps files it downloads or builds: converted weights, installed model packages,
data sets and compiled XLA programs, all under one cache folder."""

from __future__ import annotations

import os
import pathlib


def cache_dir() -> pathlib.Path:
    """The kvjax cache folder: ``$KVJAX_CACHE_DIR``, default ``~/.cache/kvjax``."""
    return pathlib.Path(os.environ.get("KVJAX_CACHE_DIR", pathlib.Path.home() / ".cache" / "kvjax"))
