"""Pallas kernels for paged attention, each with a plain-jnp reference beside it.

Axis names used across the kernels (one letter each in einsums):
  s  num_seqs        sequences in the batch
  q  num_queries     query rows per sequence (1 for decode)
  k  kv_len          key/value slots gathered for a sequence (pages_per_seq * page_size)
  h  num_kv_heads    KV heads (MHA: = query heads, MQA: 1)
  g  group           query heads per KV head
  d  head_dim
Page pools are ``[num_pages, page_size, num_kv_heads, head_dim]`` per layer.
"""
