"""Quantized KV cache (int8 / fp8 values with per-token or per-page scales) as a cache policy:
quality deviation from a float32 cache, bytes per token, decode speed.

    python -m experiments.run --config=configs/kv_quant.py
    python -m experiments.run --config=configs/kv_quant.py:tiny      # smoke run (seconds of work, minutes of compiling)
    python -m experiments.run --config=configs/kv_quant.py --config.models='("smollm2-135m", "gemma3-270m")'

Parts (per model, per dtype x scale granularity, against a float32 cache):
  rag    synthetic RAG prompts (``experiments.workloads.rag``: system prefix, retrieved chunks,
         question): KL and top-1 agreement over ``continuation_tokens`` positions teacher-forced
         along the float32 cache's greedy continuation, bootstrap 95% intervals over prompts;
  long   passages of the committed reference text continued for ``generate_tokens`` (>= 256)
         greedy tokens: the same metrics and the greedy divergence point;
  blend  CacheBlend at ``recompute_ratio`` on engines whose whole cache, chunk store included,
         is quantized, against float32 full recompute (and full recompute on the same cache);
  speed  decode ms/token through the engine at batch 1 and 8.
"""

import pathlib

import ml_collections

_TEXT = pathlib.Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "reference_text.txt"


def get_config(preset: str = "") -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.experiment = "kv_quant"  # module experiments.kv_quant
    # registry names (gemma3-270m: no CacheBlend, its windowed layer groups)
    config.models = ("smollm2-135m", "gemma3-270m")
    config.parts = ("rag", "long", "blend", "speed")  # parts run (see above)
    config.seed = 0  # workload, random speed prompts and bootstrap seed
    config.dtypes = ("int8", "fp8")  # quantized KV dtypes compared with float32
    config.scale_granularities = ("token", "page")  # scales: per token and KV head / per page and KV head
    config.tokens_per_block = 32  # tokens per page
    config.attn_impl = "auto"  # attention for the quality parts: auto | reference | blocked
    config.bootstrap = 2000  # bootstrap resamples for 95% intervals

    config.rag = ml_collections.ConfigDict()
    config.rag.num_prompts = 6  # synthetic RAG prompts (bootstrap units)
    config.rag.num_chunks = (3, 4)  # (min, max) retrieved chunks per prompt
    config.rag.chunk_tokens = (64, 128)  # (min, max) tokens per chunk (multiples of 64)
    config.rag.continuation_tokens = 16  # teacher-forced positions after the prompt

    config.long = ml_collections.ConfigDict()
    config.long.text_path = str(_TEXT)  # text the prompts are cut from (committed fixture)
    config.long.num_prompts = 3  # passages continued (bootstrap units)
    config.long.prompt_tokens = 96  # tokens per passage
    config.long.generate_tokens = 256  # greedy continuation length (>= 256)

    config.blend = ml_collections.ConfigDict()
    config.blend.recompute_ratio = 0.15  # CacheBlend share of chunk tokens recomputed
    config.blend.check_layers = (1, 2, 3)  # CacheBlend deviation checks
    config.blend.budgets = (2.0, 1.5, 1.0)  # rows kept after each check, in units of the target
    config.blend.scale_granularity = "token"  # scales of the quantized engines
    config.blend.cache_tokens = 8192  # engine cache (tokens): chunks and the evaluation requests

    config.speed = ml_collections.ConfigDict()
    config.speed.models = ("smollm2-135m",)  # models whose decode speed is measured (of config.models)
    config.speed.batches = (1, 8)  # decode batch sizes
    config.speed.context = 128  # prompt tokens before decoding
    config.speed.decode_tokens = 16  # decode steps timed per round
    config.speed.warmup = 1  # untimed rounds (compilation)
    config.speed.rounds = 2  # timed rounds; the median is reported
    config.speed.attn_impl = "blocked"  # attention of the speed engines: auto | reference | blocked
    config.speed.scale_granularities = ("token",)  # scales of the quantized engines timed

    if preset == "tiny":
        config.models = ("smollm2-135m",)
        config.rag.num_prompts = 2
        config.rag.num_chunks = (3, 3)
        config.rag.chunk_tokens = (64, 64)
        config.rag.continuation_tokens = 4
        config.long.num_prompts = 1
        config.long.prompt_tokens = 32
        config.long.generate_tokens = 8
        config.scale_granularities = ("token",)
        config.blend.cache_tokens = 2048
        config.speed.batches = (1, 2)
        config.speed.context = 32
        config.speed.decode_tokens = 4
        config.speed.warmup = 0
        config.speed.rounds = 1
        config.bootstrap = 200
    elif preset:
        raise ValueError(f"preset={preset!r} must be '' or 'tiny'")
    return config
