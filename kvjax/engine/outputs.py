"""What the engine keeps per request (``RequestRecord``) and what it returns (``RequestOutput``)."""

from __future__ import annotations

import dataclasses

import numpy as np

from kvjax.engine.requests import ChunkedPrompt
from kvjax.manager.scheduler import SchedulerRequest
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
