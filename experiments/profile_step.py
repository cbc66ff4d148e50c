"""Per-op profile of one forward step: where the time of a decode or prefill step goes.

See ``configs/profile_step.py`` for the rows and the command.
"""

from __future__ import annotations

import collections
import functools
import math
import pathlib
import re
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from experiments import report
from experiments.timing import machine_limits, median_seconds
from kvjax import attention
from kvjax.attention import blocked
from kvjax.cache import CacheLayout, PagePool
from kvjax.cache.pool import slot_mapping, write_layer
from kvjax.config import KvCacheConfig, SchedulerConfig
from kvjax.engine import Engine, prefill_bucket
from kvjax.engine.runner import StepInputs, step_inputs
from kvjax.engine.scheduler import ScheduledRequest
from kvjax.model.config import ModelConfig
from kvjax.model.registry import load_model
from kvjax.model.transformer import Params, embed_tokens, forward, linear, logits_of

_WRAPPERS = ("ThunkExecutor", "SlinkyThreadPool", "end: ")
"""Trace events on XLA threads that wrap or wait for ops rather than being one."""
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+) (\w[\w\-]*)\((.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_SHAPE = re.compile(r"(f32|bf16|f16|s32|s8|u8|f8e4m3fn|pred)\[([\d,]*)\]")
_BYTES = {"f32": 4, "s32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1, "f8e4m3fn": 1, "pred": 1}


def step_args(layout: CacheLayout, row: str, context: int, vocab_size: int, seed: int = 0) -> StepInputs:
    """Engine-shaped inputs (``kvjax.engine.runner.step_inputs``, as the engine pads a step) of
    a ``decode_b<S>`` row (S sequences of ``context`` cached tokens decoding one token each), a
    ``prefill_<T>`` row (one sequence, T tokens from position 0) or an ``extend_<T>_<C>`` row
    (one sequence, T new tokens after C cached ones: a prefix hit). Sequences own disjoint
    pages, allocated from page 1 upwards."""
    kind, *sizes = row.split("_")
    if kind == "decode" and len(sizes) == 1 and sizes[0].startswith("b") and sizes[0][1:].isdigit():
        seqs, new, start = int(sizes[0][1:]), 1, context
    elif kind == "prefill" and len(sizes) == 1 and sizes[0].isdigit():
        seqs, new, start = 1, int(sizes[0]), 0
    elif kind == "extend" and len(sizes) == 2 and all(s.isdigit() for s in sizes):
        seqs, new, start = 1, int(sizes[0]), int(sizes[1])
    else:
        raise ValueError(f"row={row!r} must be 'decode_b<batch>', 'prefill_<tokens>' or 'extend_<tokens>_<cached>'")
    rng = np.random.default_rng(seed)
    prefill = kind != "decode"
    works = [
        ScheduledRequest(str(i), tuple(int(t) for t in rng.integers(0, vocab_size, new)), start, prefill, True)
        for i in range(seqs)
    ]
    pages = layout.pages_for(start + new)

    def table_of(request_id: str, group: int) -> list[int]:
        return list(1 + int(request_id) * pages + np.arange(pages))

    return step_inputs(layout, works, prefill_bucket(new) if prefill else 1, table_of)


def hlo_ops(hlo_text: str) -> dict[str, dict]:
    """Op name -> {"label", "flops", "rhs_bytes"} for each instruction of a compiled HLO
    module (nested ones too, e.g. a fusion and the dot inside it): a fusion or call is labelled by the dot it contains
    (operand shapes), else by
    the most telling opcode of its body (gather, scatter, dynamic-update-slice, reduce)."""
    bodies: dict[str, list[tuple[str, str, str, str]]] = collections.defaultdict(list)
    insts: dict[str, tuple[str, str, str]] = {}
    shapes: dict[str, str] = {}
    current = ""
    for line in hlo_text.splitlines():
        inst = _INSTRUCTION.match(line)
        if inst:
            name, shape, opcode, rest = inst.groups()
            bodies[current].append((name, shape, opcode, rest))
            insts[name] = (shape, opcode, rest)
            shapes[name] = shape
            continue
        header = _COMPUTATION.match(line)
        if header:
            current = header.group(1)
            shapes.update(re.findall(r"([\w.\-]+): (\w+\[[\d,]*\])", line))
    ops = {}
    for name, (shape, opcode, rest) in insts.items():
        called = re.findall(r"(?:calls|to_apply|body)=%?([\w.\-]+)", rest)
        body = [i for c in called for i in bodies.get(c, [])] or [(name, shape, opcode, rest)]
        dot = next((i for i in body if i[2] == "dot"), None)
        if dot is not None:
            _, out, _, operands = dot
            lhs_name, rhs_name = re.findall(r"%([\w.\-]+)", operands.split(")")[0])[:2]
            (lhs_type, lhs), (rhs_type, rhs), (_, out_dims) = (
                _dims(shapes[lhs_name]),
                _dims(shapes[rhs_name]),
                _dims(out),
            )
            contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", operands)
            k = math.prod(lhs[int(d)] for d in contracting.group(1).split(",") if d) if contracting else 1
            ops[name] = {
                "label": f"dot {lhs_type}{list(lhs)} x {list(rhs)}",
                "flops": 2 * math.prod(out_dims) * k,
                "rhs_bytes": math.prod(rhs) * _BYTES.get(rhs_type, 4),
            }
            continue
        opcodes = {i[2] for i in body}
        kind = next(
            (o for o in ("gather", "scatter", "dynamic-update-slice", "while", "sort", "reduce") if o in opcodes),
            opcode,
        )
        ops[name] = {"label": kind, "flops": 0, "rhs_bytes": 0}
    return ops


def _dims(shape: str) -> tuple[str, tuple[int, ...]]:
    """("f32", (2, 3)) of an HLO shape such as "f32[2,3]{1,0}" (or of an instruction name's shape)."""
    found = _SHAPE.search(shape)
    if found is None:
        return "?", ()
    return found.group(1), tuple(int(d) for d in found.group(2).split(",") if d)


def op_times(trace_dir: pathlib.Path) -> dict[str, tuple[float, int]]:
    """Op name -> (CPU ns summed over XLA threads, events) from the newest trace under
    ``trace_dir``; waits and executor wrappers are left out."""
    path = sorted(trace_dir.glob("**/*.xplane.pb"))[-1]
    data = jax.profiler.ProfileData.from_file(str(path))
    times: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for plane in data.planes:
        for line in plane.lines:
            if not line.name.startswith("tf_XLA"):
                continue
            for event in line.events:
                if event.name.startswith(_WRAPPERS):
                    continue
                times[event.name][0] += event.duration_ns
                times[event.name][1] += 1
    return {name: (ns, n) for name, (ns, n) in times.items()}


def compile_row(engine: Engine, row: str, config: ml_collections.ConfigDict) -> tuple[StepInputs, jax.stages.Compiled]:
    """The engine's arguments for one row and ``forward`` compiled for them (logits of each
    row's last token, as the engine asks when it samples)."""
    model = engine.model
    args = step_args(engine.layout, row, config.decode_context, model.config.vocab_size)
    static = dict(cfg=model.config, layout=engine.layout, logits_mode="last", attn_impl=config.attn_impl)
    compiled = forward.lower(
        model.params, engine.pool, args.tokens, args.positions, args.block_tables, args.lengths, **static
    ).compile()
    return args, compiled


def profile_row(
    engine: Engine, args: StepInputs, compiled: jax.stages.Compiled, row: str, config: ml_collections.ConfigDict,
    workdir: pathlib.Path,
) -> tuple[dict, list[dict]]:
    """Traces the compiled forward of one row (trace under ``workdir/trace/<row>``, HLO in
    ``workdir/hlo_<row>.txt``); returns (the row's totals, one dict per traced op)."""
    trace_dir = workdir / "trace" / row
    model = engine.model
    hlo = compiled.as_text()
    (workdir / f"hlo_{row}.txt").write_text(hlo)
    labels = hlo_ops(hlo)
    pool: PagePool = engine.pool

    def call() -> None:
        nonlocal pool
        logits, pool = compiled(model.params, pool, args.tokens, args.positions, args.block_tables, args.lengths)
        jax.block_until_ready(logits)

    for _ in range(config.warmup):
        call()
    walls = []
    with jax.profiler.trace(str(trace_dir)):
        for _ in range(config.traced_steps):
            start = time.perf_counter()
            call()
            walls.append(time.perf_counter() - start)
    engine.pool = pool
    steps = config.traced_steps
    ops = []
    for name, (ns, events) in op_times(trace_dir).items():
        info = labels.get(name, {"label": "(not in HLO)", "flops": 0, "rhs_bytes": 0})
        ms = ns / 1e6 / steps
        ops.append(
            {
                "op": name,
                "label": info["label"],
                "flops": info["flops"],
                "events_per_step": events / steps,
                "cpu_ms_per_step": ms,
                "gflops": info["flops"] / ms / 1e6 if ms and info["flops"] else 0.0,
                "rhs_gb_s": info["rhs_bytes"] / ms / 1e6 if ms and info["rhs_bytes"] else 0.0,
            }
        )
    ops.sort(key=lambda o: -o["cpu_ms_per_step"])
    cpu = sum(o["cpu_ms_per_step"] for o in ops)
    for o in ops:
        o["share"] = o["cpu_ms_per_step"] / cpu if cpu else 0.0
    dots = [o for o in ops if o["label"].startswith("dot")]
    dot_ms = sum(o["cpu_ms_per_step"] for o in dots)
    flops = sum(o["flops"] for o in dots)
    rhs = sum(labels[o["op"]]["rhs_bytes"] for o in dots)
    wall = float(np.median(walls)) * 1e3
    totals = {
        "row": row, "wall_ms": wall, "cpu_ms": cpu, "dot_share": dot_ms / cpu if cpu else 0.0,
        "dot_gflops_per_cpu_s": flops / dot_ms / 1e6 if dot_ms else 0.0,
        "model_gflops_per_wall_s": flops / wall / 1e6,
        "rhs_gb_per_wall_s": rhs / wall / 1e6,
    }
    return totals, ops


def attention_only(
    q: jax.Array, positions: jax.Array, pool: PagePool, block_tables: tuple[jax.Array, ...], lengths: jax.Array, *,
    cfg: ModelConfig, layout: CacheLayout, attn_impl: str,
) -> tuple[jax.Array, PagePool]:
    """The forward's K/V writes and attention calls alone, each attention layer's output the
    next one's query and (its first KV heads) the K and V it writes, so that every layer's
    page reads follow its write as in ``forward``. (Without that dependence XLA:CPU starts all
    layers' page gathers at once, which measured 3.5x slower on 2 cores.)

    Args:
      q: [S, T, H, d] queries; T = 1 runs the decode attention, as ``forward`` does.
      positions, block_tables, lengths: the step's (see ``forward``); pool: donated.

    Returns:
      ([S, T, H, d] the last attention layer's output, the written pool).
    """
    pool_k, pool_v = list(pool.k), list(pool.v)
    for layer in range(cfg.num_layers):
        if cfg.is_recurrent(layer):
            continue
        table = block_tables[layout.layer_group[layer]]
        page_ids, offsets = slot_mapping(table, positions, layout.tokens_per_block)
        kv = q[:, :, : cfg.num_kv_heads]
        pool_k[layer] = write_layer(pool_k[layer], page_ids, offsets, kv)
        pool_v[layer] = write_layer(pool_v[layer], page_ids, offsets, kv)
        kv = attention.paged_kv(pool_k[layer], pool_v[layer], lengths, table)
        spec = attention.AttentionSpec(cfg.sm_scale, layout.window_of(layer))
        if q.shape[1] == 1:
            q = attention.paged_attention(q[:, 0], kv, spec, impl=attn_impl)[:, None]
        else:
            q = attention.partial_attention(q, positions, kv, spec, impl=attn_impl)
    return q, PagePool(k=tuple(pool_k), v=tuple(pool_v))


def products_only(params: Params, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The forward's weight products alone, at the step's rows: every layer's Q, K, V, output,
    gate, up and down projections, each layer's input the previous one's output.

    Args:
      x: [S, T, D] the embedded tokens.

    Returns:
      ([S, T, D] the last layer's output, [] the sum of every K and V, which keeps them live).
    """
    kept = jnp.zeros((), x.dtype)
    for lp in params.layers:
        q, k, v = linear(x, lp.wq), linear(x, lp.wk), linear(x, lp.wv)
        x = x + linear(q, lp.wo)
        x = x + linear(linear(x, lp.w_gate) * linear(x, lp.w_up), lp.w_down)
        kept = kept + jnp.sum(k) + jnp.sum(v)
    return x, kept


def _decode_via_partial(q: jax.Array, kv: attention.PagedKV, spec: attention.AttentionSpec) -> jax.Array:
    """Decode attention through the general blocked algorithm: one query row per sequence at
    position ``lengths - 1``."""
    return blocked.partial_attention(q[:, None], (kv.lengths - 1)[:, None], kv, spec)[:, 0]


def decode_algorithm_ab(engine: Engine, args: StepInputs, row: str, config: ml_collections.ConfigDict) -> dict:
    """In-process A/B of a decode row's whole forward: the blocked decode algorithm
    (``blocked.paged_attention``, the default) against the general blocked algorithm at one
    query row (``blocked.partial_attention``). Both are compiled first (compilation not
    timed), then called alternately ``decode_ab_rounds`` times each; medians in ms."""
    model = engine.model
    implementations = attention._IMPLEMENTATIONS["paged"]
    decode = implementations["blocked"]
    compiled = {}
    try:
        for name, fn in (("decode_algorithm", decode), ("general_algorithm", _decode_via_partial)):
            implementations["blocked"] = fn
            jax.clear_caches()  # forward's trace must see the swapped implementation
            compiled[name] = forward.lower(
                model.params, engine.pool, args.tokens, args.positions, args.block_tables, args.lengths,
                cfg=model.config, layout=engine.layout, logits_mode="last", attn_impl="blocked",
            ).compile()
    finally:
        implementations["blocked"] = decode
        jax.clear_caches()
    times: dict[str, list[float]] = collections.defaultdict(list)
    logits = {}
    pool = engine.pool
    for _ in range(config.decode_ab_rounds + 1):
        for name, program in compiled.items():
            start = time.perf_counter()
            out, pool = program(model.params, pool, args.tokens, args.positions, args.block_tables, args.lengths)
            jax.block_until_ready(out)
            times[name].append(time.perf_counter() - start)
            logits[name] = out
    engine.pool = pool
    ms = {name: float(np.median(t[1:])) * 1e3 for name, t in times.items()}  # the first round warms up
    return {"row": row, **{f"{name}_ms": v for name, v in ms.items()},
            "general_over_decode": ms["general_algorithm"] / ms["decode_algorithm"],
            "max_logit_diff": float(jnp.max(jnp.abs(logits["decode_algorithm"] - logits["general_algorithm"])))}


def components(engine: Engine, args: StepInputs, full: jax.stages.Compiled, row: str,
               config: ml_collections.ConfigDict) -> dict:
    """Wall ms of one row's forward split by what it runs, each part compiled as its own
    program at the row's shapes and timed as the median over ``component_rounds`` interleaved
    rounds of its median of ``component_calls`` calls after one warm-up call: the forward, the
    K/V writes and attention calls alone (``attention_only``), the weight products alone
    (``products_only``) and the output head alone (final norm and tied projection of each
    row's last token). ``rest_ms`` (norms, RoPE, SiLU, residuals, embedding) is what those
    parts leave of the forward. Rates: the products' FLOPs and weight bytes per wall second.

    Args:
      args, full: the row's arguments and compiled forward (``compile_row``)."""
    model, layout = engine.model, engine.layout
    cfg = model.config
    pool: PagePool = engine.pool

    def run_forward() -> PagePool:
        nonlocal pool
        _, pool = full(model.params, pool, args.tokens, args.positions, args.block_tables, args.lengths)
        return pool

    def run_attention() -> PagePool:
        nonlocal pool
        _, pool = attend(q, args.positions, pool, args.block_tables, args.lengths)
        return pool

    rows, steps = args.tokens.shape
    q = jax.random.normal(jax.random.key(0), (rows, steps, cfg.num_heads, cfg.head_dim), model.params.embed.dtype)
    attend = (
        jax.jit(
            functools.partial(attention_only, cfg=cfg, layout=layout, attn_impl=config.attn_impl),
            donate_argnames="pool",
        )
        .lower(q, args.positions, engine.pool, args.block_tables, args.lengths)
        .compile()
    )
    x = embed_tokens(model.params, cfg, args.tokens)
    products = jax.jit(products_only).lower(model.params, x).compile()
    last = x[:, -1]  # [S, D]: the head runs on one token per row, as with logits_mode="last"
    head = jax.jit(functools.partial(logits_of, cfg=cfg)).lower(model.params, x=last).compile()
    programs = {
        "forward": run_forward,
        "attention": run_attention,
        "products": lambda: products(model.params, x),
        "head": lambda: head(model.params, x=last),
    }
    times: dict[str, list[float]] = collections.defaultdict(list)
    for _ in range(config.component_rounds):
        for name, program in programs.items():
            times[name].append(median_seconds(program, 1, config.component_calls) * 1e3)
    engine.pool = pool
    ms = {name: float(np.median(t)) for name, t in times.items()}
    weights = [w for lp in model.params.layers for w in (lp.wq, lp.wk, lp.wv, lp.wo, lp.w_gate, lp.w_up, lp.w_down)]
    flops = 2 * rows * steps * sum(w.size for w in weights)
    return {
        "row": row, "forward_ms": ms["forward"], "attention_ms": ms["attention"], "products_ms": ms["products"],
        "head_ms": ms["head"], "rest_ms": ms["forward"] - ms["attention"] - ms["products"] - ms["head"],
        "products_flops": flops,
        "products_gflops": flops / ms["products"] / 1e6,
        "products_weight_gb_s": sum(w.nbytes for w in weights) / ms["products"] / 1e6,
    }


def grouped(ops: list[dict]) -> list[dict]:
    """Ops summed by label (e.g. the 30 per-layer instances of one projection)."""
    groups: dict[str, dict] = {}
    for o in ops:
        g = groups.setdefault(o["label"], {"label": o["label"], "ops": 0, "cpu_ms_per_step": 0.0, "share": 0.0})
        g["ops"] += 1
        g["cpu_ms_per_step"] += o["cpu_ms_per_step"]
        g["share"] += o["share"]
    return sorted(groups.values(), key=lambda g: -g["cpu_ms_per_step"])


def run(config: ml_collections.ConfigDict, workdir: pathlib.Path) -> dict:
    model = load_model(config.model)
    engine = Engine(model, KvCacheConfig(**config.kv_cache.to_dict()), SchedulerConfig(),
                    max_seq_len=min(config.kv_cache.max_tokens, model.config.max_seq_len), attn_impl=config.attn_impl)
    limits = machine_limits()
    rows, parts, sections, ab = [], [], [], []
    for row in config.rows:
        args, compiled = compile_row(engine, row, config)
        totals, ops = profile_row(engine, args, compiled, row, config, workdir)
        rows.append(totals)
        parts.append(components(engine, args, compiled, row, config))
        if row.startswith("decode") and config.decode_ab_rounds:
            ab.append(decode_algorithm_ab(engine, args, row, config))
        report.write_csv(workdir / f"ops_{row}.csv", ops)
        sections.append((f"{row}: ops grouped by label (CPU ms per step, summed over threads)",
                         report.markdown_table(grouped(ops)[: config.top_ops])))
    sections.insert(0, ("Rows (wall ms per forward; CPU ms summed over XLA threads)", report.markdown_table(rows)))
    sections.insert(
        1, ("Components (wall ms per forward, each part run as its own program)", report.markdown_table(parts))
    )
    sections.insert(2, ("Machine", report.markdown_table([limits])))
    if ab:
        sections.insert(2, ("Decode attention: the decode algorithm against the general one at T = 1 "
                            "(whole forward, wall ms, alternating calls)", report.markdown_table(ab)))
        report.write_csv(workdir / "decode_ab.csv", ab)
    report.write_csv(workdir / "rows.csv", rows)
    report.write_csv(workdir / "components.csv", parts)
    report.write_summary(workdir, f"Per-op profile of the forward step — {config.model}", sections)
    return {"rows": rows, "components": parts, "decode_ab": ab, "machine": limits}
