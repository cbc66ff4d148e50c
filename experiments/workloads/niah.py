"""Seeded needle-in-a-haystack prompts in the style of RULER (Hsieh et al. 2024).

The haystack is essay text (the Paul Graham essays by default) cut at sentence boundaries
into chunks of ``chunk_tokens`` tokens, as many as ``max_tokens`` allows. Needles are
sentences "One of the special magic numbers for {key} is: {value}." (key: an
adjective-noun pair, value: a ``value_digits``-digit number) inserted at a random
sentence boundary of distinct, randomly drawn chunks. Tasks:

  niah_single      one needle; ask its value.
  niah_multikey    2-4 needles with different keys; ask one key's value (the others distract).
  niah_multivalue  2-4 needles with the same key; ask for all its values.
  niah_multiquery  2-4 needles with different keys; ask for all of their values.

Scoring: ``kvjax.metrics.niah_exact`` (every required value in the answer) and
``niah_recall`` (the share found). A multi-value answer needs room: budget about
``value_digits + 3`` generated tokens per value.

``split`` partitions the essays by a hash of their name (``frame.in_split``).
"""

from __future__ import annotations

import os
import pathlib
import re
from collections.abc import Sequence

import numpy as np

from experiments.workloads.datasets import fetch_essays
from experiments.workloads.frame import SYSTEM_PROMPT, chunk_tokens, document_prefix, in_split, question_suffix
from experiments.workloads.rag import RagExample
from kvjax.model.tokenizer import Tokenizer

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery")
NEEDLE = "One of the special magic numbers for {key} is: {value}."
_ADJECTIVES = [
    "amber", "brisk", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly", "keen", "lively",
    "mellow", "nimble", "odd", "polite", "quick", "rusty", "silent", "tidy", "vivid", "wary", "young", "zesty",
]
_NOUNS = [
    "anchor", "badger", "canyon", "dolphin", "engine", "falcon", "glacier", "harbor", "island", "jacket", "kettle",
    "lantern", "meadow", "needle", "orchard", "pebble", "quarry", "river", "saddle", "tunnel", "violin", "walnut",
]
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def _sentences(text: str) -> list[str]:
    return [s for s in _SENTENCE_END.split(" ".join(text.split())) if s]


def _question(task: str, keys: list[str]) -> tuple[str, str, str]:
    """(question, chat instruction, base-model answer stem) asking for ``keys``' values."""
    where = "mentioned in the provided text"
    if task in ("niah_single", "niah_multikey"):
        return (f"What is the special magic number for {keys[0]} {where}?", "Answer with the number only.",
                f"The special magic number for {keys[0]} {where} is")
    names = keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + f" and {keys[-1]}"
    return (f"What are all the special magic numbers for {names} {where}?", "Answer with the numbers only.",
            f"The special magic numbers for {names} {where} are")


def _needles(
    task: str, rng: np.random.Generator, num_needles: tuple[int, int], digits: int
) -> tuple[list[tuple[str, str]], list[int], list[str]]:
    """(needles as (key, value), indices of the needles the question needs, queried keys)."""
    n = 1 if task == "niah_single" else int(rng.integers(num_needles[0], num_needles[1] + 1))
    pairs = rng.choice(len(_ADJECTIVES) * len(_NOUNS), size=n, replace=False)
    keys = [f"{_ADJECTIVES[p // len(_NOUNS)]}-{_NOUNS[p % len(_NOUNS)]}" for p in pairs]
    low = 10 ** (digits - 1)
    values = [str(low + int(v)) for v in rng.choice(10**digits - low, size=n, replace=False)]
    if task == "niah_multivalue":
        return [(keys[0], v) for v in values], list(range(n)), [keys[0]]
    needles = list(zip(keys, values))
    if task == "niah_multikey":
        target = int(rng.integers(n))
        return needles, [target], [keys[target]]
    return needles, list(range(n)), keys


def _haystack(
    tokenizer: Tokenizer, rng: np.random.Generator, essays: list[list[str]], budget: int, chunk_range: tuple[int, int]
) -> list[list[str]]:
    """Sentences of consecutive chunks of essay text, each at most a drawn target in
    ``chunk_range`` tokens, together at most ``budget`` tokens."""
    order = rng.permutation(len(essays))
    stream = (s for k in range(len(essays)) for s in essays[order[k]])
    for _ in range(int(rng.integers(max(1, len(essays[order[0]]) // 2)))):
        next(stream)  # start part-way into the first essay
    chunks: list[list[str]] = []
    pending: str | None = None
    while budget >= chunk_range[0]:
        target = min(int(rng.integers(chunk_range[0], chunk_range[1] + 1)), budget)
        sentences: list[str] = []
        while (sentence := pending if pending is not None else next(stream, None)) is not None:
            pending = None
            if len(chunk_tokens(tokenizer, " ".join([*sentences, sentence]))) <= target:
                sentences.append(sentence)
            elif sentences:
                pending = sentence
                break  # a lone sentence longer than the target is skipped
        if not sentences:
            break
        chunks.append(sentences)
        budget -= len(chunk_tokens(tokenizer, " ".join(sentences)))
    return chunks


def _insert(tokenizer: Tokenizer, rng: np.random.Generator, sentences: list[str], needle: str, max_tokens: int) -> None:
    """Puts ``needle`` at a random sentence boundary, then drops the sentences farthest from
    it until the chunk fits ``max_tokens``."""
    at = int(rng.integers(len(sentences) + 1))
    sentences.insert(at, needle)
    while len(chunk_tokens(tokenizer, " ".join(sentences))) > max_tokens and len(sentences) > 1:
        if at >= len(sentences) - 1 - at:
            sentences.pop(0)
            at -= 1
        else:
            sentences.pop()


def needle_haystack(
    tokenizer: Tokenizer,
    *,
    num: int,
    seed: int,
    tasks: Sequence[str] = TASKS,
    essays: Sequence[str | os.PathLike] | None = None,
    split: str = "eval",
    train_fraction: float = 0.5,
    num_needles: tuple[int, int] = (2, 4),
    chunk_range: tuple[int, int] = (256, 512),
    max_tokens: int = 2048,
    value_digits: int = 7,
    system_prompt: str = SYSTEM_PROMPT,
) -> list[RagExample]:
    """``num`` prompts cycling through ``tasks``, reproducible from ``seed``.

    Args:
      tokenizer: a chat model's (ChatML prompt) or a base model's (plain text behind BOS
        ending in the prefilled stem "The special magic number(s) for ... is/are").
      essays: plain-text files for the haystack; None = ``datasets.fetch_essays()``.
      split: "train", "eval" or "all" (essays partitioned by file name).
      num_needles: (min, max) needles of the multi-needle tasks, within [2, 4].
      chunk_range: (min, max) tokens per chunk, needle included; whole sentences, so a
        chunk may fall short of the min by about one sentence.
      max_tokens: cap on prefix + chunks + suffix tokens.
      value_digits: digits of each needle value (RULER: 7).

    Returns:
      ``RagExample``s with ``gold_answers`` = the values the question needs (all required),
      ``fact_chunks`` = the slots of the chunks holding those needles.

    Raises:
      ValueError: bad arguments, or ``max_tokens`` leaves fewer chunks than needles.
    """
    if not tasks or any(t not in TASKS for t in tasks):
        raise ValueError(f"tasks={tuple(tasks)} must be a non-empty subset of {TASKS}")
    if not (2 <= num_needles[0] <= num_needles[1] <= 4):
        raise ValueError(f"num_needles={num_needles} must satisfy 2 <= min <= max <= 4")
    if not (1 <= chunk_range[0] <= chunk_range[1]):
        raise ValueError(f"chunk_range={chunk_range} must satisfy 1 <= min <= max")
    if not 1 <= value_digits <= 18:
        raise ValueError(f"value_digits={value_digits} must be in [1, 18]")
    paths = [pathlib.Path(p) for p in (fetch_essays() if essays is None else essays)]
    texts = [
        _sentences(p.read_text())
        for p in sorted(paths, key=lambda p: p.name)
        if in_split(p.name, split, train_fraction)
    ]
    texts = [t for t in texts if t]
    if not texts:
        raise ValueError(f"no essay text in split={split!r} of {len(paths)} file(s)")
    rng = np.random.default_rng(seed)
    prefix = document_prefix(tokenizer, system_prompt)
    longest = NEEDLE.format(key=f"{max(_ADJECTIVES, key=len)}-{max(_NOUNS, key=len)}", value="9" * value_digits)
    reserve = len(tokenizer.encode(" " + longest, add_bos=False)) + 1  # a needle's tokens, at most
    examples = []
    for i in range(num):
        task = tasks[i % len(tasks)]
        needles, needed, keys = _needles(task, rng, num_needles, value_digits)
        question, instruction, stem = _question(task, keys)
        suffix = question_suffix(tokenizer, question, instruction=instruction, stem=stem, system_prompt=system_prompt)
        budget = max_tokens - len(prefix) - len(suffix) - reserve * len(needles)
        chunks = _haystack(tokenizer, rng, texts, budget, chunk_range)
        if len(chunks) < len(needles):
            raise ValueError(
                f"max_tokens={max_tokens} leaves {len(chunks)} chunk(s) for {len(needles)} needles; raise max_tokens"
            )
        slots = [int(s) for s in rng.choice(len(chunks), size=len(needles), replace=False)]
        for (key, value), slot in zip(needles, slots):
            _insert(tokenizer, rng, chunks[slot], NEEDLE.format(key=key, value=value), chunk_range[1])
        values = [needles[j][1] for j in needed]
        examples.append(RagExample(
            task=task, prefix=prefix, chunks=tuple(chunk_tokens(tokenizer, " ".join(c)) for c in chunks), suffix=suffix,
            answer=", ".join(values), fact_chunks=tuple(slots[j] for j in needed), question=question,
            gold_answers=tuple(values),
        ))
    return examples
