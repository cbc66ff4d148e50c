"""Block sizes for the paged-attention kernels, keyed by (backend, op).

Starting points for memory-bound decode, not yet swept on hardware: KV blocks of 512
tokens per loop step on TPU (few, large DMAs) and 64 on GPU (a [16, 64] logits tile stays in
registers). ``experiments/device_check.sh`` times the GPU decode entry on a lent device.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Static kernel tiling.

    Attributes:
      block_tokens: KV slots per loop step; ``pages_per_block = block_tokens // tokens_per_block``.
      block_q: queries per grid step (partial attention only).
      min_programs: GPU decode splits each sequence's pages into k-splits until
        ``num_seqs * num_kv_heads * k_splits`` reaches this (fills the SMs at small batch).
      num_warps, num_stages: Triton launch parameters (GPU only).
    """

    block_tokens: int
    block_q: int = 8
    min_programs: int = 0
    num_warps: int = 4
    num_stages: int = 2

    def pages_per_block(self, tokens_per_block: int) -> int:
        """Pages per loop step for ``tokens_per_block`` (at least one)."""
        if tokens_per_block < 1:
            raise ValueError(f"{tokens_per_block=} must be >= 1")
        return max(1, self.block_tokens // tokens_per_block)


TUNED_BLOCK_SIZES: dict[tuple[str, str], BlockSizes] = {
    ("tpu", "decode"): BlockSizes(block_tokens=512),
    ("tpu", "partial"): BlockSizes(block_tokens=256, block_q=8),
    # 528 = 4 programs per SM on a 132-SM H100/H200.
    ("gpu", "decode"): BlockSizes(block_tokens=64, min_programs=528, num_warps=4, num_stages=2),
    ("gpu", "partial"): BlockSizes(block_tokens=64, block_q=16, num_warps=4, num_stages=2),
}


def block_sizes(backend: str, op: str) -> BlockSizes:
    """The table entry for ``backend`` ("tpu" or "gpu") and ``op`` ("decode" or "partial")."""
    if (backend, op) not in TUNED_BLOCK_SIZES:
        raise ValueError(f"({backend=}, {op=}) must be one of {tuple(TUNED_BLOCK_SIZES)}")
    return TUNED_BLOCK_SIZES[backend, op]
