"""Tokenizers built from GGUF metadata (``tokenizer_from_gguf``) or read from a Hugging Face
folder's ``tokenizer.json`` (``tokenizer_from_hf``) with the ``tokenizers`` library, plus chat
templates.

``gpt2`` vocabularies (SmolLM2) become byte-level BPE with the pre-tokenizer llama.cpp
names; ``llama`` vocabularies with scores (Gemma 3, SentencePiece) become a BPE whose merges
are derived from the piece scores. Control tokens are registered as special tokens so
``<|im_start|>`` and friends encode to one id; user-defined pieces (Gemma 3's runs of
newlines, spaces and tabs, its HTML tags) are matched whole before BPE, as SentencePiece does.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Sequence

import gguf
import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers

from kvjax.model.gguf_loader import field_value

_CONTROL = int(gguf.TokenType.CONTROL)
_USER_DEFINED = int(gguf.TokenType.USER_DEFINED)


CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""The ChatML chat template (the Jinja text a ``tokenizer_config.json`` carries), as
``Tokenizer.apply_chat_template`` renders it."""


@dataclasses.dataclass(frozen=True)
class Message:
    role: str
    content: str


@dataclasses.dataclass
class Tokenizer:
    """Encodes text to ids and back; applies the model's chat template.

    Attributes:
      backend: the ``tokenizers.Tokenizer``.
      bos_id, eos_ids: special ids.
      add_bos: whether ``encode`` prepends BOS by default.
      chat_format: "chatml" or None (base models have no chat template).
      default_system: the template's default system prompt.
    """

    backend: tokenizers.Tokenizer
    bos_id: int
    eos_ids: tuple[int, ...]
    add_bos: bool
    chat_format: str | None
    default_system: str | None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if (self.add_bos if add_bos is None else add_bos) else ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Message | dict], *, add_generation_prompt: bool = True) -> str:
        """Renders a conversation as the model expects it (ChatML for SmolLM2)."""
        msgs = [m if isinstance(m, Message) else Message(**m) for m in messages]
        if self.chat_format != "chatml":
            raise ValueError(f"this model has no chat template (chat_format={self.chat_format!r}); encode plain text")
        if self.default_system and (not msgs or msgs[0].role != "system"):
            msgs = [Message("system", self.default_system), *msgs]
        text = "".join(f"<|im_start|>{m.role}\n{m.content}<|im_end|>\n" for m in msgs)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def _added_tokens(tokens: Sequence[str], types: Sequence[int]) -> list[tokenizers.AddedToken]:
    """Control tokens (special: dropped when decoding with skip_special_tokens) and
    user-defined ones (matched whole in the normalized input, leftmost-longest, as
    SentencePiece's prefix matcher does, never merged with their neighbours, and kept as text)."""
    return [
        tokenizers.AddedToken(tok, special=kind == _CONTROL, normalized=kind == _USER_DEFINED)
        for tok, kind in zip(tokens, types)
        if kind in (_CONTROL, _USER_DEFINED)
    ]


def _gpt2_backend(reader: gguf.GGUFReader, tokens: list[str], types: list[int]) -> tokenizers.Tokenizer:
    merges = [tuple(m.split(" ", 1)) for m in field_value(reader, "tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = field_value(reader, "tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        # llama.cpp's "smollm" pre-tokenizer: every digit alone, then GPT-2's regex.
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    return backend


def _unescape_user_defined_spaces(tokens: Sequence[str], types: Sequence[int]) -> list[str]:
    """Spells user-defined pieces with "▁" again where the GGUF has a literal space.

    llama.cpp's converter rewrites "▁" as " " in user-defined pieces (Gemma 3's ids 138-167
    are runs of 2-31 spaces), because llama.cpp matches them on the raw text. SentencePiece
    matches them on the normalized text, where every space is "▁": with the literal spelling
    they never match, and each run of spaces falls apart into single "▁" tokens.
    """
    return [tok.replace(" ", "▁") if kind == _USER_DEFINED else tok for tok, kind in zip(tokens, types)]


def _spm_backend(reader: gguf.GGUFReader, tokens: list[str], types: list[int]) -> tokenizers.Tokenizer:
    scores = list(field_value(reader, "tokenizer.ggml.scores"))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    # SentencePiece BPE merges: every split of a piece into two known pieces, ranked by the
    # merged piece's score (higher score merges first).
    merges: list[tuple[str, str, float]] = []
    for piece, score, kind in zip(tokens, scores, types):
        if kind in (_CONTROL, _USER_DEFINED) or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right, score))
    merges.sort(key=lambda m: (-m[2], vocab[m[0] + m[1]]))
    backend = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=[(a, b) for a, b, _ in merges], fuse_unk=True, byte_fallback=True,
                   unk_token=tokens[int(field_value(reader, "tokenizer.ggml.unknown_token_id", 3))])
    )
    # No pre-tokenizer: SentencePiece merges across "▁" too (Gemma 3 has ">▁</").
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return backend


def tokenizer_from_gguf(reader: gguf.GGUFReader) -> Tokenizer:
    """Builds the tokenizer a GGUF file describes."""
    tokens = [str(t) for t in field_value(reader, "tokenizer.ggml.tokens")]
    types = [int(t) for t in field_value(reader, "tokenizer.ggml.token_type")]
    kind = field_value(reader, "tokenizer.ggml.model")
    if kind == "gpt2":
        backend = _gpt2_backend(reader, tokens, types)
    elif kind == "llama":
        tokens = _unescape_user_defined_spaces(tokens, types)
        backend = _spm_backend(reader, tokens, types)
    else:
        raise ValueError(f"tokenizer.ggml.model={kind!r} is not supported; supported: 'gpt2', 'llama'")
    backend.add_tokens(_added_tokens(tokens, types))
    template = field_value(reader, "tokenizer.chat_template") or ""
    chat_format = "chatml" if "<|im_start|>" in template else None
    default_system = None
    if chat_format == "chatml" and "You are a helpful AI assistant named SmolLM" in template:
        default_system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    eos = int(field_value(reader, "tokenizer.ggml.eos_token_id", 2))
    eos_ids: tuple[int, ...] = (eos,)
    if chat_format == "chatml" and "<|im_end|>" in tokens:
        eos_ids = tuple(dict.fromkeys((eos, tokens.index("<|im_end|>"))))
    return Tokenizer(
        backend=backend,
        bos_id=int(field_value(reader, "tokenizer.ggml.bos_token_id", 1)),
        eos_ids=eos_ids,
        add_bos=bool(field_value(reader, "tokenizer.ggml.add_bos_token", False)),
        chat_format=chat_format,
        default_system=default_system,
    )


def tokenizer_from_hf(folder: pathlib.Path, bos_id: int, eos_ids: tuple[int, ...]) -> Tokenizer:
    """The tokenizer of a Hugging Face checkpoint folder: ``tokenizer.json`` as is, with
    ``tokenizer_config.json``'s BOS rule and chat template (ChatML templates are rendered;
    other templates are not: the model then encodes plain text).

    Args:
      folder: the checkpoint folder.
      bos_id, eos_ids: the model's special ids (``config.json``); ``<|im_end|>`` joins the
        stop ids of a ChatML model.
    """
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} does not exist: a Hugging Face checkpoint folder needs tokenizer.json")
    backend = tokenizers.Tokenizer.from_file(str(path))
    settings_path = folder / "tokenizer_config.json"
    settings = json.loads(settings_path.read_text()) if settings_path.is_file() else {}
    template = settings.get("chat_template") or ""
    template = template if isinstance(template, str) else " ".join(t.get("template", "") for t in template)
    chat_format = "chatml" if "<|im_start|>" in template else None
    end = backend.token_to_id("<|im_end|>")
    if chat_format == "chatml" and end is not None:
        eos_ids = tuple(dict.fromkeys((*eos_ids, end)))
    add_bos = settings.get("add_bos_token")
    if add_bos is None:  # the post-processor's own rule: does encoding with specials put BOS first?
        add_bos = backend.encode("a", add_special_tokens=True).ids[:1] == [bos_id]
    return Tokenizer(backend=backend, bos_id=bos_id, eos_ids=eos_ids, add_bos=bool(add_bos),
                     chat_format=chat_format, default_system=None)
