#!/usr/bin/env bash
# GPU check of the Pallas Triton kernels, in one call on a lent GPU machine:
#   1. correctness grid: pallas_kernels/{paged,partial}_attention/gpu.py compiled for the
#      GPU against the XLA references (NaN-poisoned pools, permuted tables; f32 1e-5, bf16 1e-2);
#   2. timings: decode at batch 32, 4k context, bf16 (32 query / 8 KV heads, head_dim 128,
#      tokens_per_block 16) for a few (pages_per_block, k_splits), the XLA reference and contiguous
#      attention, as achieved HBM bytes/s against the measured device-to-device copy bandwidth.
# Writes $OUT/device_check.md and $OUT/device_check.json (OUT defaults to ./device_check_out).
# Run from anywhere:  bash experiments/device_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/device_check_out}"
mkdir -p "$OUT"
export OUT
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false

python - <<'EOF'
import itertools
import json
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench_paged_attention import contiguous_decode
from kvjax.testing.paged_inputs import TOLERANCE, make_inputs
from pallas_kernels.paged_attention import gpu as paged_gpu
from pallas_kernels.paged_attention.reference import paged_attention_ref
from pallas_kernels.partial_attention import gpu as partial_gpu
from pallas_kernels.partial_attention.reference import partial_attention_ref

out_dir = pathlib.Path(os.environ["OUT"])
device = jax.devices()[0]
if device.platform != "gpu":
    raise SystemExit(f"device_check.sh needs a GPU; jax sees {device.platform} ({device.device_kind})")


def max_rel_error(actual, expected):
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    if np.isnan(actual).any():
        return float("nan")
    return float(np.max(np.abs(actual - expected) / (np.abs(expected) + 1.0)))


checks = []
grid = [*itertools.product([16], [(32, 8), (12, 4), (8, 1), (8, 8)], [64, 128], ["float32", "bfloat16"]),
        *itertools.product([32], [(32, 8)], [128], ["float32", "bfloat16"])]
for tokens_per_block, (num_heads, num_kv_heads), head_dim, dtype in grid:
    for window, cap, num_queries in [(None, None, 1), (100, 30.0, 1), (None, None, 48), (70, None, 48)]:
        inputs = make_inputs(
            tokens_per_block + head_dim, lengths=[1, tokens_per_block, tokens_per_block + 1, 8 * tokens_per_block, 0, 5 * tokens_per_block - 3],
            num_heads=num_heads, num_kv_heads=num_kv_heads, tokens_per_block=tokens_per_block, pages_per_seq=8,
            head_dim=head_dim, dtype=jnp.dtype(dtype), num_queries=num_queries, chunked=num_queries > 1,
            sliding_window=window,
        )
        options = dict(sm_scale=head_dim**-0.5, sliding_window=window, logit_soft_cap=cap)
        clean = (inputs.clean_k_pages, inputs.clean_v_pages, inputs.lengths, inputs.page_indices)
        poisoned = (inputs.k_pages, inputs.v_pages, inputs.lengths, inputs.page_indices)
        if num_queries == 1:
            op, q = "decode", inputs.q[:, 0]
            actual, expected = paged_gpu.paged_attention(q, *poisoned, **options), paged_attention_ref(q, *clean, **options)
        else:
            op, args = "partial", (inputs.q, inputs.q_positions)
            actual = partial_gpu.partial_attention(*args, *poisoned, **options)
            expected = partial_attention_ref(*args, *clean, **options)
        error = max_rel_error(actual, expected)
        checks.append(dict(op=op, tokens_per_block=tokens_per_block, heads=f"{num_heads}/{num_kv_heads}", head_dim=head_dim,
                           dtype=dtype, window=window, soft_cap=cap, error=error, ok=error <= TOLERANCE[dtype]))


def per_call_seconds(fn, calls=50):
    jax.block_until_ready(fn())
    jax.block_until_ready(fn())
    start = time.perf_counter()
    for _ in range(calls):
        result = fn()
    jax.block_until_ready(result)
    return (time.perf_counter() - start) / calls


num_seqs, context, num_heads, num_kv_heads, head_dim, tokens_per_block = 32, 4096, 32, 8, 128, 16
rng = np.random.default_rng(0)
pages_per_seq = context // tokens_per_block
num_pages = 1 + num_seqs * pages_per_seq
k_pages = jnp.asarray(rng.standard_normal((num_pages, tokens_per_block, num_kv_heads, head_dim)), jnp.bfloat16)
v_pages = jnp.asarray(rng.standard_normal((num_pages, tokens_per_block, num_kv_heads, head_dim)), jnp.bfloat16)
table = jnp.asarray(rng.permutation(np.arange(1, num_pages)).reshape(num_seqs, pages_per_seq), jnp.int32)
lengths = jnp.full((num_seqs,), context, jnp.int32)
q = jnp.asarray(rng.standard_normal((num_seqs, num_heads, head_dim)), jnp.bfloat16)
k_contig = k_pages[1:].reshape(num_seqs, context, num_kv_heads, head_dim)
v_contig = v_pages[1:].reshape(num_seqs, context, num_kv_heads, head_dim)
kv_bytes = 2 * num_seqs * context * num_kv_heads * head_dim * 2
sm_scale = head_dim**-0.5

copy = jax.jit(lambda x: x + jnp.ones((), x.dtype))
copy_bandwidth = 2 * k_pages.size * 2 / per_call_seconds(lambda: copy(k_pages))
timings = []
for pages_per_block, k_splits in [(None, None), (4, 1), (4, 2), (4, 4), (8, 2), (2, 4)]:
    fn = jax.jit(lambda q, kp, vp, n, t, P=pages_per_block, K=k_splits: paged_gpu.paged_attention(
        q, kp, vp, n, t, sm_scale=sm_scale, pages_per_block=P, k_splits=K))
    seconds = per_call_seconds(lambda: fn(q, k_pages, v_pages, lengths, table))
    timings.append((f"pallas triton P={pages_per_block or 'tuned'} k_splits={k_splits or 'tuned'}", seconds))
reference = jax.jit(lambda q, kp, vp, n, t: paged_attention_ref(q, kp, vp, n, t, sm_scale=sm_scale))
timings.append(("xla reference (gather)", per_call_seconds(lambda: reference(q, k_pages, v_pages, lengths, table))))
contiguous = jax.jit(lambda q, k, v, n: contiguous_decode(q, k, v, n, sm_scale))
timings.append(("xla contiguous", per_call_seconds(lambda: contiguous(q, k_contig, v_contig, lengths))))

lines = [f"# device_check on {device.device_kind}, jax {jax.__version__}", "",
         f"Correctness: {sum(c['ok'] for c in checks)}/{len(checks)} within tolerance", "",
         "| op | tokens_per_block | heads | head_dim | dtype | window | soft_cap | max rel err | ok |",
         "|---|---:|---|---:|---|---:|---:|---:|---|"]
lines += [f"| {c['op']} | {c['tokens_per_block']} | {c['heads']} | {c['head_dim']} | {c['dtype']} | {c['window']} "
          f"| {c['soft_cap']} | {c['error']:.2e} | {'yes' if c['ok'] else 'NO'} |" for c in checks]
lines += ["", f"Decode, batch {num_seqs}, context {context}, bf16, heads {num_heads}/{num_kv_heads}, "
          f"head_dim {head_dim}, tokens_per_block {tokens_per_block}; KV bytes {kv_bytes / 1e6:.0f} MB; "
          f"device-to-device copy {copy_bandwidth / 1e9:.0f} GB/s", "",
          "| kernel | us | tokens/s | GB/s | of copy BW |", "|---|---:|---:|---:|---:|"]
lines += [f"| {name} | {s * 1e6:.1f} | {num_seqs / s:.0f} | {kv_bytes / s / 1e9:.0f} | {kv_bytes / s / copy_bandwidth:.2f} |"
          for name, s in timings]
(out_dir / "device_check.md").write_text("\n".join(lines) + "\n")
(out_dir / "device_check.json").write_text(json.dumps(
    dict(device=device.device_kind, checks=checks, copy_bytes_per_s=copy_bandwidth, kv_bytes=kv_bytes,
         timings=[dict(name=name, seconds=s, fraction_of_copy=kv_bytes / s / copy_bandwidth) for name, s in timings]),
    indent=2))
print("\n".join(lines))
EOF
