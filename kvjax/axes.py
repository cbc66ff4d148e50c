"""The axes of kvjax's arrays: one letter and one name per axis.

The paged KV cache and its attention, the model, blended prefill and speculative decoding
share one glossary. A letter stands for its axis in einsum and einops strings
(``"s q (h g) d -> s h (g q) d"``) and in shape comments and docstrings (``# [s, h, r, d]``);
the name is the variable or argument that holds the axis's size (``num_kv_heads``), and
long-form shape comments use it (``[num_pages, tokens_per_block, num_kv_heads, head_dim]``).
Letters are case-sensitive: ``H`` (query heads) and ``h`` (KV heads) are different axes, and
so are ``P`` and ``p``, ``S`` and ``s``, ``F`` and ``f``. A module states "Axis letters are
``kvjax/axes.py``'s." instead of a legend of its own.

======  ====================  ======================================================  ==================================
letter  name                  counts                                                  set by
======  ====================  ======================================================  ==================================
s       num_seqs              sequences of one step (the batch)                       SchedulerConfig.max_batch_size
q       num_queries           query tokens of one sequence in one attention call: 1
                              in decode, a prefill chunk (at most
                              ``SchedulerConfig.prefill_chunk_size``), CacheBlend's
                              recomputed rows (``q = M``), a speculative step's
                              input and drafts (``q = 1 + a``)
k       kv_len                key/value slots read for one sequence:
                              ``pages_per_seq * tokens_per_block``
H       num_heads             query heads: ``H = h * g``                              ModelConfig.num_heads
h       num_kv_heads          KV heads (MHA: H, MQA: 1)                               ModelConfig.num_kv_heads
g       group                 query heads per KV head: ``num_heads // num_kv_heads``
r       rows                  query rows of one KV head: ``q * g``, laid out ``(g q)``
                              or ``(q g)``
d       head_dim              width of one head                                       ModelConfig.head_dim
P       num_pages             pages in one pool (the null page included)              CacheLayout.num_pages
p       pages_per_seq         entries of a block table; in a blocked loop, the
                              pages of one key block
t       tokens_per_block      token slots of one page (TensorRT-LLM's name, used      KvCacheConfig.tokens_per_block
                              for this axis everywhere, kernels included)
n       num_blocks            query or key blocks of a blocked loop (the chunks of
                              a recurrent layer's scan included)
l       num_layers            decoder layers                                          ModelConfig.num_layers
v       vocab_size            vocabulary entries                                      ModelConfig.vocab_size
G       num_groups            layer groups, one per attention window, each with its
                              own pool and block tables (``CacheLayout.num_groups``)
S       max_seqs              sequence slots: rows of a layer group's block tables    SchedulerConfig.max_batch_size
                              in Manager V2 (``DeviceBlockPool``), the most sequences held
                              at once; a step's s sequences occupy s of them
D       d_model               width of the residual stream                            ModelConfig.d_model
F       ffn_dim               hidden units of one MLP                                 ModelConfig.ffn_dim
R       num_recurrent_layers  recurrent layers of a hybrid model
                              (``ModelConfig.recurrent_layers``), each with its own
                              row of the recurrent state
c       chunk_len             tokens of one chunk of a recurrent layer's chunked
                              scan: ``min(q, kvjax.model.recurrent.CHUNK)``
B       num_variants          variants of one blended prompt prefilled together
                              (``fusor.blend_prefill``; e.g. the policies of a sweep)
T       padded                tokens of a blended prompt, padded to a multiple of
                              ``tokens_per_block``; its fused K/V holds one slot per
                              token, so the recomputed rows attend over ``k = T``
M       capacity              row capacity of a blended prefill at one layer: the
                              recomputed rows, static and bucketed
                              (``selection.row_capacity``), narrowed at each check
                              layer; attending, they are the queries (``q = M``)
o       num_probes            probe positions whose per-layer attention output a
                              blended prefill traces (``BlendPlan.num_probes``)
f       num_features          per-token features of a check layer, the learned
                              scorer's inputs: ``len(scoring.FEATURES)``
z       hidden                hidden units of the learned scorer's MLP
                              (``kvjax.blend.scorer.train_scorer``)
a       num_draft_tokens      draft tokens per sequence of a speculative step (at     SpeculativeConfig.num_draft_tokens
                              most the config's); its verification reads
                              ``q = 1 + a`` input tokens
======  ====================  ======================================================  ==================================

"Set by" names the field of ``kvjax.config`` (``KvCacheConfig``, ``SchedulerConfig``,
``SpeculativeConfig``), ``kvjax.model.config.ModelConfig`` or ``kvjax.cache.layout.CacheLayout``
that fixes the size (``SchedulerConfig.max_batch_size`` bounds ``s`` from above,
``SpeculativeConfig.num_draft_tokens`` bounds ``a``); an axis without one is derived from the
others, from a call's block sizes, from the step or from the blended prompt. ``AXES`` holds the
same table as data, and ``tests/test_axes.py`` checks the einsum and einops strings and the
shape comments against it.
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
    "G": Axis("num_groups"),
    "S": Axis("max_seqs", "SchedulerConfig.max_batch_size"),
    "D": Axis("d_model", "ModelConfig.d_model"),
    "F": Axis("ffn_dim", "ModelConfig.ffn_dim"),
    "R": Axis("num_recurrent_layers"),
    "c": Axis("chunk_len"),
    "B": Axis("num_variants"),
    "T": Axis("padded"),
    "M": Axis("capacity"),
    "o": Axis("num_probes"),
    "f": Axis("num_features"),
    "z": Axis("hidden"),
    "a": Axis("num_draft_tokens", "SpeculativeConfig.num_draft_tokens"),
})
"""The glossary's table by letter (what each axis counts is the docstring's)."""
