"""Generation on the real model through the engine: prefill and decode speed, KV bytes/token."""

from __future__ import annotations

import pathlib

import ml_collections
import numpy as np
from absl import logging
from tqdm import tqdm

from experiments import report
from kvjax.config import KvCacheConfig, SchedulerConfig
from kvjax.engine import Engine
from kvjax.model.registry import load_model
from kvjax.sampling import SamplingParams


def run(config: ml_collections.ConfigDict, workdir: pathlib.Path) -> dict:
    model = load_model(config.model, config.gguf_path or None, config.param_dtype or None)
    tok = model.tokenizer
    text = (
        tok.apply_chat_template([{"role": "user", "content": config.prompt}])
        if config.chat and tok.chat_format
        else config.prompt
    )
    prompt = tok.encode(text)
    sampling = SamplingParams(
        max_new_tokens=config.max_new_tokens, temperature=config.temperature, top_p=config.top_p, seed=config.seed
    )
    engine = Engine(
        model, KvCacheConfig(**config.kv_cache.to_dict()), SchedulerConfig(), max_seq_len=config.max_seq_len
    )
    engine.generate([prompt], sampling)  # warm-up: compiles the prefill and decode buckets
    rows = []
    for i in tqdm(range(config.repeats), desc="generate"):
        engine.timings.clear()
        [out] = engine.generate([prompt], sampling)
        t = engine.timings
        rows.append({
            "repeat": i,
            "prompt_tokens": len(prompt),
            "reused_tokens": out.num_reused_tokens,
            "new_tokens": len(out.output),
            "ttft_s": out.ttft_s,
            "prefill_tok_per_s": t["prefill_tokens"] / max(t["prefill_s"], 1e-9),
            "decode_ms_per_token": 1e3 * t["decode_s"] / max(t["decode_steps"], 1),
        })
    text_out = tok.decode(out.output)
    logging.info("generated: %s", text_out)
    size = engine.cache_size
    results = {
        "model": config.model,
        "prompt": config.prompt,
        "output_text": text_out,
        "output_tokens": out.output,
        "runs": rows,
        "median_prefill_tok_per_s": float(np.median([r["prefill_tok_per_s"] for r in rows])),
        "median_decode_ms_per_token": float(np.median([r["decode_ms_per_token"] for r in rows])),
        "kv_bytes_per_token": size.bytes_per_token,
        "kv_cache_tokens": size.num_tokens,
        "kv_cache_bytes": size.cache_bytes,
        "kv_cache_limited_by": size.limited_by,
    }
    report.write_summary(
        workdir,
        f"generate — {config.model}",
        [
            ("Output", f"Prompt: {config.prompt!r}\n\n> {text_out}\n"),
            ("Speed (this machine)", report.markdown_table(rows)),
            (
                "KV cache",
                report.markdown_table(
                    [
                        {
                            k: results[k]
                            for k in ("kv_bytes_per_token", "kv_cache_tokens", "kv_cache_bytes", "kv_cache_limited_by")
                        }
                    ]
                ),
            ),
        ],
    )
    return results
