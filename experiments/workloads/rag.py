"""Seeded synthetic RAG prompts whose answers need the chunks to see each other.

Each example is a shared system prefix, 3-8 retrieved chunks of 64-512 tokens (filler prose
around one planted fact, or only filler for distractors), and a question. Tasks:

  cross_chunk_binding  chunk A binds a codename to a person, chunk B gives the codename's
                       password; the question asks for the person's password.
  two_hop              A: person works at an office; B: the office's city; ask the person's city.
  scoped_override      an earlier chunk overrides a fact stated in a later chunk (the order
                       is kept: override first); ask for the current value.
  single_chunk         control: the answer sits in one chunk (no cross-chunk dependency).

Chunk order is a seeded permutation. Every chunk is tokenized on its own (it is stored and
reused on its own) and cut or filled to its exact sampled length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from experiments.workloads.frame import SYSTEM_PROMPT, document_prefix, question_suffix
from kvjax.model.tokenizer import Tokenizer

TASKS = ("cross_chunk_binding", "two_hop", "scoped_override", "single_chunk")

_FIRST = [
    "Ivan", "Mira", "Tomas", "Aiko", "Lena", "Omar", "Priya",
    "Jonas", "Sofia", "Mateo", "Hana", "Felix", "Nadia", "Ravi",
]
_LAST = [
    "Petrov", "Olsen", "Novak", "Tanaka", "Berg", "Haddad", "Rao",
    "Weber", "Costa", "Silva", "Kim", "Moreau", "Ivanova", "Singh",
]
_CODES = [
    "Falcon", "Juniper", "Cobalt", "Orchid", "Granite", "Harbor",
    "Saffron", "Quartz", "Willow", "Ember", "Nimbus", "Tundra",
]
_CITIES = [
    "Lyon", "Osaka", "Porto", "Krakow", "Denver", "Nairobi",
    "Quito", "Oslo", "Perth", "Seville", "Tbilisi", "Halifax",
]
_OFFICES = ["north", "river", "harbor", "central", "hill", "garden", "station", "bridge", "market", "lake"]
_PROJECTS = ["Atlas", "Beacon", "Cinder", "Delta", "Echo", "Fjord", "Gale", "Helix", "Iris", "Jade"]
_FILLER = [
    "The committee reviewed the {adj} budget for the {noun} program and postponed the vote.",
    "Several volunteers repainted the {noun} near the old {place} last spring.",
    "A short report described how the {adj} {noun} was repaired after the storm.",
    "Visitors often ask about the history of the {place}, which opened decades ago.",
    "The newsletter mentioned a {adj} increase in the number of {noun} requests.",
    "Staff members attended a workshop on {adj} safety procedures for the {noun}.",
    "The weather in the region stayed {adj} for most of the season.",
    "An inspection of the {place} found that the {noun} needed new paint.",
    "The library added a {adj} collection of books about the {noun}.",
    "Most residents agreed that the {adj} {place} should stay open on weekends.",
]
_ADJ = ["annual", "quiet", "modest", "sudden", "careful", "regional", "gradual", "seasonal", "minor", "steady"]
_NOUN = [
    "garden", "bridge", "archive", "fountain", "warehouse",
    "tram line", "clinic", "harbor wall", "bakery", "school",
]
_PLACE = ["town hall", "market square", "museum", "railway station", "park", "community center", "old mill", "pier"]


@dataclasses.dataclass(frozen=True)
class RagExample:
    """One tokenized prompt.

    Attributes:
      task: one of ``TASKS``.
      prefix: shared system prefix token ids.
      chunks: token ids of each chunk, in prompt order.
      suffix: question (and the assistant header) token ids.
      answer: gold answer string (the first of ``gold_answers``, or all the required needle
        values joined by ", ").
      fact_chunks: prompt-order indices of the chunks holding the planted facts (the gold
        paragraph, the needles the question needs).
      question: the question text.
      gold_answers: accepted answers (SQuAD: any one; needle in a haystack: every value is
        required); score a generation with ``experiments.workloads.gold_scores``.
    """

    task: str
    prefix: tuple[int, ...]
    chunks: tuple[tuple[int, ...], ...]
    suffix: tuple[int, ...]
    answer: str
    fact_chunks: tuple[int, ...]
    question: str
    gold_answers: tuple[str, ...]


def _filler(rng: np.random.Generator) -> str:
    template = _FILLER[rng.integers(len(_FILLER))]
    return template.format(
        adj=_ADJ[rng.integers(len(_ADJ))], noun=_NOUN[rng.integers(len(_NOUN))], place=_PLACE[rng.integers(len(_PLACE))]
    )


def _pick(rng: np.random.Generator, items: Sequence[str], n: int) -> list[str]:
    return [items[i] for i in rng.choice(len(items), size=n, replace=False)]


def _facts(task: str, rng: np.random.Generator) -> tuple[list[str], str, str, str]:
    """(fact sentences, one per fact chunk, question, answer, answer stem)."""
    first, last = _pick(rng, _FIRST, 1)[0], _pick(rng, _LAST, 1)[0]
    person = f"{first} {last}"
    if task == "cross_chunk_binding":
        code, number = _pick(rng, _CODES, 1)[0], str(rng.integers(1000, 10000))
        return (
            [f"In these records, the codename {code} always refers to {person}.",
             f"The password of {code} is {number}."],
            f"What is the password of {person}?", number, f"The password of {person} is",
        )
    if task == "two_hop":
        office, city = _pick(rng, _OFFICES, 1)[0], _pick(rng, _CITIES, 1)[0]
        return (
            [f"{person} works at the {office} office.", f"The {office} office is located in {city}."],
            f"In which city does {person} work?", city, f"{person} works in the city of",
        )
    if task == "scoped_override":
        project = _pick(rng, _PROJECTS, 1)[0]
        old, new = (str(r) for r in rng.choice(np.arange(100, 1000), size=2, replace=False))
        return (
            [
                f"Update: the {project} project moved from room {old} to room {new}; later notes naming room {old} are "
                f"outdated.",
                f"The {project} project meets in room {old}.",
            ],
            f"In which room does the {project} project meet now?",
            new,
            f"The {project} project now meets in room",
        )
    if task == "single_chunk":
        number = str(rng.integers(1000, 10000))
        return ([f"The password of {person} is {number}."], f"What is the password of {person}?", number,
                f"The password of {person} is")
    raise ValueError(f"task={task!r} must be one of {TASKS}")


def _chunk_tokens(tok: Tokenizer, rng: np.random.Generator, length: int, fact: str | None) -> tuple[int, ...]:
    """``length`` tokens of filler with ``fact`` planted at a random sentence boundary."""
    before = " ".join(_filler(rng) for _ in range(rng.integers(0, 4)))
    head = tok.encode("\n" + before + (" " if before else ""), add_bos=False)
    ids = head + (tok.encode(fact, add_bos=False) if fact else [])
    if len(ids) > length:
        raise ValueError(f"chunk length={length} cannot hold the fact ({len(ids)} tokens); raise chunk_tokens")
    while len(ids) < length:
        ids += tok.encode(" " + _filler(rng), add_bos=False)
    return tuple(ids[:length])


def make_examples(
    tokenizer: Tokenizer,
    *,
    num: int,
    seed: int,
    tasks: Sequence[str] = TASKS,
    num_chunks: tuple[int, int] = (6, 6),
    chunk_tokens: tuple[int, int] = (256, 256),
    system_prompt: str = SYSTEM_PROMPT,
) -> list[RagExample]:
    """``num`` examples cycling through ``tasks``, reproducible from ``seed``.

    A chat model (``tokenizer.chat_format``) gets a ChatML prompt; a base model (Gemma 3 270M)
    gets plain text behind BOS ending in a prefilled answer stem ("Answer: The password of
    Ivan Petrov is"), so its greedy continuation is the answer.

    Args:
      num_chunks: (min, max) chunks per prompt, within [3, 8] and at least the facts' count.
      chunk_tokens: (min, max) tokens per chunk, within [64, 512]; lengths are drawn in
        multiples of 64 so prompts share compiled shapes.
    """
    if any(t not in TASKS for t in tasks) or not tasks:
        raise ValueError(f"tasks={tuple(tasks)} must be a non-empty subset of {TASKS}")
    if not (3 <= num_chunks[0] <= num_chunks[1] <= 8):
        raise ValueError(f"num_chunks={num_chunks} must satisfy 3 <= min <= max <= 8")
    if not (64 <= chunk_tokens[0] <= chunk_tokens[1] <= 512):
        raise ValueError(f"chunk_tokens={chunk_tokens} must satisfy 64 <= min <= max <= 512")
    rng = np.random.default_rng(seed)
    prefix = document_prefix(tokenizer, system_prompt)
    lengths = np.arange(chunk_tokens[0], chunk_tokens[1] + 1)
    lengths = lengths[lengths % 64 == 0] if np.any(lengths % 64 == 0) else lengths
    examples = []
    for i in range(num):
        task = tasks[i % len(tasks)]
        facts, question, answer, stem = _facts(task, rng)
        n = int(rng.integers(num_chunks[0], num_chunks[1] + 1))
        order = rng.permutation(n)  # order[j] = prompt slot of chunk j; chunks 0..len(facts)-1 hold facts
        if task == "scoped_override" and order[0] > order[1]:
            order[0], order[1] = order[1], order[0]
        contents: list[tuple[int, ...]] = [()] * n
        for j in range(n):
            fact = facts[j] if j < len(facts) else None
            contents[order[j]] = _chunk_tokens(tokenizer, rng, int(rng.choice(lengths)), fact)
        suffix = question_suffix(
            tokenizer, question, instruction="Answer with the value only.", stem=stem, system_prompt=system_prompt
        )
        examples.append(RagExample(
            task=task, prefix=prefix, chunks=tuple(contents), suffix=suffix, answer=answer,
            fact_chunks=tuple(int(order[j]) for j in range(len(facts))), question=question, gold_answers=(answer,),
        ))
    return examples


def answer_matches(generated: str, gold: str) -> bool:
    """Whether the gold answer appears in the generated text (case- and space-insensitive)."""
    norm = lambda s: " ".join(s.lower().replace(".", " ").replace(",", " ").split())
    return f" {norm(gold)} " in f" {norm(generated)} "
