"""Prefix-aware scheduling (B10) without a model: fake sampled tokens drive the loop."""

from __future__ import annotations

import pytest

from kvjax.config import SchedulerConfig
from kvjax.engine.scheduler import Scheduler, SchedulerRequest

SYSTEM = list(range(200, 216))  # 16 tokens = 4 blocks


def _step(sched, token=7):
    plan = sched.schedule()
    finished = sched.finish_step({s.request_id: token for s in plan.scheduled if s.samples})
    return plan, finished


def _sched(make, aware=True, max_num_tokens=64, chunk=64, batch=8, pages=64):
    mgr = make(num_device_pages=pages, max_seq_len=128)
    config = SchedulerConfig(enable_prefix_aware_scheduling=aware, max_num_tokens=max_num_tokens,
                             prefill_chunk_size=chunk, max_batch_size=batch)
    return Scheduler(config, mgr), mgr


def test_prefill_then_decode_until_max_new_tokens(make):
    sched, mgr = _sched(make)
    sched.add(SchedulerRequest("a", tuple(range(1, 11)), max_new_tokens=3))
    plan, _ = _step(sched)
    (work,) = plan.scheduled
    assert (work.start, len(work.token_ids), work.is_prefill, work.samples) == (0, 10, True, True)
    plan, _ = _step(sched)
    assert [(s.start, s.token_ids, s.is_prefill) for s in plan.scheduled] == [(10, (7,), False)]
    plan, finished = _step(sched)
    assert finished == ["a"] and not sched.has_work()
    assert mgr.request_ids() == []
    mgr.check_consistency()


def test_prompt_is_chunked_under_the_chunk_size(make):
    sched, _ = _sched(make, max_num_tokens=8, chunk=8)
    sched.add(SchedulerRequest("a", tuple(range(1, 21)), max_new_tokens=1))
    chunks = []
    while sched.has_work():
        plan, _ = _step(sched)
        chunks.append([(s.start, len(s.token_ids), s.samples) for s in plan.scheduled])
    assert chunks == [[(0, 8, False)], [(8, 8, False)], [(16, 4, True)]]


def test_duplicate_first_chunk_is_deferred_then_reuses(make):
    sched, mgr = _sched(make)
    sched.add(SchedulerRequest("a", tuple(SYSTEM + [1, 2]), max_new_tokens=2))
    sched.add(SchedulerRequest("b", tuple(SYSTEM + [3, 4]), max_new_tokens=2))
    plan, _ = _step(sched)
    assert [s.request_id for s in plan.scheduled] == ["a"]
    assert plan.deferred == ("b",)
    plan, _ = _step(sched)  # a decodes; b starts and reuses a's 4 blocks
    assert [(s.request_id, s.start) for s in plan.scheduled] == [("a", 18), ("b", 16)]
    assert mgr.request_stats("b").reused_tokens == 16


def test_without_prefix_awareness_duplicates_run_together_and_recompute(make):
    sched, _ = _sched(make, aware=False)
    sched.add(SchedulerRequest("a", tuple(SYSTEM + [1, 2]), max_new_tokens=2))
    sched.add(SchedulerRequest("b", tuple(SYSTEM + [3, 4]), max_new_tokens=2))
    plan, _ = _step(sched)
    assert [(s.request_id, s.start) for s in plan.scheduled] == [("a", 0), ("b", 0)]
    assert plan.deferred == ()


@pytest.mark.parametrize("aware, admitted, charged", [(True, ["b", "c", "d"], 12), (False, ["b", "c"], 24)])
def test_budget_charges_only_non_reused_tokens_when_aware(make, aware, admitted, charged):
    sched, _ = _sched(make, aware=aware, max_num_tokens=24, chunk=24)
    sched.add(SchedulerRequest("warm", tuple(SYSTEM + [0]), max_new_tokens=1))
    _step(sched)  # SYSTEM's 4 blocks cached
    for rid, tail in (("b", [1, 2, 3, 4]), ("c", [5, 6, 7, 8]), ("d", [9, 9, 9, 9])):
        sched.add(SchedulerRequest(rid, tuple(SYSTEM + tail), max_new_tokens=1))
    plan = sched.schedule()
    # aware: 16 of 20 tokens reused, each request charged 4; unaware: b is charged its whole
    # 20-token prompt, c the 4 tokens left, d waits. Block reuse happens either way.
    assert [s.request_id for s in plan.scheduled] == admitted
    assert all((s.start, len(s.token_ids)) == (16, 4) for s in plan.scheduled)
    assert plan.num_budget_tokens == charged
    assert plan.num_tokens == 4 * len(admitted)


def test_preemption_frees_pages_and_requeues_the_newest(make):
    sched, mgr = _sched(make, pages=6)  # 5 usable pages of 4 tokens
    sched.add(SchedulerRequest("a", tuple(range(1, 9)), max_new_tokens=8))
    sched.add(SchedulerRequest("b", tuple(range(50, 58)), max_new_tokens=8))
    _step(sched)  # both prefilled: 4 pages
    preempted = []
    while sched.has_work():
        plan, _ = _step(sched)
        preempted.extend(plan.preempted)
        mgr.check_consistency()
    assert preempted and preempted[0] == "b"


def test_add_rejects_bad_requests(make):
    sched, _ = _sched(make)
    sched.add(SchedulerRequest("a", (1, 2), max_new_tokens=1))
    with pytest.raises(ValueError, match="request_id='a' is already queued"):
        sched.add(SchedulerRequest("a", (1, 2), max_new_tokens=1))
    with pytest.raises(ValueError, match=r"max_new_tokens=0 must be an int >= 1"):
        sched.add(SchedulerRequest("b", (1, 2), max_new_tokens=0))
    with pytest.raises(ValueError, match=r"exceeds max_seq_len=128"):
        sched.add(SchedulerRequest("c", (1,) * 100, max_new_tokens=29))


@pytest.mark.parametrize("aware", [True, False])
def test_admission_matches_each_prompt_once(make, monkeypatch, aware):
    """Admitting (or deferring) a waiting prompt plans its prefix match once: one
    ``add_request``, no separate estimate; a deferred twin is matched again only on a later step."""
    sched, mgr = _sched(make, aware=aware, chunk=8)
    plans = []
    real_plan = type(mgr)._plan
    monkeypatch.setattr(type(mgr), "_plan", lambda self, *a: plans.append(a[0]) or real_plan(self, *a))
    monkeypatch.setattr(type(mgr), "estimate_reusable_tokens", lambda *a, **k: pytest.fail("estimate called"))
    sched.add(SchedulerRequest("a", tuple(SYSTEM + [1, 2]), max_new_tokens=1))
    sched.add(SchedulerRequest("b", tuple(SYSTEM + [3, 4]), max_new_tokens=1))
    plan = sched.schedule()
    assert len(plans) == 2  # "a" admitted, "b" admitted (unaware) or deferred (aware): one match each
    assert [s.request_id for s in plan.scheduled] == (["a"] if aware else ["a", "b"])
    assert plan.deferred == (("b",) if aware else ())
