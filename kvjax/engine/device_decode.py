"""Manager V2's pure-decode step on the device: several tokens per request per dispatch.

When every running request decodes and nothing admissible waits, the engine hands the step to
``DeviceDecode``: up to ``num_decode_steps_per_dispatch`` tokens of every running request come
from one dispatch of ``kvjax.decode.decode_steps``, which takes pages, runs the forward,
samples and applies stops on the device against Manager V2's device-side allocation state
(``kvjax.manager.DeviceStateManager``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.decode import decode_steps
from kvjax.engine.buckets import pow2_bucket, table_width
from kvjax.engine.runner import StepRunner, sampling_arrays
from kvjax.engine.scheduler import ScheduledRequest, SchedulerRequest
from kvjax.manager import CacheManager, DeviceStateManager


class DeviceDecode:
    """The on-device decode loop of an engine whose manager keeps its allocation state on the
    device (Manager V2).

    Args:
      manager: the engine's manager (its ``states`` are replaced by each dispatch).
      runner: the engine's step runner (context, records, timings).
      num_steps: tokens per request per dispatch at most (``num_decode_steps_per_dispatch``).
    """

    def __init__(self, manager: DeviceStateManager, runner: StepRunner, num_steps: int) -> None:
        self.manager = manager
        self.runner = runner
        self.num_steps = num_steps

    def __call__(self, running: Sequence[SchedulerRequest]) -> tuple[dict[str, list[int]], bool]:
        """One dispatch for the ``running`` requests (all decoding).

        Returns:
          (each request's emitted tokens (possibly none), whether the dispatch had the pages
          it wanted: False = it stopped short, the scheduler must preempt).

        Raises:
          Whatever the dispatch raised (the engine then steps through the scheduler).
        """
        start = time.perf_counter()
        manager, n = self.manager, self.num_steps
        rows = pow2_bucket(len(running))
        row_ids, tokens = np.full(rows, manager.row_of(running[0].request_id), np.int32), np.zeros(rows, np.int32)
        stop_ids, budgets, active = np.full(rows, -1, np.int32), np.zeros(rows, np.int32), np.zeros(rows, bool)
        works = []
        longest = 0
        for i, req in enumerate(running):
            row_ids[i], tokens[i], active[i] = manager.row_of(req.request_id), req.output_token_ids[-1], True
            stop_ids[i] = -1 if req.eos_token_id is None else req.eos_token_id
            budgets[i] = req.max_new_tokens - len(req.output_token_ids)
            longest = max(longest, req.num_computed_tokens + min(n, int(budgets[i])))
            works.append(ScheduledRequest(req.request_id, (int(tokens[i]),), req.num_computed_tokens, False, True))
        ctx = self.runner.context
        width = min(table_width(ctx.layout.pages_for(longest)), manager.max_blocks)
        ctx.pool, manager.states, emitted, counts, ok = decode_steps(
            ctx.params, ctx.pool, manager.states, jnp.asarray(row_ids), jnp.asarray(tokens), jnp.asarray(active),
            jnp.asarray(stop_ids), jnp.asarray(budgets), *sampling_arrays(works, self.runner.records, rows),
            cfg=ctx.cfg, layout=ctx.layout, num_steps=n, width=width, attn_impl=ctx.attn_impl,
        )
        emitted, counts, ok = jax.device_get((emitted, counts, ok))
        timings = self.runner.timings
        timings["decode_s"] += time.perf_counter() - start
        timings["decode_tokens"] += int(counts.sum())
        timings["decode_steps"] += int(counts.max(initial=0))
        timings["decode_dispatches"] += 1
        return {w.request_id: emitted[i, : counts[i]].tolist() for i, w in enumerate(works)}, bool(ok)


def device_decode_for(manager: CacheManager, runner: StepRunner, num_steps: int) -> DeviceDecode | None:
    """The engine's on-device decode loop over ``manager``, or None when ``manager`` keeps its
    allocation state on the host (every decode then steps through the scheduler)."""
    return DeviceDecode(manager, runner, num_steps) if isinstance(manager, DeviceStateManager) else None
