"""Shape buckets of a step: padded lengths, row counts and block-table widths, so a run of
requests compiles a bounded set of programs."""

from __future__ import annotations


def pow2_bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    m = max(int(n), minimum, 1)
    return 1 << (m - 1).bit_length()


PREFILL_STEP = 256
"""Prefill chunks longer than this pad to a multiple of it rather than to a power of two, so a
cache hit of 30% on a 1k-token prompt computes 768 tokens, not 1024 (a few more compiled shapes)."""


def prefill_bucket(n: int) -> int:
    """Padded length of a prefill chunk of ``n`` tokens: 1 for one token (a prefix hit that
    leaves only the last token to compute runs the decode step's shape and its paged decode
    attention), else a power of two >= 16 up to PREFILL_STEP, then a multiple of PREFILL_STEP."""
    if n == 1:
        return 1
    return pow2_bucket(n, 16) if n <= PREFILL_STEP else -(-n // PREFILL_STEP) * PREFILL_STEP


PREFILL_BATCH_TOKENS = 1024
"""Padded tokens (rows x bucket) of one batched prefill forward at most: short chunks of one
bucket go together, up to 64 of 16 tokens, while a chunk of 1024 or more runs alone, so a
batch's activations and kept logits never exceed a long chunk's alone."""


MIN_TABLE_WIDTH = 4
"""Fewest pages in a step's block tables."""


def table_width(pages: int) -> int:
    """Pages in a step's block tables when its longest sequence needs ``pages``: at least
    MIN_TABLE_WIDTH, then four widths per doubling (5, 6, 7, 8, 10, 12, 14, 16, 20, ...), so
    attention gathers at most 25% of pages past the longest sequence's last one, where
    powers of two gathered up to 100% (a 161-token batch-8 decode step read 8 pages per
    sequence for 6 needed). Each width is one compiled shape per row bucket."""
    n = max(int(pages), MIN_TABLE_WIDTH)
    step = 1 << max(0, (n - 1).bit_length() - 3)  # 1 up to 8 pages, 2 up to 16, 4 up to 32, ...
    return -(-n // step) * step
