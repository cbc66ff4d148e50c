"""A byte-level ``Tokenizer`` (one token per UTF-8 byte) for fast tests without a checkpoint."""

from __future__ import annotations

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from kvjax.model.tokenizer import Tokenizer

SPECIAL = ("<bos>", "<|im_start|>", "<|im_end|>")


def byte_tokenizer(chat: bool) -> Tokenizer:
    """Ids 0-255 are the bytes, then ``SPECIAL`` (each one id). ``chat`` selects ChatML (like
    SmolLM2) or a base model that prepends BOS (like Gemma 3)."""
    vocab = {c: _byte_of(c) for c in pre_tokenizers.ByteLevel.alphabet()}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL))
    bos, _, im_end = (backend.token_to_id(t) for t in SPECIAL)
    assert bos is not None and im_end is not None, "the special tokens were just added"
    return Tokenizer(
        backend=backend, bos_id=bos, eos_ids=(im_end,) if chat else (), add_bos=not chat,
        chat_format="chatml" if chat else None, default_system=None,
    )


def _byte_of(char: str) -> int:
    """The byte GPT-2's byte-to-unicode table maps to ``char``."""
    code = ord(char)
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]
