"""When a blended prefill's work ran: ``PhaseClock`` (seconds per phase, waiting for each
phase's outputs) and ``ComputeTimeline`` (when each dispatched layer ran, watched from a thread
that never holds the dispatching one back). ``kvjax.blend.fusor`` reports through them; the
numerics never read them."""

from __future__ import annotations

import queue
import threading
import time

import jax


class PhaseClock:
    """Seconds per phase into ``phases`` (a no-op when None); waits for each phase's outputs."""

    def __init__(self, phases: dict[str, float] | None) -> None:
        self.phases, self.start = phases, time.perf_counter()

    def lap(self, name: str, outputs: object) -> None:
        if self.phases is None:
            return
        jax.block_until_ready(outputs)
        now = time.perf_counter()
        self.phases[name] = now - self.start
        self.start = now


class ComputeTimeline:
    """When each layer's computation ran: a watcher thread waits for each dispatched layer's
    output in order, without holding the dispatching thread back.

    Events (``events``, after ``close``): dicts with "layers" (first, last + 1), "dispatch_s",
    "start_s" (the later of its dispatch and the previous layer's end: XLA runs them in
    order), "end_s", all ``time.perf_counter()`` seconds.
    """

    def __init__(self) -> None:
        self.events: list[dict] = []
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._watch, name="kvjax-blend-timeline", daemon=True)
        self._thread.start()

    def dispatched(self, layers: tuple[int, int], output: jax.Array) -> None:
        self._queue.put((layers, time.perf_counter(), output))

    def _watch(self) -> None:
        end = 0.0
        while (item := self._queue.get()) is not None:
            layers, dispatch, output = item
            jax.block_until_ready(output)
            start, end = max(dispatch, end), time.perf_counter()
            self.events.append({"layers": layers, "dispatch_s": dispatch, "start_s": start, "end_s": end})

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
