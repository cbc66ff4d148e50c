"""A soak of the real engine under faults (``experiments.soak``).

    python -m experiments.run --config=configs/soak.py                   # 30 minutes on SmolLM2
    python -m experiments.run --config=configs/soak.py --config.minutes=60
    python -m experiments.run --config=configs/soak.py:tiny              # the test's: 300 steps, tiny model
"""

from __future__ import annotations

import ml_collections

from experiments.soak import FAULTS, KINDS


def get_config(preset: str = "") -> ml_collections.ConfigDict:
    """Defaults: 30 minutes of SmolLM2 serving the four request kinds through a small device
    cache with host and disk tiers, a fault every 40 steps.

    Args:
      preset: "" (defaults) or "tiny": 300 steps (about a minute) of the tiny test model
        (random token text), a fault every 2 steps, for the test suite.
    """
    config = ml_collections.ConfigDict()
    config.experiment = "soak"  # module experiments.soak
    config.model = "smollm2-135m"  # registry name, or "tiny" (kvjax.testing.tiny's model)
    config.minutes = 30.0  # serving time; the engines then drain
    config.max_steps = 0  # ... or this many steps, if sooner (0 = no bound)
    config.seed = 0  # every draw: prompts, kinds, priorities, fault targets, kill delays
    config.max_seq_len = 1024  # every engine's longest prompt + output

    config.cache = ml_collections.ConfigDict()
    config.cache.tokens_per_block = 32
    config.cache.device_tokens = 3072  # each served engine's device cache: under pressure (preemptions, eviction)
    config.cache.host_bytes = 96 << 20  # main and quantized engines' host tier
    config.cache.disk_bytes = 192 << 20  # main engine's disk tier
    config.cache.reference_tokens = 8192  # the fault-free reference engines' (no reuse)

    config.scheduler = ml_collections.ConfigDict()
    config.scheduler.max_num_tokens = 512
    config.scheduler.max_batch_size = 4
    config.scheduler.prefill_chunk_size = 256  # a long prompt takes several steps (aborts mid-prefill)

    config.mix = ml_collections.ConfigDict()
    config.mix.weights = {kind: 1.0 for kind in KINDS}  # relative arrival weights by kind
    config.mix.in_flight = 4  # requests in flight per served engine
    config.mix.max_new_tokens = 16  # greedy
    config.mix.text_tokens = 200_000  # SQuAD v1.1 dev context tokens prompts are drawn from
    config.mix.num_system_prompts = 3
    config.mix.system_tokens = 128  # a system prompt (shared prefix)
    config.mix.turn_tokens = 96  # a chat turn, a question, a speculative prompt's repeated piece
    config.mix.num_chats = 6  # conversations whose prompts grow turn by turn
    config.mix.num_passages = 24  # the chunk pool of CacheBlend prompts
    config.mix.chunk_tokens = 128
    config.mix.chunks_per_prompt = 3
    config.mix.zipf_alpha = 1.5  # passage popularity by rank
    config.mix.recompute_ratio = 0.15
    config.mix.selector = "cacheblend"  # kvjax.blend.selection.SELECTORS
    config.mix.priority_fraction = 0.5  # chats with a retention priority (system prompt 80, decode 20)

    config.faults = ml_collections.ConfigDict()
    config.faults.kinds = FAULTS  # in turn, one every every_steps steps
    config.faults.every_steps = 40
    config.faults.patience_steps = 200  # a fault with nothing to act on this long is skipped (counted)
    config.faults.read_error_steps = 5  # disk reads fail this many steps
    config.faults.kill_within_s = 0.5  # the snapshot-saving process is killed within this after it starts saving

    config.checks = ml_collections.ConfigDict()
    config.checks.rss_warmup_fraction = 0.3  # resident memory is compared after this share of the run
    # allowed rise of resident memory's high-water mark after warm-up, summed over the steps that compiled no program
    config.checks.rss_growth_mb = 256
    config.checks.drain_steps = 5000  # steps the engines get to finish every request at the end
    # An int8 request's largest |logit difference| from a cold int8 run, as a multiple of that
    # run's own from float32. Both runs are int8 roundings of the same float32 computation, each
    # about that far from it, so they may differ by up to twice it (the triangle inequality).
    config.checks.quantized_drift_fraction = 2.0

    if preset == "tiny":
        config.model = "tiny"
        config.minutes = 5.0  # a bound: the steps end it
        config.max_steps = 300
        config.max_seq_len = 256
        config.cache.tokens_per_block = 16
        config.cache.device_tokens = 512  # 32 pages: four chats of up to 16 pages each preempt
        config.cache.host_bytes = 256 << 10  # 32 pages of the tiny model: blocks soon reach the disk
        config.cache.disk_bytes = 1 << 20
        config.cache.reference_tokens = 2048
        config.scheduler.max_num_tokens = 128
        config.scheduler.prefill_chunk_size = 32
        config.mix.text_tokens = 20_000
        config.mix.system_tokens = 32
        config.mix.turn_tokens = 24
        config.mix.chunk_tokens = 32
        config.mix.chunks_per_prompt = 2
        config.mix.weights = {"chat": 4.0, "chunks": 1.0, "speculative": 1.0, "quantized": 1.0}
        config.mix.selector = "cacheblend_single"  # one check, at layer 1: the tiny model has 2 layers
        config.faults.every_steps = 2
        config.faults.patience_steps = 30
        config.faults.read_error_steps = 2
        config.checks.rss_growth_mb = 1024
    elif preset:
        raise ValueError(f"unknown preset {preset!r}; allowed: '' (default) or 'tiny'")
    return config
