"""The fast paths agree with the plain definitions: chained prompt keys, the prompt memo,
commits that skip re-validating prompt ids, and the first-token child index."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.manager import KeyExtras, MultimodalItem
from kvjax.manager.hashing import block_key, chain_keys, hash_items, items_in, pack_ids, root_key


def test_chain_keys_equal_block_keys_with_items_at_prompt_offsets():
    prompt = tuple(range(100, 118))
    items = hash_items([MultimodalItem("image", b"cat", offset=5, length=6)], len(prompt))
    root = root_key("tenant", None)
    keys = chain_keys(root, pack_ids(prompt), 4, items)
    parent, expected = root, []
    for b in range(len(prompt) // 4):
        parent = block_key(parent, prompt[b * 4 : (b + 1) * 4], items_in(items, b * 4, (b + 1) * 4))
        expected.append(parent)
    assert keys == expected and len(keys) == 4
    assert keys[1] != chain_keys(keys[0], pack_ids(prompt[4:8]), 4)[0]  # the item is in block 1


def test_generated_block_keeps_an_item_at_the_prompt_end(make, run):
    """Block 2 (tokens 8..11) holds the end of an image and a generated token: two requests
    with different images there must not share it."""
    keys = []
    for i, content in enumerate((b"cat", b"dog")):
        mgr = make(num_device_pages=16)
        prompt = list(range(1, 12))
        mm = [MultimodalItem("image", content, offset=7, length=4)]
        mgr.add_request(f"r{i}", prompt, extras=KeyExtras(mm_items=mm))
        mgr.allocate(f"r{i}", 12)
        mgr.commit_tokens(f"r{i}", prompt)
        mgr.commit_tokens(f"r{i}", [99])
        keys.append(mgr._sequences[f"r{i}"].keys[2])
        mgr.check_consistency()
    assert keys[0] != keys[1]


def test_memo_and_commit_accept_the_same_ids_in_any_container(make):
    mgr = make(num_device_pages=16)
    prompt = tuple(range(1, 10))
    first = mgr.prompt_block_keys(prompt)
    assert mgr.prompt_block_keys(list(prompt)) == first == mgr.prompt_block_keys(np.array(prompt))
    mgr.add_request("a", prompt)
    mgr.allocate("a", 12)
    mgr.commit_tokens("a", np.array(prompt[:5]))
    mgr.commit_tokens("a", list(prompt[5:]) + [np.int64(7)])
    assert mgr.num_tokens("a") == 10 and all(type(t) is int for t in mgr._sequences["a"].tokens)
    with pytest.raises(ValueError, match=r"token_ids\[1\]=-3 must be an int token id"):
        mgr.commit_tokens("a", [5, -3])
    with pytest.raises(ValueError, match=r"prompt_token_ids\[0\]=True must be an int token id"):
        mgr.add_request("b", (True, 2, 3))
    mgr.check_consistency()


def test_partial_reuse_finds_the_sibling_sharing_the_first_tokens(make, run):
    mgr = make(num_device_pages=32)
    base = [1, 2, 3, 4]
    for i, tail in enumerate(([9, 8, 7, 6], [5, 6, 7, 8], [5, 6, 0, 0], [6, 6, 6, 6])):
        run(mgr, f"w{i}", base + tail)
    assert run(mgr, "q", base + [5, 6, 7, 1, 1]) == 7  # 4 + the 3 leading tokens of [5, 6, 7, 8]
