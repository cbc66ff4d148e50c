"""KV-cache memory: bytes/token by attention type, windowed layer groups on long sequences,
and how many distinct prompts stay reusable with a host tier.

    python -m experiments.run --config=configs/bench_memory.py
    python -m experiments.run --config=configs/bench_memory.py --config.windows.lengths='(1024, 2048, 4096, 8192)'
    python -m experiments.run --config=configs/bench_memory.py:tiny  # smoke run

Three parts, side by side in one run folder (``memory.md`` table, ``memory.png`` plot):
  attention  MHA / GQA / MQA on SmolLM2's geometry, per KV dtype (float32, bfloat16, and
             int8 / fp8 with per-token or per-page float32 scales): bytes/token from the
             layout formula (scales included) against the bytes of an allocated pool, and
             the tokens that fit a fixed budget;
  windows    pages held per layer group by one running request of each length, on the real
             engine (Gemma 3's own 512-token windows; SmolLM2 with ``max_attention_window``);
  offload    distinct prompts still reusable after a fill, with 0 or N x the device cache
             as host cache (checked once by re-running the oldest prompt);
  pools      pages per layer group of one device budget under the per-group pool settings
             (equal pages, ``avg_seq_len``, ``pool_ratio``), for Gemma 3 and for a hybrid of
             its geometry (no setting: the warning and half of max_seq_len).
The default takes about 8 minutes on 2 CPU cores (mostly compiling the engines' buckets).
"""

import ml_collections


def get_config(preset: str = "") -> ml_collections.ConfigDict:
    """Args:
      preset: "" (defaults) or "tiny": two dtypes, one 512-token SmolLM2 request, 8 offload
        prompts with 0 or 1 x the device cache as host cache, for smoke runs.
    """
    config = ml_collections.ConfigDict()
    config.experiment = "bench_memory"  # module experiments.bench_memory
    config.seed = 0  # random prompt tokens

    config.attention = ml_collections.ConfigDict()
    config.attention.model = "smollm2-135m"  # geometry (layers, heads, head_dim) of the comparison
    config.attention.kv_heads = (9, 3, 1)  # MHA (= query heads), GQA (the model's), MQA
    config.attention.dtypes = ("float32", "bfloat16", "int8", "fp8")  # KV dtypes (KvCacheConfig.dtype)
    config.attention.scale_granularities = ("token", "page")  # scales of the quantized dtypes
    config.attention.budget_bytes = 1 << 30  # fixed memory budget for the tokens-that-fit column
    config.attention.num_pages = 8  # pages of the allocated pool that checks the formula
    config.attention.tokens_per_block = 32  # tokens per page

    config.windows = ml_collections.ConfigDict()
    config.windows.lengths = (1024, 2048, 4096)  # prompt lengths of the running request
    config.windows.smollm2_window = (4096, 256)  # SmolLM2 max_attention_window, cycled over layers
    config.windows.models = ("gemma3-270m", "smollm2-135m")  # engines measured (gemma: its own windows)
    config.windows.tokens_per_block = 32  # page size
    config.windows.prefill_chunk_size = 1024  # scheduler chunk (windowed pages are released between chunks)

    config.offload = ml_collections.ConfigDict()
    config.offload.model = "smollm2-135m"  # engine model
    config.offload.device_tokens = 1024  # device cache capacity (max_tokens)
    config.offload.host_multiples = (0, 1, 3)  # host_cache_size in units of the device cache bytes
    config.offload.num_prompts = 40  # distinct prompts filled in turn
    config.offload.prompt_tokens = 128  # tokens per prompt (4 blocks of 32)
    config.offload.tokens_per_block = 32  # page size
    config.pools = ml_collections.ConfigDict()
    # geometry split (also as a hybrid: its layers cycled recurrent, recurrent, attention)
    config.pools.model = "gemma3-270m"
    config.pools.max_tokens = 32768  # device cache, tokens of the equal split
    config.pools.max_seq_len = 8192  # longest sequence each group must hold
    config.pools.avg_seq_lens = (1024, 4096)  # KvCacheConfig.avg_seq_len settings
    config.pools.ratios = ((1, 1),)  # KvCacheConfig.pool_ratio settings (one weight per layer group)

    if preset == "tiny":
        config.attention.dtypes = ("float32", "int8")
        config.windows.update(lengths=(512,), models=("smollm2-135m",), prefill_chunk_size=512)
        config.offload.update(device_tokens=256, host_multiples=(0, 1), num_prompts=8)
        config.pools.update(model="smollm2-135m", max_tokens=4096, max_seq_len=1024, avg_seq_lens=(512,), ratios=())
    elif preset:
        raise ValueError(f"unknown preset {preset!r}; allowed: '' (default) or 'tiny'")
    return config
