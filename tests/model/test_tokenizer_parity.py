"""Tokenizers on the real GGUF vocabularies: the ids of independent implementations on runs
of spaces, code, tables, mixed whitespace and Unicode (``tests/fixtures/tokenizer_parity.json``,
made by ``make_tokenizer_fixture.py``), and Gemma 3's space-run tokens surviving a
decode/encode round trip of the model's own greedy output."""

from __future__ import annotations

import json
import pathlib

import pytest

from kvjax.config import KvCacheConfig
from kvjax.engine import Engine
from kvjax.model.registry import load_model
from kvjax.model.tokenizer import Tokenizer
from kvjax.sampling import SamplingParams

pytestmark = pytest.mark.real_model

PARITY = json.loads((pathlib.Path(__file__).parents[1] / "fixtures" / "tokenizer_parity.json").read_text())
GEMMA_SPACE_RUNS = range(138, 168)  # ids of the user-defined pieces for 2..31 spaces


def differences(tokenizer: Tokenizer, expected: list[list[int]]) -> list[str]:
    """One line per fixture string whose ids differ from the expected ones."""
    lines = []
    for i, (text, ids) in enumerate(zip(PARITY["strings"], expected)):
        got = tokenizer.encode(text, add_bos=False)
        if got != ids:
            first = next((j for j, (a, b) in enumerate(zip(got, ids)) if a != b), min(len(got), len(ids)))
            lines.append(f"string {i} {text[:30]!r}, from id {first}: {got[first:first + 6]} != {ids[first:first + 6]}")
    return lines


@pytest.mark.parametrize("name", ["gemma3-270m", "smollm2-135m"])
def test_ids_match_an_independent_tokenizer(name):
    """SentencePiece for Gemma 3, transformers with the "smollm" pre-tokenizer for SmolLM2;
    llama.cpp agrees with both (see tests/fixtures/README.md)."""
    assert differences(load_model(name).tokenizer, PARITY[name]["ids"]) == []


@pytest.mark.parametrize("name", ["gemma3-270m", "smollm2-135m"])
def test_decode_restores_every_string(name):
    """Except, for Gemma, text holding "▁" itself: SentencePiece escapes spaces as "▁", so a
    literal one decodes as a space there too."""
    tokenizer = load_model(name).tokenizer
    for text, ids in zip(PARITY["strings"], PARITY[name]["ids"]):
        if not (name == "gemma3-270m" and "▁" in text):
            assert tokenizer.decode(ids) == text


def test_gemma_space_runs_are_single_user_defined_tokens():
    """Runs of 2..31 spaces are one token each; longer runs take 31 at a time, leftmost first,
    and a single space left over merges into the next word, as in SentencePiece."""
    tokenizer = load_model("gemma3-270m").tokenizer
    for n, token_id in zip(range(2, 32), GEMMA_SPACE_RUNS):
        assert tokenizer.encode(" " * n, add_bos=False) == [token_id]
        assert tokenizer.decode([token_id]) == " " * n
    assert tokenizer.encode(" " * 40, add_bos=False) == [167, 145]
    assert tokenizer.encode('\n    """', add_bos=False) == [107, 140, 12234]
    assert tokenizer.encode("a" + " " * 32 + "b", add_bos=False) == [236746, 167, 518]  # "a", 31 spaces, " b"


def test_gemma_greedy_code_round_trips_through_text():
    """Prompted with indented code, Gemma emits space-run tokens; decoding its output and
    encoding the text again gives back the same ids."""
    gemma = load_model("gemma3-270m")
    tokenizer = gemma.tokenizer
    prompt = "```python\nclass Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    engine = Engine(gemma, KvCacheConfig(tokens_per_block=32, max_tokens=32 * 8), max_seq_len=256)
    [out] = engine.generate([tokenizer.encode(prompt)], SamplingParams(max_new_tokens=32, ignore_eos=True))
    assert any(i in GEMMA_SPACE_RUNS for i in out.output)
    assert tokenizer.encode(tokenizer.decode(out.output), add_bos=False) == out.output
