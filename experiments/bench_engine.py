"""Engine speed: TTFT, prefill throughput and decode latency through ``Engine``, beside the
machine's measured matmul rate and copy bandwidth and vLLM CPU's figures.

See ``configs/bench_engine.py`` for the rows and the command.
"""

from __future__ import annotations

import pathlib
import time

import jax
import ml_collections
import numpy as np
from tqdm import tqdm

from experiments import report
from experiments.timing import machine_limits
from kvjax.config import KvCacheConfig, SchedulerConfig
from kvjax.engine import Engine
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


def measure(engine: Engine, config: ml_collections.ConfigDict, rng: np.random.Generator) -> dict[str, tuple[float, float]]:
    """One round of every row: name -> (value in the row's unit, wall seconds)."""
    vocab = engine.model.config.vocab_size
    draw = lambda n: rng.integers(3, vocab, n).tolist()  # noqa: E731

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
        ids = [engine.submit(draw(config.decode_context), sampling) for _ in range(batch)]
        while any(engine.requests[i].first_token_time is None for i in ids):
            engine.step()
        start, steps = time.perf_counter(), 0
        while engine.has_work:
            engine.step()
            steps += 1
        step_s = (time.perf_counter() - start) / steps
        rows[f"decode_b{batch}"] = (1e3 * step_s / batch, step_s)
    return rows


def run(config: ml_collections.ConfigDict, workdir: pathlib.Path) -> dict:
    model = load_model(config.model)
    engine = Engine(
        model, KvCacheConfig(**config.kv_cache.to_dict()), SchedulerConfig(**config.scheduler.to_dict()),
        max_seq_len=max(config.prompt_tokens, *config.prefill_lengths, config.decode_context + config.decode_tokens + 1) + 64,
        attn_impl=config.attn_impl,
    )
    rng = np.random.default_rng(config.seed)
    limits = machine_limits()
    samples: dict[str, list[tuple[float, float]]] = {}
    for round_ in tqdm(range(config.warmup + config.repeats), desc="bench_engine rounds"):
        measured = measure(engine, config, rng)
        if round_ >= config.warmup:
            for name, value in measured.items():
                samples.setdefault(name, []).append(value)
    scale = limits["matmul_2048_gflops"] / VLLM_MACHINE_GFLOPS
    rows = []
    for name, values in samples.items():
        value = float(np.median([v[0] for v in values]))
        row = {"row": name, "kvjax": value, "wall_s": float(np.median([v[1] for v in values]))}
        if name in VLLM_CPU:
            peer, unit = VLLM_CPU[name]
            lower_is_better = unit != "tok/s"
            row |= {"unit": unit, "vllm_cpu": peer, "kvjax_over_vllm": value / peer if lower_is_better else peer / value}
            # vLLM's figure moved to this machine by the matmul-rate ratio (an estimate, not a measurement).
            row["vllm_scaled"] = peer / scale if lower_is_better else peer * scale
            row["kvjax_over_vllm_scaled"] = value / row["vllm_scaled"] if lower_is_better else row["vllm_scaled"] / value
        rows.append(row)
    columns = ["row", "unit", "kvjax", "vllm_cpu", "kvjax_over_vllm", "vllm_scaled", "kvjax_over_vllm_scaled", "wall_s"]
    table = report.markdown_table(rows, columns)
    report.write_csv(workdir / "engine.csv", rows, columns)
    note = (
        f"{config.model} on {jax.devices()[0].device_kind} ({jax.default_backend()}); median of {config.repeats} rounds "
        f"after {config.warmup} warm-up. This machine: f32 matmul {limits['matmul_2048_gflops']:.0f} GFLOP/s at 2048^3, "
        f"{limits['matmul_mlp_gflops']:.0f} GFLOP/s at [1024x576]x[576x1536]; copy {limits['copy_gb_s']:.1f} GB/s "
        "(read + write). kvjax_over_vllm < 1 means kvjax is faster. vllm_cpu was measured on another machine "
        f"(~{VLLM_MACHINE_GFLOPS:.0f} GFLOP/s); vllm_scaled moves it here by the matmul-rate ratio ({scale:.2f}), an "
        "estimate: only a side-by-side run settles a comparison.\n"
    )
    report.write_summary(workdir, "bench_engine — engine speed vs vLLM CPU", [("Setup", note), ("Rows", table)])
    return {"rows": rows, "machine": limits, "device": jax.devices()[0].device_kind}
