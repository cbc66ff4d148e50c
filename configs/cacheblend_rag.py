"""CacheBlend on synthetic RAG prompts, every policy an engine request against full recompute.

    python -m experiments.run --config=configs/cacheblend_rag.py
    python -m experiments.run --config=configs/cacheblend_rag.py \
        --config.num_prompts=200 --config.policy.recompute_ratio=auto

The default (6 prompts of 6 chunks x 256 tokens) takes a few minutes on 2 CPU cores;
``num_prompts`` scales the bootstrap intervals.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.experiment = "cacheblend"  # module experiments.cacheblend
    config.model = "smollm2-135m"  # registry name: smollm2-135m | gemma3-270m
    config.gguf_path = ""  # local GGUF file; empty = from the model's PyPI package
    config.seed = 0  # workload, random selection and bootstrap seed
    config.num_prompts = 6  # prompts evaluated (bootstrap units); scale to hundreds for tight intervals

    config.workload = ml_collections.ConfigDict()
    config.workload.tasks = ("cross_chunk_binding", "two_hop", "scoped_override", "single_chunk")  # cycled
    config.workload.num_chunks = (6, 6)  # (min, max) chunks per prompt, within [3, 8]
    config.workload.chunk_tokens = (256, 256)  # (min, max) tokens per chunk, within [64, 512]

    config.store = ml_collections.ConfigDict()
    config.store.variant = "system"  # chunk KV computed at: pos0 | bos | system (behind the system prompt)
    config.store.tier = "hbm"  # controller tier the chunks wait in ("auto" ratio): hbm | host | nvme | disk
    config.store.cache_tokens = 32768  # engine cache size (tokens): chunks, prefixes and evaluation requests

    config.policy = ml_collections.ConfigDict()
    config.policy.recompute_ratio = "0.15"  # share of chunk tokens recomputed (selectors), or "auto": the loading controller
    config.policy.check_layers = (1, 2, 3)  # CacheBlend deviation checks; first >= 1
    config.policy.budgets = (2.0, 1.5, 1.0)  # rows kept after each check, in units of the target
    config.policy.deviation = "kv"  # k | v | kv: which deviation scores tokens
    config.policy.row_bucket = 64  # recomputed-row capacities round up to this

    config.policies = ("full_recompute", "prefix_caching", "full_reuse", "cacheblend", "random", "oracle", "epic")  # compared
    config.sweep = ml_collections.ConfigDict()
    config.sweep.ratios = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)  # quality-vs-ratio sweep
    config.sweep.policies = ("cacheblend",)  # selectors swept (add "random" for the control curve)
    config.sweep.num_prompts = 1  # first prompts used by the sweep (0 = skip)
    # cheaper CacheBlend schedules (check layers, budgets) timed and scored beside the default
    config.schedules = (((1,), (1.0,)), ((2,), (1.0,)))

    config.eval = ml_collections.ConfigDict()
    config.eval.continuation_tokens = 32  # N: teacher-forced continuation length for KL / top-1
    config.eval.max_answer_tokens = 12  # greedy answer budget (answer agreement, gold accuracy)
    config.eval.num_probes = 16  # suffix rows traced for attention deviation
    config.eval.bootstrap = 2000  # bootstrap resamples for 95% intervals

    config.runtime = ml_collections.ConfigDict()
    config.runtime.page_size = 32  # tokens per page of the sequence pool
    config.runtime.token_bucket = 256  # prompt lengths pad to a multiple of this
    config.runtime.attn_impl = "auto"  # attention: auto | reference | interpret

    config.controller = ml_collections.ConfigDict()
    config.controller.min_ratio = 0.15  # quality floor of the recompute ratio
    config.controller.hbm_gbps = 2000.0  # assumed HBM bandwidth (GB/s) for the cost table
    config.controller.nvme_gbps = 3.0  # assumed NVMe bandwidth (GB/s)
    config.controller.nvme_latency_ms = 0.1  # assumed NVMe latency per layer read (ms)

    return config
