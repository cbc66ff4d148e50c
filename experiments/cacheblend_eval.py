"""Evaluation for the CacheBlend experiment: the engine, the workload's train and eval prompts,
the full-recompute reference of a prompt, each policy's one prefill and its quality against
the reference (KL, top-1, gold-answer likelihood, gold score, FLOP fraction, deviations),
the learned scorer's training, and the aggregation into rows with bootstrap intervals over
prompts.

Per prompt and policy there is one prefill, timed alone with nothing compiling in it
(``timed`` re-runs a prefill that compiled). Its KV stays in the engine's tree under the
run's scope, and ordinary requests continue it (``Blender.extend``, the runs of
``eval.decode_batch`` policies together): the reference's greedy continuation of N tokens
fed behind the prompt (teacher forcing: the policy's logits at every position along the
reference), each gold answer fed the same way (its mean log-probability per token,
``gold_ll``), and, when the policy's top-1 leaves the reference inside the answer, its own
greedy answer from there (which ends at the stop token when the fed tokens already started
the answer). The reference itself is the full-recompute request, generating N tokens.

Shapes: L = layers, T = prompt tokens, K = kv heads, d = head_dim, V = vocab, N = continuation,
P = probe rows, H = heads.
"""

from __future__ import annotations

import dataclasses
import itertools
import pathlib
from collections.abc import Sequence

import ml_collections
import numpy as np

from experiments import statistics
from experiments.blender import FULL_RECOMPUTE, Blender, Extension, PolicyRun
from experiments.policies import OWN_SELECTORS, POLICIES, PUBLISHED_SELECTORS
from experiments.timing import compilations_during
from experiments.workloads import WORKLOADS, gold_scores, gold_targets
from experiments.workloads.rag import RagExample
from kvjax import metrics
from kvjax.blend import loading_controller, scorer, scoring, selection
from kvjax.blend.chunk_store import ChunkStore
from kvjax.blend.prompt import BlendPrompt
from kvjax.cache import TierThrottle
from kvjax.config import KvCacheConfig, SchedulerConfig
from kvjax.engine import Engine, RequestOutput
from kvjax.model.registry import Model, load_model
from kvjax.model.tokenizer import Tokenizer

GOLD_KEYS = ("gold", "f1", "em", "exact", "recall")
"""Gold scores a workload may report (``workloads.gold_scores``); "gold" is its headline."""
LIKELIHOOD = "gold_ll"
"""Gold-answer likelihood: the best gold answer's mean log-probability per token (nats),
teacher-forced behind the prompt over the policy's KV (``answer_log_likelihood``)."""
_TRAIN_SEED = 1_000_003
"""Seed offset of the training prompts: the synthetic workload has no hash split, and the
needles of a needle-in-a-haystack prompt come from the seed, not from the essays."""


@dataclasses.dataclass
class Setup:
    """The model, the engine and the prompts of one run.

    Attributes:
      max_chunk_tokens: the longest chunk the store takes (a windowed layer group keeps a
        stored chunk whole only inside its window); longer chunks were split.
      num_split_chunks: chunks of the evaluation and training prompts split to fit it.
    """

    model: Model
    stop_ids: tuple[int, ...]
    engine: Engine
    store: ChunkStore
    blender: Blender
    examples: list[RagExample]  # evaluation prompts
    train_examples: list[RagExample]  # the learned scorer's training prompts (disjoint)
    max_chunk_tokens: int
    num_split_chunks: int

    @property
    def prompts(self) -> list[BlendPrompt]:
        return [BlendPrompt(e.prefix, e.chunks, e.suffix) for e in self.examples]


def workload_examples(
    config: ml_collections.ConfigDict, tokenizer: Tokenizer, *, split: str, num: int
) -> list[RagExample]:
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


def split_long_chunks(example: RagExample, limit: int) -> tuple[RagExample, int]:
    """``example`` with every chunk longer than ``limit`` tokens cut into the fewest pieces of
    near-equal length (each precomputed alone, as a retriever's passages would be); returns it
    and the number of chunks cut. ``fact_chunks`` follow their chunks' first piece and pieces."""
    chunks, facts, first, cut = [], [], [], 0
    for i, chunk in enumerate(example.chunks):
        pieces = -(-len(chunk) // limit)
        cut += pieces > 1
        first.append(len(chunks))
        bounds = np.linspace(0, len(chunk), pieces + 1).round().astype(int)
        chunks += [chunk[a:b] for a, b in itertools.pairwise(bounds)]
        if i in example.fact_chunks:
            facts += range(len(chunks) - pieces, len(chunks))
    return dataclasses.replace(example, chunks=tuple(chunks), fact_chunks=tuple(facts)), cut


def build(config: ml_collections.ConfigDict) -> Setup:
    """Loads the model, builds the prompts (from ``workload.split``, and the learned scorer's
    training prompts if it runs) and the engine; chunks too long for the store are split
    (``split_long_chunks``)."""
    unknown = [p for p in config.policies if p not in POLICIES]
    if unknown or "full_recompute" not in config.policies:
        raise ValueError(
            f"policies={tuple(config.policies)} must include 'full_recompute' and only names from {POLICIES}"
        )
    split = config.workload.split
    needs_training = "learned" in config.policies or "learned" in config.sweep.policies
    if split not in ("eval", "train") or (split == "train" and needs_training):
        raise ValueError(
            f"workload.split={split!r} must be 'eval', or 'train' (selector development) without the 'learned' "
            "policy, whose scorer trains on that split"
        )
    model = load_model(config.model, config.gguf_path or None, config.param_dtype or None)
    tok = model.tokenizer
    # Chat models stop at <|im_end|>; a base model's answer (after the prefilled stem) ends at a newline.
    stop_text = "<|im_end|>" if tok.chat_format == "chatml" else "\n"
    stop_ids = tuple(model.config.eos_ids) + tuple(tok.encode(stop_text, add_bos=False))
    examples = workload_examples(config, tok, split=split, num=config.num_prompts)
    train = workload_examples(config, tok, split="train", num=config.learned.train_prompts) if needs_training else []
    check_disjoint(train, examples)
    bucket, ps = config.runtime.token_bucket, config.runtime.tokens_per_block
    longest = max(len(e.prefix) + sum(map(len, e.chunks)) + len(e.suffix) for e in examples + train)
    engine = Engine(
        model, KvCacheConfig(tokens_per_block=ps, max_tokens=config.store.cache_tokens),
        SchedulerConfig(max_num_tokens=8192, prefill_chunk_size=8192, max_batch_size=config.eval.decode_batch),
        max_seq_len=longest + config.eval.continuation_tokens + config.eval.max_answer_tokens + bucket,
        attn_impl=config.runtime.attn_impl, max_finished_requests=64,
    )
    store = ChunkStore(engine, variant=config.store.variant, prefix_tokens=examples[0].prefix)
    windows = engine.manager.group_windows
    room = min(windows) - 1 if len(windows) > 1 else engine.max_seq_len - ps  # a stored chunk, padded, plus one sample
    limit = room // ps * ps - store.stored_start
    if limit < 1:
        raise ValueError(
            f"runtime.tokens_per_block={ps} leaves no room for a chunk in the smallest window {min(windows)}"
        )
    fitted = [split_long_chunks(e, limit) for e in examples + train]
    examples, train = [e for e, _ in fitted[: len(examples)]], [e for e, _ in fitted[len(examples):]]
    return Setup(model, stop_ids, engine, store, Blender(store, token_bucket=bucket), examples, train, limit,
                 sum(n for _, n in fitted))


def answer_tokens(setup: Setup, example: RagExample) -> list[tuple[int, ...]]:
    """Token ids of each gold answer (``gold_targets``) as the model would write it after the
    prompt: a base model's answer follows "Answer:" after a space; the answer ends with the
    stop token (the likelihood counts stopping there)."""
    tok = setup.model.tokenizer
    lead = "" if tok.chat_format == "chatml" else " "
    return [(*tok.encode(lead + text, add_bos=False), setup.stop_ids[-1]) for text in gold_targets(example)]


def selection_config(config: ml_collections.ConfigDict, ratio: float) -> selection.SelectionConfig:
    """The run's one selection config (selector "cacheblend"; policies swap the selector)."""
    p = config.policy
    return selection.SelectionConfig(
        recompute_ratio=ratio, check_layers=tuple(p.check_layers), budgets=tuple(p.budgets), deviation=p.deviation,
        row_bucket=p.row_bucket, seed=config.seed, query_rows=p.query_rows,
    )


@dataclasses.dataclass
class Reference:
    """Full recompute of one prompt: its run (TTFT, KV), continuation and logits, exact KV,
    the reused KV's deviation and the suffix attention.

    Attributes:
      run: the full-recompute request (its KV under ``run.scope``).
      continuation: [N] its greedy tokens; logits: [N, V] their logits.
      answer_len: tokens of the greedy answer (``answer_text``), its stop token included.
      k, v: [L, T, K, d] exact KV; true_dev: [L, T] deviation of the reused KV (full reuse);
      attn: [L, P, H*d] attention output of the probe rows (empty when the exact KV came
        from the request's pages).
      last_logit_error: max |difference| of the last prompt logits between the blended
        path recomputing every token (selector "all") and the full-recompute request (NaN
        when that path did not run).
    """

    run: PolicyRun
    continuation: np.ndarray
    logits: np.ndarray
    answer_len: int
    answer: str
    k: np.ndarray
    v: np.ndarray
    true_dev: np.ndarray
    attn: np.ndarray
    last_logit_error: float


@dataclasses.dataclass
class TimingLog:
    """Compilation kept out of timed figures.

    Attributes:
      timed_runs: prefills timed.
      warmup_runs: prefills that compiled and were run again before timing.
      warmup_s: wall seconds of those runs (compilation included).
      compiles_in_timed: programs compiled inside a timed prefill (always 0: ``timed`` raises otherwise).
    """

    timed_runs: int = 0
    warmup_runs: int = 0
    warmup_s: float = 0.0
    compiles_in_timed: int = 0


MAX_WARMUPS = 3
"""Runs of one prefill that may compile before ``timed`` gives up."""


def timed(setup: Setup, prompt: BlendPrompt, pol: selection.SelectionConfig | str, log: TimingLog, *,
          scores: np.ndarray | None = None, max_new_tokens: int = 1) -> PolicyRun:
    """One policy's prefill (alone on the engine) with its TTFT; a run during which JAX
    compiled anything is discarded and run again, so the returned TTFT holds no compilation.

    Raises:
      RuntimeError: it still compiled after ``MAX_WARMUPS`` runs (shapes that never repeat).
    """
    scores = None if pol == FULL_RECOMPUTE else scores
    for _ in range(MAX_WARMUPS):
        run, compiled = compilations_during(
            lambda: setup.blender.run(prompt, pol, scores=scores, max_new_tokens=max_new_tokens, fill_last_page=True))
        if not compiled.programs:
            log.timed_runs += 1
            return run
        log.warmup_runs += 1
        log.warmup_s += run.ttft_s
    log.compiles_in_timed += compiled.programs
    raise RuntimeError(f"policy {pol!r} compiled {compiled.programs} programs in each of {MAX_WARMUPS} runs")


def _answer_start(tokenizer: Tokenizer, tokens: Sequence[int], stop_ids: tuple[int, ...]) -> int:
    """Index of the first token that is neither a stop token nor whitespace (len if none)."""
    return next(
        (i for i, t in enumerate(tokens) if t not in stop_ids and tokenizer.decode([int(t)]).strip()), len(tokens)
    )


def answer_started(tokenizer: Tokenizer, tokens: Sequence[int], stop_ids: tuple[int, ...]) -> bool:
    """Whether ``tokens`` hold the answer's first token, so the next stop token ends it."""
    return _answer_start(tokenizer, tokens, stop_ids) < len(tokens)


def answer_text(tokenizer: Tokenizer, tokens: list[int], stop_ids: tuple[int, ...]) -> tuple[str, int]:
    """Decoded answer and its length in tokens (stop included): leading whitespace tokens and
    stop tokens are skipped, then the answer runs to the next stop token."""
    start = _answer_start(tokenizer, tokens, stop_ids)
    end = next((i + 1 for i in range(start, len(tokens)) if tokens[i] in stop_ids), len(tokens))
    return tokenizer.decode(tokens[start:end]).strip(), end


def reference(setup: Setup, prompt: BlendPrompt, sel_cfg: selection.SelectionConfig, config: ml_collections.ConfigDict,
              log: TimingLog, *, detailed: bool = True) -> Reference:
    """Full recompute of ``prompt`` (timed, N greedy tokens), plus the exact and fully reused KV.

    The exact KV is the full-recompute request's own, read from its pages (``Blender.cached_kv``)
    up to the prompt's last full block; the tokens after it (the suffix's tail, recomputed by
    every policy) take the reused run's KV, so their deviation is 0. With ``detailed``, or
    when a sliding window leaves no pages for the early tokens of some layers, the blended path
    recomputing every token (selector "all") gives the exact KV instead, with the probe
    attention and ``last_logit_error``.
    """
    n, blender = prompt.roles.num_tokens, setup.blender
    full = timed(setup, prompt, FULL_RECOMPUTE, log, max_new_tokens=config.eval.continuation_tokens)
    continuation = np.asarray(full.tokens, np.int32)
    answer, answer_len = answer_text(
        setup.model.tokenizer, continuation.tolist()[: config.eval.max_answer_tokens], setup.stop_ids
    )
    probes = config.eval.num_probes
    windowed = len(setup.engine.manager.group_windows) > 1
    cached = None if detailed or windowed else blender.cached_kv(full)
    reused = blender.run(prompt, dataclasses.replace(sel_cfg, selector="none"), num_probes=probes).trace
    k_reused, v_reused = np.asarray(reused["k"])[:, :n], np.asarray(reused["v"])[:, :n]
    if cached is None:
        exact = blender.run(prompt, dataclasses.replace(sel_cfg, selector="all"), num_probes=probes)
        k_full, v_full = np.asarray(exact.trace["k"])[:, :n], np.asarray(exact.trace["v"])[:, :n]
        attn, error = np.asarray(exact.trace["attn"]), float(np.abs(exact.logits[0] - full.logits[0]).max())
    else:
        covered = cached[0].shape[1]
        k_full, v_full = (np.concatenate([c, r[:, covered:]], axis=1) for c, r in zip(cached, (k_reused, v_reused)))
        attn, error = np.zeros((0,), np.float32), float("nan")
    true_dev = metrics.kv_deviation(k_reused, v_reused, k_full, v_full)
    return Reference(full, continuation, full.logits, answer_len, answer, k_full, v_full, true_dev, attn, error)


def _quality(ref: Reference, logits: np.ndarray) -> dict:
    kl = metrics.kl_divergence(ref.logits, logits)
    div = metrics.first_divergence(ref.logits, logits)
    return {"kl": float(kl.mean()), "top1": float(metrics.top1_agreement(ref.logits, logits).mean()), "first_div": div,
            "answer_agree": float(div >= ref.answer_len)}


def _answer_extensions(run: PolicyRun, answers: list[tuple[int, ...]]) -> list[Extension]:
    """Each answer teacher-forced behind ``run``'s prompt over its KV, keeping the logits
    before each answer token."""
    return [Extension(run, a[:-1], prompt_logits=len(a)) for a in answers]


def _best_likelihood(outputs: Sequence[RequestOutput], answers: list[tuple[int, ...]]) -> float:
    """The best of ``answers``' mean log-probabilities per token (``_answer_extensions``' outputs)."""
    return max(metrics.answer_log_likelihood(o.prompt_logits, a) for o, a in zip(outputs, answers))


def _recall_vs_oracle(prompt: BlendPrompt, ratio: float, ref: Reference, recomputed: np.ndarray) -> float:
    """Share of the oracle's chunk tokens (highest true deviation) that the last layer recomputed."""
    selectable, _ = prompt.roles.masks(prompt.roles.num_tokens)
    oracle = selection.select_oracle(prompt.roles, ratio, ref.true_dev, 1)
    oracle_ids = np.setdiff1d(
        oracle.rows[oracle.rows_valid], np.arange(prompt.roles.suffix_start, prompt.roles.num_tokens)
    )
    return metrics.recall(np.flatnonzero(recomputed[-1] & selectable), oracle_ids)


def _deviations(setup: Setup, prompt: BlendPrompt, pol: selection.SelectionConfig, ref: Reference,
                config: ml_collections.ConfigDict) -> dict:
    """Per-layer KV deviation of the selected and the reused tokens, and the suffix attention
    deviation, from a traced (untimed) run of the policy."""
    n = prompt.roles.num_tokens
    trace = setup.blender.run(prompt, pol, num_probes=config.eval.num_probes, scores=ref.true_dev).trace
    mask = np.asarray(trace["recomputed"])[:, :n]
    k, v = np.asarray(trace["k"])[:, :n], np.asarray(trace["v"])[:, :n]
    dev = metrics.relative_kv_deviation(metrics.kv_deviation(k, v, ref.k, ref.v), ref.k, ref.v)
    selectable, _ = prompt.roles.masks(n)
    sel, unsel = mask & selectable[None], ~mask & selectable[None]
    valid = np.arange(config.eval.num_probes) < prompt.roles.num_forced
    return {
        "dev_selected": np.asarray([dev[i][sel[i]].mean() if sel[i].any() else np.nan for i in range(len(dev))]),
        "dev_unselected": np.asarray([dev[i][unsel[i]].mean() if unsel[i].any() else np.nan for i in range(len(dev))]),
        "attn_dev": metrics.attention_deviation(np.asarray(trace["attn"]), ref.attn, valid),
    }


def _model_ttft(results: dict[str, dict], timed_keys: Sequence[str]) -> None:
    """Sets ``ttft_s`` of the batched sweep points (``ttft_batch_s``, the batch's time, is no
    one variant's) from the prompt's blended runs timed alone: the least-squares line of
    their TTFT against their FLOP fraction (the blended prefill costs a fixed part plus one
    proportional to the rows it recomputes, ``loading_controller.RecomputeCost``), at each
    point's FLOP fraction; ``ttft_modelled`` marks them.

    Raises:
      ValueError: fewer than two timed blended runs with distinct FLOP fractions.
    """
    flops = np.asarray([results[k]["flop_fraction"] for k in timed_keys])
    ttft = np.asarray([results[k]["ttft_s"] for k in timed_keys])
    if len(np.unique(flops)) < 2:
        raise ValueError(
            f"the batched sweep's TTFT is modelled on the prompt's blended runs timed alone: got {list(timed_keys)}, "
            "which need two distinct FLOP fractions (add full_reuse to the policies, or set sweep.batched=False)"
        )
    slope, fixed = np.polyfit(flops, ttft, 1)
    for out in results.values():
        if "ttft_batch_s" in out:
            out["ttft_s"], out["ttft_modelled"] = float(fixed + slope * out["flop_fraction"]), True


def evaluate_prompt(
    setup: Setup,
    example: RagExample,
    runs: Sequence[tuple[str, str, selection.SelectionConfig | str]],
    ref: Reference,
    config: ml_collections.ConfigDict,
    log: TimingLog,
    *,
    detailed: bool,
) -> dict[str, dict]:
    """Every run of one prompt against its reference.

    Each policy's prefill is timed alone; with ``sweep.batched`` the sweep points ("epic@0.3")
    of one ratio run together instead (``Blender.run_together``: one batched blended prefill)
    and their TTFT is modelled (``_model_ttft``).

    Args:
      runs: (key, policy name, policy) per run; keys are unique ("cacheblend", "epic@0.3", ...).
      detailed: adds per-layer deviations (a traced run per policy, untimed).

    Returns:
      {key: metrics}: ttft_s, kl, top1, first_div, answer_agree, gold_ll, the gold scores and answer,
      flop_fraction, recall_vs_oracle, phases (seconds of the blended prefill's parts), for a
      batched sweep point ttft_batch_s and ttft_modelled, and with ``detailed``
      dev_selected, dev_unselected, attn_dev [L].
    """
    prompt = BlendPrompt(example.prefix, example.chunks, example.suffix)
    n, cfg, tok = prompt.roles.num_tokens, setup.model.config, setup.model.tokenizer
    budget = config.eval.max_answer_tokens
    results: dict[str, dict] = {}
    scoring: list[tuple[str, PolicyRun]] = []  # runs whose teacher-forced extensions go together
    answers = answer_tokens(setup, example)
    continuation = tuple(ref.continuation[:-1].tolist())

    def score_runs() -> None:
        """The waiting runs' teacher-forced continuations and gold answers in one ``extend``,
        then the greedy answers of those whose top-1 leaves the reference inside the answer,
        decoded together (every run's KV is cached meanwhile)."""
        per_run = 1 + len(answers)
        outputs = setup.blender.extend([ext for _, run in scoring for ext in (
            Extension(run, continuation, prompt_logits=len(ref.continuation)), *_answer_extensions(run, answers))])
        pending: dict[str, Extension] = {}
        for i, (key, run) in enumerate(scoring):
            forced, *golds = outputs[i * per_run : (i + 1) * per_run]
            out = results[key]
            out.update(_quality(ref, forced.prompt_logits), **{LIKELIHOOD: _best_likelihood(golds, answers)})
            if out["first_div"] < ref.answer_len:
                div = out["first_div"]
                feed = ref.continuation[:div]
                # then a stop token ends it
                stop = setup.stop_ids[-1] if answer_started(tok, feed, setup.stop_ids) else None
                pending[key] = Extension(run, tuple(feed.tolist()), max_new_tokens=budget - div, stop_token_id=stop)
        for (key, ext), out in zip(pending.items(), setup.blender.extend(list(pending.values()))):
            results[key]["answer"], _ = answer_text(tok, [*ext.feed, *out.output], setup.stop_ids)
        scoring.clear()

    def blended(key: str, run: PolicyRun, pol: selection.SelectionConfig) -> None:
        report = run.report
        results[key] = {
            "ttft_s": run.ttft_s,
            "flop_fraction": metrics.recompute_flop_fraction(cfg, report.recomputed, n, run.qkv_checks),
            "recall_vs_oracle": _recall_vs_oracle(prompt, pol.recompute_ratio, ref, report.recomputed),
            "phases": {"load_s": report.load_s, **{f"{k}_s": v for k, v in report.phases.items()}},
            "answer": ref.answer,
        }
        scoring.append((key, run))
        if len(scoring) >= config.eval.decode_batch:
            score_runs()

    traced: list[tuple[str, selection.SelectionConfig]] = []
    together: dict[float, list[tuple[str, selection.SelectionConfig]]] = {}  # sweep points batched per ratio
    done: dict[selection.SelectionConfig | str, str] = {}  # a sweep point at the run's ratio is the policy's own run
    for key, _name, pol in runs:
        if pol in done:
            results[key] = results[done[pol]]
            continue
        done[pol] = key
        if "@" in key and config.sweep.batched:
            together.setdefault(pol.recompute_ratio, []).append((key, pol))
            continue
        if pol == FULL_RECOMPUTE:
            gold_ll = _best_likelihood(setup.blender.extend(_answer_extensions(ref.run, answers)), answers)
            results[key] = {"ttft_s": ref.run.ttft_s, "kl": 0.0, "top1": 1.0, "first_div": len(ref.continuation),
                            "answer_agree": 1.0, "flop_fraction": 1.0, "recall_vs_oracle": 1.0, "phases": {},
                            "answer": ref.answer, LIKELIHOOD: gold_ll}
            continue
        run = timed(setup, prompt, pol, log, scores=ref.true_dev)
        if detailed and "@" not in key:
            traced.append((key, pol))
        blended(key, run, pol)
    timed_keys = [key for key in results if key in done.values() and "@" not in key and results[key]["phases"]]
    for points in together.values():
        if scoring:
            score_runs()  # only the batch's runs and their extensions hold pages meanwhile
        batch = setup.blender.run_together(prompt, [pol for _, pol in points], scores=ref.true_dev, fill_last_page=True)
        for (key, pol), run in zip(points, batch):
            blended(key, run, pol)
            results[key]["ttft_batch_s"] = results[key].pop("ttft_s")
    if scoring:
        score_runs()
    if together:
        _model_ttft(results, timed_keys)
    for key, pol in traced:  # after the answers: their runs' blocks are the oldest in the cache
        results[key].update(_deviations(setup, prompt, pol, ref, config))
    results = {key: dict(out) for key, out in results.items()}  # sweep points at the run's ratio get their own copy
    for out in results.values():
        out.update(gold_scores(example, out["answer"]))
    return results


def train_learned(
    setup: Setup, config: ml_collections.ConfigDict, sel_cfg: selection.SelectionConfig
) -> tuple[tuple[float, ...], dict]:
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
        exact = setup.blender.run(
            prompt, dataclasses.replace(sel_cfg, selector="all"), num_probes=config.eval.num_probes
        ).trace
        reused = setup.blender.run(
            prompt, dataclasses.replace(sel_cfg, selector="none"), num_probes=config.eval.num_probes
        ).trace
        devs.append(metrics.kv_deviation(np.asarray(reused["k"])[:, :n], np.asarray(reused["v"])[:, :n],
                                         np.asarray(exact["k"])[:, :n], np.asarray(exact["v"])[:, :n]))
        features.append(
            np.asarray(setup.blender.run(prompt, single, num_probes=config.eval.num_probes).trace["features"])[:n]
        )
        roles.append(prompt.roles)
    data = scorer.training_set(roles, features, devs, sel_cfg.recompute_ratio)
    weights = scorer.train_scorer(data, hidden=config.learned.hidden, steps=config.learned.steps,
                                  learning_rate=config.learned.learning_rate, seed=config.seed)
    x = data.features
    rules = {"learned": np.asarray(scoring.mlp_score(weights, x)), "key_deviation": x[:, 0],
             "kv_deviation": np.exp(x[:, 0]) + np.exp(x[:, 1]), "attention": x[:, 2],
             "fused": np.exp(x[:, 2]) + (np.exp(x[:, 0]) + np.exp(x[:, 1])) / 2, "first_tokens": -x[:, 3]}
    info = {"train_prompts": len(roles), "train_tokens": len(x),
            "train_recall": {name: scorer.top_k_recall(data, s) for name, s in rules.items()}}
    return weights, info


def controller_table(config: ml_collections.ConfigDict, setup: Setup, workdir: pathlib.Path,
                     num_tokens: int) -> tuple[loading_controller.LoadingController, list[dict]]:
    """The loading controller measured on this machine (the device tier, the host and disk tiers
    read through ``config.controller``'s throttles, the blended layer step's recompute cost at
    ``num_tokens`` tokens) and its per-tier decisions."""
    c = config.controller
    throttles = {
        "host": TierThrottle(c.host_read_gbps, c.host_latency_ms),
        "disk": TierThrottle(c.disk_read_gbps, c.disk_latency_ms),
    }
    engine = setup.engine
    cost = loading_controller.measure_recompute(engine.model.params, engine.model.config, engine.layout, num_tokens,
                                                attn_impl=config.runtime.attn_impl)
    tiers = [loading_controller.TierSpec("device", float("inf"), 0.0, cost_rank=2)]
    tiers += [
        loading_controller.measure_tier(engine.layout, name, throttles[name], num_tokens, str(workdir))
        for name in ("host", "disk")
    ]
    controller = loading_controller.LoadingController(
        tiers, cost.seconds_per_token_layer, engine.layout.bytes_per_token_layer, c.min_ratio, cost.fixed_s, c.headroom
    )
    rows = []
    for t in tiers:
        d = dataclasses.asdict(controller.decide(num_tokens, t.name))
        rows.append({"tier": t.name, "GB_per_s": t.bandwidth / 1e9, "latency_ms": t.latency * 1e3,
                     **{k: d[k] for k in ("ratio", "break_even", "load_s", "recompute_s")}})
    return controller, rows


def ci_row(name: str, per_prompt: list[dict], nboot: int, seed: int, **extra: object) -> dict:
    """Mean and bootstrap 95% interval over prompts of every quality metric present."""
    row: dict = {"policy": name, **extra}
    for key in ("kl", "top1", "answer_agree", LIKELIHOOD, *GOLD_KEYS, "flop_fraction"):
        if key in per_prompt[0]:
            mean, lo, hi = statistics.bootstrap_ci([p[key] for p in per_prompt], num=nboot, seed=seed)
            row[key], row[f"{key}_lo"], row[f"{key}_hi"] = mean, lo, hi
    if "recall_vs_oracle" in per_prompt[0]:
        row["recall_vs_oracle"] = float(np.mean([p["recall_vs_oracle"] for p in per_prompt]))
    return row


def speed_row(per_prompt: list[dict], full: list[dict], nboot: int, seed: int) -> dict:
    """TTFT against full recompute's on the same prompts: mean and median TTFT, the speedup
    (full recompute's total TTFT over the policy's, with a bootstrap interval over prompts)
    and the time fraction (its inverse)."""
    t = np.asarray([p["ttft_s"] for p in per_prompt])
    f = np.asarray([p["ttft_s"] for p in full])
    speedup, lo, hi = statistics.bootstrap_statistic(
        (f, t), lambda a, b: a.mean(axis=-1) / b.mean(axis=-1), num=nboot, seed=seed
    )
    return {"ttft_mean_s": float(t.mean()), "ttft_median_s": float(np.median(t)), "speedup": speedup, "speedup_lo": lo,
            "speedup_hi": hi, "time_fraction": float(t.mean() / f.mean())}


TOLERANCE = {"kl": 1e-4, LIKELIHOOD: 1e-3}
"""Smallest difference called significant, per metric (nats for kl and gold_ll); every other
metric is a share in [0, 1], with ``DEFAULT_TOLERANCE``. Two paths computing the same KV
differ by float rounding far below these (KL ~1e-11)."""
DEFAULT_TOLERANCE = 1e-3


def paired_rows(
    per_policy: dict[str, list[dict]], baseline: str, keys: tuple[str, ...], nboot: int, seed: int
) -> list[dict]:
    """Per-prompt differences policy minus ``baseline`` with paired bootstrap intervals;
    ``significant``: the interval excludes 0 and the difference exceeds the metric's
    ``TOLERANCE`` in magnitude."""
    rows = []
    for name, results in per_policy.items():
        if name == baseline or baseline not in per_policy:
            continue
        for key in keys:
            if key in results[0]:
                mean, lo, hi = statistics.paired_bootstrap_ci(
                    [p[key] for p in results], [p[key] for p in per_policy[baseline]], num=nboot, seed=seed
                )
                tol = TOLERANCE.get(key, DEFAULT_TOLERANCE)
                rows.append(
                    {
                        "policy": name,
                        "metric": key,
                        "baseline": baseline,
                        "difference": mean,
                        "lo": lo,
                        "hi": hi,
                        "tolerance": tol,
                        "significant": bool((lo > 0 or hi < 0) and abs(mean) > tol),
                    }
                )
    return rows


def _share(s: np.ndarray, r: np.ndarray, f: np.ndarray) -> np.ndarray:
    """(selector - full reuse) / (full recompute - full reuse) of the means over the last axis."""
    gap = f.mean(axis=-1) - r.mean(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(gap != 0, (s.mean(axis=-1) - r.mean(axis=-1)) / gap, np.nan)


def recovery(per_policy: dict[str, list[dict]], nboot: int, seed: int, key: str = LIKELIHOOD) -> dict:
    """Loss of full reuse against full recompute on ``key`` (paired CI) and the share of it
    each selector recovers, (selector - full reuse) / (full recompute - full reuse) of the
    means, with a bootstrap interval over prompts (NaN where a resample has no loss to recover)."""
    full, reuse = per_policy.get("full_recompute"), per_policy.get("full_reuse")
    if not full or not reuse or key not in full[0]:
        return {}
    f = np.asarray([p[key] for p in full])
    r = np.asarray([p[key] for p in reuse])
    loss, lo, hi = statistics.paired_bootstrap_ci(r, f, num=nboot, seed=seed)
    shares = {}
    for name, results in per_policy.items():
        if name in ("full_recompute", "full_reuse", "prefix_caching"):
            continue
        s = np.asarray([p[key] for p in results])
        shares[name] = statistics.bootstrap_statistic((s, r, f), _share, num=nboot, seed=seed)
    return {"metric": key, "reuse_minus_full": loss, "lo": lo, "hi": hi, "recovered_share": shares}


RECOVERED = (0.95, 0.99)
"""Shares of full reuse's loss a selector's budget is read at."""
RELATIVE_DROP = 0.01
"""The quality drop QCFuse and SIFT report speedups at: a metric >= (1 - drop) x full
recompute's (gold_ll, in nats: per-token probability >= (1 - drop) x full recompute's)."""


def goal(key: str, reuse: np.ndarray, full: np.ndarray, *, recovered: float | None = None) -> np.ndarray:
    """The mean a selector must reach on ``key`` (means [...] of full reuse and full recompute):
    ``recovered`` of full reuse's loss, or with None full recompute's within ``RELATIVE_DROP``."""
    if recovered is not None:
        return reuse + recovered * (full - reuse)
    if key == LIKELIHOOD:
        return full + np.log1p(-RELATIVE_DROP)
    return (1 - RELATIVE_DROP) * full


def ratio_at_goal(ratios: Sequence[float], scores: np.ndarray, reuse: np.ndarray, full: np.ndarray,
                  target: np.ndarray) -> np.ndarray:
    """Smallest recompute ratio whose mean score reaches ``target``, on the piecewise-linear
    curve through (0, full reuse), the sweep's (ratio, mean) points and (1, full recompute).
    Vectorized over leading axes (bootstrap resamples).

    Args:
      ratios: [R] increasing sweep ratios in (0, 1).
      scores: [..., R, P] per ratio and prompt; reuse, full: [..., P]; target: [...].

    Returns:
      [...] ratios: 0 when full reuse reaches the target, 1 when only full recompute does,
      NaN when not even full recompute does.
    """
    x = np.asarray([0.0, *ratios, 1.0])
    y = np.concatenate([reuse.mean(-1)[..., None], scores.mean(-1), full.mean(-1)[..., None]], axis=-1)  # [..., R + 2]
    g = np.asarray(target)
    reached = y >= g[..., None] - 1e-12
    first = np.argmax(reached, axis=-1)
    prev = np.maximum(first - 1, 0)
    take = lambda a, i: np.take_along_axis(a, i[..., None], axis=-1)[..., 0]
    y0, y1 = take(y, prev), take(y, first)
    with np.errstate(divide="ignore", invalid="ignore"):
        frac = np.where(y1 > y0, (g - y0) / (y1 - y0), 1.0)
    ratio = np.where(first == 0, 0.0, x[prev] + np.clip(frac, 0, 1) * (x[first] - x[prev]))
    return np.where(reached.any(axis=-1), ratio, np.nan)


def _goals() -> list[tuple[str, float | None]]:
    """(label, recovered share or None for the relative drop) of each budget column."""
    return [*((f"{round(100 * t)}%", t) for t in RECOVERED), (f"{RELATIVE_DROP:.0%} drop", None)]


def _sweep_ratios(sweep: dict[tuple[str, float], list[dict]], name: str) -> list[float]:
    return sorted(r for n, r in sweep if n == name and sweep[(n, r)])


def _ratios_needed(sweep: dict[tuple[str, float], list[dict]], per_policy: dict[str, list[dict]], name: str, key: str,
                   share: float | None, idx: np.ndarray) -> tuple[float, np.ndarray]:
    """The ratio ``name`` needs on ``key`` for ``share`` (``goal``), on all the sweep's prompts
    and on each resample ``idx`` [B, P] of them: (ratio, [B] ratios)."""
    ratios = _sweep_ratios(sweep, name)
    p = idx.shape[1]
    scores = np.asarray([[q[key] for q in sweep[(name, r)][:p]] for r in ratios])  # [R, P]
    reuse = np.asarray([q[key] for q in per_policy["full_reuse"][:p]])
    full = np.asarray([q[key] for q in per_policy["full_recompute"][:p]])
    ratio = float(ratio_at_goal(ratios, scores, reuse, full, goal(key, reuse.mean(), full.mean(), recovered=share)))
    boot = ratio_at_goal(ratios, scores[:, idx].transpose(1, 0, 2), reuse[idx], full[idx],
                         goal(key, reuse[idx].mean(-1), full[idx].mean(-1), recovered=share))
    return ratio, boot


def budget_rows(sweep: dict[tuple[str, float], list[dict]], per_policy: dict[str, list[dict]], nboot: int, seed: int,
                keys: tuple[str, ...] = (LIKELIHOOD, "gold")) -> list[dict]:
    """Per swept selector and metric: the smallest ratio recovering each of ``RECOVERED`` of
    full reuse's loss and the one within ``RELATIVE_DROP`` of full recompute
    (``ratio_at_goal``, bootstrap 95% interval over the sweep's prompts), with the mean TTFT
    there and the speedup over full recompute's (TTFT interpolated on the sweep's means,
    full reuse at 0 and full recompute at 1)."""
    if "full_reuse" not in per_policy:
        return []
    rows = []
    for name in dict.fromkeys(n for n, _ in sweep):
        ratios = _sweep_ratios(sweep, name)
        if not ratios:
            continue
        p = len(sweep[(name, ratios[0])])
        ttft = [np.mean([q["ttft_s"] for q in per_policy["full_reuse"][:p]]),
                *[np.mean([q["ttft_s"] for q in sweep[(name, r)]]) for r in ratios],
                np.mean([q["ttft_s"] for q in per_policy["full_recompute"][:p]])]
        idx = np.random.default_rng(seed).integers(0, p, (nboot, p))
        for key in keys:
            if key not in sweep[(name, ratios[0])][0]:
                continue
            row = {"policy": name, "metric": key, "prompts": p}
            for label, share in _goals():
                ratio, boot = _ratios_needed(sweep, per_policy, name, key, share, idx)
                lo, hi = np.nanquantile(boot, [0.025, 0.975]) if np.isfinite(boot).any() else (np.nan, np.nan)
                at = float(np.interp(ratio, [0.0, *ratios, 1.0], ttft)) if np.isfinite(ratio) else np.nan
                row.update({f"ratio_{label}": ratio, f"ratio_{label}_lo": float(lo), f"ratio_{label}_hi": float(hi),
                            f"speedup_{label}": ttft[-1] / at if np.isfinite(at) else np.nan})
            rows.append(row)
    return rows


def budget_differences(sweep: dict[tuple[str, float], list[dict]], per_policy: dict[str, list[dict]], nboot: int,
                       seed: int, key: str = LIKELIHOOD) -> list[dict]:
    """Each swept selector of our own (``OWN_SELECTORS``) against each published one
    (``PUBLISHED_SELECTORS``) swept beside it: the difference of the ratios they need on ``key`` (ours minus theirs;
    negative = ours needs less) at each budget column, with a paired bootstrap 95% interval
    (both ratios from the same resamples of the sweep's prompts; resamples where either is
    NaN are left out)."""
    first = {n: sweep[(n, _sweep_ratios(sweep, n)[0])] for n in dict.fromkeys(n for n, _ in sweep)
             if _sweep_ratios(sweep, n)}  # each swept selector's results at its first ratio
    swept = list(first)
    if "full_reuse" not in per_policy or not swept or key not in first[swept[0]][0]:
        return []
    p = min(len(results) for results in first.values())
    idx = np.random.default_rng(seed).integers(0, p, (nboot, p))
    rows = []
    for ours, theirs in itertools.product(swept, swept):
        if ours not in OWN_SELECTORS or theirs not in PUBLISHED_SELECTORS:
            continue
        row = {"policy": ours, "minus": theirs, "metric": key, "prompts": p}
        for label, share in _goals():
            a, boot_a = _ratios_needed(sweep, per_policy, ours, key, share, idx)
            b, boot_b = _ratios_needed(sweep, per_policy, theirs, key, share, idx)
            diff = boot_a - boot_b
            lo, hi = np.nanquantile(diff, [0.025, 0.975]) if np.isfinite(diff).any() else (np.nan, np.nan)
            row.update({f"difference_{label}": a - b, f"difference_{label}_lo": float(lo),
                        f"difference_{label}_hi": float(hi)})
        rows.append(row)
    return rows


__all__ = [
    "GOLD_KEYS",
    "LIKELIHOOD",
    "RECOVERED",
    "RELATIVE_DROP",
    "TOLERANCE",
    "Reference",
    "Setup",
    "TimingLog",
    "answer_tokens",
    "budget_differences",
    "budget_rows",
    "build",
    "check_disjoint",
    "ci_row",
    "controller_table",
    "evaluate_prompt",
    "goal",
    "paired_rows",
    "ratio_at_goal",
    "recovery",
    "reference",
    "selection_config",
    "speed_row",
    "split_long_chunks",
    "timed",
    "train_learned",
    "workload_examples",
]
