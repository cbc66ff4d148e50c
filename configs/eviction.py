"""Eviction under memory pressure: priority-LRU vs plain LRU vs Belady's optimum, with and
without host offload (manager-only sweep, then a short check through the real engine).

    python -m experiments.run --config=configs/eviction.py
    python -m experiments.run --config=configs/eviction.py --config.engine.enabled=False  # simulation only
    python -m experiments.run --config=configs/eviction.py:tiny  # smoke run (seconds)
"""

from __future__ import annotations

import ml_collections


def get_config(preset: str = "") -> ml_collections.ConfigDict:
    """Defaults: a 10k-request trace in ~30 s of simulation plus ~1 min on SmolLM2 (2-core CPU).

    Args:
      preset: "" (defaults) or "tiny": a 600-request trace on 64 device pages and a 6-request
        engine replay on 8 pages, for smoke tests.
    """
    config = ml_collections.ConfigDict()
    config.experiment = "eviction"  # module experiments.eviction
    config.model = "smollm2-135m"  # registry name of the engine check: smollm2-135m | gemma3-270m
    config.gguf_path = ""  # local GGUF file; empty = from the model's PyPI package
    config.vocab_size = 49152  # token ids of the simulated trace are drawn from [1, vocab_size)
    config.tokens_per_block = 32  # tokens per block/page
    config.num_device_pages = 1025  # device pages of the simulated manager, the null page included
    config.host_pages = (0, 1024)  # host tier sizes to compare, in pages (0 = no offload)
    config.disk_pages = (0, 4096)  # disk tier sizes run below each host tier > 0, in pages (0 = none)
    config.bytes_per_page = 2 * 30 * 3 * 64 * 32 * 4  # bytes one page moves (SmolLM2 f32, 32 tokens: 1.4 MiB)
    config.max_seq_len = 4096  # longest prompt + output, tokens

    config.trace = ml_collections.ConfigDict()
    config.trace.seed = 0  # seed of the trace (contents, popularity draws, priorities)
    config.trace.num_requests = 10000  # requests in the trace
    config.trace.chat_fraction = 0.3  # share of multi-turn chat turns (the rest: document questions)
    config.trace.num_system_prompts = 4  # distinct system prompts (priority 90)
    config.trace.system_tokens = 96  # tokens per system prompt
    config.trace.num_documents = 2000  # documents, drawn with Zipf popularity (priority 35)
    config.trace.document_tokens = 256  # tokens per document
    config.trace.zipf_alpha = 1.0  # Zipf exponent of document popularity (rank ** -alpha)
    config.trace.question_tokens = 64  # one-off question after the document (priority 10..34)
    config.trace.num_active_chats = 32  # chats in progress at any time (a turn picks one uniformly)
    config.trace.max_turns = 6  # a chat lasts 1..max_turns turns
    config.trace.turn_tokens = 48  # tokens of a new user turn
    config.trace.chat_output_tokens = 48  # tokens generated per chat turn (become history)
    config.trace.doc_output_tokens = 16  # tokens generated per document question (decode priority 10)

    config.engine = ml_collections.ConfigDict()
    config.engine.enabled = True  # also replay a small trace through the real engine
    config.engine.max_tokens = 512  # engine device cache in tokens (16 pages: memory pressure)
    config.engine.host_cache_mb = 12.0  # engine host tier in MiB for the offload runs (8 SmolLM2 f32 pages)
    config.engine.max_seq_len = 512  # engine max_seq_len and prefill chunk, tokens
    config.engine.trace = ml_collections.ConfigDict()  # overrides of config.trace for the engine run
    config.engine.trace.num_requests = 24  # requests (each one prefill on the real model)
    config.engine.trace.num_documents = 6  # documents
    config.engine.trace.document_tokens = 96  # tokens per document
    config.engine.trace.question_tokens = 24  # one-off question tokens
    config.engine.trace.turn_tokens = 24  # new user turn tokens
    config.engine.trace.num_active_chats = 3  # chats in progress
    config.engine.trace.max_turns = 3  # turns per chat at most
    if preset == "tiny":
        config.num_device_pages = 65
        config.host_pages = (0, 64)
        config.disk_pages = (0, 256)
        config.trace.update(num_requests=600, num_documents=120, document_tokens=128, system_tokens=64,
                            question_tokens=32, turn_tokens=32, chat_output_tokens=16, doc_output_tokens=4,
                            num_active_chats=8, max_turns=3)
        config.engine.update(max_tokens=256, max_seq_len=256, host_cache_mb=7.1)  # 8 device pages, 5 host pages
        config.engine.trace.update(num_requests=6, num_documents=3, document_tokens=48, question_tokens=16,
                                   turn_tokens=16, num_active_chats=1, max_turns=2)
    elif preset:
        raise ValueError(f"unknown preset {preset!r}; allowed: '' (default) or 'tiny'")
    return config
