"""The RAG serving experiment: its query stream, its block trace and replay, and a tiny run on
the real model."""

from __future__ import annotations

import csv
import dataclasses
import json
import pathlib

import numpy as np
import pytest

from experiments.rag_serving import RecordingManager, Run, replay
from experiments.workloads.datasets import load_squad
from experiments.workloads.rag_stream import StreamConfig, make_stream, read_stream, write_stream
from experiments.workloads.trace import belady_hit_rate
from kvjax.config import KvCacheConfig, KvCacheRetentionConfig, TokenRangeRetentionConfig
from kvjax.manager import KeyExtras, KVCacheManager
from kvjax.manager.hashing import InternalScope

SLICE = pathlib.Path(__file__).parents[1] / "fixtures" / "squad_new_wiki_slice.json"


@pytest.fixture(scope="module")
def paragraphs():
    return load_squad(SLICE)  # 12 paragraphs of 3 articles, 36 questions


def test_stream_is_seeded_and_only_retrieves_passages_that_have_arrived(paragraphs):
    config = StreamConfig(num_queries=60, seed=3, top_k=3, initial_articles=1, article_every=20, drift_every=7,
                          drift_size=2, exact_fraction=0.5)
    stream = make_stream(paragraphs, config)
    assert stream == make_stream(paragraphs, config)
    assert stream != make_stream(paragraphs, dataclasses.replace(config, seed=4))
    arrived: list[int] = []  # articles in order of arrival, read off the queries
    for q in stream:
        assert q.num_articles == 1 + q.index // 20
        assert len(q.passages) == len(set(q.passages)) <= 3
        for p in (q.gold, *q.passages):
            if paragraphs[p].article not in arrived:
                arrived.append(paragraphs[p].article)
        assert len(arrived) <= q.num_articles  # nothing from an article that has not arrived
        assert q.question_id in {x.id for x in paragraphs[q.gold].questions}
    assert len(arrived) == 3
    assert 0.3 < np.mean([q.exact for q in stream]) < 0.7
    assert np.mean([q.gold_retrieved for q in stream]) > 0.6  # BM25 finds the question's passage mostly


def test_gold_distractors_always_hold_the_gold_passage(paragraphs):
    stream = make_stream(paragraphs, StreamConfig(num_queries=30, retriever="gold_distractors", top_k=4,
                                                  initial_articles=3))
    assert all(q.gold_retrieved and len(q.passages) == 4 for q in stream)


def test_stream_file_round_trips_and_refuses_other_files(paragraphs, tmp_path):
    stream = make_stream(paragraphs, StreamConfig(num_queries=10, initial_articles=2))
    write_stream(tmp_path / "s.jsonl", stream, {"corpus_sha256": "abc"})
    assert read_stream(tmp_path / "s.jsonl") == (stream, {"corpus_sha256": "abc"})
    (tmp_path / "bad.jsonl").write_text(json.dumps({"header": {}}) + "\n" + json.dumps({"index": 0}) + "\n")
    with pytest.raises(ValueError, match="line 2 is not a stream query"):
        read_stream(tmp_path / "bad.jsonl")


@pytest.mark.parametrize("field, value, match", [
    ("top_k", 0, r"stream.top_k=0 must be an int >= 1"),
    ("retriever", "dense", r"stream.retriever='dense' must be one of"),
    ("exact_fraction", 1.5, r"stream.exact_fraction=1.5 must lie in \[0, 1\]"),
    ("zipf_alpha", -1.0, r"stream.zipf_alpha=-1.0 must be >= 0"),
])
def test_stream_config_names_the_bad_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        StreamConfig(**{field: value})


def test_run_names_parse_and_bad_ones_name_the_allowed_values():
    assert Run.parse("cacheblend_auto/priority_lru/disk") == Run("cacheblend_auto", "priority_lru", "disk")
    with pytest.raises(ValueError, match="policy in"):
        Run.parse("cacheblend/belady/disk")


def _traffic(mgr: KVCacheManager, rng: np.random.Generator, n: int) -> None:
    """Prompts sharing prefixes, in two scopes and two priorities, some requests overlapping."""
    chunk = InternalScope("chunk:system")
    docs = [tuple(int(t) for t in rng.integers(1, 50, 12)) for _ in range(6)]
    held: list[str] = []
    for i in range(n):
        salt = chunk if i % 3 == 0 else None
        doc = docs[min(int(rng.zipf(1.5)) - 1, 5)]
        prompt = (*doc, *(int(t) for t in rng.integers(1, 50, int(rng.integers(1, 6)))))
        prio = KvCacheRetentionConfig((TokenRangeRetentionConfig(0, None, int(rng.choice([20, 60]))),))
        rid = f"r{i}"
        reused = mgr.add_request(rid, prompt, retention=prio, extras=KeyExtras(cache_salt=salt))
        mgr.allocate(rid, len(prompt) + 2)
        mgr.commit_tokens(rid, prompt[reused:])
        mgr.commit_tokens(rid, (7, 8))
        mgr.take_page_ops()
        held.append(rid)
        if len(held) > 1 or rng.random() < 0.5:
            mgr.free_request(held.pop(0))
    for rid in held:
        mgr.free_request(rid)


def test_replay_of_a_recorded_block_trace_reproduces_the_manager(make):
    base = make(num_device_pages=13, host=4, disk=4, tokens_per_block=4)
    kv = KvCacheConfig(tokens_per_block=4)
    recorder = RecordingManager(kv, base.layout)
    _traffic(recorder, np.random.default_rng(0), 80)
    assert recorder.stats.device_evictions > 0 and recorder.stats.onboarded_pages > 0  # the trace has pressure
    again = replay(recorder.log, KVCacheManager(kv, base.layout))
    assert again.stats == dataclasses.asdict(recorder.stats)
    lru = replay(recorder.log, KVCacheManager(kv, base.layout), priorities=False)
    assert lru.accesses == again.accesses  # the same block accesses whatever the policy
    small = replay(recorder.log, KVCacheManager(kv, dataclasses.replace(base.layout, num_host_pages=0,
                                                                        num_disk_pages=0)))
    assert small.stats["reused_blocks"] < again.stats["reused_blocks"]  # fewer tiers, fewer hits
    capacity = base.layout.num_pages[0] - 1 + 8
    assert belady_hit_rate(again.accesses, capacity) >= again.chunk_hit_rate  # MIN bounds the manager


def _records(path: pathlib.Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
@pytest.mark.real_model
def test_tiny_preset_serves_the_stream_under_every_policy_in_pieces(tmp_path):
    from configs import rag_serving as rag_serving_config
    from experiments import rag_serving

    config = rag_serving_config.get_config("tiny")
    config.piece.max_runs = 2
    assert rag_serving.run(config, tmp_path) == {"runs_left": list(config.runs[2:])}  # the first piece
    config.piece.max_runs = 0
    results = rag_serving.run(config, tmp_path)  # the second serves the two runs left, then the summary
    assert json.dumps(rag_serving.run(config, tmp_path), default=str) == json.dumps(results, default=str)
    other = rag_serving_config.get_config("tiny")
    other.serving.max_new_tokens = 5
    with pytest.raises(ValueError, match=r"holds run 'no_reuse/lru/device' of another config \(fields \['serving'\]"):
        rag_serving.run(other, tmp_path)
    steady = {row["run"]: row for row in results["steady"]}
    assert list(steady) == list(config.runs)
    for row in steady.values():
        assert row["replay_equal"]  # the manager alone, fed the run's block trace, counts the same
        assert row["exact_violations"] == 0  # no exact request read blended KV
    assert all(steady[r]["exact_requests"] > 0 for r in config.runs if not r.startswith("no_reuse"))
    blend = steady["cacheblend/priority_lru/disk"]
    assert blend["hit_device"] + blend["hit_host"] + blend["hit_disk"] > 0  # chunks were reused
    blend_queries = _records(tmp_path / "queries-cacheblend-priority_lru-disk.csv")
    loaded = [float(r["recomputed_share"]) for r in blend_queries if r["exact"] == "False" and r["chunks_miss"] == "0"]
    k = str(config.stream.top_k)
    unstored = [float(r["recomputed_share"]) for r in blend_queries if r["chunks_miss"] == k]
    assert loaded and max(loaded) < 0.6  # every chunk read: a share of it recomputed
    assert unstored and min(unstored) > 0.8  # no chunk stored yet: every chunk token recomputed in place
    # the tiny preset's disk tier reads at 0.001 GB/s, slower than recomputing: "auto" recomputes every chunk it
    # finds there and reads the others
    records = _records(tmp_path / "queries-cacheblend_auto-lru-disk.csv")
    assert sum(int(r["chunks_disk"]) for r in records) > 0 and sum(int(r["chunks_host"]) for r in records) > 0
    assert all(int(r["recomputed_chunks"]) == int(r["chunks_disk"]) for r in records)
    # a chunk on no tier is recomputed in place at its first miss and stored at its second
    assert blend["unstored_chunks"] > 0
    first = next(r for r in records if r["exact"] == "False")
    assert int(first["chunks_miss"]) == config.stream.top_k  # the first blended query finds nothing stored
    assert steady["cacheblend_auto/lru/disk"]["unstored_chunks"] > 0
    assert {r["trace"] for r in results["replays"]} == {"cacheblend/priority_lru/disk", "cacheblend_auto/lru/disk"}
    for name in ("summary.md", "stream.jsonl", "windows.csv", "over_time.png"):
        assert (tmp_path / name).stat().st_size > 0


def test_store_after_misses_names_the_field():
    from configs import rag_serving as rag_serving_config
    from experiments import rag_serving

    config = rag_serving_config.get_config("tiny")
    config.serving.store_after_misses = 0
    with pytest.raises(ValueError, match=r"serving.store_after_misses=0 must be an int >= 1"):
        rag_serving.Server(config, None, Run.parse("cacheblend/lru/device"), {}, "")


def test_unknown_preset_is_an_error():
    from configs import rag_serving as rag_serving_config

    with pytest.raises(ValueError, match="unknown preset 'huge'; allowed: '' .default., 'long' or 'tiny'"):
        rag_serving_config.get_config("huge")
    long, default = rag_serving_config.get_config("long").stream, rag_serving_config.get_config().stream
    # the long preset serves more of the same stream: the default's queries are its first ones
    assert long.num_queries > default.num_queries
    assert {**long.to_dict(), "num_queries": 0} == {**default.to_dict(), "num_queries": 0}
