"""``BlendPrompt``: a prompt made of an exact prefix, retrieved chunks and a suffix, the unit
CacheBlend's policies are run and compared on (``experiments.blender``) and its tests draw
(``kvjax.testing.blend``).

Prompt layout::

    | prefix (exact) | chunk 0 | ... | chunk n-1 | suffix |
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from kvjax.blend.selection import Roles
from kvjax.manager.hashing import check_token_ids


@dataclasses.dataclass(frozen=True)
class BlendPrompt:
    """A prompt made of an exact prefix, retrieved chunks and a suffix (token ids).

    The parts are validated and stored as tuples of Python ints: ids must be ints >= 0 (the
    model's vocabulary bound is checked by the call that runs the prompt, ``check_vocab``),
    every chunk holds at least one token and the suffix at least one.
    """

    prefix: tuple[int, ...]
    chunks: tuple[tuple[int, ...], ...]
    suffix: tuple[int, ...]

    def __post_init__(self) -> None:
        if isinstance(self.chunks, (str, bytes)) or not hasattr(self.chunks, "__iter__"):
            raise ValueError(f"chunks must be a sequence of token id sequences, got {type(self.chunks).__name__}")
        chunks = tuple(check_token_ids(c, f"chunks[{i}]") for i, c in enumerate(self.chunks))
        for i, chunk in enumerate(chunks):
            if not chunk:
                raise ValueError(f"chunks[{i}] is empty: every chunk must hold at least one token")
        object.__setattr__(self, "prefix", check_token_ids(self.prefix, "prefix"))
        object.__setattr__(self, "chunks", chunks)
        object.__setattr__(self, "suffix", check_token_ids(self.suffix, "suffix"))
        if not self.suffix:
            raise ValueError("suffix must hold at least one token (the last token yields the logits)")

    def check_vocab(self, vocab_size: int) -> None:
        """Raises ValueError naming the part (``prompt.chunks[i]``, ...) that holds an id outside [0, vocab_size)."""
        check_token_ids(self.prefix, "prompt.prefix", vocab_size)
        for i, chunk in enumerate(self.chunks):
            check_token_ids(chunk, f"prompt.chunks[{i}]", vocab_size)
        check_token_ids(self.suffix, "prompt.suffix", vocab_size)

    def describe(self) -> str:
        """The part lengths, for error messages: "prefix 5 + chunks [60, 60] + suffix 14"."""
        return f"prefix {len(self.prefix)} + chunks {[len(c) for c in self.chunks]} + suffix {len(self.suffix)}"

    @property
    def tokens(self) -> np.ndarray:
        return np.asarray([*self.prefix, *(t for c in self.chunks for t in c), *self.suffix], np.int32)

    @functools.cached_property
    def chunk_starts(self) -> tuple[int, ...]:
        starts, pos = [], len(self.prefix)
        for chunk in self.chunks:
            starts.append(pos)
            pos += len(chunk)
        return tuple(starts)

    @functools.cached_property
    def roles(self) -> Roles:
        spans = tuple((s, s + len(c)) for s, c in zip(self.chunk_starts, self.chunks))
        end = spans[-1][1] if spans else len(self.prefix)
        return Roles(
            num_tokens=end + len(self.suffix), prefix_len=len(self.prefix), chunk_spans=spans, suffix_start=end
        )
