"""Resident memory of a test suite's workers, sampled over time and added up.

A worker (a pytest-xdist process, or the lone pytest process) runs ``RssSampler``, which
appends ``time,rss_mib,children_mib`` to ``<folder>/<worker>.samples.csv`` every
``interval_s`` seconds: the process's resident set and its children's (subprocess tests).
``combined_peak`` reads every worker's samples and adds them up over time, each worker
counted at its latest sample (zero before its first and after its last), so the peak it
reports is what the workers held together at one moment, not the sum of their separate
peaks. The suite's fixture also appends one row per test to ``<folder>/<worker>.csv``
(``test id,rss_mib,children_mib,peak_mib,time``, and a ``<module>::(released)`` row after each
module); ``module_peaks`` reads both to give each module's peak. ``python -m
kvjax.testing.memory_log <folder>`` prints both.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
import threading
import time

import numpy as np
import psutil

SUFFIX = ".samples.csv"
TESTS = ".csv"
"""Suffix of a worker's per-test rows (a samples file ends in ``SUFFIX``)."""


class RssSampler:
    """A daemon thread appending this process's resident memory to ``path`` every ``interval_s`` s."""

    def __init__(self, path: pathlib.Path, interval_s: float = 0.25) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s={interval_s} must be > 0")
        self.path, self.interval_s = path, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def start(self) -> RssSampler:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        process = psutil.Process()
        with self.path.open("a", buffering=1) as out:
            while not self._stop.is_set():
                try:
                    children = sum(c.memory_info().rss for c in process.children(recursive=True))
                except psutil.Error:  # a child ended while it was read
                    children = 0
                out.write(f"{time.time():.3f},{process.memory_info().rss / 2**20:.0f},{children / 2**20:.0f}\n")
                self._stop.wait(self.interval_s)


@dataclasses.dataclass(frozen=True)
class CombinedPeak:
    """The workers' resident memory added up over time.

    Attributes:
      peak_mib: the largest sum over the workers (their children included), MiB.
      at: Unix seconds when it was reached.
      by_worker: each worker's MiB (with its children) at that moment.
      worker_peaks: each worker's own largest MiB (with its children), whenever reached.
      seconds: from the first sample to the last, over all workers.
    """

    peak_mib: float
    at: float
    by_worker: dict[str, float]
    worker_peaks: dict[str, float]
    seconds: float


def combined_peak(folder: pathlib.Path) -> CombinedPeak:
    """Adds up the ``*.samples.csv`` of ``folder`` over time (see the module docstring).

    Raises:
      ValueError: ``folder`` holds no samples.
    """
    series: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for path in sorted(pathlib.Path(folder).glob(f"*{SUFFIX}")):
        if path.stat().st_size:
            series[path.name.removesuffix(SUFFIX)] = _series(path)
    if not series:
        raise ValueError(
            f"{folder} holds no worker samples (*{SUFFIX}); run pytest with KVJAX_TEST_MEMORY_LOG={folder}"
        )
    grid = np.unique(np.concatenate([t for t, _ in series.values()]))
    held: dict[str, np.ndarray] = {}
    for name, (t, mib) in series.items():
        latest = np.searchsorted(t, grid, side="right") - 1
        alive = (latest >= 0) & (grid <= t[-1])
        held[name] = np.where(alive, mib[np.clip(latest, 0, None)], 0.0)
    total = np.sum(list(held.values()), axis=0)
    i = int(np.argmax(total))
    return CombinedPeak(
        peak_mib=float(total[i]),
        at=float(grid[i]),
        by_worker={name: float(h[i]) for name, h in held.items()},
        worker_peaks={name: float(mib.max()) for name, (_, mib) in series.items()},
        seconds=float(grid[-1] - grid[0]),
    )


def _series(path: pathlib.Path) -> tuple[np.ndarray, np.ndarray]:
    """(time [S] s, resident MiB with children [S]) of one samples file, in time order."""
    rows = np.loadtxt(path, delimiter=",", ndmin=2)
    order = np.argsort(rows[:, 0], kind="stable")
    return rows[order, 0], rows[order, 1] + rows[order, 2]


def module_peaks(folder: pathlib.Path) -> dict[str, float]:
    """Each test module's peak resident MiB (its worker's, children included): the largest
    sample between the end of the test before the module's first and the module's last row
    (rows carry whole seconds, so a span reaches one second either side). Heaviest first.

    Raises:
      ValueError: ``folder`` holds no per-test rows beside samples.
    """
    peaks: dict[str, float] = {}
    for path in sorted(pathlib.Path(folder).glob(f"*{SUFFIX}")):
        tests = path.with_name(path.name.removesuffix(SUFFIX) + TESTS)
        if not tests.is_file():
            continue
        t, mib = _series(path)
        start = t[0]
        spans: dict[str, list[float]] = {}
        for line in tests.read_text().splitlines():
            test_id, *_, when = line.rsplit(",", 4)  # a test id may hold commas, the numbers do not
            module = test_id.split("::", 1)[0]
            span = spans.setdefault(module, [start - 1, float(when) + 1])
            span[1] = float(when) + 1
            start = float(when)
        for module, (lo, hi) in spans.items():
            inside = mib[(t >= lo) & (t <= hi)]
            if len(inside):
                peaks[module] = max(peaks.get(module, 0.0), float(inside.max()))
    if not peaks:
        raise ValueError(f"{folder} holds no per-test rows (*{TESTS}) beside its samples (*{SUFFIX})")
    return dict(sorted(peaks.items(), key=lambda kv: -kv[1]))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m kvjax.testing.memory_log <folder of KVJAX_TEST_MEMORY_LOG>")
    peak = combined_peak(pathlib.Path(sys.argv[1]))
    workers = ", ".join(f"{name} {mib / 1024:.2f}" for name, mib in peak.by_worker.items())
    own = ", ".join(f"{name} {mib / 1024:.2f}" for name, mib in peak.worker_peaks.items())
    print(f"workers together: peak {peak.peak_mib / 1024:.2f} GiB at {time.strftime('%H:%M:%S', time.gmtime(peak.at))} "
          f"UTC ({workers}); each worker's own peak: {own} GiB; {peak.seconds / 60:.1f} min sampled")
    modules = module_peaks(pathlib.Path(sys.argv[1]))
    print("modules by peak (GiB, worker with children): "
          + ", ".join(f"{module} {mib / 1024:.2f}" for module, mib in list(modules.items())[:12]))
