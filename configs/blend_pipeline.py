"""CacheBlend's pipeline: TTFT with the chunks' KV on the device, host or disk tier, the tiers
throttled to emulate slower storage, serial vs layer-wise pipelined onboarding.

    python -m experiments.run --config=configs/blend_pipeline.py
    python -m experiments.run --config=configs/blend_pipeline.py --config.bandwidths_gbps='(0.05, 1.0)'
    python -m experiments.run --config=configs/blend_pipeline.py:tiny   # smoke run

For each prompt (synthetic RAG prompts of ``num_chunks`` x ``chunk_tokens``, SmolLM2-135M) the
chunks are stored once; full recompute runs as an ordinary request; then for every placement
of the chunk blocks (device; host and disk at each bandwidth in ``bandwidths_gbps``, moved
there by ``KVCacheManager.demote_cached``) and every mode (``pipelined``: onboarded layer by
layer while the prefill computes; ``serial``: all onboarded before the first layer), each
policy (full reuse, CacheBlend at each ratio in ``ratios``, and "auto": the loading
controller's ratio for that tier, measured) runs as a blended request. The throttle
(``KvCacheConfig.host_read_gbps`` / ``disk_read_gbps`` and latencies) is an emulation: the
bytes are copied at memory speed, then the read sleeps until it has lasted
``latency + bytes / bandwidth``. ``warmup_prompts`` first prompts run every cell untimed
(compilation). Writes ``pipeline.csv``, ``timeline.csv``, ``validation.csv`` and plots.
"""

import ml_collections


def get_config(preset: str = "") -> ml_collections.ConfigDict:
    """Args:
      preset: "" (defaults) or "tiny": one short prompt, one bandwidth, one ratio.
    """
    config = ml_collections.ConfigDict()
    config.experiment = "blend_pipeline"  # module experiments.blend_pipeline
    config.model = "smollm2-135m"  # registry name or a Hugging Face checkpoint folder
    config.seed = 0  # workload seed
    config.num_prompts = 3  # timed prompts
    config.warmup_prompts = 1  # prompts run untimed first (every shape compiles there)
    config.num_chunks = (6, 6)  # (min, max) chunks per prompt
    config.chunk_tokens = (256, 256)  # (min, max) tokens per chunk
    config.tiers = ("host", "disk")  # tiers the chunks are moved to (besides the device)
    config.bandwidths_gbps = (0.03, 0.1, 0.3, 1.0, 3.0, 10.0)  # emulated read bandwidth of the tier (GB/s)
    config.latency_ms = 0.05  # emulated latency of each read (one layer of one tier), ms
    config.ratios = (0.15, 0.3, 0.5)  # CacheBlend recompute ratios (fixed)
    config.min_ratio = 0.15  # the controller's quality floor ("auto")
    config.headroom = 0.8  # the controller plans the recompute at this share of the load time ("auto"), in (0, 1]
    config.row_bucket = 16  # recomputed-row capacities round up to this, or to 1/4 of the rows when coarser
    config.token_bucket = 256  # blended prompts pad to a multiple of this
    config.tokens_per_block = 16  # page size
    config.cache_tokens = 16384  # device cache (tokens)
    config.host_tokens = 8192  # host tier (tokens)
    config.disk_tokens = 8192  # disk tier (tokens)

    if preset == "tiny":
        config.num_prompts = 1
        config.warmup_prompts = 0
        config.num_chunks = (3, 3)
        config.chunk_tokens = (64, 64)
        config.bandwidths_gbps = (0.1,)
        config.ratios = (0.15,)
        config.token_bucket = 64
        config.cache_tokens = 4096
        config.host_tokens = 2048
        config.disk_tokens = 2048
    elif preset:
        raise ValueError(f"unknown preset {preset!r}; allowed: '' (default) or 'tiny'")
    return config
