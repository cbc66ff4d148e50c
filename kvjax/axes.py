"""The axes of the paged KV cache and its attention: one letter and one name per axis.

A letter stands for its axis in einsum and einops strings (``"s q (h g) d -> s h (g q) d"``)
and in shape comments (``# [s, h, r, d]``); the name is the variable or argument that holds
the axis's size (``num_kv_heads``), and long-form shape comments use it
(``[num_pages, tokens_per_block, num_kv_heads, head_dim]``). Letters are case-sensitive:
``H`` (query heads) and ``h`` (KV heads) are different axes, and so are ``P`` and ``p``.

======  =================  ======================================================  =================================
letter  name               counts                                                  set by
======  =================  ======================================================  =================================
s       num_seqs           sequences of one step (the batch)                       SchedulerConfig.max_batch_size
q       num_queries        query tokens of one sequence in one attention call: 1
                           in decode, a prefill chunk (at most
                           ``SchedulerConfig.prefill_chunk_size``), CacheBlend's
                           recomputed rows
k       kv_len             key/value slots read for one sequence:
                           ``pages_per_seq * tokens_per_block``
H       num_heads          query heads: ``H = h * g``                              ModelConfig.num_heads
h       num_kv_heads       KV heads (MHA: H, MQA: 1)                               ModelConfig.num_kv_heads
g       group              query heads per KV head: ``num_heads // num_kv_heads``
r       rows               query rows of one KV head: ``q * g``, laid out ``(g q)``
                           or ``(q g)``
d       head_dim           width of one head                                       ModelConfig.head_dim
P       num_pages          pages in one pool (the null page included)              CacheLayout.num_pages
p       pages_per_seq      entries of a block table; in a blocked loop, the
                           pages of one key block
t       tokens_per_block   token slots of one page (TensorRT-LLM's name, used      KvCacheConfig.tokens_per_block
                           for this axis everywhere, kernels included)
n       num_blocks         query or key blocks of a blocked loop
l       num_layers         decoder layers                                          ModelConfig.num_layers
v       vocab_size         vocabulary entries                                      ModelConfig.vocab_size
======  =================  ======================================================  =================================

"Set by" names the field of ``kvjax.config`` (``KvCacheConfig``, ``SchedulerConfig``),
``kvjax.model.config.ModelConfig`` or ``kvjax.cache.layout.CacheLayout`` that fixes the size
(``SchedulerConfig.max_batch_size`` bounds ``s`` from above); an axis without one is derived
from the others, from a call's block sizes or from the step. ``AXES`` holds the same table
as data, and ``tests/test_axes.py`` checks the einsum and einops strings against it.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class Axis:
    """One row of the glossary.

    Attributes:
      name: the variable that holds the axis's size.
      set_by: ``"Class.field"`` of the config or layout field that fixes it; None = derived.
    """

    name: str
    set_by: str | None = None


AXES: Mapping[str, Axis] = types.MappingProxyType({
    "s": Axis("num_seqs", "SchedulerConfig.max_batch_size"),
    "q": Axis("num_queries"),
    "k": Axis("kv_len"),
    "H": Axis("num_heads", "ModelConfig.num_heads"),
    "h": Axis("num_kv_heads", "ModelConfig.num_kv_heads"),
    "g": Axis("group"),
    "r": Axis("rows"),
    "d": Axis("head_dim", "ModelConfig.head_dim"),
    "P": Axis("num_pages", "CacheLayout.num_pages"),
    "p": Axis("pages_per_seq"),
    "t": Axis("tokens_per_block", "KvCacheConfig.tokens_per_block"),
    "n": Axis("num_blocks"),
    "l": Axis("num_layers", "ModelConfig.num_layers"),
    "v": Axis("vocab_size", "ModelConfig.vocab_size"),
})
"""The glossary's table by letter (what each axis counts is the docstring's)."""
