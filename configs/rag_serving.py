"""CacheBlend in steady-state serving: a stream of RAG queries over SQuAD passages served by the
real engine through a finite device cache, eviction and host/disk tiers (``experiments.rag_serving``).

    python -m experiments.run --config=configs/rag_serving.py
    python -m experiments.run --config=configs/rag_serving.py --config.cache.device_tokens=16384
    python -m experiments.run --config=configs/rag_serving.py:long --workdir=<folder> \
        --config.piece.max_runs=1 --config.piece.commit=true  # 1,000 queries, one run per piece (~40 min)
    python -m experiments.run --config=configs/rag_serving.py:tiny  # smoke run (a minute)
"""

from __future__ import annotations

import ml_collections


def get_config(preset: str = "") -> ml_collections.ConfigDict:
    """Defaults: the first 240 queries of a stream of 4 BM25-retrieved passages each on SmolLM2,
    three runs (about 30 minutes on 2 cores).

    Args:
      preset: "" (defaults); "long": 1,000 queries of the same stream and prefix caching as a
        fourth run (2.5 hours on 2 cores); "tiny": 24 queries of 2 passages on small caches, for
        tests.
    """
    config = ml_collections.ConfigDict()
    config.experiment = "rag_serving"  # module experiments.rag_serving
    config.model = "smollm2-135m"  # registry name: smollm2-135m | gemma3-270m
    config.gguf_path = ""  # local GGUF file; empty = from the model's PyPI package
    # policy/eviction/tiers (experiments.rag_serving.Run): each serves the whole stream on its own engine
    config.runs = ("no_reuse/lru/device", "cacheblend/priority_lru/disk", "cacheblend_auto/priority_lru/disk")

    config.stream = ml_collections.ConfigDict()  # workloads.rag_stream.StreamConfig, plus the trace file
    config.stream.trace = ""  # a stream.jsonl to serve (from an earlier run); empty = generate from the fields below
    config.stream.num_queries = 240  # queries in the stream
    config.stream.seed = 0  # seed of every draw (passages, questions, drift, exact marks)
    config.stream.top_k = 4  # passages retrieved per query (chunks per prompt)
    config.stream.retriever = "bm25"  # bm25 | gold_distractors (the fallback: no retriever)
    config.stream.initial_articles = 8  # SQuAD articles present at the start (48 in all)
    config.stream.article_every = 50  # queries between two article arrivals (0 = none)
    config.stream.zipf_alpha = 1.0  # Zipf exponent of passage popularity by rank
    config.stream.drift_every = 100  # queries between two popularity drifts (0 = none)
    config.stream.drift_size = 20  # passages moved to the top of the ranking at each drift
    config.stream.exact_fraction = 0.1  # share of queries that must get exact KV (prefix reuse only)

    config.cache = ml_collections.ConfigDict()
    config.cache.tokens_per_block = 32  # tokens per page/block
    config.cache.device_tokens = 8192  # device cache in tokens (SmolLM2 float32: 45 KiB per token)
    config.cache.host_mb = 512.0  # host tier in MiB (runs with tiers host or disk)
    config.cache.disk_mb = 1536.0  # disk tier in MiB (runs with tiers disk)
    config.cache.host_read_gbps = 8.0  # emulated host read bandwidth, GB/s (0 = unthrottled)
    config.cache.host_latency_ms = 0.0  # emulated host read latency per read, ms
    config.cache.disk_read_gbps = 0.01  # emulated disk read bandwidth, GB/s: slower than recomputing (SGLang 26305)
    config.cache.disk_latency_ms = 2.0  # emulated disk read latency per read, ms
    config.cache.chunk_priority = 60  # priority-LRU: chunk blocks (kept longest, offloaded when evicted)
    config.cache.prefix_priority = 90  # priority-LRU: the system prefix of exact requests
    config.cache.query_priority = 20  # priority-LRU: a query's own blocks (below 35: dropped, not offloaded)

    config.serving = ml_collections.ConfigDict()
    config.serving.concurrency = 4  # queries in flight (continuous batching)
    config.serving.max_new_tokens = 12  # greedy answer tokens per query
    config.serving.recompute_ratio = 0.15  # cacheblend's ratio; cacheblend_auto's floor
    config.serving.selector = "cacheblend"  # the selector (kvjax.blend.selection.SELECTORS)
    # a chunk on no tier is recomputed in place until its n-th miss, then stored (1 = store at every miss)
    config.serving.store_after_misses = 2
    config.serving.token_bucket = 64  # blended prompts pad to a multiple of this (shared compiled code)
    config.serving.quality_every = 10  # every n-th query is compared with full recompute
    config.serving.window = 20  # queries per window of the over-time figures
    config.serving.warmup_queries = 80  # queries before the steady-state table starts
    # the blended runs' block traces are replayed through the manager alone at these multiples of the device cache
    config.replay_device_scales = (0.5, 1.0, 2.0, 4.0)
    config.piece = ml_collections.ConfigDict()  # a long stream in pieces: each serves runs not yet in the workdir
    config.piece.max_runs = 0  # runs served by this invocation (0 = every run left); the summary waits for all
    config.piece.commit = False  # commit the run folder to git as each run ends (a run kept under docs/results/)
    if preset == "long":
        config.runs = ("no_reuse/lru/device", "prefix/priority_lru/host", "cacheblend/priority_lru/disk",
                       "cacheblend_auto/priority_lru/disk")
        config.stream.num_queries = 1000
        config.serving.update(window=100, warmup_queries=200)
    elif preset == "tiny":
        config.runs = ("no_reuse/lru/device", "prefix/priority_lru/device", "cacheblend/priority_lru/disk",
                       "cacheblend_auto/lru/disk")
        config.stream.update(num_queries=24, top_k=2, initial_articles=1, article_every=8, drift_every=6,
                             drift_size=4, exact_fraction=0.25, zipf_alpha=2.0)
        # a disk ten times slower than the default, so that it stays slower than recomputing on any CPU
        config.cache.update(device_tokens=2048, host_mb=24.0, disk_mb=48.0, disk_read_gbps=0.001)
        config.serving.update(concurrency=2, max_new_tokens=4, quality_every=4, window=8, warmup_queries=8)
    elif preset:
        raise ValueError(f"unknown preset {preset!r}; allowed: '' (default), 'long' or 'tiny'")
    return config
