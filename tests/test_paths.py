"""The cache lock: processes that fill one cache entry on first use take turns."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from kvjax.paths import cache_dir, cache_lock


def test_cache_lock_makes_a_second_process_wait(tmp_path, monkeypatch):
    monkeypatch.setenv("KVJAX_CACHE_DIR", str(tmp_path))
    held, released = tmp_path / "held", tmp_path / "released"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import pathlib, time
        from kvjax.paths import cache_lock
        with cache_lock("entry"):
            pathlib.Path({str(held)!r}).touch()
            time.sleep(1.0)
            pathlib.Path({str(released)!r}).write_text(repr(time.time()))  # the last thing under the lock
    """)])
    try:
        deadline = time.monotonic() + 60
        while not held.exists():
            assert holder.poll() is None and time.monotonic() < deadline, "the holder never took the lock"
            time.sleep(0.02)
        with cache_lock("entry"):
            acquired = time.time()
            assert released.exists(), "the lock was granted while the other process held it"
            assert acquired >= float(released.read_text())
    finally:
        holder.wait(timeout=60)
    assert holder.returncode == 0
    assert (cache_dir() / "locks" / "entry.lock").is_file()


def test_cache_lock_is_released_when_its_block_raises(tmp_path, monkeypatch):
    monkeypatch.setenv("KVJAX_CACHE_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="fill failed"), cache_lock("entry"):
        raise RuntimeError("fill failed")
    code = "from kvjax.paths import cache_lock\nwith cache_lock('entry'): pass\n"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
