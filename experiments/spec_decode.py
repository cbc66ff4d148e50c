"""Speculative decoding: decode speed per drafter and draft length, and hit rates on vs off.

See ``configs/spec_decode.py`` for the workloads and the command. Every speculative run is
checked against the non-speculative run of the same prompts: greedy outputs must be equal.
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Sequence

import matplotlib
import ml_collections
import numpy as np
from tqdm import tqdm

from configs import eviction as eviction_config
from configs import prefix_reuse as prefix_reuse_config
from experiments import report
from experiments.workloads import chat as chat_workload
from experiments.workloads import trace as eviction_trace
from experiments.workloads.datasets import load_squad
from kvjax.config import KvCacheConfig, SchedulerConfig, SpeculativeConfig
from kvjax.engine import Engine
from kvjax.manager import KVCacheManager
from kvjax.model.registry import Model, load_model
from kvjax.sampling import SamplingParams

matplotlib.use("Agg")
import matplotlib.pyplot as plt

SQUAD_SLICE = pathlib.Path(__file__).parents[1] / "tests" / "fixtures" / "squad_new_wiki_slice.json"
"""36 SQuAD-shifts new_wiki questions (CC BY 4.0) committed with the tests."""
CHAT_QUESTIONS = [
    "Why is the sky blue?",
    "Give me three ideas for a rainy weekend.",
    "What should I pack for a week of hiking?",
    "How do I make a good cup of tea?",
    "Explain what a neural network is to a child.",
    "Write a short poem about autumn.",
    "What are the benefits of learning a second language?",
    "How can I sleep better at night?",
]


def chat(model: Model, user: str) -> list[int]:
    """A one-turn prompt: the chat template if the model has one, else "User: / Assistant:"."""
    tok = model.tokenizer
    if tok.chat_format:
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": user}]))
    return tok.encode(f"User: {user}\nAssistant:")


def workloads(model: Model, config: ml_collections.ConfigDict) -> dict[str, list[list[int]]]:
    """``config.num_prompts`` RAG copy prompts and free-chat prompts (token ids)."""
    rng = np.random.default_rng(config.seed)
    pairs = [(p.context.strip(), q.question) for p in load_squad(SQUAD_SLICE) for q in p.questions]
    chosen = [pairs[i] for i in rng.permutation(len(pairs))[: config.num_prompts]]
    rag = [
        chat(model, f"Context:\n{context}\n\nQuestion: {question}\n"
                    "Quote the sentence of the context that answers the question, word for word.")
        for context, question in chosen
    ]
    free = [chat(model, CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)]) for i in range(config.num_prompts)]
    return {"rag": rag, "chat": free}


def make_engine(model: Model, config: ml_collections.ConfigDict, speculative: SpeculativeConfig | None, **kv) -> Engine:
    return Engine(
        model, KvCacheConfig(**{**config.kv_cache.to_dict(), **kv}), SchedulerConfig(**config.scheduler.to_dict()),
        max_seq_len=config.max_seq_len, attn_impl=config.attn_impl, speculative=speculative,
    )


def spec_config(config: ml_collections.ConfigDict, method: str, k: int) -> SpeculativeConfig:
    return SpeculativeConfig(
        method, num_draft_tokens=k, ngram_sizes=tuple(config.ngram_sizes), exit_layer=config.exit_layer
    )


def decode_speed(engine: Engine, prompts: Sequence[list[int]], batch: int, max_new_tokens: int) -> dict:
    """Runs ``prompts`` ``batch`` at a time (caches cleared first, so no run reuses another's
    prefix); returns decode tokens/s (drafting included), speculation counters and outputs."""
    engine.manager.clear_cache()
    before = dict(engine.timings)
    sampling = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    outputs = []
    for i in range(0, len(prompts), batch):
        outputs += [o.output for o in engine.generate(prompts[i : i + batch], sampling)]
    delta = {key: engine.timings[key] - before.get(key, 0) for key in engine.timings}
    rows = delta.get("spec_rows", 0)
    return {
        "decode_tokens_per_s": delta["decode_tokens"] / delta["decode_s"],
        "decode_steps": delta["decode_steps"],
        "draft_share": delta.get("draft_s", 0.0) / delta["decode_s"],
        "mean_accepted_length": 1 + delta.get("spec_accepted", 0) / rows if rows else 1.0,
        "acceptance_rate": delta.get("spec_accepted", 0) / delta["spec_drafted"] if delta.get("spec_drafted") else 0.0,
        "outputs": outputs,
    }


def speed_rows(model: Model, config: ml_collections.ConfigDict) -> list[dict]:
    """One row per (workload, batch, drafter, k), plus the baseline rows (drafter "off"). A
    cell decodes the workload's first max(batch, min_cell_prompts) prompts, batch at a time,
    twice: the first run (untimed) compiles every shape the timed second run meets.
    One engine lives at a time (each holds a page pool), the baseline first."""
    prompts = workloads(model, config)
    cases = [(w, b) for w in prompts for b in config.batches]
    variants = [("off", 0)] + [(method, k) for method, ks in config.ks.items() for k in ks]
    base: dict[tuple[str, int], dict] = {}
    rows = []
    for method, k in tqdm(variants, desc="speed"):
        engine = make_engine(model, config, None if method == "off" else spec_config(config, method, k))
        for workload, batch in cases:
            subset = prompts[workload][: max(batch, config.min_cell_prompts)]
            # the same run untimed: compiles every shape it meets
            decode_speed(engine, subset, batch, config.max_new_tokens)
            res = decode_speed(engine, subset, batch, config.max_new_tokens)
            ref = base.setdefault((workload, batch), res)
            rows.append(
                {
                    "workload": workload,
                    "batch": batch,
                    "drafter": method,
                    "k": k,
                    "tokens_per_s": res["decode_tokens_per_s"],
                    "speedup": res["decode_tokens_per_s"] / ref["decode_tokens_per_s"],
                    "mean_accepted_length": res["mean_accepted_length"],
                    "acceptance_rate": res["acceptance_rate"],
                    "draft_share": res["draft_share"],
                    "decode_steps": res["decode_steps"],
                    "outputs_equal": res["outputs"] == ref["outputs"],
                }
            )
        del engine
    return rows


def prefix_reuse_hit_rates(model: Model, config: ml_collections.ConfigDict) -> list[dict]:
    """``configs/prefix_reuse.py``'s workload (shared system prompts, multi-turn chats whose
    answers are fed back) on an engine without speculation and one with each drafter, each
    request run on both back to back; block and token hit rates side by side."""
    cfg = prefix_reuse_config.get_config()
    cfg.update(config.hit_rates.prefix_reuse.to_dict())
    cfg.max_new_tokens = config.hit_rates.prefix_reuse_new_tokens
    kv = dict(tokens_per_block=cfg.kv_cache.tokens_per_block, max_tokens=cfg.kv_cache.max_tokens)
    rows = []
    for method in config.ks:
        off = make_engine(model, config, None, **kv)
        on = make_engine(model, config, spec_config(config, method, config.hit_rates.k), **kv)
        requests = chat_workload.one_pass(cfg, model, off, on, f"prefix reuse, {method}")
        for name, engine in (("off", off), (method, on)):
            stats = engine.manager.stats
            rows.append({
                "workload": "prefix_reuse", "speculation": name, "requests": len(requests),
                "block_hit_rate": stats.block_hit_rate, "token_hit_rate": stats.token_hit_rate,
                "outputs_equal": all(r["outputs_agree"] for r in requests),
            })
    return rows


def speculative_replay(mgr: KVCacheManager, trace: Sequence[eviction_trace.TraceRequest], *, k: int, acceptance: float,
                       concurrency: int, seed: int) -> KVCacheManager:
    """``experiments.workloads.trace.replay`` with speculative decodes: each decode step takes the input token's
    slot (``allocate``), up to k draft slots (``allocate_drafts``), commits the input token and
    the accepted drafts (each accepted with probability ``acceptance`` until the first
    rejection; the trace's output tokens are the verified tokens) and rolls back the rest."""
    rng = np.random.default_rng(seed)
    active: dict[str, tuple[eviction_trace.TraceRequest, int]] = {}
    pending = iter(enumerate(trace))
    while True:
        while len(active) < concurrency:
            nxt = next(pending, None)
            if nxt is None:
                break
            i, req = nxt
            rid = f"r{i}"
            reused = mgr.add_request(rid, req.prompt, retention=req.retention())
            mgr.allocate(rid, len(req.prompt))
            mgr.commit_tokens(rid, req.prompt[reused:])
            active[rid] = (req, 0)
        if not active:
            return mgr
        for rid, (req, done) in list(active.items()):
            if done == len(req.output):
                mgr.free_request(rid)
                del active[rid]
                continue
            n = len(req.prompt) + done
            mgr.allocate(rid, n + 1)
            want = min(k, len(req.output) - done - 1)
            slots = mgr.allocate_drafts(rid, n + 1 + want) - n - 1
            accepted = 0
            while accepted < slots and rng.random() < acceptance:
                accepted += 1
            mgr.rollback(rid, slots - accepted)
            mgr.commit_tokens(rid, req.output[done : done + 1 + accepted])
            active[rid] = (req, done + 1 + accepted)


def eviction_hit_rates(config: ml_collections.ConfigDict) -> list[dict]:
    """The eviction trace (``configs/eviction.py``'s shape, ``trace_requests`` requests,
    priority-LRU, with and without the host tier) through the manager, plain vs speculative."""
    ev = eviction_config.get_config()
    sim = ml_collections.ConfigDict({**ev.to_dict(), **ev.trace.to_dict()})
    sim.num_requests = config.hit_rates.trace_requests
    trace = eviction_trace.make_trace(sim, sim.vocab_size)
    rows = []
    for host in sim.host_pages:
        for concurrency in config.hit_rates.concurrency:
            plain = eviction_trace.replay(
                eviction_trace.make_manager(sim, host), trace, priorities=True, concurrency=concurrency
            )
            spec = speculative_replay(eviction_trace.make_manager(sim, host), trace, k=config.hit_rates.k,
                                      acceptance=config.hit_rates.acceptance, concurrency=concurrency, seed=sim.seed)
            spec.check_consistency()
            rows.append({
                "workload": "eviction trace (manager)", "host_pages": host, "concurrency": concurrency,
                "block_hit_rate_off": plain.block_hit_rate, "block_hit_rate_on": spec.stats.block_hit_rate,
                "token_hit_rate_off": plain.token_hit_rate, "token_hit_rate_on": spec.stats.token_hit_rate,
                "device_evictions_off": plain.device_evictions, "device_evictions_on": spec.stats.device_evictions,
            })
    return rows


def engine_eviction_hit_rates(model: Model, config: ml_collections.ConfigDict) -> list[dict]:
    """A small eviction trace (``configs/eviction.py``'s engine trace) through the engine under
    memory pressure, one request at a time with greedy outputs, speculation off and on."""
    ev = eviction_config.get_config()
    trace_cfg = ml_collections.ConfigDict({**ev.trace.to_dict(), **ev.engine.trace.to_dict()})
    trace_cfg.num_requests = config.hit_rates.engine_requests
    trace = eviction_trace.make_trace(trace_cfg, model.config.vocab_size)
    sampling = SamplingParams(max_new_tokens=config.hit_rates.engine_new_tokens, ignore_eos=True)
    kv = dict(tokens_per_block=ev.tokens_per_block, max_tokens=config.hit_rates.engine_max_tokens)
    rows, outputs = [], {}
    for name in ("off", *config.ks):
        spec = None if name == "off" else spec_config(config, name, config.hit_rates.k)
        engine = Engine(model, KvCacheConfig(**kv), SchedulerConfig(max_num_tokens=ev.engine.max_seq_len,
                        prefill_chunk_size=ev.engine.max_seq_len), max_seq_len=ev.engine.max_seq_len,
                        attn_impl=config.attn_impl, speculative=spec)
        outputs[name] = [engine.generate([r.prompt], sampling, retention=r.retention())[0].output
                         for r in tqdm(trace, desc=f"engine eviction trace, {name}", leave=False)]
        stats = engine.manager.stats
        rows.append({
            "workload": "eviction trace (engine)", "speculation": name, "requests": len(trace),
            "block_hit_rate": stats.block_hit_rate, "token_hit_rate": stats.token_hit_rate,
            "device_evictions": stats.device_evictions, "outputs_equal": outputs[name] == outputs["off"],
        })
    return rows


def plot(rows: Sequence[dict], path: pathlib.Path, batches: Sequence[int]) -> None:
    """Speedup over non-speculative decoding vs k, one panel per batch size."""
    fig, axes = plt.subplots(1, len(batches), figsize=(5.0 * len(batches), 3.8), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        for workload in ("rag", "chat"):
            for method in sorted({r["drafter"] for r in rows} - {"off"}):
                sel = sorted(
                    (r for r in rows if r["batch"] == batch and r["workload"] == workload and r["drafter"] == method),
                    key=lambda r: r["k"],
                )
                ax.plot([r["k"] for r in sel], [r["speedup"] for r in sel], marker="o", label=f"{method}, {workload}")
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_xlabel("draft length k")
        ax.set_ylabel("decode tokens/s, relative to no speculation")
        ax.set_title(f"batch {batch}")
        ax.legend(fontsize=7)
    report.save_figure(fig, path)


def run(config: ml_collections.ConfigDict, workdir: pathlib.Path) -> dict:
    model = load_model(config.model, config.gguf_path or None, config.param_dtype or None)
    start = time.perf_counter()
    speed = speed_rows(model, config)
    hits = prefix_reuse_hit_rates(model, config)
    trace_rows = eviction_hit_rates(config)
    engine_trace_rows = engine_eviction_hit_rates(model, config)
    plot(speed, workdir / "speedup_vs_k.png", config.batches)
    report.write_csv(workdir / "speed.csv", speed)
    report.write_csv(workdir / "hit_rates.csv", hits + engine_trace_rows)
    report.write_csv(workdir / "eviction_trace.csv", trace_rows)
    results = {
        "model": config.model,
        "all_outputs_equal": all(r["outputs_equal"] for r in speed + hits + engine_trace_rows),
        "hit_rates_equal": all(
            r["block_hit_rate_on"] == r["block_hit_rate_off"] for r in trace_rows
        ) and all(
            r["block_hit_rate"] == next(o["block_hit_rate"] for o in hits + engine_trace_rows
                                        if o["speculation"] == "off" and o["workload"] == r["workload"])
            for r in hits + engine_trace_rows
        ),
        "seconds": time.perf_counter() - start,
        "speed": speed,
        "hit_rates": hits + engine_trace_rows,
        "eviction_trace": trace_rows,
    }
    report.write_summary(workdir, f"Speculative decoding — {config.model}", [
        ("Decode speed (greedy; tokens/s of the decode phase, drafting included)", report.markdown_table(speed)),
        ("Speedup vs k", "![speedup](speedup_vs_k.png)\n"),
        ("Hit rates through the engine, speculation off vs on", report.markdown_table(hits + engine_trace_rows)),
        ("Eviction trace through the manager, speculation off vs on", report.markdown_table(trace_rows)),
    ])
    return results
