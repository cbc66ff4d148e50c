"""Quantized KV cache as a cache policy: its quality deviation from a float32 cache, its
memory and its decode speed. See ``configs/kv_quant.py`` for the parts and the command.

Quality is teacher-forced along the float32 cache's greedy continuation through the model's
own paged forward (the function the engine steps): a prefill of the prompt, then one decode
step per continuation token, each writing its KV into the (quantized) pool. Under teacher
forcing the first position whose argmax leaves the reference token is exactly where greedy
decoding with the quantized cache would first diverge. CacheBlend runs as engine requests
(``Engine.submit(..., chunks=ChunkReuse(...))``) on engines whose whole cache, chunk store
included, has the given dtype.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from tqdm import tqdm

from experiments import report, statistics
from experiments.timing import decode_step_seconds
from experiments.workloads import rag
from kvjax import metrics
from kvjax.blend.chunk_store import ChunkStore
from kvjax.blend.engine_blend import ChunkReuse
from kvjax.blend.prompt import BlendPrompt
from kvjax.blend.selection import SelectionConfig
from kvjax.cache import QUANTIZED_DTYPES, CacheLayout, init_pool
from kvjax.config import KvCacheConfig, SchedulerConfig
from kvjax.engine import Engine, pow2_bucket, prefill_bucket
from kvjax.model.registry import Model, load_model
from kvjax.model.transformer import forward
from kvjax.sampling import SamplingParams

PARTS = ("rag", "long", "blend", "speed")
REFERENCE = ("float32", "-")
"""The full-precision cache every variant is compared with."""


def variants(config: ml_collections.ConfigDict) -> list[tuple[str, str]]:
    """(dtype, scale granularity) of every quantized variant measured."""
    return [(d, g) for d in config.dtypes if d in QUANTIZED_DTYPES for g in config.scale_granularities]


def kv_cache_config(config: ml_collections.ConfigDict, dtype: str, granularity: str, max_tokens: int) -> KvCacheConfig:
    """The engine cache of one variant: ``config.tokens_per_block`` tokens per page, ``max_tokens`` tokens,
    ``dtype`` with ``granularity`` scales ("-" for float dtypes)."""
    return KvCacheConfig(tokens_per_block=config.tokens_per_block, max_tokens=max_tokens, dtype=dtype,
                         scale_granularity="token" if granularity == "-" else granularity)


def sequence_layout(model: Model, dtype: str, granularity: str, max_seq_len: int, tokens_per_block: int) -> CacheLayout:
    """A pool for one sequence of up to ``max_seq_len`` tokens (page 0 is the null page)."""
    cfg = model.config
    windows = tuple(min(w, max_seq_len) for w in cfg.layer_windows)
    pages = -(-max_seq_len // tokens_per_block) + 1
    return CacheLayout(
        layer_windows=windows, num_pages=(pages,) * len(dict.fromkeys(windows)), tokens_per_block=tokens_per_block,
        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, max_seq_len=max_seq_len, dtype=dtype,
        scale_granularity="token" if granularity == "-" else granularity,
    )


def continuation_logits(
    model: Model, layout: CacheLayout, prompt: list[int], forced: list[int] | None, num: int, attn_impl: str,
    padded: int,
) -> tuple[np.ndarray, list[int]]:
    """Logits of ``num`` continuation positions after ``prompt``, one decode step each.

    Args:
      forced: the continuation fed back (teacher forcing); None = greedy (its own argmax).
      padded: the prompt's prefill is padded to this many tokens (one compiled shape for all prompts).

    Returns:
      (logits [num, V] float32 — row i predicts continuation token i, the tokens fed).
    """
    n = len(prompt)
    table = jnp.arange(1, layout.num_pages[0], dtype=jnp.int32)[None]  # one sequence owns every page
    tables = (table,) * layout.num_groups
    tokens = np.zeros((1, padded), np.int32)
    tokens[0, :n] = prompt
    positions = np.full((1, padded), -1, np.int32)
    positions[0, :n] = np.arange(n)
    run = dict(cfg=model.config, layout=layout, logits_mode="last", attn_impl=attn_impl)
    logits, pool = forward(model.params, init_pool(layout), jnp.asarray(tokens), jnp.asarray(positions), tables,
                           jnp.array([n], jnp.int32), **run)
    out, fed = [np.asarray(logits[0])], []
    for i in range(num - 1):
        token = int(np.argmax(out[-1])) if forced is None else forced[i]
        fed.append(token)
        logits, pool = forward(model.params, pool, jnp.array([[token]], jnp.int32), jnp.array([[n + i]], jnp.int32),
                               tables, jnp.array([n + i + 1], jnp.int32), **run)
        out.append(np.asarray(logits[0]))
    fed.append(int(np.argmax(out[-1])) if forced is None else forced[num - 1])
    return np.stack(out), fed


def _ci(values: list[float], config: ml_collections.ConfigDict) -> dict[str, float]:
    mean, lo, hi = statistics.bootstrap_ci(values, num=config.bootstrap, seed=config.seed)
    return {"mean": mean, "lo": lo, "hi": hi}


def quality_rows(
    config: ml_collections.ConfigDict, model: Model, part: str, prompts: list[list[int]], num: int,
    max_seq_len: int, padded: int,
) -> tuple[list[dict], list[dict]]:
    """KL / top-1 / divergence of every variant against the float32 cache on ``prompts``.

    Args:
      max_seq_len, padded: the sequence pool's capacity and the prefill length, shared by every
        part so that each cache variant compiles one prefill and one decode program.

    Returns:
      (summary rows per variant with bootstrap intervals over prompts, per-prompt rows).
    """
    layout = lambda d, g: sequence_layout(model, d, g, max_seq_len, config.tokens_per_block)
    per_prompt: list[dict] = []
    for i, prompt in enumerate(tqdm(prompts, desc=f"{part} {model.config.name}", unit="prompt")):
        ref_logits, ref_tokens = continuation_logits(
            model, layout(*REFERENCE), prompt, None, num, config.attn_impl, padded
        )
        for dtype, granularity in variants(config):
            logits, _ = continuation_logits(
                model, layout(dtype, granularity), prompt, ref_tokens, num, config.attn_impl, padded
            )
            agree = np.argmax(logits, axis=-1) == np.asarray(ref_tokens)
            per_prompt.append({
                "model": model.config.name, "part": part, "prompt": i, "dtype": dtype, "scales": granularity,
                "kl": float(np.mean(metrics.kl_divergence(ref_logits, logits))),
                "top1": float(np.mean(metrics.top1_agreement(ref_logits, logits))),
                "divergence": int(np.argmin(agree)) if not agree.all() else num,
            })
    rows = []
    for dtype, granularity in variants(config):
        mine = [r for r in per_prompt if (r["dtype"], r["scales"]) == (dtype, granularity)]
        lay = layout(dtype, granularity)
        row = {"model": model.config.name, "part": part, "dtype": dtype, "scales": granularity, "prompts": len(mine),
               "positions": num, "bytes_per_token": lay.bytes_per_token,
               "memory_vs_float32": round(layout(*REFERENCE).bytes_per_token / lay.bytes_per_token, 3)}
        for key in ("kl", "top1", "divergence"):
            ci = _ci([r[key] for r in mine], config)
            row |= {key: ci["mean"], f"{key}_lo": ci["lo"], f"{key}_hi": ci["hi"]}
        rows.append(row)
    return rows, per_prompt


def rag_prompts(config: ml_collections.ConfigDict, model: Model) -> list[BlendPrompt]:
    c = config.rag
    examples = rag.make_examples(model.tokenizer, num=c.num_prompts, seed=config.seed, num_chunks=tuple(c.num_chunks),
                                 chunk_tokens=tuple(c.chunk_tokens))
    return [BlendPrompt(prefix=e.prefix, chunks=e.chunks, suffix=e.suffix) for e in examples]


def long_prompts(config: ml_collections.ConfigDict, model: Model) -> list[list[int]]:
    """Passages of the committed reference text, each continued by the model."""
    text = pathlib.Path(config.long.text_path).read_text()
    ids = model.tokenizer.encode(text)
    c = config.long
    starts = [i * c.prompt_tokens for i in range(c.num_prompts)]
    if starts[-1] + c.prompt_tokens > len(ids):
        raise ValueError(
            f"long.num_prompts={c.num_prompts} x long.prompt_tokens={c.prompt_tokens} exceed the text's {len(ids)} "
            f"tokens"
        )
    bos = [model.tokenizer.bos_id] if model.tokenizer.add_bos else []
    return [bos + ids[s : s + c.prompt_tokens] for s in starts]


def blend_rows(config: ml_collections.ConfigDict, model: Model, prompts: list[BlendPrompt]) -> list[dict]:
    """CacheBlend at ``blend.recompute_ratio`` and full recompute, each on an engine whose cache
    (chunk store included) has the variant's dtype, against full recompute on float32; KL and
    top-1 over the suffix positions."""
    c = config.blend
    longest = max(p.roles.num_tokens for p in prompts)
    scheduler = SchedulerConfig(max_num_tokens=c.cache_tokens, prefill_chunk_size=c.cache_tokens)
    cases = [REFERENCE, *[(d, g) for d, g in variants(config) if g == c.scale_granularity]]
    logits: dict[tuple[str, str, str], list[np.ndarray]] = {}
    for dtype, granularity in cases:
        engine = Engine(model, kv_cache_config(config, dtype, granularity, c.cache_tokens), scheduler,
                        max_seq_len=pow2_bucket(longest + 8, config.tokens_per_block), attn_impl=config.attn_impl)
        for prompt in tqdm(prompts, desc=f"blend {dtype}/{granularity}", unit="prompt"):
            store = ChunkStore(engine, variant="system", prefix_tokens=prompt.prefix)
            for chunk in prompt.chunks:
                store.put(chunk)
            for policy, selector in (("full_recompute", "all"), ("cacheblend", "cacheblend")):
                selection = SelectionConfig(selector=selector, recompute_ratio=c.recompute_ratio,
                                            check_layers=tuple(c.check_layers), budgets=tuple(c.budgets))
                reuse = ChunkReuse(store, prompt.roles.chunk_spans, selection, num_prompt_logits=len(prompt.suffix))
                rid = engine.submit(
                    prompt.tokens.tolist(), SamplingParams(max_new_tokens=1, ignore_eos=True), chunks=reuse
                )
                engine.run()
                out = engine.output(rid)
                if out.error is not None:
                    raise RuntimeError(f"blended request on {dtype}/{granularity} failed: {out.error}")
                logits.setdefault((dtype, granularity, policy), []).append(np.asarray(out.prompt_logits))
    reference = logits[(*REFERENCE, "full_recompute")]
    rows = []
    for (dtype, granularity, policy), runs in logits.items():
        kl = [float(np.mean(metrics.kl_divergence(r, x))) for r, x in zip(reference, runs)]
        top1 = [float(np.mean(metrics.top1_agreement(r, x))) for r, x in zip(reference, runs)]
        row = {
            "model": model.config.name,
            "policy": policy,
            "dtype": dtype,
            "scales": granularity,
            "prompts": len(runs),
        }
        for key, values in (("kl", kl), ("top1", top1)):
            ci = _ci(values, config)
            row |= {key: ci["mean"], f"{key}_lo": ci["lo"], f"{key}_hi": ci["hi"]}
        rows.append(row)
    return rows


def speed_rows(config: ml_collections.ConfigDict, model: Model) -> list[dict]:
    """Decode ms/token through the engine per dtype at each batch size (median of rounds)."""
    c = config.speed
    rng = np.random.default_rng(config.seed)
    max_seq_len = pow2_bucket(c.context + c.decode_tokens + 2, config.tokens_per_block)
    rows = []
    for dtype, granularity in [REFERENCE, *[(d, g) for d, g in variants(config) if g in c.scale_granularities]]:
        kv = kv_cache_config(config, dtype, granularity, max(c.batches) * max_seq_len)
        engine = Engine(model, kv, SchedulerConfig(max_batch_size=max(c.batches)), max_seq_len=max_seq_len,
                        attn_impl=c.attn_impl)
        for batch in c.batches:
            times = []
            for _ in range(c.warmup + c.rounds):
                sampling = SamplingParams(max_new_tokens=c.decode_tokens + 1, ignore_eos=True)
                prompts = [rng.integers(3, model.config.vocab_size, c.context).tolist() for _ in range(batch)]
                times.append(decode_step_seconds(engine, prompts, sampling) / batch)
            rows.append({"model": model.config.name, "dtype": dtype, "scales": granularity, "batch": batch,
                         "attn_impl": c.attn_impl, "ms_per_token": 1e3 * float(np.median(times[c.warmup:]))})
    return rows


def run(config: ml_collections.ConfigDict, workdir: pathlib.Path) -> dict:
    """Runs the configured parts for every model; writes each part's table as soon as it is
    done, then summary.md, into ``workdir``."""
    unknown = set(config.parts) - set(PARTS)
    if unknown:
        raise ValueError(f"parts={tuple(config.parts)} may only name {PARTS}")
    quality, per_prompt, blend, speed = [], [], [], []
    for name in config.models:
        model = load_model(name)
        if model.tokenizer is None:
            raise ValueError(f"model {name!r} has no tokenizer: the RAG workload needs one")
        prompts = rag_prompts(config, model)
        parts = {
            "rag": ([p.tokens.tolist() for p in prompts], config.rag.continuation_tokens),
            "long": (long_prompts(config, model), config.long.generate_tokens),
        }
        max_seq_len = pow2_bucket(max(len(p) + num for ps, num in parts.values() for p in ps), config.tokens_per_block)
        padded = prefill_bucket(max(len(p) for ps, _ in parts.values() for p in ps))
        for part, (part_prompts, num) in parts.items():
            if part in config.parts:
                rows, detail = quality_rows(config, model, part, part_prompts, num, max_seq_len, padded)
                quality += rows
                per_prompt += detail
                report.write_csv(workdir / "quality.csv", quality)
                report.write_csv(workdir / "per_prompt.csv", per_prompt)
        if "blend" in config.parts and len(dict.fromkeys(model.config.layer_windows)) == 1:
            blend += blend_rows(config, model, prompts)
            report.write_csv(workdir / "blend.csv", blend)
        if "speed" in config.parts and name in config.speed.models:
            speed += speed_rows(config, model)
            report.write_csv(workdir / "speed.csv", speed)
    sections = [
        (
            "Quality vs float32 KV (mean [95% bootstrap CI over prompts]); divergence = first greedy token that "
            "differs",
            report.markdown_table(quality),
        ),
        (
            f"CacheBlend {config.blend.recompute_ratio:.0%} on quantized vs float32 chunk KV (suffix positions, vs "
            f"float32 full recompute)",
            report.markdown_table(blend) if blend else "not run (windowed model, or not in parts)\n",
        ),
        (
            "Decode ms/token through the engine",
            report.markdown_table(speed) if speed else "not run (speed.models, parts)\n",
        ),
    ]
    report.write_summary(workdir, "kv_quant — quantized KV cache", sections)
    return {"quality": quality, "blend": blend, "speed": speed, "device": jax.devices()[0].device_kind}
