"""What the engine keeps per request (``RequestRecord``, in ``Records``) and what it returns
(``RequestOutput``)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable

import numpy as np

from kvjax.engine.requests import ChunkedPrompt
from kvjax.engine.scheduler import SchedulerRequest
from kvjax.sampling import SamplingParams


@dataclasses.dataclass(slots=True)
class RequestRecord:
    """What the engine keeps per request beside the scheduler's progress.

    Attributes:
      logits: each generated position's logits [V] when ``sampling.return_logits``.
      submit_time, first_token_time, finish_time: ``time.perf_counter()`` seconds.
      chunks: the stored chunks a blended request reuses (None = ordinary request).
      prompt_logits: the last prompt positions' logits [R, V]: a blended request's
        (R = chunks.num_prompt_logits), or an ordinary one's computed rows among its last
        ``sampling.prompt_logits`` positions.
      blend_trace, blend_report: a blended request's fusor trace and reuse report.
    """

    sched: SchedulerRequest
    sampling: SamplingParams
    submit_time: float
    chunks: ChunkedPrompt | None = None
    prompt_logits: np.ndarray | None = None
    blend_trace: dict | None = None
    blend_report: object | None = None
    logits: list[np.ndarray] = dataclasses.field(default_factory=list)
    first_token_time: float | None = None
    finish_time: float | None = None
    finished: bool = False
    num_preemptions: int = 0
    finish_reason: str | None = None
    error: str | None = None

    def restart(self) -> None:
        """Forgets what a preempted request produced (it starts over when re-admitted); a
        blended request keeps its prompt logits, which its prefill sets again."""
        self.num_preemptions += 1
        self.logits.clear()
        self.prompt_logits = None if self.chunks is None else self.prompt_logits
        self.first_token_time = None


class Records(dict[str, RequestRecord]):
    """The engine's request records by id: live requests, and the last ``max_finished``
    finished ones (older finished records are forgotten, oldest first).

    Args:
      max_finished: finished records kept, >= 1.
    """

    def __init__(self, max_finished: int) -> None:
        super().__init__()
        self.max_finished = max_finished
        self._finished: dict[str, None] = {}  # finished ids, oldest first (an insertion-ordered set)

    def finish(self, request_id: str, reason: str | None, error: str | None) -> None:
        """Marks a request finished now (``reason`` None: by its stop token or length)."""
        record = self[request_id]
        record.finished, record.finish_time = True, time.perf_counter()
        record.finish_reason, record.error = reason, error
        self._finished[request_id] = None
        while len(self._finished) > self.max_finished:
            oldest = next(iter(self._finished))
            del self._finished[oldest]
            del self[oldest]

    def sampled(self, request_ids: Iterable[str]) -> None:
        """Stamps the first token's time on requests that sampled their first token now."""
        now = time.perf_counter()
        for rid in request_ids:
            record = self[rid]
            record.first_token_time = now if record.first_token_time is None else record.first_token_time

    def trim_logits(self, request_ids: Iterable[str]) -> None:
        """Drops kept logits past each request's output (a speculative step emits tokens past
        a stop or ``max_new_tokens``, which the scheduler cuts)."""
        for rid in request_ids:
            record = self[rid]
            del record.logits[len(record.sched.output_token_ids) :]

    def release(self, request_id: str) -> None:
        """Forgets a finished request (its id may be reused); raises if the id is live."""
        record = self.get(request_id)
        if record is None:
            return
        if not record.finished:
            raise ValueError(f"request_id={request_id!r} is already in use by a request that has not finished")
        del self[request_id]
        self._finished.pop(request_id, None)

    def output(self, request_id: str) -> RequestOutput:
        """A request's output so far (final once ``finish_reason`` is set)."""
        record = self.get(request_id)
        if record is None:
            raise KeyError(
                f"request_id={request_id!r} is unknown: never submitted, or finished and forgotten "
                f"(outputs of the last max_finished_requests={self.max_finished} finished requests are kept)"
            )
        return to_output(request_id, record)


@dataclasses.dataclass(frozen=True, slots=True)
class RequestOutput:
    """A request's result.

    Attributes:
      finish_reason: None while running; "stop" (EOS or stop token), "length"
        (max_new_tokens), "abort" (``Engine.abort``) or "error" (its work raised; see ``error``).
      num_reused_tokens: prompt tokens served from the cache (prefill skipped).
      ttft_s: seconds from submission to the first generated token.
      latency_s: seconds from submission to the last token.
      logits: per generated token, [V] float32 (only with ``return_logits``).
      error: the exception that finished the request, as "Type: message".
      prompt_logits: the last prompt positions' logits [R, V]: a blended request's, or an
        ordinary request's computed rows among its last ``sampling.prompt_logits`` (else None).
      blend_report: a blended request's reuse report (else None).
    """

    request_id: str
    prompt: list[int]
    output: list[int]
    finish_reason: str | None
    num_reused_tokens: int
    ttft_s: float | None
    latency_s: float | None
    logits: list[np.ndarray]
    error: str | None = None
    prompt_logits: np.ndarray | None = None
    blend_report: object | None = None


def to_output(request_id: str, r: RequestRecord) -> RequestOutput:
    output = list(r.sched.output_token_ids)
    reason = r.finish_reason
    if r.finished and reason is None:
        reason = "stop" if output and output[-1] == r.sched.eos_token_id else "length"
    return RequestOutput(
        request_id=request_id, prompt=list(r.sched.prompt_token_ids), output=output, finish_reason=reason,
        num_reused_tokens=r.sched.num_reused_tokens,
        ttft_s=None if r.first_token_time is None else r.first_token_time - r.submit_time,
        latency_s=None if r.finish_time is None else r.finish_time - r.submit_time,
        logits=list(r.logits), error=r.error, prompt_logits=r.prompt_logits, blend_report=r.blend_report,
    )
