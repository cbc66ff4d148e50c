"""A seeded stream of RAG queries over a growing corpus of real passages, saved as a trace file.

The corpus is SQuAD v1.1's paragraphs (one passage each), grouped by article. Articles arrive
over time: ``initial_articles`` of them (a seeded draw) are there from the start, then one
more every ``article_every`` queries. Passage popularity is Zipf(``zipf_alpha``) over a
ranking that moves:

  * a new article's passages enter the ranking at the top (fresh documents are read most);
  * every ``drift_every`` queries, ``drift_size`` passages drawn uniformly move to the top.

Each query draws a passage by its rank's Zipf weight and one of that passage's questions
(uniformly; popular questions repeat), then retrieves ``top_k`` passages for the question
from the passages present so far:

  "bm25"             BM25 (``bm25s``, Lucene scoring, English stopwords) over the present
                     passages, best first; the question's own passage may be missed, as a
                     real retriever misses it.
  "gold_distractors" the question's passage at a seeded slot among ``top_k - 1`` others of
                     its article (then of other present articles): no retriever needed.

A share ``exact_fraction`` of the queries is marked exact: a serving policy must answer them
with exact KV (prefix reuse only, never blended chunks).

``write_stream`` saves the stream as JSON lines (a header with the generation settings and the
corpus file's sha256, then one query per line) and ``read_stream`` reads it back, so every
policy serves identical queries.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Mapping, Sequence

import bm25s
import numpy as np

from experiments.workloads.datasets import SquadParagraph

RETRIEVERS = ("bm25", "gold_distractors")


@dataclasses.dataclass(frozen=True)
class StreamQuery:
    """One query of the stream.

    Attributes:
      index: position in the stream (0-based).
      question_id: the SQuAD question id; question: its text; gold_answers: its answers.
      gold: index of the question's passage in the corpus.
      passages: retrieved passage indices, best first (``top_k`` of them, or all present).
      exact: the query must be served with exact KV.
      num_articles: articles present when the query arrived.
    """

    index: int
    question_id: str
    question: str
    gold_answers: tuple[str, ...]
    gold: int
    passages: tuple[int, ...]
    exact: bool
    num_articles: int

    @property
    def gold_retrieved(self) -> bool:
        return self.gold in self.passages


@dataclasses.dataclass(frozen=True)
class StreamConfig:
    """Settings of ``make_stream``.

    Attributes:
      num_queries: queries in the stream (>= 1).
      seed: seed of every draw.
      top_k: passages retrieved per query (>= 1).
      retriever: one of ``RETRIEVERS``.
      initial_articles: articles present at the start (>= 1).
      article_every: queries between two article arrivals (0 = no arrivals).
      zipf_alpha: Zipf exponent of passage popularity by rank (>= 0; 0 = uniform).
      drift_every: queries between two popularity drifts (0 = no drift).
      drift_size: passages moved to the top at each drift (>= 0).
      exact_fraction: share of queries marked exact, in [0, 1].
    """

    num_queries: int = 1000
    seed: int = 0
    top_k: int = 4
    retriever: str = "bm25"
    initial_articles: int = 8
    article_every: int = 50
    zipf_alpha: float = 1.0
    drift_every: int = 100
    drift_size: int = 20
    exact_fraction: float = 0.1

    def __post_init__(self) -> None:
        for field, low in (("num_queries", 1), ("top_k", 1), ("initial_articles", 1), ("article_every", 0),
                           ("drift_every", 0), ("drift_size", 0)):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"stream.{field}={value!r} must be an int >= {low}")
        if self.retriever not in RETRIEVERS:
            raise ValueError(f"stream.retriever={self.retriever!r} must be one of {RETRIEVERS}")
        if not self.zipf_alpha >= 0:
            raise ValueError(f"stream.zipf_alpha={self.zipf_alpha!r} must be >= 0")
        if not 0.0 <= self.exact_fraction <= 1.0:
            raise ValueError(f"stream.exact_fraction={self.exact_fraction!r} must lie in [0, 1]")


class _Retriever:
    """BM25 over the passages present, re-indexed when an article arrives."""

    def __init__(self, paragraphs: Sequence[SquadParagraph]) -> None:
        self.paragraphs = paragraphs
        self.present: list[int] = []
        self.index: bm25s.BM25 | None = None

    def add(self, ids: Sequence[int]) -> None:
        self.present = sorted({*self.present, *ids})
        corpus = bm25s.tokenize([self.paragraphs[i].context for i in self.present], stopwords="en",
                                show_progress=False)
        self.index = bm25s.BM25()
        self.index.index(corpus, show_progress=False)

    def top(self, question: str, k: int) -> tuple[int, ...]:
        assert self.index is not None
        words = bm25s.tokenize(question, stopwords="en", return_ids=False, show_progress=False)[0]
        scores = self.index.get_scores(words) if words else np.zeros(len(self.present))
        best = np.lexsort((np.asarray(self.present), -scores))[:k]  # by score, ties by passage index
        return tuple(self.present[i] for i in best)


def make_stream(paragraphs: Sequence[SquadParagraph], config: StreamConfig) -> list[StreamQuery]:
    """The query stream of the module docstring over ``paragraphs`` (``datasets.load_squad``).

    Raises:
      ValueError: ``initial_articles`` exceeds the corpus' articles, or an article has no
        question (nothing to ask).
    """
    rng = np.random.default_rng(config.seed)
    by_article: dict[int, list[int]] = {}
    for i, p in enumerate(paragraphs):
        by_article.setdefault(p.article, []).append(i)
    articles = sorted(by_article)
    if config.initial_articles > len(articles):
        raise ValueError(
            f"stream.initial_articles={config.initial_articles} must be at most the corpus' {len(articles)} articles"
        )
    arrivals = [articles[j] for j in rng.permutation(len(articles))]
    ranking: list[int] = []  # present passages, most popular first
    retriever = _Retriever(paragraphs)

    def arrive(article: int) -> None:
        ids = [by_article[article][j] for j in rng.permutation(len(by_article[article]))]
        ranking[:0] = [i for i in ids if paragraphs[i].questions] + [i for i in ids if not paragraphs[i].questions]
        if config.retriever == "bm25":
            retriever.add(ids)

    present = 0
    for article in arrivals[: config.initial_articles]:
        arrive(article)
        present += 1
    queries = []
    for q in range(config.num_queries):
        if config.article_every and q and q % config.article_every == 0 and present < len(arrivals):
            arrive(arrivals[present])
            present += 1
        if config.drift_every and q and q % config.drift_every == 0:
            moved = sorted(rng.choice(len(ranking), size=min(config.drift_size, len(ranking)), replace=False))
            hot = [ranking[j] for j in moved]
            rest = set(moved)
            ranking[:] = hot + [p for j, p in enumerate(ranking) if j not in rest]
        askable = [p for p in ranking if paragraphs[p].questions]
        if not askable:
            raise ValueError("the present articles have no question to ask")
        weights = np.arange(1, len(askable) + 1, dtype=np.float64) ** -config.zipf_alpha
        gold = askable[int(rng.choice(len(askable), p=weights / weights.sum()))]
        question = paragraphs[gold].questions[int(rng.integers(len(paragraphs[gold].questions)))]
        if config.retriever == "bm25":
            passages = retriever.top(question.question, config.top_k)
        else:
            passages = _gold_distractors(paragraphs, ranking, gold, config.top_k, rng)
        queries.append(StreamQuery(
            index=q, question_id=question.id, question=question.question, gold_answers=question.answers, gold=gold,
            passages=passages, exact=bool(rng.random() < config.exact_fraction), num_articles=present,
        ))
    return queries


def _gold_distractors(paragraphs: Sequence[SquadParagraph], present: Sequence[int], gold: int, k: int,
                      rng: np.random.Generator) -> tuple[int, ...]:
    """The gold passage at a random slot among ``k - 1`` present passages of its article
    first, then of other articles (seeded)."""
    same = [p for p in present if p != gold and paragraphs[p].article == paragraphs[gold].article]
    other = [p for p in present if paragraphs[p].article != paragraphs[gold].article]
    picked = [same[j] for j in rng.permutation(len(same))] + [other[j] for j in rng.permutation(len(other))]
    picked = picked[: k - 1]
    picked.insert(int(rng.integers(len(picked) + 1)), gold)
    return tuple(picked)


def write_stream(path: str | os.PathLike, queries: Sequence[StreamQuery], header: Mapping[str, object]) -> None:
    """Writes the stream as JSON lines: ``{"header": header}``, then one query per line."""
    lines = [json.dumps({"header": dict(header)})]
    lines += [json.dumps(dataclasses.asdict(q)) for q in queries]
    pathlib.Path(path).write_text("\n".join(lines) + "\n")


def read_stream(path: str | os.PathLike) -> tuple[list[StreamQuery], dict]:
    """The queries and header of a stream file written by ``write_stream``.

    Raises:
      ValueError: the file is not such a stream (naming the line that is not).
    """
    lines = pathlib.Path(path).read_text().splitlines()
    if not lines or "header" not in json.loads(lines[0]):
        raise ValueError(f"{path}: line 1 must be the stream's header ({{\"header\": ...}})")
    header = json.loads(lines[0])["header"]
    queries = []
    for n, line in enumerate(lines[1:], start=2):
        try:
            row = json.loads(line)
            row["gold_answers"], row["passages"] = tuple(row["gold_answers"]), tuple(row["passages"])
            queries.append(StreamQuery(**row))
        except (json.JSONDecodeError, TypeError, KeyError) as error:
            raise ValueError(f"{path}: line {n} is not a stream query ({error})") from None
    return queries, header


__all__ = ["RETRIEVERS", "StreamConfig", "StreamQuery", "make_stream", "read_stream", "write_stream"]
