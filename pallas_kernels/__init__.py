"""Pallas kernels for paged attention, each with a plain-jnp reference beside it.

Axis letters and names (``s`` num_seqs, ``q`` num_queries, ``k`` kv_len, ``H`` num_heads,
``h`` num_kv_heads, ``g`` group, ``r`` rows, ``d`` head_dim, ``p`` pages_per_seq, ``t``
tokens_per_block, ``n`` blocks) are the glossary's in ``kvjax/axes.py``. Page pools are
``[num_pages, tokens_per_block, num_kv_heads, head_dim]`` per layer; the arguments every
attention entry takes are documented once, by ``common.check_inputs``.

Layout (imports point down only)::

    paged_attention/     decode: one query row per sequence at ``length - 1``; its reference
                         and TPU entry run partial_attention's with that one row
    partial_attention/   query rows at arbitrary positions: reference, TPU and GPU kernels
    common.py            the shared arguments and their validation, row layout, and the
                         online-softmax step of every kernel and of kvjax's blocked XLA form
    gpu_common.py        Triton tiling limits and scale gathers of both GPU kernels
    tuned_sizes.py       block sizes per (backend, op)

``partial_attention`` imports nothing from ``paged_attention``; the package imports nothing
from ``kvjax``, ``experiments`` or ``tests``.
"""
