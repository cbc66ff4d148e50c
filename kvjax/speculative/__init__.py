"""Speculative decoding with KV reuse: drafters and on-device verification.

The engine (``Engine(..., speculative=SpeculativeConfig(...))``) gives each decoding sequence
up to k draft slots in its own pages (free pages only, never an evicted cached block),
asks the drafter for drafts, verifies them in one multi-token forward, commits the accepted
tokens and rolls the rest back, so only verified tokens ever fill a block of the radix tree.
"""

from kvjax.speculative.drafters import Drafter, DraftRow, Drafts, EarlyExitDrafter, NgramDrafter, make_drafter
from kvjax.speculative.verify import verify

__all__ = ["DraftRow", "Drafter", "Drafts", "EarlyExitDrafter", "NgramDrafter", "make_drafter", "verify"]
