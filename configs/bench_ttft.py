"""Time to first token vs prompt length: cold, prefix hits and CacheBlend, side by side.

    python -m experiments.run --config=configs/bench_ttft.py
    python -m experiments.run --config=configs/bench_ttft.py --config.lengths='(512, 1024)' --config.repeats=5
    python -m experiments.run --config=configs/bench_ttft.py:tiny  # smoke run: one 256-token length

For every prompt length, in one run on SmolLM2-135M:
  cold        a fresh prompt through the engine (nothing reusable);
  hit_<p>     through the engine, a prompt whose first p% (block-aligned) is cached by an
              earlier request (the radix-tree prefix hit skips that prefill);
  blend_full  full recompute as an engine request of the Blender harness (nothing reused);
  blend_<r>   CacheBlend at recompute ratio r: chunk KV precomputed (untimed, offline) and
              reused out of prefix order, r of the chunk tokens recomputed (kvjax.blend).
Each cell runs ``warmup`` untimed rounds (compiles every shape) and reports the median of
``repeats``, with fresh random tokens per round. Writes ``ttft.md``/``ttft.csv`` and
``ttft.png``. The default took 22 minutes on a shared 2-core CPU (mostly the 2048-token
rounds); ``--config.lengths='(256, 1024)' --config.repeats=2`` is a quicker look.
"""

import ml_collections


def get_config(preset: str = "") -> ml_collections.ConfigDict:
    """Args:
      preset: "" (defaults) or "tiny": one 256-token length, one hit fraction, one blend
        ratio, one timed round.
    """
    config = ml_collections.ConfigDict()
    config.experiment = "bench_ttft"  # module experiments.bench_ttft
    config.model = "smollm2-135m"  # registry name: smollm2-135m | gemma3-270m
    config.seed = 0  # random prompt tokens
    config.lengths = (256, 512, 1024, 2048)  # prompt lengths in tokens
    config.hit_fractions = (0.1, 0.3, 0.5, 0.7, 0.9)  # cached share of the prompt (rounded to whole blocks)
    config.blend_ratios = (0.05, 0.15, 0.3, 0.5)  # CacheBlend recompute ratios (empty = no CacheBlend columns)
    config.warmup = 1  # untimed rounds per length (compilation)
    config.repeats = 3  # timed rounds per length; the median is reported

    config.kv_cache = ml_collections.ConfigDict()
    config.kv_cache.tokens_per_block = 32  # page size
    config.kv_cache.max_tokens = 8192  # engine cache capacity (LRU evicts older prompts)

    config.scheduler = ml_collections.ConfigDict()
    config.scheduler.prefill_chunk_size = 2048  # whole prompts in one chunk, like the blend path
    config.scheduler.max_num_tokens = 2048  # step token budget

    config.blend = ml_collections.ConfigDict()
    config.blend.prefix_tokens = 32  # shared system prompt (exact, reused from the chunk store)
    config.blend.suffix_tokens = 32  # question tokens (always recomputed)
    config.blend.chunk_tokens = 256  # retrieved chunk size; chunks fill the rest of the prompt
    config.blend.check_layers = (1, 2, 3)  # deviation checks (gradual filtering)
    config.blend.budgets = (2.0, 1.5, 1.0)  # rows kept after each check, in units of the target
    config.blend.row_bucket = 64  # recomputed-row capacities round up to this
    config.blend.token_bucket = 256  # prompt lengths pad to a multiple of this
    if preset == "tiny":
        config.update(lengths=(256,), hit_fractions=(0.5,), blend_ratios=(0.15,), repeats=1)
    elif preset:
        raise ValueError(f"unknown preset {preset!r}; allowed: '' (default) or 'tiny'")
    return config
