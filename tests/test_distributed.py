"""Sharded runs on 8 simulated CPU devices equal one-device runs.

The rest of the suite initializes JAX with one CPU device, and the device count is fixed
when JAX starts, so each check here runs in a fresh ``python -c`` subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``. The subprocess runs the same
computation unsharded (device 0) and over a mesh, and prints the relative errors, the
collectives of the compiled sharded prefill and the pool shardings as JSON.

Cases (8 devices; mesh = pages x kv from ``kvjax.distributed.make_mesh``):
  mha8   8 KV heads            -> pages 1 x kv 8 (attention collective-free)
  gqa4   4 KV heads of 8 heads -> pages 2 x kv 4
  gqa3   3 KV heads (SmolLM2's) -> pages 8 x kv 1 (KV heads do not divide 8), windowed layers
  mqa1   1 KV head (Gemma 3's) -> pages 8 x kv 1, windowed layers
  gqa3_on3  3 KV heads on 3 of the 8 devices -> pages 1 x kv 3
The sharded runs use ``sharded_forward``'s default attention (on CPU the XLA reference, per
device under ``shard_map``); ``kernel_gqa4`` runs the Pallas GPU kernel (interpret mode)
under ``shard_map`` on the pages 2 x kv 4 mesh.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # an end-to-end run or subprocesses: the full suite, not the fast loop

RTOL = 1e-5
TINY_CASES = {
    "mha8": dict(num_heads=8, num_kv_heads=8),
    "gqa4": dict(num_heads=8, num_kv_heads=4),
    "gqa3": dict(num_heads=6, num_kv_heads=3, num_layers=3, sliding_window=24, global_layer_period=3),
    "mqa1": dict(num_heads=4, num_kv_heads=1, num_layers=3, sliding_window=24, global_layer_period=3),
    "gqa3_on3": dict(num_heads=6, num_kv_heads=3),
}
EXPECTED_MESH = {"mha8": (1, 8), "gqa4": (2, 4), "gqa3": (8, 1), "mqa1": (8, 1), "gqa3_on3": (1, 3)}
# one layer group each (Gemma's windows are covered in tests/blend/test_gemma_blend.py)
BLEND_CASES = ("mha8", "gqa3_on3")
KERNEL_CASES = ("gqa4",)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _run_steps(step, tokens: np.ndarray, prefill: int, table: np.ndarray) -> list[np.ndarray]:
    """Prefills tokens[:prefill] in one chunk, then decodes the rest one by one; logits per step.

    ``step(tokens [1, T], positions [1, T], table [1, pages_per_seq], lengths [1], logits_mode)``.
    """
    import jax.numpy as jnp

    out = []
    spans = [(0, prefill)] + [(t, t + 1) for t in range(prefill, len(tokens))]
    for start, end in spans:
        logits = step(
            tokens[None, start:end], np.arange(start, end, dtype=np.int32)[None], table,
            np.asarray([end], np.int32), "all" if start == 0 else "last",
        )
        out.append(np.asarray(jnp.asarray(logits)))
    return out


def forward_case(
    name: str, overrides: dict, attn_impl: str = "auto", num_tokens: int = 70, tokens_per_block: int = 8
) -> dict:
    """Chunked prefill + decode on a tiny model, one device (XLA reference) vs the mesh (``attn_impl``)."""
    import jax
    import jax.numpy as jnp

    from kvjax import distributed
    from kvjax.cache import init_pool
    from kvjax.model.transformer import forward
    from kvjax.testing.paged import single_group_layout
    from kvjax.testing.tiny import tiny_model

    cfg, params = tiny_model(1, **overrides)
    devices = jax.devices()[:3] if name.endswith("_on3") else None
    mesh = distributed.make_mesh(cfg.num_kv_heads, devices=devices)
    layout = single_group_layout(cfg, 16, tokens_per_block)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, num_tokens).astype(np.int32)
    table = (rng.permutation(15)[: layout.pages_for(num_tokens)] + 1).astype(np.int32)[None]
    tables = lambda t: (jnp.asarray(t),) * layout.num_groups
    prefill = num_tokens - 4

    state = {"pool": init_pool(layout)}

    def single(tok, pos, tbl, lengths, mode):
        logits, state["pool"] = forward(
            params, state["pool"], jnp.asarray(tok), jnp.asarray(pos), tables(tbl), jnp.asarray(lengths),
            cfg=cfg, layout=layout, logits_mode=mode, attn_impl="reference",
        )
        return logits

    ref = _run_steps(single, tokens, prefill, table)
    ref_pool = jax.tree.map(np.asarray, state["pool"])

    sparams = distributed.shard_params(params, cfg, mesh)
    state["pool"] = distributed.init_sharded_pool(layout, mesh)
    lowered = jax.jit(forward, static_argnames=("cfg", "layout", "logits_mode", "attn_impl", "mesh")).lower(
        sparams,
        state["pool"],
        *distributed.replicate(
            (
                tokens[None, :prefill],
                np.arange(prefill, dtype=np.int32)[None],
                tables(table),
                np.asarray([prefill], np.int32),
            ),
            mesh,
        ),
        cfg=cfg,
        layout=layout,
        logits_mode="all",
        attn_impl=attn_impl,
        mesh=mesh,
    )
    found = distributed.collectives(lowered.compile().as_text())

    def sharded(tok, pos, tbl, lengths, mode):
        logits, state["pool"] = distributed.sharded_forward(
            sparams, state["pool"], tok, pos, tables(tbl), lengths, cfg=cfg, layout=layout, mesh=mesh, logits_mode=mode,
            attn_impl=attn_impl,
        )
        return logits

    got = _run_steps(sharded, tokens, prefill, table)
    pool = state["pool"]
    return {
        "mesh": [mesh.shape["pages"], mesh.shape["kv"]],
        "prefill_rel": _rel(got[0], ref[0]),
        "decode_rel": max(_rel(g, r) for g, r in zip(got[1:], ref[1:])),
        "pool_rel": max(_rel(np.asarray(a), b) for a, b in zip(pool.k + pool.v, ref_pool.k + ref_pool.v)),
        "pool_sharded": all(
            a.sharding.is_equivalent_to(distributed.pool_sharding(mesh), a.ndim) for a in pool.k + pool.v
        ),
        "pool_shard_shape": list(pool.k[0].addressable_shards[0].data.shape),
        "pool_shape": list(pool.k[0].shape),
        "collectives": {op: len(shapes) for op, shapes in found.items()},
        "all_gathers": found["all-gather"],
    }


def blend_case(name: str, overrides: dict) -> dict:
    """A CacheBlend prefill (ratio 0.3, gradual filtering) and greedy decode through the engine,
    one device vs an engine over the mesh (``Engine(mesh=...)``: sharded weights and page pool)."""
    from experiments.blender import FULL_RECOMPUTE, make_blender
    from kvjax import distributed
    from kvjax.blend.prompt import BlendPrompt
    from kvjax.blend.selection import SelectionConfig
    from kvjax.testing.tiny import tiny_model

    cfg, params = tiny_model(2, **{**overrides, "num_layers": 4})
    rng = np.random.default_rng(1)
    draw = lambda n: tuple(int(t) for t in rng.integers(3, cfg.vocab_size, n))
    prompt = BlendPrompt(prefix=draw(7), chunks=(draw(40), draw(33), draw(50)), suffix=draw(9))
    config = SelectionConfig(recompute_ratio=0.3, check_layers=(1, 2), budgets=(2.0, 1.0), row_bucket=16)

    def run(blender) -> dict:
        blend = blender.run(prompt, config, max_new_tokens=5)
        full = blender.run(prompt, FULL_RECOMPUTE)
        return {"blend": blend.logits[0], "decode": blend.logits[1:], "tokens": blend.tokens, "full": full.logits[0]}

    ref = run(make_blender(cfg, params, prompt, max_tokens=256))
    mesh = distributed.make_mesh(cfg.num_kv_heads)
    blender = make_blender(cfg, params, prompt, max_tokens=256, mesh=mesh)  # Engine(mesh=...): sharded weights and pool
    engine = blender.engine
    got = run(blender)
    return {
        "mesh": [mesh.shape["pages"], mesh.shape["kv"]],
        "blend_rel": _rel(got["blend"], ref["blend"]),
        "decode_rel": _rel(got["decode"], ref["decode"]),
        "full_rel": _rel(got["full"], ref["full"]),
        "same_tokens": got["tokens"] == ref["tokens"],
        "blend_vs_full": _rel(ref["blend"], ref["full"]),
        "pool_sharded": all(
            a.sharding.is_equivalent_to(distributed.pool_sharding(mesh), a.ndim) for a in engine.pool.k
        ),
        "params_sharded": not engine.runner.context.params.layers[0].w_gate.sharding.is_fully_replicated,
    }


def smollm2_case(num_tokens: int = 520) -> dict:
    """SmolLM2: one-chunk prefill of ``num_tokens`` then 3 decode steps, one device vs 8."""
    import jax.numpy as jnp

    from kvjax import distributed
    from kvjax.cache import init_pool
    from kvjax.model.registry import load_model
    from kvjax.model.transformer import forward
    from kvjax.testing.paged import single_group_layout

    model = load_model("smollm2-135m")
    cfg = model.config
    mesh = distributed.make_mesh(cfg.num_kv_heads)
    tokens_per_block = 32
    layout = single_group_layout(cfg, 24, tokens_per_block)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, num_tokens + 3).astype(np.int32)
    table = (rng.permutation(23)[: layout.pages_for(len(tokens))] + 1).astype(np.int32)[None]
    state = {"pool": init_pool(layout)}

    def single(tok, pos, tbl, lengths, mode):
        logits, state["pool"] = forward(
            model.params, state["pool"], jnp.asarray(tok), jnp.asarray(pos), (jnp.asarray(tbl),), jnp.asarray(lengths),
            cfg=cfg, layout=layout, logits_mode="last", attn_impl="reference",
        )
        return logits

    ref = _run_steps(single, tokens, num_tokens, table)
    del state["pool"]
    sparams = distributed.shard_params(model.params, cfg, mesh)
    state["pool"] = distributed.init_sharded_pool(layout, mesh)

    def sharded(tok, pos, tbl, lengths, mode):
        logits, state["pool"] = distributed.sharded_forward(
            sparams, state["pool"], tok, pos, (tbl,), lengths, cfg=cfg, layout=layout, mesh=mesh, logits_mode="last",
        )
        return logits

    got = _run_steps(sharded, tokens, num_tokens, table)
    return {
        "mesh": [mesh.shape["pages"], mesh.shape["kv"]],
        "prefill_rel": _rel(got[0], ref[0]),
        "decode_rel": max(_rel(g, r) for g, r in zip(got[1:], ref[1:])),
        "same_argmax": [int(np.argmax(g)) for g in got] == [int(np.argmax(r)) for r in ref],
        "pool_sharded": all(
            a.sharding.is_equivalent_to(distributed.pool_sharding(mesh), a.ndim) for a in state["pool"].k
        ),
    }


def _spawn(code: str, timeout: int = 300) -> dict:
    """Runs ``code`` (which prints one JSON line last) in Python with 8 simulated CPU devices."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tiny_results() -> dict:
    return _spawn("""
        import json, jax
        assert jax.device_count() == 8, jax.devices()
        from tests.test_distributed import TINY_CASES, BLEND_CASES, KERNEL_CASES, forward_case, blend_case
        out = {name: forward_case(name, o) for name, o in TINY_CASES.items()}
        out.update({f"kernel_{name}": forward_case(name, TINY_CASES[name], "interpret") for name in KERNEL_CASES})
        out.update({f"blend_{name}": blend_case(name, TINY_CASES[name]) for name in BLEND_CASES})
        print(json.dumps(out))
    """)


@pytest.mark.parametrize("name", list(TINY_CASES))
def test_prefill_and_decode_match_one_device(tiny_results, name):
    r = tiny_results[name]
    assert tuple(r["mesh"]) == EXPECTED_MESH[name]
    assert r["prefill_rel"] < RTOL and r["decode_rel"] < RTOL, r
    assert r["pool_rel"] < RTOL, r


@pytest.mark.parametrize("name", KERNEL_CASES)
def test_pallas_kernel_runs_per_device_under_shard_map(tiny_results, name):
    r = tiny_results[f"kernel_{name}"]
    assert tuple(r["mesh"]) == EXPECTED_MESH[name]
    assert r["prefill_rel"] < RTOL and r["decode_rel"] < RTOL, r
    assert r["pool_sharded"] and r["collectives"]["all-gather"] == 0, r


@pytest.mark.parametrize("name", list(TINY_CASES))
def test_pool_stays_sharded_and_is_never_gathered(tiny_results, name):
    r = tiny_results[name]
    pages, kv = r["mesh"]
    assert r["pool_sharded"]
    shard, full = r["pool_shard_shape"], r["pool_shape"]
    assert shard == [full[0] // pages, full[1], full[2] // kv, full[3]]
    assert r["collectives"]["all-gather"] == 0, r["all_gathers"]
    assert r["collectives"]["all-to-all"] == 0 and r["collectives"]["collective-permute"] == 0


def test_kv_only_mesh_needs_two_all_reduces_per_layer(tiny_results):
    """Megatron-style: one after the attention output projection, one after the MLP."""
    r = tiny_results["mha8"]  # 2 layers
    assert r["collectives"]["all-reduce"] == 2 * 2, r["collectives"]


@pytest.mark.parametrize("name", BLEND_CASES)
def test_cacheblend_matches_one_device(tiny_results, name):
    r = tiny_results[f"blend_{name}"]
    assert r["pool_sharded"] and r["params_sharded"], r
    assert r["blend_rel"] < RTOL and r["decode_rel"] < RTOL and r["full_rel"] < RTOL, r
    assert r["same_tokens"]
    assert r["blend_vs_full"] > 1e-4  # the blend really reused KV (it is not full recompute)


def test_mesh_shape_and_errors():
    from kvjax import distributed

    assert distributed.mesh_shape(3, 8) == (8, 1)
    assert distributed.mesh_shape(4, 8) == (2, 4)
    assert distributed.mesh_shape(8, 8) == (1, 8)
    assert distributed.mesh_shape(3, 3) == (1, 3)
    with pytest.raises(ValueError, match="kv=2 must divide both num_kv_heads=3"):
        distributed.mesh_shape(3, 8, kv=2)
    with pytest.raises(ValueError, match="num_devices=0"):
        distributed.mesh_shape(3, 0)
    with pytest.raises(ValueError, match="process_id=2"):
        distributed.initialize_distributed("localhost:1234", num_processes=2, process_id=2)


def test_collectives_parses_hlo():
    from kvjax import distributed

    hlo = (
        "  %ag = f32[8,4]{1,0} all-gather(f32[1,4]{1,0} %p), dimensions={0}\n"
        "  ROOT %ar = (f32[2], f32[2]) all-reduce-start(%a, %b)\n"
    )
    found = distributed.collectives(hlo)
    assert found["all-gather"] == ["f32[8,4]{1,0}"] and found["all-reduce"] == ["(f32[2], f32[2])"]


@pytest.mark.real_model
def test_smollm2_prefill_and_decode_match_one_device():
    r = _spawn("""
        import json
        from tests.test_distributed import smollm2_case
        print(json.dumps(smollm2_case()))
    """)
    assert tuple(r["mesh"]) == (8, 1)
    assert r["prefill_rel"] < RTOL and r["decode_rel"] < RTOL, r
    assert r["same_argmax"]
    assert r["pool_sharded"]


def test_an_engine_over_a_mesh_refuses_what_it_lacks_and_matches_one_device():
    """On a one-device mesh the sharded engine gives the plain engine's tokens; host tiers and
    speculative decoding over a mesh are refused naming the field."""
    import pathlib

    import jax

    from kvjax import distributed
    from kvjax.config import KvCacheConfig, SchedulerConfig, SpeculativeConfig
    from kvjax.engine import Engine
    from kvjax.model.model import Model
    from kvjax.sampling import SamplingParams
    from kvjax.testing.tiny import tiny_model

    cfg, params = tiny_model(0)
    model = Model(config=cfg, params=params, tokenizer=None, path=pathlib.Path("tiny"))
    mesh = distributed.make_mesh(cfg.num_kv_heads, devices=jax.devices()[:1])
    kv = KvCacheConfig(tokens_per_block=8, max_tokens=504)
    sampling = SamplingParams(max_new_tokens=6, ignore_eos=True)
    prompt = list(range(3, 40))
    [plain] = Engine(model, kv, SchedulerConfig(), max_seq_len=128).generate([prompt], sampling)
    [sharded] = Engine(model, kv, SchedulerConfig(), max_seq_len=128, mesh=mesh).generate([prompt], sampling)
    assert sharded.output == plain.output
    with pytest.raises(ValueError, match=r"does not support speculative yet"):
        Engine(model, kv, SchedulerConfig(), max_seq_len=128, mesh=mesh, speculative=SpeculativeConfig())
    with pytest.raises(ValueError, match=r"does not support kv_cache_config.host_cache_size yet"):
        Engine(model, KvCacheConfig(tokens_per_block=8, max_tokens=504, host_cache_size=1 << 20), SchedulerConfig(),
               max_seq_len=128, mesh=mesh)
    with pytest.raises(ValueError, match=r"mesh must be None or a jax.sharding.Mesh"):
        Engine(model, kv, SchedulerConfig(), max_seq_len=128, mesh="pages")
