"""Step scheduler with prefix-aware admission, host-only.

Each step: running requests go first, oldest first (a decode token, or their next prefill
chunk); then waiting requests are admitted in arrival order while the token budget
(``max_num_tokens``) and ``max_batch_size`` allow. Pages come from the manager at schedule
time, so a plan handed to the engine is always executable.

With ``enable_prefix_aware_scheduling`` (default):

* a waiting request is charged only the tokens it will compute, ``len(prompt)`` minus the
  manager's reusable-token estimate;
* a waiting request whose first block *to compute* (the first block past its reusable prefix)
  is a block that a running request is still prefilling is deferred: once the twin has
  written that block, the deferred request reuses it instead of computing it again.

With it off, admission charges the full prompt chunk and never defers; the manager still
reuses blocks (``enable_block_reuse`` is independent).

Engine loop::

    plan = scheduler.schedule()
    for op in manager.take_page_ops(): ...                 # copy/offload/onboard pages
    logits = forward(plan, manager.block_table(...))       # token_ids at positions start...
    finished = scheduler.finish_step({r.request_id: sample(...) for r in plan.scheduled if r.samples})

When a running request cannot get a page, the newest running request is preempted: its
references are dropped (its full blocks stay cached), its outputs are discarded, and it
returns to the front of the queue to start over.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Literal

from kvjax.config import KvCacheRetentionConfig, SchedulerConfig
from kvjax.manager.hashing import NO_EXTRAS, BlockKey, KeyExtras
from kvjax.manager.interface import CacheManager, OutOfPagesError

_Verdict = Literal["admit", "defer", "stop"]
"""An admission decision (``Scheduler._verdict``)."""


@dataclasses.dataclass(slots=True)
class SchedulerRequest:
    """A generation request and its progress.

    Attributes:
      request_id: unique among live requests.
      prompt_token_ids: the prompt.
      max_new_tokens: tokens to generate, >= 1.
      eos_token_id: generation also stops after sampling this token (None = never).
      retention, extras: passed to ``CacheManager.add_request``.
      num_computed_tokens: tokens whose KV is written (reused prefix included).
      num_reused_tokens: prompt tokens reused at admission.
      output_token_ids: sampled tokens so far.
      num_prefill_rows: a blended request (CacheBlend): its whole prompt is computed in one
        step, charged this many tokens (the rows it recomputes); None = ordinary chunked prefill.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_new_tokens: int
    eos_token_id: int | None = None
    retention: KvCacheRetentionConfig | None = None
    extras: KeyExtras = NO_EXTRAS
    num_computed_tokens: int = 0
    num_reused_tokens: int = 0
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_prefill_rows: int | None = None
    prompt_keys: list[BlockKey] = dataclasses.field(default_factory=list, repr=False)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed_tokens < len(self.prompt_token_ids)


@dataclasses.dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One sequence's work in a step.

    Attributes:
      token_ids: input tokens of this step (a prefill chunk, or the last sampled token).
      start: position of ``token_ids[0]`` in the sequence.
      is_prefill: a prompt chunk (else one decode token).
      samples: the logits of the last input token are sampled (last prefill chunk or decode).
    """

    request_id: str
    token_ids: tuple[int, ...]
    start: int
    is_prefill: bool
    samples: bool


@dataclasses.dataclass(frozen=True, slots=True)
class StepPlan:
    """What one engine step computes.

    Attributes:
      scheduled: sequences in batch order.
      num_budget_tokens: tokens charged to ``max_num_tokens``.
      deferred: waiting requests held back as duplicates of an in-flight prefill.
      preempted: running requests sent back to the queue for lack of pages.
    """

    scheduled: tuple[ScheduledRequest, ...]
    num_budget_tokens: int
    deferred: tuple[str, ...] = ()
    preempted: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        """Tokens computed by the forward pass."""
        return sum(len(s.token_ids) for s in self.scheduled)


class Scheduler:
    """Chooses, per step, which requests prefill (in chunks) and which decode."""

    def __init__(self, config: SchedulerConfig, manager: CacheManager) -> None:
        self.config = config
        self.manager = manager
        self.waiting: collections.deque[SchedulerRequest] = collections.deque()
        self.running: dict[str, SchedulerRequest] = {}
        self._last_plan: StepPlan | None = None

    def add(self, request: SchedulerRequest) -> None:
        """Queues a request (validated against the manager's limits)."""
        rid = request.request_id
        if rid in self.running or any(r.request_id == rid for r in self.waiting):
            raise ValueError(f"request_id={rid!r} is already queued or running")
        if not isinstance(request.max_new_tokens, int) or request.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={request.max_new_tokens!r} must be an int >= 1")
        limit = self.manager.max_seq_len
        if len(request.prompt_token_ids) + request.max_new_tokens > limit:
            raise ValueError(
                f"len(prompt)={len(request.prompt_token_ids)} + max_new_tokens={request.max_new_tokens} "
                f"exceeds max_seq_len={limit}"
            )
        request.prompt_token_ids = tuple(request.prompt_token_ids)
        request.prompt_keys = self.manager.prompt_block_keys(request.prompt_token_ids, request.extras)
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> bool:
        """Drops a waiting or running request and its cache references (its committed full
        blocks stay cached). Inside a step (between ``schedule`` and ``finish_step``) its work
        in the plan is skipped by ``finish_step``.

        Returns:
          Whether the request was waiting or running.
        """
        if request_id in self.running:
            self.manager.free_request(request_id)
            del self.running[request_id]
            return True
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                return True
        return False

    def schedule(self) -> StepPlan:
        """Plans the next step and reserves its pages."""
        if self._last_plan is not None:
            raise RuntimeError("finish_step() must report the previous plan before schedule() is called again")
        cfg = self.config
        budget, slots = cfg.max_num_tokens, cfg.max_batch_size
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        for req in list(self.running.values()):
            if not slots or not budget:
                break
            if req.request_id not in self.running:
                continue
            n, charge = self._size(req, budget)
            if not n:
                continue
            if not self._allocate_or_preempt(req, req.num_computed_tokens + n, preempted):
                continue
            scheduled.append(self._work(req, n))
            budget -= charge
            slots -= 1
        deferred: list[str] = []
        if not preempted:
            budget = self._admit(budget, slots, scheduled, deferred)
        plan = StepPlan(tuple(scheduled), cfg.max_num_tokens - budget, tuple(deferred), tuple(preempted))
        self._last_plan = plan
        return plan

    def finish_step(self, sampled: Mapping[str, int | Sequence[int]]) -> list[str]:
        """Records the step: commits the computed tokens and appends sampled ones.

        Args:
          sampled: the sampled token of every scheduled request with ``samples=True`` that
            was not aborted during the step. A decode verified speculatively gives the tokens
            it emits instead: its accepted drafts, whose KV the step wrote and which are
            committed after its input token, then the token sampled after them. Tokens past
            ``max_new_tokens`` or the stop token are dropped.

        Returns:
          Requests that finished (their cache references are dropped).
        """
        plan = self._last_plan
        if plan is None:
            raise RuntimeError("finish_step() called without a schedule() before it")
        missing = [
            s.request_id
            for s in plan.scheduled
            if s.samples and s.request_id in self.running and s.request_id not in sampled
        ]
        if missing:
            raise ValueError(f"sampled has no token for request(s) {missing}, which sample this step")
        self._last_plan = None
        finished = []
        for work in plan.scheduled:
            req = self.running.get(work.request_id)
            if req is None:
                continue
            emitted = sampled.get(req.request_id, ()) if work.samples else ()
            emitted = tuple(emitted) if isinstance(emitted, Sequence) else (emitted,)
            if self._record(req, work.token_ids, emitted, work.samples):
                finished.append(req.request_id)
        return finished

    @property
    def decodes_only(self) -> bool:
        """Whether every running request is decoding and nothing waits that a step could admit
        (none waiting, or the batch full): the next steps are pure decode steps, which the
        engine may run several at a time on the device."""
        if not self.running or any(r.in_prefill for r in self.running.values()):
            return False
        return not self.waiting or len(self.running) >= self.config.max_batch_size

    def record_decodes(self, emitted: Mapping[str, Sequence[int]]) -> list[str]:
        """Records decode steps run outside ``schedule`` (the engine's on-device decode loop):
        each running request in ``emitted`` fed its last token, then its sampled tokens but
        the last, whose KV the loop wrote in slots it took itself.

        Returns:
          Requests that finished (their cache references are dropped).
        """
        if self._last_plan is not None:
            raise RuntimeError("record_decodes() cannot run between schedule() and finish_step()")
        finished = []
        for rid, tokens in emitted.items():
            req = self.running.get(rid)
            if req is None or req.in_prefill:
                raise ValueError(f"request {rid!r} is not a running decode")
            if tokens and self._record(req, (req.output_token_ids[-1],), tuple(tokens), True):
                finished.append(rid)
        return finished

    def _record(self, req: SchedulerRequest, inputs: tuple[int, ...], emitted: tuple[int, ...], samples: bool) -> bool:
        """Commits ``inputs`` and the emitted tokens but the last, appends the emitted tokens
        (cut at ``max_new_tokens`` and the stop token); True if the request finished."""
        emitted = emitted[: req.max_new_tokens - len(req.output_token_ids)]
        if req.eos_token_id in emitted:
            emitted = emitted[: emitted.index(req.eos_token_id) + 1]
        computed = inputs + emitted[:-1]
        self.manager.commit_tokens(req.request_id, computed)
        req.num_computed_tokens += len(computed)
        if not samples:
            return False
        token = emitted[-1]
        req.output_token_ids.extend(emitted)
        if len(req.output_token_ids) >= req.max_new_tokens or token == req.eos_token_id:
            self.manager.free_request(req.request_id)
            del self.running[req.request_id]
            return True
        return False

    # ------------------------------------------------------------------ internals

    def _size(self, req: SchedulerRequest, budget: int) -> tuple[int, int]:
        """(tokens to compute this step, tokens charged); (0, 0) = wait. A blended prefill
        runs whole and waits for a step whose budget covers its rows."""
        remaining = len(req.prompt_token_ids) - req.num_computed_tokens
        if not req.in_prefill:
            return 1, 1
        if req.num_prefill_rows is None:
            n = min(self.config.prefill_chunk_size, remaining, budget)
            return n, n
        charge = min(req.num_prefill_rows, remaining)
        if charge > budget and budget < self.config.max_num_tokens:
            return 0, 0
        return remaining, min(charge, budget)

    def _work(self, req: SchedulerRequest, n: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        prompt = req.prompt_token_ids
        if req.in_prefill:
            return ScheduledRequest(req.request_id, prompt[start : start + n], start, True, start + n == len(prompt))
        return ScheduledRequest(req.request_id, (req.output_token_ids[-1],), start, False, True)

    def _allocate_or_preempt(self, req: SchedulerRequest, total: int, preempted: list[str]) -> bool:
        """Allocates, preempting the newest running requests as needed; False if ``req`` itself went."""
        while True:
            try:
                self.manager.allocate(req.request_id, total)
                return True
            except OutOfPagesError:
                victim = next(reversed(self.running.values()))
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    return False

    def _preempt(self, req: SchedulerRequest) -> None:
        self.manager.free_request(req.request_id)
        del self.running[req.request_id]
        req.num_computed_tokens = req.num_reused_tokens = 0
        req.output_token_ids.clear()
        self.waiting.appendleft(req)

    def _verdict(self, req: SchedulerRequest, estimate: int, budget: int, pending: set[BlockKey]) -> _Verdict:
        """Whether a waiting request that would reuse ``estimate`` tokens is admitted now:
        "defer" when its first block to compute is one a running request is still prefilling
        (prefix-aware scheduling), "stop" when a blended prefill's rows exceed a partly spent
        budget (admission stops, keeping arrival order), else "admit"."""
        first = estimate // self.manager.tokens_per_block
        if (
            self.config.enable_prefix_aware_scheduling
            and first < len(req.prompt_keys)
            and req.prompt_keys[first] in pending
        ):
            return "defer"
        rows = req.num_prefill_rows
        if (
            rows is not None
            and min(rows, len(req.prompt_token_ids) - estimate) > budget
            and budget < self.config.max_num_tokens
        ):
            return "stop"
        return "admit"

    def _admit(self, budget: int, slots: int, scheduled: list[ScheduledRequest], deferred: list[str]) -> int:
        """Admits waiting requests in arrival order into ``scheduled`` (each asks the manager
        once: ``add_request`` with an ``admit`` check); returns the budget left."""
        cfg = self.config
        aware = cfg.enable_prefix_aware_scheduling
        ps = self.manager.tokens_per_block
        pending = {
            key
            for r in self.running.values()
            if r.in_prefill
            for key in r.prompt_keys[r.num_computed_tokens // ps :]
        }
        for req in list(self.waiting):
            if not slots or not budget:
                break
            prompt = req.prompt_token_ids
            verdict: _Verdict | None = None

            def admit(reusable: int, req: SchedulerRequest = req, budget: int = budget) -> bool:
                nonlocal verdict
                verdict = self._verdict(req, reusable if aware else 0, budget, pending)
                return verdict == "admit"

            reused = self.manager.add_request(req.request_id, prompt, req.extras, retention=req.retention, admit=admit)
            if verdict == "defer":
                deferred.append(req.request_id)
                continue
            if reused is None:
                break
            limit = cfg.prefill_chunk_size if req.num_prefill_rows is None else req.num_prefill_rows
            charge = min(limit, len(prompt) - (reused if aware else 0), budget)
            n = len(prompt) - reused
            if req.num_prefill_rows is None:
                n = min(cfg.prefill_chunk_size, n, budget)
            try:
                self.manager.allocate(req.request_id, reused + n)
            except OutOfPagesError:
                self.manager.free_request(req.request_id)
                break
            self.waiting.remove(req)
            req.num_computed_tokens = req.num_reused_tokens = reused
            self.running[req.request_id] = req
            pending.update(req.prompt_keys[reused // ps :])
            scheduled.append(self._work(req, n))
            budget -= charge if req.num_prefill_rows is not None else max(charge, n)
            slots -= 1
        return budget


__all__ = ["ScheduledRequest", "Scheduler", "SchedulerRequest", "StepPlan"]
