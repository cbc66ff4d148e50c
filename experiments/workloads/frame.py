"""The prompt frame every workload shares: system prefix, chunks, question suffix; and the
hash split that keeps training prompts out of evaluation.

A prompt is ``prefix + chunk_1 + ... + chunk_n + suffix`` (token ids). Each chunk is
tokenized on its own ("\\n" + text), so a stored chunk is reusable in any prompt.

  chat model (SmolLM2)  the model's chat template split around the user turn:
                        "<|im_start|>system\\n{system}<|im_end|>\\n<|im_start|>user\\nDocuments:"
                        ... "\\nQuestion: {question} {instruction}<|im_end|>\\n<|im_start|>assistant\\n"
  base model (Gemma 3)  "<bos>{system}\\n\\nDocuments:" ... "\\n\\nQuestion: {question}\\nAnswer: {stem}",
                        a prefilled answer stem whose greedy continuation (up to a newline) is
                        the answer.
"""

from __future__ import annotations

import hashlib

from kvjax.model.tokenizer import Message, Tokenizer

SYSTEM_PROMPT = "You are a helpful assistant. Answer the question using the documents."
SPLITS = ("train", "eval", "all")
_SENTINEL = "\x00"


def _chat_halves(tokenizer: Tokenizer, system_prompt: str) -> tuple[str, str]:
    """The chat template's text before and after the user message."""
    text = tokenizer.apply_chat_template([Message("system", system_prompt), Message("user", _SENTINEL)])
    head, tail = text.split(_SENTINEL)
    return head, tail


def document_prefix(tokenizer: Tokenizer, system_prompt: str = SYSTEM_PROMPT) -> tuple[int, ...]:
    """Token ids of everything before the first chunk (the same for every prompt)."""
    if tokenizer.chat_format == "chatml":
        return tuple(tokenizer.encode(_chat_halves(tokenizer, system_prompt)[0] + "Documents:", add_bos=False))
    return tuple(tokenizer.encode(f"{system_prompt}\n\nDocuments:", add_bos=True))


def question_suffix(
    tokenizer: Tokenizer, question: str, *, instruction: str, stem: str, system_prompt: str = SYSTEM_PROMPT
) -> tuple[int, ...]:
    """Token ids after the last chunk: the question, then ``instruction`` (chat) or the answer
    ``stem`` (base; "" leaves the prompt ending at "Answer:")."""
    if tokenizer.chat_format == "chatml":
        tail = _chat_halves(tokenizer, system_prompt)[1]
        return tuple(tokenizer.encode(f"\nQuestion: {question} {instruction}{tail}", add_bos=False))
    return tuple(tokenizer.encode(f"\n\nQuestion: {question}\nAnswer:" + (f" {stem}" if stem else ""), add_bos=False))


def chunk_tokens(tokenizer: Tokenizer, text: str) -> tuple[int, ...]:
    """Token ids of one retrieved chunk, tokenized on its own."""
    return tuple(tokenizer.encode("\n" + text, add_bos=False))


def in_split(key: str, split: str, train_fraction: float) -> bool:
    """Whether the unit named ``key`` (a paragraph, an essay) belongs to ``split``.

    The unit's sha256 maps it to u in [0, 1): train iff u < ``train_fraction``, eval
    otherwise, so the two splits are disjoint and stable across runs and machines.
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r} must be one of {SPLITS}")
    if not 0.0 <= train_fraction <= 1.0:
        raise ValueError(f"train_fraction={train_fraction} must be in [0, 1]")
    if split == "all":
        return True
    u = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64
    return (u < train_fraction) == (split == "train")
