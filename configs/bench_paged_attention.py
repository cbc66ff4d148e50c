"""Paged vs contiguous decode attention on the backend at hand.

Measures one layer's decode attention over a paged pool (``kvjax.attention.paged_attention``,
kernel or XLA reference by backend) against the same keys laid out contiguously, as
tokens/s and achieved bytes/s next to the device's measured copy bandwidth.

Run:
  python -m experiments.run --config=configs/bench_paged_attention.py --workdir=/tmp/bench_paged
  python -m experiments.run --config=configs/bench_paged_attention.py:tiny  # smoke run (a second)
On a GPU, the issue's operating point:
  python -m experiments.run --config=configs/bench_paged_attention.py --workdir=/tmp/bench_paged \
      --config.num_seqs=32 --config.context_lens='(1024, 4096)' --config.dtype=bfloat16
"""

from __future__ import annotations

import ml_collections


def get_config(preset: str = "") -> ml_collections.ConfigDict:
    """Defaults sized for a 2-core CPU (a few seconds).

    Args:
      preset: "" (defaults) or "tiny": 2 sequences of 32 and 64 tokens, 4/2 heads of 16, for smoke tests.
    """
    config = ml_collections.ConfigDict()
    config.experiment = "bench_paged_attention"  # experiments/run.py dispatches on this name.
    config.impl = "auto"  # kvjax.attention impl of the paged path: "auto", "reference" or "interpret".
    config.dtype = "float32"  # Query and KV dtype: "float32" or "bfloat16".
    config.num_seqs = 8  # Sequences decoded together (the batch).
    config.context_lens = (256, 1024)  # Tokens already in each sequence's cache; one run per entry.
    config.num_heads = 8  # Query heads.
    config.num_kv_heads = 2  # KV heads (GQA group = num_heads // num_kv_heads).
    config.head_dim = 64  # Per-head width.
    config.tokens_per_block = 16  # Tokens per page.
    config.warmup = 2  # Untimed calls per measurement (compilation included).
    config.iters = 10  # Timed calls per measurement; the median is reported.
    config.seed = 0  # Seed of the random pool, queries and page permutation.
    if preset == "tiny":
        config.update(num_seqs=2, context_lens=(32, 64), num_heads=4, num_kv_heads=2, head_dim=16, tokens_per_block=8,
                      warmup=1, iters=2)
    elif preset:
        raise ValueError(f"unknown preset {preset!r}; allowed: '' (default) or 'tiny'")
    return config
