"""The check's problem sizes: ``FULL`` for the GPU (the whole check within ~8 minutes on an
H200, so that it can run twice inside a 15-minute lease), ``DRY_RUN`` for the CPU (every
stage, tiny, the kernels interpreted: well under a minute on two cores).

Geometry names follow ``kvjax/axes.py``: ``num_heads`` / ``num_kv_heads`` query and KV heads,
``head_dim``, ``tokens_per_block`` (the page size).
"""

from __future__ import annotations

import dataclasses

GridCase = tuple[int, tuple[int, int], int, str]
"""(tokens_per_block, (num_heads, num_kv_heads), head_dim, q and page dtype) of one correctness case."""


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Every size the stages use."""

    budget_s: float  # wall seconds of the Python part; stages past it are skipped
    stage_budget_s: tuple[tuple[str, float], ...]  # (stage, wall seconds) after which its remaining rows are skipped
    interpret: bool  # Pallas kernels in interpret mode (the CPU dry run)
    # kernels: correctness grid
    grid: tuple[GridCase, ...]  # float cases; each runs decode and partial attention, plain and windowed
    quantized_grid: tuple[GridCase, ...]  # cases run with int8 and fp8 pages (per-token and per-page scales)
    pages_per_seq: int  # block table width of the correctness problems
    # bandwidth: paged decode
    bw_heads: tuple[int, int]  # (num_heads, num_kv_heads)
    bw_head_dim: int
    bw_tokens_per_block: int
    bw_batches: tuple[int, ...]  # sequences per decode call
    bw_contexts: tuple[int, ...]  # tokens per sequence (each a multiple of bw_tokens_per_block)
    # largest batch x context measured: the pool holds this many tokens (< 2**31 elements per K or V)
    bw_max_tokens: int
    bw_dtypes: tuple[str, ...]  # page dtypes: "bfloat16", "int8", "fp8"
    bw_calls: int  # timed calls per point (after two untimed ones)
    bw_sweep_point: tuple[int, int]  # (batch, context) of the block-size sweep and the XLA baselines (bf16)
    bw_sweep: tuple[tuple[int, int], ...]  # (pages_per_block, k_splits) tried there, besides the tuned sizes
    copy_elements: int  # bf16 elements of the array whose device copy sets the bandwidth ceiling
    # engine: SmolLM2-135M's shapes, random bf16 weights
    model_layers: int | None  # None = the model's 30 layers; fewer in the dry run
    model_vocab: int | None  # None = the model's 49152 tokens
    attn_impl: str  # the engine's attention ("auto": the Pallas kernel on GPU; "interpret" on CPU)
    tokens_per_block: int  # the engine's page size
    cache_tokens: int  # the engine's device cache (tokens)
    ttft_lengths: tuple[int, ...]  # prompt tokens of the TTFT rows
    hit_fraction: float  # share of the prompt cached in the "prefix hit" rows (whole blocks)
    repeats: int  # timed rounds per TTFT row (median), after one untimed round
    decode_batches: tuple[int, ...]  # sequences decoding together
    decode_prompt: int  # prompt tokens of each decoding sequence
    decode_tokens: int  # tokens generated per sequence (>= 2; steps after the first are timed)
    # blend: CacheBlend against full recompute
    blend_prefix: int  # exact system prefix tokens
    blend_chunks: tuple[int, ...]  # tokens of each retrieved chunk
    blend_suffix: int  # question tokens (always recomputed)
    blend_ratio: float  # CacheBlend's recompute ratio
    blend_row_bucket: int  # recomputed-row capacities round up to this
    blend_token_bucket: int  # blended prompts pad to a multiple of this


_TODAY_GRID = (
    *((16, heads, head_dim, dtype) for heads in ((32, 8), (12, 4), (8, 1), (8, 8)) for head_dim in (64, 128)
      for dtype in ("float32", "bfloat16")),
    (32, (32, 8), 128, "float32"), (32, (32, 8), 128, "bfloat16"),
)

FULL = Sizes(
    budget_s=420.0,
    stage_budget_s=(("correctness", 100.0), ("bandwidth", 80.0), ("engine_speed", 150.0), ("blend_speed", 90.0)),
    interpret=False,
    grid=_TODAY_GRID,
    quantized_grid=((16, (32, 8), 128, "bfloat16"), (16, (9, 3), 64, "bfloat16")),
    pages_per_seq=8,
    bw_heads=(32, 8),
    bw_head_dim=128,
    bw_tokens_per_block=16,
    bw_batches=(1, 8, 64),
    bw_contexts=(1024, 4096, 16384, 32768),
    bw_max_tokens=2**20,  # 64 x 16k or 32 x 32k: 2 GB per K pool in bf16 (64 x 32k would overflow int32 offsets)
    bw_dtypes=("bfloat16", "int8", "fp8"),
    bw_calls=20,
    bw_sweep_point=(32, 4096),
    bw_sweep=((4, 1), (4, 2), (4, 4), (8, 2), (2, 4)),
    copy_elements=512 * 2**20,
    model_layers=None,
    model_vocab=None,
    attn_impl="auto",
    tokens_per_block=16,
    cache_tokens=65536,
    ttft_lengths=(1024, 4096),
    hit_fraction=0.9,
    repeats=3,
    decode_batches=(1, 8, 64),
    decode_prompt=512,
    decode_tokens=32,
    blend_prefix=32,
    blend_chunks=(512,) * 6,
    blend_suffix=32,
    blend_ratio=0.15,
    blend_row_bucket=16,
    blend_token_bucket=256,
)

DRY_RUN = Sizes(
    budget_s=240.0,
    stage_budget_s=(("correctness", 60.0), ("bandwidth", 60.0), ("engine_speed", 60.0), ("blend_speed", 60.0)),
    interpret=True,
    grid=((8, (8, 1), 16, "bfloat16"),),
    quantized_grid=((8, (4, 2), 16, "float32"),),
    pages_per_seq=4,
    bw_heads=(4, 2),
    bw_head_dim=16,
    bw_tokens_per_block=8,
    bw_batches=(2,),
    bw_contexts=(64,),
    bw_max_tokens=128,
    bw_dtypes=("bfloat16", "int8", "fp8"),
    bw_calls=2,
    bw_sweep_point=(2, 64),
    bw_sweep=((2, 2),),
    copy_elements=2**20,
    model_layers=4,  # CacheBlend checks layers 1-3
    model_vocab=1024,
    attn_impl="interpret",
    tokens_per_block=16,
    cache_tokens=4096,
    ttft_lengths=(64,),
    hit_fraction=0.5,
    repeats=1,
    decode_batches=(2,),
    decode_prompt=32,
    decode_tokens=3,
    blend_prefix=16,
    blend_chunks=(32, 32),
    blend_suffix=16,
    blend_ratio=0.15,
    blend_row_bucket=16,
    blend_token_bucket=64,
)
