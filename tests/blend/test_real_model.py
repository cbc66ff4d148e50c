"""CacheBlend identities on the real SmolLM2-135M with 256-token chunks (float32), every policy
an engine request."""

from __future__ import annotations

import numpy as np
import pytest

from experiments.blender import FULL_RECOMPUTE, Blender
from experiments.policies import SELECTOR_POLICIES
from kvjax.blend.chunk_store import ChunkStore
from kvjax.blend.prompt import BlendPrompt
from kvjax.blend.selection import SelectionConfig, target_count
from kvjax.config import KvCacheConfig, SchedulerConfig
from kvjax.engine import Engine

pytestmark = pytest.mark.real_model
RTOL = 1e-5
NONE = SelectionConfig(selector="none")


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def make_blender(model, prefix: tuple[int, ...], variant: str, chunks, tokens_per_block: int = 32) -> Blender:
    engine = Engine(
        model,
        KvCacheConfig(tokens_per_block=tokens_per_block, max_tokens=8192),
        SchedulerConfig(prefill_chunk_size=2048),
        max_seq_len=1024,
    )
    store = ChunkStore(engine, variant=variant, prefix_tokens=prefix)
    for chunk in chunks:
        store.put(chunk)
    return Blender(store, token_bucket=256)


@pytest.fixture(scope="module")
def setup(smollm2, rag_example):
    ex = rag_example(seed=3, chunk_tokens=256)
    prompt = BlendPrompt(ex.prefix, ex.chunks, ex.suffix)
    blender = make_blender(smollm2, ex.prefix, "system", prompt.chunks)
    full = blender.run(prompt, FULL_RECOMPUTE).logits[0]
    return smollm2, prompt, blender, full


def test_ratio_one_reproduces_full_recompute(setup):
    _, prompt, blender, full = setup
    assert rel_err(blender.run(prompt, SelectionConfig(recompute_ratio=1.0)).logits[-1], full) <= RTOL


def test_ratio_zero_equals_full_kv_reuse(setup):
    _, prompt, blender, full = setup
    reuse = blender.run(prompt, NONE).logits[-1]
    assert rel_err(blender.run(prompt, SelectionConfig(recompute_ratio=0.0)).logits[-1], reuse) <= RTOL
    assert rel_err(reuse, full) > 1e-3


def test_single_chunk_at_position_zero_is_exact(smollm2, rag_example):
    ex = rag_example(seed=4, chunk_tokens=256, task="single_chunk")
    prompt = BlendPrompt((), ex.chunks[:1], ex.suffix)
    blender = make_blender(smollm2, (), "pos0", prompt.chunks)
    full = blender.run(prompt, FULL_RECOMPUTE).logits[0]
    assert rel_err(blender.run(prompt, NONE).logits[-1], full) <= RTOL


def test_repositioned_layer0_keys_equal_full_recompute(setup):
    _, prompt, blender, _ = setup
    exact = blender.run(prompt, SelectionConfig(selector="all"), num_probes=1).trace
    reused = blender.run(prompt, NONE, num_probes=1).trace
    s, e = prompt.roles.chunk_spans[1][0], prompt.roles.suffix_start
    np.testing.assert_allclose(np.asarray(reused["k"][0, s:e]), np.asarray(exact["k"][0, s:e]), rtol=1e-4, atol=1e-4)


def test_cacheblend_single_recomputes_the_top_key_difference_at_layer_1(setup):
    _, prompt, blender, _ = setup
    n = prompt.roles.num_tokens
    exact = blender.run(prompt, SelectionConfig(selector="all"), num_probes=1).trace
    reused = blender.run(prompt, NONE, num_probes=1).trace
    k_dev = np.square(np.asarray(exact["k"][1, :n]) - np.asarray(reused["k"][1, :n])).sum(axis=(-2, -1))
    run = blender.run(prompt, SelectionConfig(selector="cacheblend_single", recompute_ratio=0.15), num_probes=1)
    rec = np.asarray(run.trace["recomputed"])[:, :n]
    selectable, _ = prompt.roles.masks(n)
    ids = np.flatnonzero(selectable)
    top = np.sort(ids[np.argsort(-k_dev[ids])[: target_count(prompt.roles, 0.15)]])
    np.testing.assert_array_equal(np.flatnonzero(rec[-1] & selectable), top)
    assert (rec[2:] == rec[2]).all()


def test_query_aware_fused_at_ratio_one_reproduces_full_recompute(setup):
    _, prompt, blender, full = setup
    config = SelectionConfig(selector="query_aware_fused", recompute_ratio=1.0, budgets=(1.0, 1.0, 1.0))
    assert rel_err(blender.run(prompt, config).logits[-1], full) <= RTOL


def test_an_extension_continues_the_runs_fused_kv(smollm2, rag_example):
    """Teacher forcing through an ordinary request on a run's committed blocks gives the logits
    of feeding the tokens inside the blended request itself, and the same greedy tokens."""
    from experiments.blender import Extension

    ex = rag_example(seed=5, chunk_tokens=200)
    prompt = BlendPrompt(ex.prefix, ex.chunks, ex.suffix)
    blender = make_blender(smollm2, ex.prefix, "system", prompt.chunks, tokens_per_block=16)
    assert prompt.roles.num_tokens >= 512
    policy = SelectionConfig(selector="cacheblend", recompute_ratio=0.15)
    feed = tuple(smollm2.tokenizer.encode(" the answer is seven", add_bos=False))
    inside = blender.run(prompt, policy, feed=feed, max_new_tokens=4)
    run = blender.run(prompt, policy)
    forced, greedy = blender.extend(
        [Extension(run, feed, prompt_logits=len(feed) + 1), Extension(run, feed, max_new_tokens=4)]
    )
    assert forced.num_reused_tokens >= prompt.roles.suffix_start
    assert rel_err(forced.prompt_logits, inside.logits[: len(feed) + 1]) <= 1e-4
    assert greedy.output == inside.tokens
    blender.engine.manager.clear_cache()  # the run's blocks are gone: continuing it would recompute its chunks exactly
    with pytest.raises(RuntimeError, match="reused 0 tokens of its run's KV"):
        blender.extend([Extension(run, feed)])


def test_a_prompt_of_whole_pages_is_continued_after_its_last_token(smollm2, rag_example):
    """When the prompt fills its last page, the run's blocks serve every prompt token: the
    extension computes only the fed rows, and the logits after the prompt are the run's own."""
    from experiments.blender import Extension

    ex = rag_example(seed=6, chunk_tokens=200)
    n = len(ex.prefix) + sum(map(len, ex.chunks)) + len(ex.suffix)
    prompt = BlendPrompt(ex.prefix, ex.chunks, ex.suffix[: len(ex.suffix) - n % 16])
    assert prompt.roles.num_tokens % 16 == 0 and prompt.roles.num_tokens >= 512 and len(prompt.suffix) >= 16
    blender = make_blender(smollm2, ex.prefix, "system", prompt.chunks, tokens_per_block=16)
    policy = SelectionConfig(selector="epic", recompute_ratio=0.15)
    feed = tuple(smollm2.tokenizer.encode(" so the key is", add_bos=False))
    inside = blender.run(prompt, policy, feed=feed)
    run = blender.run(prompt, policy, fill_last_page=True)
    assert len(run.tokens) == 1  # nothing to fill
    [forced] = blender.extend([Extension(run, feed, prompt_logits=len(feed) + 1)])
    assert forced.num_reused_tokens == prompt.roles.num_tokens and len(forced.prompt_logits) == len(feed) + 1
    assert rel_err(forced.prompt_logits, inside.logits[: len(feed) + 1]) <= 1e-4


@pytest.mark.parametrize("suffix_tokens", [1, 3])
def test_a_suffix_shorter_than_the_last_partial_page_is_continued_over_the_run_kv(smollm2, suffix_tokens, rag_example):
    """Chunk tokens in the prompt's last partial page: the run decodes until that page is
    committed, and the extension takes every chunk token from it by partial reuse, so teacher
    forcing and the greedy answer equal feeding the tokens inside the blended request."""
    from experiments.blender import Extension

    ex = rag_example(seed=7, chunk_tokens=200)
    trim = (len(ex.prefix) + sum(map(len, ex.chunks)) - 8) % 16  # the chunks end 8 tokens into a page
    prompt = BlendPrompt(
        ex.prefix, (*ex.chunks[:-1], ex.chunks[-1][: len(ex.chunks[-1]) - trim]), ex.suffix[-suffix_tokens:]
    )
    n, ps = prompt.roles.num_tokens, 16
    assert n >= 512 and n // ps * ps < prompt.roles.suffix_start  # the last chunk ends inside the partial page
    blender = make_blender(smollm2, ex.prefix, "system", prompt.chunks, tokens_per_block=ps)
    policy = SelectionConfig(selector="cacheblend", recompute_ratio=0.15)
    feed = tuple(smollm2.tokenizer.encode(" and so the answer is", add_bos=False))
    inside = blender.run(prompt, policy, feed=feed, max_new_tokens=4)
    run = blender.run(prompt, policy, fill_last_page=True)
    assert len(run.tokens) == blender.fill_tokens(prompt) == -n % ps + 1
    forced, greedy, answer = blender.extend(
        [
            Extension(run, feed, prompt_logits=len(feed) + 1),
            Extension(run, feed, max_new_tokens=4),
            Extension(run, (), max_new_tokens=4),
        ]
    )
    assert min(o.num_reused_tokens for o in (forced, greedy, answer)) >= prompt.roles.suffix_start
    assert len(forced.prompt_logits) == len(feed) + 1
    assert rel_err(forced.prompt_logits, inside.logits[: len(feed) + 1]) <= 1e-4
    assert greedy.output == inside.tokens and answer.output == run.tokens[:4]
    with pytest.raises(ValueError, match=r"prompt_logits=3 must be in \[0, len\(feed\) \+ 1 = 2\]"):
        blender.extend([Extension(run, feed[:1], prompt_logits=3)])


def test_extensions_sharing_fed_tokens_get_every_logit_from_whoever_computed_it(smollm2, rag_example):
    """Two extensions of one run whose fed tokens start alike: the second is deferred until
    the first has committed the page they share (prefix-aware scheduling) and reuses it past
    the prompt; its logits there come from the first, and equal feeding inside the run."""
    from experiments.blender import Extension

    ex = rag_example(seed=8, chunk_tokens=200)
    n = len(ex.prefix) + sum(map(len, ex.chunks)) + len(ex.suffix)
    # n = 15 (mod 16): one fed token fills the page
    prompt = BlendPrompt(ex.prefix, ex.chunks, ex.suffix[(n + 1) % 16 :])
    assert prompt.roles.num_tokens % 16 == 15 and prompt.roles.num_tokens >= 512 and len(prompt.suffix) >= 16
    blender = make_blender(smollm2, ex.prefix, "system", prompt.chunks, tokens_per_block=16)
    policy = SelectionConfig(selector="cacheblend", recompute_ratio=0.15)
    first = tuple(smollm2.tokenizer.encode(" the key is seven", add_bos=False))
    second = (first[0], *smollm2.tokenizer.encode(" value was nine", add_bos=False))
    run = blender.run(prompt, policy)
    a, b = blender.extend(
        [Extension(run, first, prompt_logits=len(first) + 1), Extension(run, second, prompt_logits=len(second) + 1)]
    )
    assert b.num_reused_tokens > prompt.roles.num_tokens  # it reused the page the first extension committed
    for feed, out in ((first, a), (second, b)):
        inside = blender.run(prompt, policy, feed=feed)
        assert (
            len(out.prompt_logits) == len(feed) + 1
            and rel_err(out.prompt_logits, inside.logits[: len(feed) + 1]) <= 1e-4
        )


def test_extensions_of_runs_of_other_policies_never_take_each_others_logits(smollm2, rag_example):
    # The runs of full reuse and CacheBlend share the prompt's tokens but not its KV. Each
    # decodes one token into its last page (n = 15 mod 16); an answer starting with that token,
    # teacher-forced behind each run in one extend, reuses the run's page past the prompt and
    # must take that position's logits from its own run, equal to feeding it inside the run.
    from experiments.blender import Extension

    ex = rag_example(seed=8, chunk_tokens=200)
    n = len(ex.prefix) + sum(map(len, ex.chunks)) + len(ex.suffix)
    prompt = BlendPrompt(ex.prefix, ex.chunks, ex.suffix[(n + 1) % 16 :])
    assert prompt.roles.num_tokens % 16 == 15 and prompt.roles.num_tokens >= 512
    blender = make_blender(smollm2, ex.prefix, "system", prompt.chunks, tokens_per_block=16)
    policies = (NONE, SelectionConfig(selector="cacheblend", recompute_ratio=0.15))
    runs = [blender.run(prompt, policy, max_new_tokens=2) for policy in policies]
    assert runs[0].tokens[0] == runs[1].tokens[0]
    answer = (runs[0].tokens[0], *smollm2.tokenizer.encode(" the key is seven", add_bos=False))
    outs = blender.extend([Extension(run, answer[:-1], prompt_logits=len(answer)) for run in runs])
    # each reused its run's page past the prompt
    assert all(out.num_reused_tokens > prompt.roles.num_tokens for out in outs)
    for policy, out in zip(policies, outs):
        inside = blender.run(prompt, policy, feed=answer[:-1])
        assert rel_err(out.prompt_logits, inside.logits[: len(answer)]) <= 1e-4, policy.selector


def test_variants_run_together_equal_each_alone(setup):
    # Every selector at three ratios, the variants of one ratio submitted together: their
    # blended prefills share steps (each layer's reused KV read once, the rows of a capacity
    # through each layer as one batch) and each equals its run alone, logits and rows.
    model, prompt, blender, _ = setup
    rng = np.random.default_rng(0)
    scores = rng.random((model.config.num_layers, prompt.roles.num_tokens))
    weights = tuple(rng.normal(size=8 * 7 + 1).tolist())
    selectors = SELECTOR_POLICIES
    engine = blender.engine
    for ratio in (0.05, 0.15, 0.5):
        policies = [
            SelectionConfig(
                selector=name, recompute_ratio=ratio, row_bucket=16, scorer=weights if name == "learned" else ()
            )
            for name in selectors
        ]
        steps = engine.timings["blend_steps"]
        together = blender.run_together(prompt, policies, scores=scores)
        assert engine.timings["blend_steps"] - steps < len(policies)
        for policy, run in zip(policies, together):
            alone = blender.run(prompt, policy, scores=scores)
            np.testing.assert_array_equal(
                run.report.recomputed, alone.report.recomputed, err_msg=f"{policy.selector}@{ratio}"
            )
            assert rel_err(run.logits, alone.logits) <= RTOL, f"{policy.selector}@{ratio}"
