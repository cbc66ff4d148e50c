"""Workloads by name, all producing ``rag.RagExample`` prompts in the same frame
(``frame``), and the gold score of a generated answer.

  synthetic        ``rag.make_examples``: templated cross-chunk stress tests.
  squad_multidoc   ``squad.squad_multidoc``: SQuAD question + gold + distractor paragraphs.
  needle_haystack  ``niah.needle_haystack``: RULER-style needles in essay text.

Every builder is called as ``builder(tokenizer, num=..., seed=..., **options)``.
"""

from __future__ import annotations

from collections.abc import Callable

from experiments.workloads import niah, rag, squad
from kvjax import metrics

WORKLOADS: dict[str, Callable[..., list[rag.RagExample]]] = {
    "synthetic": rag.make_examples,
    "squad_multidoc": squad.squad_multidoc,
    "needle_haystack": niah.needle_haystack,
}


def gold_targets(example: rag.RagExample) -> tuple[str, ...]:
    """The answer texts whose teacher-forced likelihood scores a policy (the best one counts):
    SQuAD's distinct accepted answers; the one answer of the other workloads (a needle
    prompt's required values joined, as ``answer``)."""
    if example.task == squad.TASK:
        return tuple(dict.fromkeys(a.strip() for a in example.gold_answers if a.strip()))
    return (example.answer,)


def gold_scores(example: rag.RagExample, generated: str) -> dict[str, float]:
    """Gold scores of a generated answer, each in [0, 1]; "gold" is the workload's headline.

    synthetic: gold = the answer appears (``rag.answer_matches``); SQuAD: gold = f1 (token
    F1), em (exact match), max over the gold answers; needle in a haystack: gold = exact
    (every required value present), recall (share of the values present).
    """
    if example.task == squad.TASK:
        f1 = metrics.squad_f1(generated, example.gold_answers)
        return {"gold": f1, "f1": f1, "em": metrics.squad_exact_match(generated, example.gold_answers)}
    if example.task in niah.TASKS:
        exact = metrics.niah_exact(generated, example.gold_answers)
        return {"gold": exact, "exact": exact, "recall": metrics.niah_recall(generated, example.gold_answers)}
    if example.task in rag.TASKS:
        return {"gold": float(rag.answer_matches(generated, example.answer))}
    raise ValueError(f"task={example.task!r} belongs to no workload")
