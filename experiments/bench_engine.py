"""Engine speed: TTFT, prefill throughput and decode latency through ``Engine``, beside the
machine's measured matmul rate and copy bandwidth and vLLM CPU's figures.

See ``configs/bench_engine.py`` for the rows and the command.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import time

import jax
import ml_collections
import numpy as np
from tqdm import tqdm

from experiments import report
from experiments.timing import decode_step_seconds, machine_limits
from experiments.workloads.trace import make_trace, replay, sim_layout
from kvjax.config import KvCacheConfig, SchedulerConfig
from kvjax.engine import Engine
from kvjax.engine.manager_v2 import KVCacheManagerV2
from kvjax.manager import KVCacheManager
from kvjax.model.registry import load_model
from kvjax.sampling import SamplingParams

VLLM_CPU = {
    "cold_1024_ttft": (606.0, "ms"),
    "repeat_1024_ttft": (43.0, "ms"),
    "shared_900_ttft": (106.0, "ms"),
    "prefill_512": (1746.0, "tok/s"),
    "prefill_2048": (1423.0, "tok/s"),
    "decode_b1": (18.7, "ms/token"),
    "decode_b8": (2.69, "ms/token"),
}
"""vLLM CPU 0.32.0 on SmolLM2-135M float32, block size 32, medians of 3 after warm-up, on a
quiet 2-core AMD EPYC with AVX-512 whose jitted f32 2048^3 matmul reached ~460 GFLOP/s."""
VLLM_MACHINE_GFLOPS = 460.0

FIRST = SamplingParams(max_new_tokens=1, ignore_eos=True)
PEER_MARK = "VLLM_PEER_RESULT "
"""Prefix of the one stdout line carrying ``experiments/peers/vllm_cpu.py``'s JSON result."""


def measure(
    engine: Engine, config: ml_collections.ConfigDict, rng: np.random.Generator
) -> dict[str, tuple[float, float]]:
    """One round of every row: name -> (value in the row's unit, wall seconds)."""
    vocab = engine.model.config.vocab_size
    draw = lambda n: rng.integers(3, vocab, n).tolist()

    def first_token(prompt: list[int]) -> tuple[float, float]:
        start = time.perf_counter()
        [out] = engine.generate([prompt], FIRST)
        return out.ttft_s, time.perf_counter() - start

    rows: dict[str, tuple[float, float]] = {}
    prompt = draw(config.prompt_tokens)
    ttft, wall = first_token(prompt)
    rows[f"cold_{config.prompt_tokens}_ttft"] = (1e3 * ttft, wall)
    ttft, wall = first_token(prompt)
    rows[f"repeat_{config.prompt_tokens}_ttft"] = (1e3 * ttft, wall)
    prefix = draw(config.shared_prefix_tokens)
    first_token(prefix + draw(config.shared_new_tokens))
    ttft, wall = first_token(prefix + draw(config.shared_new_tokens))
    rows[f"shared_{config.shared_prefix_tokens}_ttft"] = (1e3 * ttft, wall)
    for n in config.prefill_lengths:
        ttft, wall = first_token(draw(n))
        rows[f"prefill_{n}"] = (n / ttft, wall)
    for batch in config.decode_batches:
        sampling = SamplingParams(max_new_tokens=config.decode_tokens + 1, ignore_eos=True)
        step_s = decode_step_seconds(engine, [draw(config.decode_context) for _ in range(batch)], sampling)
        rows[f"decode_b{batch}"] = (1e3 * step_s / batch, step_s)
    return rows


def decode_tokens_per_s(engine: Engine, prompts: list[list[int]], sampling: SamplingParams) -> float:
    """Submits ``prompts`` together, steps until every one has its first token (not timed),
    then returns the tokens generated per wall second by the remaining steps (with Manager V2
    one step may emit several tokens per sequence)."""
    ids = [engine.submit(p, sampling) for p in prompts]
    while any(engine.requests[i].first_token_time is None for i in ids):
        engine.step()
    emitted = sum(len(engine.requests[i].sched.output_token_ids) for i in ids)
    start = time.perf_counter()
    while engine.has_work:
        engine.step()
    seconds = time.perf_counter() - start
    return (sum(len(engine.requests[i].sched.output_token_ids) for i in ids) - emitted) / seconds


def measure_v2(
    engines: dict[str, Engine], config: ml_collections.ConfigDict, rng: np.random.Generator
) -> dict[str, tuple[float, float]]:
    """One round of the decode tokens/s rows: per batch, the same prompts through every engine."""
    vocab = config.vocab_size
    sampling = SamplingParams(max_new_tokens=config.decode_tokens + 1, ignore_eos=True)
    rows = {}
    for batch in config.decode_batches:
        prompts = [rng.integers(3, vocab, config.decode_context).tolist() for _ in range(batch)]
        for name, engine in engines.items():
            start = time.perf_counter()
            rows[f"decode_b{batch}_tok_s_{name}"] = (
                decode_tokens_per_s(engine, prompts, sampling),
                time.perf_counter() - start,
            )
    return rows


def hit_rates(config: ml_collections.ConfigDict, vocab_size: int) -> list[dict]:
    """Block and token hit rates of V1 (LRU, priority-LRU) and V2 (LRU) replaying the trace."""
    cfg = ml_collections.ConfigDict(
        {**config.hit_trace.to_dict(), "tokens_per_block": config.kv_cache.tokens_per_block}
    )
    trace = make_trace(cfg, vocab_size)
    kv = KvCacheConfig(tokens_per_block=cfg.tokens_per_block)
    rows = []
    for name, manager, priorities in (
        ("V1 priority-LRU", KVCacheManager(kv, sim_layout(cfg)), True),
        ("V1 LRU", KVCacheManager(kv, sim_layout(cfg)), False),
        ("V2 LRU", KVCacheManagerV2(kv, sim_layout(cfg), max_seqs=1), False),
    ):
        start = time.perf_counter()
        result = replay(manager, trace, priorities=priorities)
        rows.append({"manager": name, "requests": len(trace), "device_pages": cfg.num_device_pages - 1,
                     "block_hit_rate": result.block_hit_rate, "token_hit_rate": result.token_hit_rate,
                     "replay_s": time.perf_counter() - start})
    return rows


def measure_peer(config: ml_collections.ConfigDict, max_seq_len: int) -> dict[str, float]:
    """vLLM CPU on the same rows in a subprocess (its own venv): row name -> median value."""
    spec = {
        "model": config.peer_model, "tokens_per_block": config.kv_cache.tokens_per_block, "max_seq_len": max_seq_len,
        "max_num_tokens": config.scheduler.max_num_tokens, "seed": config.seed, "warmup": config.warmup,
        "repeats": config.repeats, "prompt_tokens": config.prompt_tokens,
        "shared_prefix_tokens": config.shared_prefix_tokens, "shared_new_tokens": config.shared_new_tokens,
        "prefill_lengths": list(config.prefill_lengths), "decode_batches": list(config.decode_batches),
        "decode_context": config.decode_context, "decode_tokens": config.decode_tokens,
    }
    script = pathlib.Path(__file__).parent / "peers" / "vllm_cpu.py"
    done = subprocess.run([config.peer_python, str(script), json.dumps(spec)], capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith(PEER_MARK)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM peer run failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return {name: float(np.median(values)) for name, values in json.loads(lines[-1][len(PEER_MARK):]).items()}


def run(config: ml_collections.ConfigDict, workdir: pathlib.Path) -> dict:
    max_seq_len = (
        max(config.prompt_tokens, *config.prefill_lengths, config.decode_context + config.decode_tokens + 1) + 64
    )
    peer = measure_peer(config, max_seq_len) if config.peer_python else {}
    model = load_model(config.model)
    engine = Engine(
        model, KvCacheConfig(**config.kv_cache.to_dict()), SchedulerConfig(**config.scheduler.to_dict()),
        max_seq_len=max_seq_len, attn_impl=config.attn_impl,
    )
    decode_engines = {"v1": engine} | {
        f"v2_n{n}": Engine(
            model, KvCacheConfig(**config.kv_cache.to_dict(), use_kv_cache_manager_v2="true"),
            SchedulerConfig(**config.scheduler.to_dict(), num_decode_steps_per_dispatch=n),
            max_seq_len=max_seq_len, attn_impl=config.attn_impl,
        )
        for n in config.v2_decode_steps_per_dispatch
    }
    rng = np.random.default_rng(config.seed)
    limits = machine_limits()
    samples: dict[str, list[tuple[float, float]]] = {}
    v2_config = ml_collections.ConfigDict({**config.to_dict(), "vocab_size": model.config.vocab_size})
    for round_ in tqdm(range(config.warmup + config.repeats), desc="bench_engine rounds"):
        measured = measure(engine, config, rng) | measure_v2(decode_engines, v2_config, rng)
        if round_ >= config.warmup:
            for name, value in measured.items():
                samples.setdefault(name, []).append(value)
    scale = limits["matmul_2048_gflops"] / VLLM_MACHINE_GFLOPS
    rows = []
    for name, values in samples.items():
        value = float(np.median([v[0] for v in values]))
        row = {"row": name, "kvjax": value, "wall_s": float(np.median([v[1] for v in values]))}
        if name in VLLM_CPU:
            reference, unit = VLLM_CPU[name]
            lower_is_better = unit != "tok/s"
            row |= {"unit": unit, "vllm_cpu": reference,
                    "kvjax_over_vllm": value / reference if lower_is_better else reference / value}
            # vLLM's figure moved to this machine by the matmul-rate ratio (an estimate, not a measurement).
            row["vllm_scaled"] = reference / scale if lower_is_better else reference * scale
            row["kvjax_over_vllm_scaled"] = (
                value / row["vllm_scaled"] if lower_is_better else row["vllm_scaled"] / value
            )
            if name in peer:
                row["vllm_here"] = peer[name]
                row["kvjax_over_vllm_here"] = value / peer[name] if lower_is_better else peer[name] / value
        if name.startswith("decode_b") and "_tok_s_" in name:
            row["unit"] = "tok/s"
        rows.append(row)
    hits = hit_rates(config, model.config.vocab_size)
    report.write_csv(workdir / "hit_rates.csv", hits, list(hits[0]))
    columns = ["row", "unit", "kvjax", "vllm_cpu", "kvjax_over_vllm", "vllm_scaled", "kvjax_over_vllm_scaled", "wall_s"]
    if peer:
        columns[2:2] = ["vllm_here", "kvjax_over_vllm_here"]
    table = report.markdown_table(rows, columns)
    report.write_csv(workdir / "engine.csv", rows, columns)
    note = (
        f"{config.model} on {jax.devices()[0].device_kind} ({jax.default_backend()}); median of {config.repeats} "
        f"rounds "
        f"after {config.warmup} warm-up. This machine: f32 matmul {limits['matmul_2048_gflops']:.0f} GFLOP/s at "
        f"2048^3, "
        f"{limits['matmul_mlp_gflops']:.0f} GFLOP/s at [1024x576]x[576x1536]; copy {limits['copy_gb_s']:.1f} GB/s "
        "(read + write). kvjax_over_vllm < 1 means kvjax is faster. vllm_cpu was measured on another machine "
        f"(~{VLLM_MACHINE_GFLOPS:.0f} GFLOP/s); vllm_scaled moves it here by the matmul-rate ratio ({scale:.2f}), an "
        "estimate: only a side-by-side run settles a comparison.\n"
        + (
            "vllm_here: vLLM CPU 0.32.0 measured in this run, on this machine, just before kvjax (same rows, "
            "sizes and rounds); kvjax_over_vllm_here is the side-by-side ratio.\n"
            if peer
            else ""
        )
    )
    hit_table = report.markdown_table(hits, list(hits[0]))
    report.write_summary(workdir, "bench_engine — engine speed vs vLLM CPU",
                         [("Setup", note), ("Rows", table), ("Manager V1 vs V2 hit rates (eviction trace)", hit_table)])
    return {"rows": rows, "hit_rates": hits, "machine": limits, "device": jax.devices()[0].device_kind}
