"""Internal cache scopes (chunk stores, blend scopes) are out of reach of user salts: their
roots hash under another domain tag, salt-keyed memos keep them apart, snapshots keep them."""

from __future__ import annotations

import json

from kvjax.manager import InternalScope, KeyExtras, KVCacheManager, root_key

P = list(range(100, 112))


def test_no_user_salt_gives_an_internal_root():
    for text in ("", "chunk:system", "blend:pos0:0123abcd", "kvjax-scope"):
        internal = InternalScope(text)
        assert root_key(internal, None) != root_key(text, None)
        assert root_key(internal, None) == root_key(InternalScope(text), None)
        assert internal != text and text != internal and internal == InternalScope(text)
        assert len({internal, text}) == 2


def test_user_salt_never_matches_internal_blocks(make, run):
    mgr = make(num_device_pages=16)
    scope = InternalScope("chunk:system")
    assert run(mgr, "user", P, extras=KeyExtras(cache_salt="chunk:system")) == 0  # memoizes the user salt's root first
    assert mgr.estimate_reusable_tokens(P, extras=KeyExtras(cache_salt=scope)) == 0
    assert run(mgr, "internal", P, extras=KeyExtras(cache_salt=scope)) == 0
    assert mgr.estimate_reusable_tokens(P, extras=KeyExtras(cache_salt=scope)) == 11
    assert not set(mgr.prompt_block_keys(P, extras=KeyExtras(cache_salt=scope))) & set(
        mgr.prompt_block_keys(P, extras=KeyExtras(cache_salt="chunk:system"))
    )


def test_live_internal_scope_survives_a_snapshot(make, clock):
    mgr = make(num_device_pages=16)
    scope = InternalScope("blend:x")
    mgr.add_request("live", P[:3], KeyExtras(cache_salt=scope))  # no full block yet: the next one chains from the root
    mgr.allocate("live", 3)
    mgr.commit_tokens("live", P[:3])
    state = json.loads(json.dumps(mgr.state_dict()))
    restored = KVCacheManager.from_state_dict(state, mgr.config, mgr.layout, clock=clock)
    for m in (mgr, restored):
        m.allocate("live", 8)
        m.commit_tokens("live", P[3:8])
        m.free_request("live")
        assert m.estimate_reusable_tokens(P, extras=KeyExtras(cache_salt=scope)) == 8
        assert m.estimate_reusable_tokens(P, extras=KeyExtras(cache_salt="blend:x")) == 0
    assert restored.state_dict() == mgr.state_dict()
