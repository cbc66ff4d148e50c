"""Evaluation for the CacheBlend experiment: the engine, the workload's train and eval prompts,
the full-recompute reference of a prompt, the quality of one policy against it (KL, top-1,
gold score, FLOP fraction, deviations), the learned scorer's training, and the aggregation
into rows with bootstrap intervals over prompts.

Per prompt, the full-recompute greedy continuation of N tokens is the reference every
policy is teacher-forced along (fed behind the prompt of another request of the same
policy); a policy's greedy answer is the reference's up to the first position where the
policy's top-1 differs, then the policy's own greedy tokens.

Shapes: L = layers, T = prompt tokens, K = kv heads, d = head_dim, V = vocab, N = continuation,
P = probe rows, H = heads.
"""

from __future__ import annotations

import dataclasses
import pathlib

import ml_collections
import numpy as np

from experiments.policies import POLICIES
from experiments.workloads import WORKLOADS, gold_scores
from experiments.workloads.rag import RagExample
from kvjax import metrics
from kvjax.blend import loading_controller, scorer, selection
from kvjax.blend.blender import FULL_RECOMPUTE, Blender, BlendPrompt, PolicyRun
from kvjax.blend.chunk_store import ChunkStore
from kvjax.config import KvCacheConfig, SchedulerConfig
from kvjax.engine import Engine
from kvjax.model.registry import Model, load_model
from kvjax.model.tokenizer import Tokenizer

GOLD_KEYS = ("gold", "f1", "em", "exact", "recall")
"""Gold scores a workload may report (``workloads.gold_scores``); "gold" is the headline."""
_TRAIN_SEED = 1_000_003
"""Seed offset of the training prompts: the synthetic workload has no hash split, and the
needles of a needle-in-a-haystack prompt come from the seed, not from the essays."""


@dataclasses.dataclass
class Setup:
    """The model, the engine and the prompts of one run."""

    model: Model
    stop_ids: tuple[int, ...]
    engine: Engine
    store: ChunkStore
    blender: Blender
    examples: list[RagExample]  # evaluation prompts
    train_examples: list[RagExample]  # the learned scorer's training prompts (disjoint)

    @property
    def prompts(self) -> list[BlendPrompt]:
        return [BlendPrompt(e.prefix, e.chunks, e.suffix) for e in self.examples]


def workload_examples(config: ml_collections.ConfigDict, tokenizer: Tokenizer, *, split: str, num: int) -> list[RagExample]:
    """``num`` prompts of ``config.workload`` from ``split`` ("train" or "eval")."""
    w = config.workload
    if w.name not in WORKLOADS:
        raise ValueError(f"workload.name={w.name!r} must be one of {tuple(WORKLOADS)}")
    seed = config.seed + (_TRAIN_SEED if split == "train" else 0)
    if w.name == "synthetic":
        return WORKLOADS[w.name](tokenizer, num=num, seed=seed, tasks=tuple(w.tasks), num_chunks=tuple(w.num_chunks),
                                 chunk_tokens=tuple(w.chunk_tokens))
    if w.name == "squad_multidoc":
        options = dict(source=w.source, num_distractors=w.num_distractors)
    else:
        options = dict(tasks=tuple(w.niah_tasks), num_needles=tuple(w.num_needles), chunk_range=tuple(w.chunk_range))
    return WORKLOADS[w.name](tokenizer, num=num, seed=seed, split=split, max_tokens=w.max_tokens, **options)


def check_disjoint(train: list[RagExample], evaluation: list[RagExample]) -> None:
    """Raises ValueError if a training prompt shares a chunk, or a question with the same gold
    answers, with an evaluation prompt (two needle prompts may ask for the same key's value;
    with different values they are different items)."""
    chunks = {c for e in evaluation for c in e.chunks}
    items = {(e.question, e.gold_answers) for e in evaluation}
    for i, e in enumerate(train):
        shared = sum(c in chunks for c in e.chunks)
        same = (e.question, e.gold_answers) in items
        if shared or same:
            raise ValueError(f"training prompt {i} shares {shared} chunks (question and answers shared: {same}) "
                             "with the evaluation prompts")


def build(config: ml_collections.ConfigDict) -> Setup:
    """Loads the model, builds the prompts (eval and, if "learned" runs, train) and the engine."""
    unknown = [p for p in config.policies if p not in POLICIES]
    if unknown or "full_recompute" not in config.policies:
        raise ValueError(f"policies={tuple(config.policies)} must include 'full_recompute' and only names from {POLICIES}")
    model = load_model(config.model, config.gguf_path or None)
    tok = model.tokenizer
    # Chat models stop at <|im_end|>; a base model's answer (after the prefilled stem) ends at a newline.
    stop_text = "<|im_end|>" if tok.chat_format == "chatml" else "\n"
    stop_ids = tuple(model.config.eos_ids) + tuple(tok.encode(stop_text, add_bos=False))
    examples = workload_examples(config, tok, split="eval", num=config.num_prompts)
    needs_training = "learned" in config.policies or "learned" in config.sweep.policies
    train = workload_examples(config, tok, split="train", num=config.learned.train_prompts) if needs_training else []
    check_disjoint(train, examples)
    everything = examples + train
    bucket = config.runtime.token_bucket
    longest = max(len(e.prefix) + sum(map(len, e.chunks)) + len(e.suffix) for e in everything)
    engine = Engine(
        model, KvCacheConfig(tokens_per_block=config.runtime.tokens_per_block, max_tokens=config.store.cache_tokens),
        SchedulerConfig(max_num_tokens=8192, prefill_chunk_size=8192),
        max_seq_len=longest + config.eval.continuation_tokens + config.eval.max_answer_tokens + bucket,
        attn_impl=config.runtime.attn_impl,
    )
    store = ChunkStore(engine, variant=config.store.variant, prefix_tokens=examples[0].prefix)
    return Setup(model, stop_ids, engine, store, Blender(store, token_bucket=bucket), examples, train)


def selection_config(config: ml_collections.ConfigDict, ratio: float) -> selection.SelectionConfig:
    """The run's one selection config (selector "cacheblend"; policies swap the selector)."""
    p = config.policy
    return selection.SelectionConfig(
        recompute_ratio=ratio, check_layers=tuple(p.check_layers), budgets=tuple(p.budgets), deviation=p.deviation,
        row_bucket=p.row_bucket, seed=config.seed, query_rows=p.query_rows,
    )


@dataclasses.dataclass
class Reference:
    """Full recompute of one prompt: continuation, its logits, KV and suffix attention."""

    continuation: np.ndarray  # [N]
    logits: np.ndarray  # [N, V]
    answer_len: int
    answer: str
    k: np.ndarray  # [L, T, K, d]
    v: np.ndarray
    true_dev: np.ndarray  # [L, T] deviation of the reused KV (full reuse)
    attn: np.ndarray  # [L, P, H*d]
    ttft_s: float


def answer_text(tokenizer: Tokenizer, tokens: list[int], stop_ids: tuple[int, ...]) -> tuple[str, int]:
    """Decoded answer up to the first stop token, and its length in tokens (stop included)."""
    end = next((i + 1 for i, t in enumerate(tokens) if t in stop_ids), len(tokens))
    return tokenizer.decode(tokens[:end]).strip(), end


def reference(setup: Setup, prompt: BlendPrompt, sel_cfg: selection.SelectionConfig, config: ml_collections.ConfigDict) -> Reference:
    """Full recompute of ``prompt`` (greedy continuation), plus the exact and fully reused KV."""
    n, blender = prompt.roles.num_tokens, setup.blender
    full = blender.run(prompt, FULL_RECOMPUTE, max_new_tokens=config.eval.continuation_tokens)
    continuation = np.asarray(full.tokens, np.int32)
    answer, answer_len = answer_text(setup.model.tokenizer, continuation.tolist()[: config.eval.max_answer_tokens], setup.stop_ids)
    probes = config.eval.num_probes
    exact = blender.run(prompt, dataclasses.replace(sel_cfg, selector="all"), num_probes=probes).trace
    reused = blender.run(prompt, dataclasses.replace(sel_cfg, selector="none"), num_probes=probes).trace
    k_full, v_full = np.asarray(exact["k"])[:, :n], np.asarray(exact["v"])[:, :n]
    true_dev = metrics.kv_deviation(np.asarray(reused["k"])[:, :n], np.asarray(reused["v"])[:, :n], k_full, v_full)
    return Reference(continuation, full.logits, answer_len, answer, k_full, v_full, true_dev, np.asarray(exact["attn"]),
                     full.ttft_s)


def timed(setup: Setup, prompt: BlendPrompt, pol: selection.SelectionConfig | str, ref: Reference) -> PolicyRun:
    """One policy's prefill to its first token (TTFT); the oracle's scores come from ``ref``."""
    return setup.blender.run(prompt, pol, scores=None if pol == FULL_RECOMPUTE else ref.true_dev)


def evaluate(setup: Setup, example: RagExample, name: str, pol: selection.SelectionConfig, ref: Reference,
             config: ml_collections.ConfigDict, *, detailed: bool) -> dict:
    """Quality of one policy against the reference (full recompute is evaluated as selector
    "all", which equals it): KL, top-1, first divergence, gold scores of its greedy answer,
    FLOP fraction; ``detailed`` adds per-layer KV and attention deviation and recall vs the oracle."""
    blender, tok, stop_ids = setup.blender, setup.model.tokenizer, setup.stop_ids
    prompt = BlendPrompt(example.prefix, example.chunks, example.suffix)
    n = prompt.roles.num_tokens
    probes = config.eval.num_probes if detailed else 1
    forced = blender.run(prompt, pol, feed=ref.continuation[:-1].tolist(), num_probes=probes, scores=ref.true_dev)
    logits = forced.logits
    kl = metrics.kl_divergence(ref.logits, logits)
    div = metrics.first_divergence(ref.logits, logits)
    out = {"kl": float(kl.mean()), "top1": float(metrics.top1_agreement(ref.logits, logits).mean()), "first_div": div,
           "answer_agree": float(div >= ref.answer_len)}
    if div >= ref.answer_len:
        answer = ref.answer
    else:
        tokens = [*ref.continuation[:div].tolist(), int(np.argmax(logits[div]))]
        budget = config.eval.max_answer_tokens - len(tokens)
        if tokens[-1] not in stop_ids and budget > 0:
            tokens += blender.run(prompt, pol, feed=tokens[:-1], max_new_tokens=budget + 1, scores=ref.true_dev).tokens[1:]
        answer, _ = answer_text(tok, tokens, stop_ids)
    out.update(gold_scores(example, answer))
    out["answer"] = answer
    mask = np.asarray(forced.trace["recomputed"])[:, :n]
    if name == "full_recompute":
        mask = np.ones_like(mask)
    out["flop_fraction"] = metrics.recompute_flop_fraction(setup.model.config, mask, n, forced.qkv_checks)
    if detailed:
        k, v = np.asarray(forced.trace["k"])[:, :n], np.asarray(forced.trace["v"])[:, :n]
        dev = metrics.relative_kv_deviation(metrics.kv_deviation(k, v, ref.k, ref.v), ref.k, ref.v)
        selectable, _ = prompt.roles.masks(n)
        sel, unsel = mask & selectable[None], ~mask & selectable[None]
        out["dev_selected"] = np.asarray([dev[i][sel[i]].mean() if sel[i].any() else np.nan for i in range(len(dev))])
        out["dev_unselected"] = np.asarray([dev[i][unsel[i]].mean() if unsel[i].any() else np.nan for i in range(len(dev))])
        valid = np.arange(config.eval.num_probes) < prompt.roles.num_forced
        out["attn_dev"] = metrics.attention_deviation(np.asarray(forced.trace["attn"]), ref.attn, valid)
        oracle = selection.select_oracle(prompt.roles, pol.recompute_ratio, ref.true_dev, 1)
        oracle_ids = np.setdiff1d(oracle.rows[oracle.rows_valid], np.arange(prompt.roles.suffix_start, n))
        out["oracle_recall"] = metrics.recall(np.flatnonzero(mask[-1] & selectable), oracle_ids)
    return out


def train_learned(setup: Setup, config: ml_collections.ConfigDict, sel_cfg: selection.SelectionConfig) -> tuple[tuple[float, ...], dict]:
    """Trains the learned scorer on the training prompts (features of a single-check run,
    oracle labels at the run's ratio); returns its parameters and the training-set recall of
    the learned and hand-made rules (top-k of each score vs the oracle's tokens)."""
    roles, features, devs = [], [], []
    single = dataclasses.replace(sel_cfg, selector="cacheblend_single")
    for example in setup.train_examples:
        prompt = BlendPrompt(example.prefix, example.chunks, example.suffix)
        for chunk in prompt.chunks:
            setup.store.put(chunk)
        n = prompt.roles.num_tokens
        exact = setup.blender.run(prompt, dataclasses.replace(sel_cfg, selector="all"), num_probes=1).trace
        reused = setup.blender.run(prompt, dataclasses.replace(sel_cfg, selector="none"), num_probes=1).trace
        devs.append(metrics.kv_deviation(np.asarray(reused["k"])[:, :n], np.asarray(reused["v"])[:, :n],
                                         np.asarray(exact["k"])[:, :n], np.asarray(exact["v"])[:, :n]))
        features.append(np.asarray(setup.blender.run(prompt, single, num_probes=1).trace["features"])[:n])
        roles.append(prompt.roles)
    data = scorer.training_set(roles, features, devs, sel_cfg.recompute_ratio)
    weights = scorer.train_scorer(data, hidden=config.learned.hidden, steps=config.learned.steps,
                                  learning_rate=config.learned.learning_rate, seed=config.seed)
    x = data.features
    rules = {"learned": np.asarray(selection.mlp_score(weights, x)), "key_deviation": x[:, 0],
             "kv_deviation": np.exp(x[:, 0]) + np.exp(x[:, 1]), "attention": x[:, 2],
             "fused": np.exp(x[:, 2]) + (np.exp(x[:, 0]) + np.exp(x[:, 1])) / 2, "first_tokens": -x[:, 3]}
    info = {"train_prompts": len(roles), "train_tokens": len(x),
            "train_recall": {name: scorer.top_k_recall(data, s) for name, s in rules.items()}}
    return weights, info


def controller_table(config: ml_collections.ConfigDict, setup: Setup, workdir: pathlib.Path, seconds_per_token_layer: float,
                     num_tokens: int) -> tuple[loading_controller.LoadingController, list[dict]]:
    """The loading controller (measured host/disk, configured HBM/NVMe) and its per-tier decisions."""
    tiers = [
        loading_controller.configured_tier("hbm", config.controller.hbm_gbps, 0.0, 3),
        loading_controller.measure_host_tier(),
        loading_controller.configured_tier("nvme", config.controller.nvme_gbps, config.controller.nvme_latency_ms, 1),
        loading_controller.measure_disk_tier(workdir),
    ]
    controller = loading_controller.LoadingController(
        tiers, seconds_per_token_layer, setup.engine.layout.bytes_per_token_layer, config.controller.min_ratio
    )
    rows = []
    for t in tiers:
        d = dataclasses.asdict(controller.decide(num_tokens, t.name))
        rows.append({"tier": t.name, "GB_per_s": t.bandwidth / 1e9, "latency_ms": t.latency * 1e3, "measured": t.measured,
                     **{k: d[k] for k in ("ratio", "break_even", "load_s", "recompute_s")}})
    return controller, rows


def ci_row(name: str, per_prompt: list[dict], nboot: int, seed: int, **extra: object) -> dict:
    """Mean and bootstrap 95% interval over prompts of every quality metric present."""
    row: dict = {"policy": name, **extra}
    for key in ("kl", "top1", "answer_agree", *GOLD_KEYS, "flop_fraction"):
        if key in per_prompt[0]:
            mean, lo, hi = metrics.bootstrap_ci([p[key] for p in per_prompt], num=nboot, seed=seed)
            row[key], row[f"{key}_lo"], row[f"{key}_hi"] = mean, lo, hi
    if "oracle_recall" in per_prompt[0]:
        row["recall_vs_oracle"] = float(np.mean([p["oracle_recall"] for p in per_prompt]))
    return row


def paired_rows(per_policy: dict[str, list[dict]], baseline: str, keys: tuple[str, ...], nboot: int, seed: int) -> list[dict]:
    """Per-prompt differences policy minus ``baseline`` with paired bootstrap intervals."""
    rows = []
    for name, results in per_policy.items():
        if name == baseline or baseline not in per_policy:
            continue
        for key in keys:
            if key in results[0]:
                mean, lo, hi = metrics.paired_bootstrap_ci([p[key] for p in results], [p[key] for p in per_policy[baseline]],
                                                           num=nboot, seed=seed)
                rows.append({"policy": name, "metric": key, f"minus_{baseline}": mean, "lo": lo, "hi": hi})
    return rows


def recovery(per_policy: dict[str, list[dict]], nboot: int, seed: int) -> dict:
    """Gold loss of full reuse against full recompute (paired CI) and the share of it each
    selector recovers: (selector - full reuse) / (full recompute - full reuse), from means."""
    full, reuse = per_policy.get("full_recompute"), per_policy.get("full_reuse")
    if not full or not reuse:
        return {}
    f = np.asarray([p["gold"] for p in full])
    r = np.asarray([p["gold"] for p in reuse])
    loss, lo, hi = metrics.paired_bootstrap_ci(r, f, num=nboot, seed=seed)
    shares = {}
    for name, results in per_policy.items():
        if name in ("full_recompute", "full_reuse", "prefix_caching"):
            continue
        s = np.asarray([p["gold"] for p in results])
        shares[name] = float((s.mean() - r.mean()) / (f.mean() - r.mean())) if f.mean() != r.mean() else float("nan")
    return {"reuse_minus_full": loss, "lo": lo, "hi": hi, "recovered_share": shares}


__all__ = ["GOLD_KEYS", "Reference", "Setup", "build", "check_disjoint", "ci_row", "controller_table", "evaluate",
           "paired_rows", "recovery", "reference", "selection_config", "timed", "train_learned", "workload_examples"]
