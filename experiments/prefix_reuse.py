"""Prefix reuse through the engine on the real model: TTFT cold vs warm, hit rates, agreement.

Two engines share the model: ``cold`` has ``enable_block_reuse=False`` (every prompt is
prefilled in full) and ``warm`` reuses cached blocks. Each request runs on both, one after
the other, so the two TTFTs see the same machine load. Workload::

    single-turn:  | system prompt s (shared) | question q |            s = 1..S, q = 1..Q
    multi-turn:   | system prompt | user 1 | answer 1 | ... | user t |  t = 1..T (answers: greedy output)

The first pass compiles every shape and is discarded; caches are cleared before each measured
pass. SmolLM2 prompts use its ChatML template; Gemma 3 (a base model) gets plain text
("User: ... / Assistant: ...").

    python -m experiments.run --config=configs/prefix_reuse.py [--config.model=gemma3-270m]
"""

from __future__ import annotations

import dataclasses
import pathlib

import matplotlib
import ml_collections
import numpy as np
from tqdm import tqdm

from experiments import report
from kvjax.config import KvCacheConfig, SchedulerConfig
from kvjax.engine import Engine, RequestOutput
from kvjax.model.registry import Model, load_model
from kvjax.sampling import SamplingParams

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

_TOPICS = ["a city library", "a railway museum", "a mountain hotel", "a bicycle shop", "a dental clinic", "a bakery"]
_RULES = [
    "Answer politely and keep every reply short.",
    "Opening hours are from nine in the morning to six in the evening, Monday to Saturday.",
    "Never promise refunds; refer billing questions to the front desk.",
    "Members get a ten percent discount on every purchase.",
    "The building has step-free access through the east entrance.",
    "Parking is free for the first two hours behind the main building.",
    "Pets are welcome in the garden but not indoors.",
    "Group visits of more than twelve people must be booked a week ahead.",
    "Lost items are kept for thirty days at the reception.",
    "Wi-Fi is free; the password is printed on every receipt.",
    "In case of fire, leave through the nearest marked exit and gather in the square.",
    "The cafe on the ground floor serves soup, sandwiches and cakes until five.",
]
_QUESTIONS = [
    "When are you open on Saturday?",
    "Can I bring my dog inside?",
    "Is there a discount for members?",
    "Where can I park my car?",
    "How do I book a visit for a school class?",
    "I lost my umbrella yesterday. What should I do?",
    "Is the building accessible by wheelchair?",
    "What can I eat at the cafe?",
]


def system_prompts(cfg: ml_collections.ConfigDict) -> list[str]:
    """Seeded system prompts of ``cfg.system_sentences`` rules each."""
    rng = np.random.default_rng(cfg.seed)
    prompts = []
    for s in range(cfg.num_system_prompts + cfg.num_chats):
        rules = [_RULES[i] for i in rng.integers(len(_RULES), size=cfg.system_sentences)]
        prompts.append(f"You are the assistant of {_TOPICS[s % len(_TOPICS)]} (desk {s}). " + " ".join(rules))
    return prompts


def render(model: Model, system: str, turns: list[tuple[str, str | None]]) -> list[int]:
    """Token ids of a conversation ending with an open assistant turn.

    Args:
      turns: (user message, assistant answer) pairs; the last answer is None.
    """
    tok = model.tokenizer
    if tok.chat_format:
        messages = [{"role": "system", "content": system}]
        for user, answer in turns:
            messages.append({"role": "user", "content": user})
            if answer is not None:
                messages.append({"role": "assistant", "content": answer})
        return tok.encode(tok.apply_chat_template(messages))
    text = system + "\n\n" + "".join(
        f"User: {user}\nAssistant:" + ("" if answer is None else f" {answer}\n") for user, answer in turns
    )
    return tok.encode(text)


@dataclasses.dataclass(frozen=True, slots=True)
class Pair:
    """One request run cold and warm."""

    cold: RequestOutput
    warm: RequestOutput


def run_pair(cold: Engine, warm: Engine, prompt: list[int], sampling: SamplingParams) -> Pair:
    [c] = cold.generate([prompt], sampling)
    [w] = warm.generate([prompt], sampling)
    return Pair(c, w)


def one_pass(cfg: ml_collections.ConfigDict, model: Model, cold: Engine, warm: Engine, desc: str) -> list[dict]:
    """The whole workload once; one row per request."""
    sampling = SamplingParams(max_new_tokens=cfg.max_new_tokens, ignore_eos=True, return_logits=True)
    systems = system_prompts(cfg)
    jobs: list[tuple[str, int, int]] = [
        ("shared-system", s, q) for s in range(cfg.num_system_prompts) for q in range(cfg.questions_per_system)
    ] + [("multi-turn", c, t) for c in range(cfg.num_chats) for t in range(cfg.turns)]
    histories: dict[int, list[tuple[str, str | None]]] = {}
    rows = []
    for kind, group, index in tqdm(jobs, desc=desc, leave=False):
        question = _QUESTIONS[(group * 3 + index) % len(_QUESTIONS)]
        if kind == "shared-system":
            system, turns = systems[group], [(question, None)]
        else:
            system = systems[cfg.num_system_prompts + group]
            turns = histories.setdefault(group, [])
            turns.append((question, None))
        prompt = render(model, system, turns)
        pair = run_pair(cold, warm, prompt, sampling)
        if kind == "multi-turn":
            turns[-1] = (question, model.tokenizer.decode(pair.warm.output).strip())
        first_cold, first_warm = np.asarray(pair.cold.logits[0]), np.asarray(pair.warm.logits[0])
        rows.append({
            "kind": kind, "group": group, "index": index, "prompt_tokens": len(prompt),
            "reused_tokens": pair.warm.num_reused_tokens, "ttft_cold_s": pair.cold.ttft_s, "ttft_warm_s": pair.warm.ttft_s,
            "speedup": pair.cold.ttft_s / pair.warm.ttft_s, "outputs_agree": pair.cold.output == pair.warm.output,
            "logits_rel_err": float(np.max(np.abs(first_warm - first_cold)) / np.max(np.abs(first_cold))),
        })
    return rows


def plot(rows: list[dict], path: pathlib.Path, title: str) -> None:
    """TTFT per request, cold and warm bars side by side."""
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(rows)), 3.8))
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["ttft_cold_s"] for r in rows], 0.4, label="cold (no reuse)")
    ax.bar(x + 0.2, [r["ttft_warm_s"] for r in rows], 0.4, label="warm (prefix reuse)")
    ax.set_xticks(x, [f"{'S' if r['kind'] == 'shared-system' else 'C'}{r['group']}.{r['index']}" for r in rows], fontsize=7)
    ax.set_xlabel("request (S = shared system prompt s.q, C = chat c.turn)")
    ax.set_ylabel("TTFT (s)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(config: ml_collections.ConfigDict, workdir: pathlib.Path) -> dict:
    model = load_model(config.model, config.gguf_path or None)
    sched = SchedulerConfig(**config.scheduler.to_dict())
    engines = {
        reuse: Engine(model, KvCacheConfig(**config.kv_cache.to_dict(), enable_block_reuse=reuse), sched,
                      max_seq_len=config.max_seq_len)
        for reuse in (False, True)
    }
    cold, warm = engines[False], engines[True]
    one_pass(config, model, cold, warm, "compile pass")
    rows = []
    for p in range(config.measure_passes):
        warm.manager.clear_cache()
        before = dataclasses.replace(warm.manager.stats)
        rows += [{"pass": p, **r} for r in one_pass(config, model, cold, warm, f"pass {p}")]
    after = warm.manager.stats
    prompt_blocks = after.prompt_blocks - before.prompt_blocks
    hits = [r for r in rows if r["reused_tokens"] > 0]
    results = {
        "model": config.model,
        "requests": len(rows),
        "token_hit_rate": sum(r["reused_tokens"] for r in rows) / sum(r["prompt_tokens"] for r in rows),
        "block_hit_rate": (after.reused_blocks - before.reused_blocks) / prompt_blocks if prompt_blocks else 0.0,
        "median_ttft_cold_s": float(np.median([r["ttft_cold_s"] for r in rows])),
        "median_ttft_warm_s": float(np.median([r["ttft_warm_s"] for r in rows])),
        "median_ttft_cold_hits_s": float(np.median([r["ttft_cold_s"] for r in hits])) if hits else None,
        "median_ttft_warm_hits_s": float(np.median([r["ttft_warm_s"] for r in hits])) if hits else None,
        "median_speedup_hits": float(np.median([r["speedup"] for r in hits])) if hits else None,
        "outputs_agree": all(r["outputs_agree"] for r in rows),
        "max_logits_rel_err": max(r["logits_rel_err"] for r in rows),
        "rows": rows,
    }
    plot(rows, workdir / "ttft.png", f"TTFT cold vs warm — {config.model}")
    report.write_csv(workdir / "requests.csv", rows)
    summary = {k: v for k, v in results.items() if k != "rows"}
    report.write_summary(workdir, f"Prefix reuse — {config.model}", [
        ("Summary", report.markdown_table([summary])),
        ("Requests (cold and warm run back to back)", report.markdown_table(rows)),
        ("TTFT", "![ttft](ttft.png)\n"),
    ])
    return results
