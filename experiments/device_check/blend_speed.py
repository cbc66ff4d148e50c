"""Stage "blend_speed": CacheBlend at ``sizes.blend_ratio`` against full recompute.

One synthetic prompt (a random exact prefix, random chunks of ``sizes.blend_chunks`` tokens,
a random suffix) over SmolLM2-135M's shapes with random bf16 weights; the chunks' KV is
stored first (untimed, ``kvjax.blend.ChunkStore``), then each policy runs as an engine
request of its own cache scope (``kvjax.blend.Blender``): full recompute prefills the whole
prompt, CacheBlend reuses the chunks' KV and recomputes the selected tokens. TTFT is the
median of ``sizes.repeats`` rounds after one untimed round; random weights make the timing
real and the quality columns (top-1 agreement, KL of the first-token logits) only a sanity check.
"""

from __future__ import annotations

import numpy as np

from experiments import timing
from experiments.blender import FULL_RECOMPUTE, Blender
from experiments.device_check.engine_speed import make_engine, measure_with_fallback
from experiments.device_check.random_model import random_model
from experiments.device_check.stages import Context, Table
from kvjax import metrics
from kvjax.blend.chunk_store import ChunkStore
from kvjax.blend.prompt import BlendPrompt
from kvjax.blend.selection import SelectionConfig
from kvjax.model.model import Model
from kvjax.testing.blend import random_prompt


def measure(context: Context, model: Model, attn_impl: str) -> tuple[BlendPrompt, list[dict]]:
    """The prompt and one row per policy (timed rounds stop at the stage's deadline; one always runs)."""
    sizes = context.sizes
    rng = np.random.default_rng(0)
    prompt = random_prompt(
        rng, model.config.vocab_size, sizes.blend_prefix, list(sizes.blend_chunks), sizes.blend_suffix
    )
    engine = make_engine(model, sizes, attn_impl, prompt.roles.num_tokens + 64)
    store = ChunkStore(engine, variant="system", prefix_tokens=prompt.prefix)
    for chunk in prompt.chunks:
        store.put(chunk)
    blender = Blender(store, token_bucket=sizes.blend_token_bucket)
    policies = {
        FULL_RECOMPUTE: FULL_RECOMPUTE,
        f"cacheblend@{sizes.blend_ratio:g}": SelectionConfig(
            recompute_ratio=sizes.blend_ratio, row_bucket=sizes.blend_row_bucket
        ),
    }
    for policy in policies.values():  # compiles every shape
        blender.run(prompt, policy)
    ttft: dict[str, list[float]] = {name: [] for name in policies}
    compiles, agree, kl = 0, [], []
    for round_ in range(sizes.repeats):
        if round_ and context.out_of_time:
            break
        runs = {}
        for name, policy in policies.items():
            runs[name], compilations = timing.compilations_during(lambda policy=policy: blender.run(prompt, policy))
            ttft[name].append(runs[name].ttft_s)
            compiles += compilations.programs
        full, blended = runs.values()
        agree.append(int(np.argmax(full.logits[0]) == np.argmax(blended.logits[0])))
        kl.append(float(metrics.kl_divergence(full.logits[:1], blended.logits[:1])[0]))
    full_ms = 1e3 * float(np.median(ttft[FULL_RECOMPUTE]))
    rows = []
    for name in policies:
        ms = 1e3 * float(np.median(ttft[name]))
        blended = name != FULL_RECOMPUTE
        rows.append(
            dict(
                policy=name,
                prompt_tokens=prompt.roles.num_tokens,
                ttft_ms=ms,
                speedup=full_ms / ms,
                rounds=len(ttft[name]),
                top1_agrees=float(np.mean(agree)) if blended else 1.0,
                kl=float(np.mean(kl)) if blended else 0.0,
                compiles=compiles,
            )
        )
    return prompt, rows


def run(context: Context) -> list[Table]:
    sizes = context.sizes
    model = random_model(sizes)
    (prompt, rows), _, why = measure_with_fallback(context, "blend", lambda impl: measure(context, model, impl))
    cfg = model.config
    note = (
        f"{cfg.name} shapes ({cfg.num_layers} layers), random bf16 weights, attention {why}; prompt: "
        f"{len(prompt.prefix)}-token "
        f"prefix, {len(prompt.chunks)} chunks of {sizes.blend_chunks[0]}, {len(prompt.suffix)}-token suffix; chunks on "
        f"the "
        f"device tier; median of the timed rounds (``rounds``, at most {sizes.repeats}) after one untimed round."
    )
    return [Table("CacheBlend against full recompute", note, rows)]
