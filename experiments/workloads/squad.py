"""Seeded multi-document QA on real passages (SQuAD v1.1 dev, SQuAD-shifts).

Each prompt is a SQuAD question, its gold paragraph and up to ``num_distractors``
distractor paragraphs, one chunk per paragraph at its natural length (not padded). The
distractors come from the gold paragraph's article first (same topic, the hard case), then
from other articles. The gold paragraph sits at a uniformly drawn position, the distractors
in a shuffled order. When the prompt would exceed ``max_tokens``, distractors are dropped
from the end of that preference list (other articles first); a question whose gold
paragraph alone does not fit is skipped.

``split`` partitions the paragraphs by a hash of their text (``frame.in_split``): train and
eval prompts share no question and no chunk, distractors included.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from experiments.workloads.datasets import SQUAD_SPLITS, SquadParagraph, fetch_squad_shifts, load_squad
from experiments.workloads.frame import SYSTEM_PROMPT, chunk_tokens, document_prefix, in_split, question_suffix
from experiments.workloads.rag import RagExample
from kvjax.model.tokenizer import Tokenizer

TASK = "squad_multidoc"
INSTRUCTION = "Answer with a short phrase from the documents."


def squad_paragraphs(source: str | os.PathLike | Sequence[SquadParagraph]) -> list[SquadParagraph]:
    """Paragraphs of a named split (fetched on first use), of a SQuAD-format JSON file, or
    the given paragraphs."""
    if isinstance(source, str) and source in SQUAD_SPLITS:
        return load_squad(fetch_squad_shifts(source))
    if isinstance(source, (str, os.PathLike)):
        return load_squad(source)
    return list(source)


def squad_multidoc(
    tokenizer: Tokenizer,
    *,
    num: int,
    seed: int,
    source: str | os.PathLike | Sequence[SquadParagraph] = "squad_v11_dev",
    split: str = "eval",
    train_fraction: float = 0.5,
    num_distractors: int = 5,
    max_tokens: int = 2048,
    system_prompt: str = SYSTEM_PROMPT,
) -> list[RagExample]:
    """``num`` multi-document QA prompts, reproducible from ``seed``.

    Args:
      tokenizer: a chat model's (ChatML prompt) or a base model's (plain text behind BOS
        ending in "Answer:").
      source: a split name (``datasets.SQUAD_SPLITS``), a SQuAD v1.1-format JSON path, or
        paragraphs from ``datasets.load_squad``.
      split: "train", "eval" or "all" (see the module docstring).
      train_fraction: share of paragraphs in the train split.
      num_distractors: distractor paragraphs per prompt before the token cap (>= 0).
      max_tokens: cap on prefix + chunks + suffix tokens.

    Returns:
      ``RagExample``s with task "squad_multidoc", ``fact_chunks`` = (gold paragraph's slot,),
      ``gold_answers`` = the question's distinct gold answers. Distinct questions.

    Raises:
      ValueError: fewer than ``num`` questions fit the split and the cap.
    """
    if num_distractors < 0:
        raise ValueError(f"num_distractors={num_distractors} must be >= 0")
    paragraphs = [p for p in squad_paragraphs(source) if in_split(p.context, split, train_fraction)]
    rng = np.random.default_rng(seed)
    prefix = document_prefix(tokenizer, system_prompt)
    by_article: dict[int, list[int]] = {}
    for i, p in enumerate(paragraphs):
        by_article.setdefault(p.article, []).append(i)
    questions = [(i, q) for i, p in enumerate(paragraphs) for q in p.questions]
    tokens: dict[int, tuple[int, ...]] = {}

    def chunk(i: int) -> tuple[int, ...]:
        if i not in tokens:
            tokens[i] = chunk_tokens(tokenizer, paragraphs[i].context)
        return tokens[i]

    examples = []
    for q_index in rng.permutation(len(questions)):
        if len(examples) == num:
            break
        gold, question = questions[q_index]
        suffix = question_suffix(
            tokenizer, question.question, instruction=INSTRUCTION, stem="", system_prompt=system_prompt
        )
        budget = max_tokens - len(prefix) - len(suffix) - len(chunk(gold))
        if budget < 0:
            continue
        article, context = paragraphs[gold].article, paragraphs[gold].context
        same = [i for i in by_article[article] if paragraphs[i].context != context]
        same = [same[j] for j in rng.permutation(len(same))][:num_distractors]
        others = [
            i for i in range(len(paragraphs)) if paragraphs[i].article != article and paragraphs[i].context != context
        ]
        others = [
            others[j]
            for j in rng.choice(len(others), size=min(len(others), num_distractors - len(same)), replace=False)
        ]
        distractors = []
        for i in same + others:
            if len(chunk(i)) > budget:
                break
            budget -= len(chunk(i))
            distractors.append(i)
        n = len(distractors) + 1
        slot = int(rng.integers(n))
        order = [distractors[j] for j in rng.permutation(len(distractors))]
        order.insert(slot, gold)
        examples.append(RagExample(
            task=TASK, prefix=prefix, chunks=tuple(chunk(i) for i in order), suffix=suffix, answer=question.answers[0],
            fact_chunks=(slot,), question=question.question, gold_answers=question.answers,
        ))
    if len(examples) < num:
        raise ValueError(
            f"only {len(examples)} of num={num} questions fit split={split!r} and max_tokens={max_tokens} "
            f"({len(questions)} questions in the split)"
        )
    return examples
