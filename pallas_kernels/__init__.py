"""Pallas kernels for paged attention, each with a plain-jnp reference beside it.

Axis names used across the kernels (one letter each in einsums):
  s  num_seqs        sequences in the batch
  q  num_queries     query rows per sequence (1 for decode)
  k  kv_len          key/value slots gathered for a sequence (pages_per_seq * page_size)
  h  num_kv_heads    KV heads (MHA: = query heads, MQA: 1)
  g  group           query heads per KV head
  d  head_dim
Page pools are ``[num_pages, page_size, num_kv_heads, head_dim]`` per layer.

Layout (imports point down only)::

    paged_attention/     decode: one query row per sequence at ``length - 1``; its reference
                         and TPU entry run partial_attention's with that one row
    partial_attention/   query rows at arbitrary positions: reference, TPU and GPU kernels
    common.py            validation, row layout and the online-softmax step of every kernel
    gpu_common.py        Triton tiling limits and scale gathers of both GPU kernels
    tuned_sizes.py       block sizes per (backend, op)

``partial_attention`` imports nothing from ``paged_attention``; the package imports nothing
from ``kvjax``, ``experiments`` or ``tests``.
"""
