"""Fixtures of the blend tests: a tiny random model and SmolLM2 RAG prompts (prompt and
Blender helpers live in ``kvjax.testing.blend``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from experiments.workloads.rag import RagExample, make_examples
from kvjax.testing.tiny import tiny_model


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(0, num_layers=4)


@pytest.fixture(scope="module")
def rag_example(smollm2) -> Callable[..., RagExample]:
    """A factory of one synthetic RAG prompt for SmolLM2 (``experiments.workloads.rag``): a
    system prefix, three chunks of ``chunk_tokens`` tokens each and a question, reproducible
    from ``seed``; ``task`` is one of ``rag.TASKS`` (default "cross_chunk_binding")."""

    def make(*, seed: int, chunk_tokens: int, task: str = "cross_chunk_binding") -> RagExample:
        return make_examples(
            smollm2.tokenizer, num=1, seed=seed, tasks=(task,), num_chunks=(3, 3),
            chunk_tokens=(chunk_tokens, chunk_tokens),
        )[0]

    return make
