"""Timing helpers shared by the benchmarks: medians after warm-up, the machine's own limits
(matmul rate, copy bandwidth) that every speed row is read against, and the count of JAX
compilations, so that no timed figure includes one; and the guard that keeps a long run's
compiled programs under the kernel's mapping limit."""

from __future__ import annotations

import dataclasses
import gc
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
    from kvjax.engine import Engine
    from kvjax.sampling import SamplingParams


def median_seconds(fn: Callable[[], object], warmup: int, iters: int) -> float:
    """Median wall time of ``fn()`` (blocked until ready) over ``iters`` calls after ``warmup``."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def machine_limits(iters: int = 5) -> dict[str, float]:
    """This machine's jitted f32 matmul rate in GFLOP/s (2048^3, and the prefill MLP shape
    [1024x576]x[576x1536]) and its copy bandwidth in GB/s (a 256 MiB array, bytes read +
    written per second); medians after one warm-up call."""
    matmul = jax.jit(jnp.matmul)
    a = jnp.ones((2048, 2048), jnp.float32)
    x, w = jnp.ones((1024, 576), jnp.float32), jnp.ones((576, 1536), jnp.float32)
    big = np.ones(64 * 2**20, np.float32)
    out = np.empty_like(big)
    return {
        "matmul_2048_gflops": 2 * 2048**3 / median_seconds(lambda: matmul(a, a), 1, iters) / 1e9,
        "matmul_mlp_gflops": 2 * 1024 * 576 * 1536 / median_seconds(lambda: matmul(x, w), 1, iters) / 1e9,
        "copy_gb_s": 2 * big.nbytes / median_seconds(lambda: np.copyto(out, big), 1, iters) / 1e9,
    }


def memory_mappings() -> int:
    """Memory mappings this process holds (lines of /proc/self/maps; 0 where there is none).
    Every compiled XLA:CPU executable holds some, and the kernel refuses mappings past
    ``vm.max_map_count`` (65530 by default): LLVM then fails with "Cannot allocate memory"
    and the process dies, however much memory is free."""
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


MAPPINGS_HEADROOM = 0.5
"""Share of ``vm.max_map_count`` past which ``release_executables`` drops the compiled
programs: a prompt of the ratio sweep compiles up to ~200 programs of ~90 mappings each."""


def mappings_limit() -> int | None:
    """The kernel's limit on one process's memory mappings (``vm.max_map_count``; None where
    it cannot be read). Raising it (``sysctl vm.max_map_count=262144``) lets a long run keep
    4x more compiled programs before ``release_executables`` drops them."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except OSError:
        return None


def release_executables() -> bool:
    """Drops every compiled program (``jax.clear_caches``) when this process holds more than
    ``MAPPINGS_HEADROOM`` of the kernel's mapping limit; the next call of each recompiles, or
    loads it from the persistent compilation cache. Returns whether it dropped them."""
    limit = mappings_limit()
    if limit is None or memory_mappings() <= MAPPINGS_HEADROOM * limit:
        return False
    jax.clear_caches()
    gc.collect()
    return True


def decode_step_seconds(engine: Engine, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> float:
    """Submits ``prompts`` together, steps until every one has its first token (prefill, not
    timed), then returns the mean wall seconds of the remaining steps, in which every
    sequence decodes (``sampling.max_new_tokens`` >= 2)."""
    ids = [engine.submit(list(p), sampling) for p in prompts]
    while any(engine.requests[i].first_token_time is None for i in ids):
        engine.step()
    start, steps = time.perf_counter(), 0
    while engine.has_work:
        engine.step()
        steps += 1
    return (time.perf_counter() - start) / steps


COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
"""JAX's duration events of one compilation: tracing to a jaxpr, lowering, and the backend's
compile (absent when the persistent compilation cache serves the executable)."""


@dataclasses.dataclass
class Compilations:
    """Compilations seen since the process registered ``compile_counter()``.

    Attributes:
      programs: programs traced (one ``jaxpr_trace_duration`` event each).
      backend_compiles: backend compiles (the rest came from the compilation cache).
      seconds: seconds of tracing, lowering and backend compiles together.
      functions: the name of the function each traced program compiles, in order.
    """

    programs: int = 0
    backend_compiles: int = 0
    seconds: float = 0.0
    functions: tuple[str, ...] = ()

    def since(self, earlier: Compilations) -> Compilations:
        """The compilations between ``earlier`` (a copy) and now."""
        return Compilations(self.programs - earlier.programs, self.backend_compiles - earlier.backend_compiles,
                            self.seconds - earlier.seconds, self.functions[len(earlier.functions):])


_COUNTER: Compilations | None = None
_LOCK = threading.Lock()


def compile_counter() -> Compilations:
    """The process-wide compilation counter (a listener on JAX's monitoring events, registered
    on first call). Copy it (``dataclasses.replace``) before a region and call ``since``
    after it to count that region's compilations."""
    global _COUNTER
    with _LOCK:
        if _COUNTER is None:
            counter = _COUNTER = Compilations()

            def listen(event: str, duration: float, fun_name: str = "?", **_: object) -> None:
                if event in COMPILE_EVENTS:
                    counter.seconds += duration
                    counter.backend_compiles += event == COMPILE_EVENTS[2]
                    if event == COMPILE_EVENTS[0]:
                        counter.programs += 1
                        counter.functions += (fun_name,)

            jax.monitoring.register_event_duration_secs_listener(listen)
        return _COUNTER


def compilations_during(fn: Callable[[], object]) -> tuple[object, Compilations]:
    """``fn()``'s result and the compilations that happened while it ran."""
    counter = compile_counter()
    before = dataclasses.replace(counter)
    result = fn()
    return result, counter.since(before)
