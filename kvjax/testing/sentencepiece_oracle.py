"""Gemma's SentencePiece tokenizer rebuilt from a GGUF: the independent oracle of the Gemma 3
tokenizer tests and of the fixture generator (importable without JAX)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import sentencepiece


def gemma_sentencepiece(path: str | os.PathLike) -> sentencepiece.SentencePieceProcessor:
    """The GGUF's pieces, scores and types as a SentencePiece BPE model: no normalization
    beyond escaping spaces as "▁", byte fallback, and user-defined pieces spelled with "▁" as
    in Gemma's original ``tokenizer.model`` (llama.cpp's converter wrote them with literal
    spaces: the runs of 2-31 spaces, which SentencePiece matches only in the "▁" spelling)."""
    import gguf
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    reader = gguf.GGUFReader(str(path))
    proto = pb.ModelProto()
    proto.trainer_spec.model_type = pb.TrainerSpec.BPE
    proto.trainer_spec.byte_fallback = True
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = False
    proto.normalizer_spec.remove_extra_whitespaces = False
    proto.normalizer_spec.escape_whitespaces = True
    fields = ("tokens", "scores", "token_type")
    for piece, score, kind in zip(*(reader.fields[f"tokenizer.ggml.{f}"].contents() for f in fields)):
        p = proto.pieces.add()
        user_defined = kind == pb.ModelProto.SentencePiece.USER_DEFINED
        p.piece, p.score, p.type = piece.replace(" ", "▁") if user_defined else piece, score, kind
    return spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
