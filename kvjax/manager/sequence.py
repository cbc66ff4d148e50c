"""``SequenceRecord``: the host manager's record of one request, and the checks on what a
request commits.

Token regions of one sequence (a page holds ``tokens_per_block`` tokens)::

    |<------------- committed (KV written) ------------->|<-- allocated, not committed -->|
    |<- full blocks: keyed, in the tree ->|<- private ->|   (chunk being computed, drafts)
    0                                     k*tokens_per_block    n                               num_allocated
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kvjax.config import KvCacheRetentionConfig
from kvjax.manager.hashing import BlockKey, HashedItem, chain_keys, check_token_ids, pack_ids
from kvjax.manager.radix_tree import Block
from kvjax.manager.stats import RequestStats


@dataclasses.dataclass(slots=True)
class SequenceRecord:
    """Host state of one request in ``KVCacheManager``.

    Attributes:
      prompt: prompt token ids.
      root: the request's root key (its cache salt and LoRA id).
      prompt_keys: keys of the full prompt blocks (computed once at add_request).
      tokens: committed token ids (prompt prefix, then generated), KV written.
      num_allocated: tokens with a cache slot (committed + in flight, e.g. drafts).
      keys: keys of the committed full blocks, in order.
      blocks: per layer group, one entry per block index; None = released or never held.
      first_held: per layer group, blocks below this index are released (outside the window).
    """

    request_id: str
    prompt: tuple[int, ...]
    retention: KvCacheRetentionConfig
    cache_salt: str | None
    lora_id: int | None
    items: tuple[HashedItem, ...]
    root: BlockKey
    prompt_keys: list[BlockKey]
    tokens: list[int]
    num_allocated: int
    keys: list[BlockKey]
    blocks: list[list[Block | None]]
    first_held: list[int]
    stats: RequestStats


def prompt_keys(
    prompt: tuple[int, ...], items: tuple[HashedItem, ...], root: BlockKey, tokens_per_block: int, reuse: bool
) -> list[BlockKey]:
    """Keys of the prompt's full blocks under ``root`` (empty when ``reuse`` is off)."""
    if not reuse:
        return []
    return chain_keys(root, pack_ids(prompt), tokens_per_block, items)


def committed_ids(seq: SequenceRecord, token_ids: Sequence[int]) -> tuple[int, ...]:
    """The ids of a commit to ``seq`` as a tuple of ints, validated.

    Ids that repeat the prompt at the sequence's position are the prompt's own (validated by
    ``add_request``), so only the generated part is checked here; anything else goes through
    full validation, which names the first bad id.
    """
    ids = token_ids if type(token_ids) is tuple else tuple(
        token_ids.tolist() if hasattr(token_ids, "tolist") else token_ids
    )
    n0 = len(seq.tokens)
    head = seq.prompt[n0 : n0 + len(ids)]
    if ids[: len(head)] == head:
        if len(ids) == len(head):
            return head
        try:
            return head + check_token_ids(ids[len(head) :], "token_ids")
        except ValueError:
            pass
    return check_token_ids(ids, "token_ids")
