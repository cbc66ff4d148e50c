"""Stage "engine_speed": ``kvjax.engine`` on SmolLM2-135M's shapes, random bf16 weights.

TTFT (submit to first token, scheduling included) of one prompt of each ``sizes.ttft_lengths``:
cold (random tokens, nothing cached) and with a prefix hit (the first ``hit_fraction`` of
the prompt, in whole blocks, cached by an earlier request); the median of
``sizes.repeats`` rounds after one untimed round that compiles every shape. Decode: the
batch's prompts are prefilled together (untimed), then the mean wall time of the steps in
which every sequence decodes gives tokens/s; each batch runs once untimed first. A timed
row that still compiled says so in ``compiles``. When the Pallas kernels fail inside the
engine, the stage measures again with the blocked XLA attention and says so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import numpy as np

from experiments import timing
from experiments.device_check.correctness import MOSAIC_PATH, PAGED_PATH, PARTIAL_PATH
from experiments.device_check.random_model import random_model
from experiments.device_check.sizes import Sizes
from experiments.device_check.stages import Context, Table, error_text
from kvjax.config import KvCacheConfig, SchedulerConfig
from kvjax.engine import Engine, RequestOutput
from kvjax.model.model import Model
from kvjax.sampling import SamplingParams

FIRST_TOKEN = SamplingParams(max_new_tokens=1, ignore_eos=True)

T = TypeVar("T")


def attention_impl(context: Context) -> tuple[str, str]:
    """The engine's ``attn_impl`` and why: ``sizes.attn_impl``, unless it would run a Pallas
    kernel that failed to lower or run in an earlier stage ("blocked" XLA attention then)."""
    wanted = context.sizes.attn_impl
    failed = [p for p in (PAGED_PATH, PARTIAL_PATH, MOSAIC_PATH)
              if context.kernel_paths.get(p, {}).get("failed")]
    if wanted in ("auto", "interpret") and failed:
        return "blocked", f"{wanted!r} replaced by 'blocked': {', '.join(failed)} failed earlier"
    return wanted, f"{wanted!r}"


def measure_with_fallback(context: Context, label: str, measure: Callable[[str], T]) -> tuple[T, str, str]:
    """``measure(attn_impl)`` with ``attention_impl``'s choice, again with "blocked" XLA
    attention when the kernels fail inside it; each try's outcome is recorded as the path
    ``f"{label}, attn_impl=..."``. Returns (its result, the ``attn_impl`` that ran, why)."""
    attn_impl, why = attention_impl(context)
    try:
        result = measure(attn_impl)
    except Exception as error:
        context.record_path(f"{label}, attn_impl={attn_impl!r}", error_text(error))
        if attn_impl == "blocked":
            raise
        attn_impl, why = "blocked", f"'blocked' after {attn_impl!r} failed ({error_text(error, 120)})"
        result = measure(attn_impl)
    context.record_path(f"{label}, attn_impl={attn_impl!r}", None)
    return result, attn_impl, why


def make_engine(model: Model, sizes: Sizes, attn_impl: str, max_seq_len: int) -> Engine:
    """An engine over ``model`` with a ``sizes.cache_tokens`` device cache in the model's dtype."""
    max_batch = max(sizes.decode_batches)
    return Engine(
        model, KvCacheConfig(tokens_per_block=sizes.tokens_per_block, max_tokens=sizes.cache_tokens),
        SchedulerConfig(max_batch_size=max_batch, max_num_tokens=max(8192, max_batch * sizes.decode_prompt),
                        prefill_chunk_size=4096),
        max_seq_len=max_seq_len, attn_impl=attn_impl,
    )


def checked(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """``outputs``, or RuntimeError with the first request's error (a step's failure finishes
    only its request, so a kernel that fails inside the engine surfaces here)."""
    for out in outputs:
        if out.error is not None:
            raise RuntimeError(f"request {out.request_id} failed: {out.error}")
    return outputs


def ttft_round(engine: Engine, sizes: Sizes, length: int, rng: np.random.Generator) -> dict[str, tuple[float, int]]:
    """One round at ``length``: kind -> (TTFT seconds, reused tokens)."""
    draw = lambda n: rng.integers(3, engine.model.config.vocab_size, n).tolist()
    [cold] = checked(engine.generate([draw(length)], FIRST_TOKEN))
    base = draw(length)
    checked(engine.generate([base], FIRST_TOKEN))
    cached = round(sizes.hit_fraction * length / sizes.tokens_per_block) * sizes.tokens_per_block
    [hit] = checked(engine.generate([base[:cached] + draw(length - cached)], FIRST_TOKEN))
    return {"cold": (cold.ttft_s, cold.num_reused_tokens), "prefix hit": (hit.ttft_s, hit.num_reused_tokens)}


def measure(context: Context, model: Model, attn_impl: str) -> tuple[list[dict], list[dict]]:
    """The TTFT rows and the decode rows; rows past the stage's deadline are left out."""
    sizes, cfg = context.sizes, model.config
    engine = make_engine(
        model, sizes, attn_impl, max(max(sizes.ttft_lengths), sizes.decode_prompt + sizes.decode_tokens) + 64
    )
    rng = np.random.default_rng(0)
    ttft_rows = []
    for length in sizes.ttft_lengths:
        if context.out_of_time:
            break
        ttft_round(engine, sizes, length, rng)  # compiles this length's shapes
        samples, compiles = [], 0
        for _ in range(sizes.repeats):
            measured, compilations = timing.compilations_during(
                lambda length=length: ttft_round(engine, sizes, length, rng)
            )
            samples.append(measured)
            compiles += compilations.programs
        for kind in ("cold", "prefix hit"):
            ttft_rows.append(
                dict(
                    prompt_tokens=length,
                    kind=kind,
                    ttft_ms=1e3 * float(np.median([s[kind][0] for s in samples])),
                    reused_tokens=samples[-1][kind][1],
                    compiles=compiles,
                )
            )
    decode_rows = []
    sampling = SamplingParams(max_new_tokens=sizes.decode_tokens, ignore_eos=True)
    for batch in sizes.decode_batches:
        if context.out_of_time:
            break
        prompts = lambda batch=batch: [
            rng.integers(3, cfg.vocab_size, sizes.decode_prompt).tolist() for _ in range(batch)
        ]
        checked(engine.generate(prompts(), sampling))  # compiles this batch's shapes; a failing decode raises here
        step_s, compilations = timing.compilations_during(
            lambda prompts=prompts: timing.decode_step_seconds(engine, prompts(), sampling)
        )
        decode_rows.append(
            dict(
                batch=batch,
                prompt_tokens=sizes.decode_prompt,
                step_ms=1e3 * step_s,
                tokens_per_s=batch / step_s,
                compiles=compilations.programs,
            )
        )
    return ttft_rows, decode_rows


def run(context: Context) -> list[Table]:
    sizes = context.sizes
    model = random_model(sizes)
    cfg = model.config
    (ttft_rows, decode_rows), _, why = measure_with_fallback(
        context, "engine", lambda impl: measure(context, model, impl)
    )
    shapes = (
        f"{cfg.name} shapes ({cfg.num_layers} layers, d_model {cfg.d_model}, {cfg.num_heads}/{cfg.num_kv_heads} heads "
        f"of {cfg.head_dim}, vocab {cfg.vocab_size}), random bf16 weights, bf16 KV cache of {sizes.cache_tokens} "
        f"tokens, "
        f"tokens_per_block {sizes.tokens_per_block}, attention {why}"
    )
    return [
        Table(
            "Engine TTFT",
            f"{shapes}; median of {sizes.repeats} rounds after one untimed round; the hit caches "
            f"{sizes.hit_fraction:.0%} of the prompt (whole blocks).",
            ttft_rows,
        ),
        Table(
            "Engine decode",
            f"{shapes}; {sizes.decode_tokens} tokens per sequence after a {sizes.decode_prompt}-token "
            "prompt (one untimed run first); mean step time while every sequence decodes.",
            decode_rows,
        ),
    ]
