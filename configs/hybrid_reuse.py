"""Recurrent-state reuse on a hybrid model: a multi-turn chat trace, per policy and snapshot interval.

    python -m experiments.run --config=configs/hybrid_reuse.py
    python -m experiments.run --config=configs/hybrid_reuse.py:tiny   # a fast smoke run

A random-weight hybrid model (gated linear attention layers interleaved with attention
layers; no hybrid checkpoint is reachable here) serves ``conversations`` chats of ``turns``
turns, served round by round (every conversation's turn t in one batch). Each turn's prompt
is the previous prompt + the model's output + ``user_tokens`` new random ids; every
conversation opens with the same ``system_tokens`` system prompt. For each reuse policy and
periodic snapshot interval the run reports the hit rate (reused / prompt tokens), the
recomputed tokens, the state-pool memory, and beside them the attention-only match (what a
pure-attention model would reuse, prompts served in the same order) and a vLLM-like cell
whose block is ``vllm_block_tokens`` tokens with a snapshot only at block boundaries (so
prompts shorter than a block never hit).
"""

import ml_collections


def get_config(preset: str = "") -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.experiment = "hybrid_reuse"  # module experiments.hybrid_reuse
    config.seed = 0  # weights and token ids

    config.model = ml_collections.ConfigDict()  # the random-weight hybrid (kvjax.testing.tiny)
    config.model.vocab_size = 4096
    config.model.d_model = 128
    config.model.num_layers = 6
    config.model.num_heads = 4  # attention query heads and recurrent heads
    config.model.num_kv_heads = 2
    config.model.head_dim = 32  # recurrent state per head: head_dim x head_dim float32
    config.model.ffn_dim = 256
    config.model.layer_types = ("recurrent", "recurrent", "attention")  # cycled over the layers

    config.conversations = 8  # chats served side by side
    config.turns = 6  # turns per chat
    config.system_tokens = 128  # shared system prompt opening every chat
    config.first_user_tokens = 96  # the first user message
    config.user_tokens = 48  # each later user message
    config.output_tokens = 32  # generated tokens per turn (greedy, EOS ignored)

    config.policies = ("all_reusable", "per_conversation")  # block_reuse_config.policy
    config.intervals = (0, 64, 256, 1024)  # periodic_snapshot_interval (tokens; 0 = off)
    # additional_snapshot_offsets_from_end per policy: all_reusable cells show the periodic
    # interval alone (interval 0 = no snapshot, as a hybrid model without state reuse);
    # per_conversation needs a boundary: the end of each prompt
    config.offsets_from_end = ml_collections.ConfigDict({"all_reusable": (), "per_conversation": (0,)})
    config.max_num_turns = 4  # block_reuse_config.max_num_turns (per_conversation)
    config.max_snapshots = 512  # snapshot slots of the state pool
    config.vllm_block_tokens = 1024  # the vLLM-like cell's block (= its snapshot interval)

    config.kv_cache = ml_collections.ConfigDict()
    config.kv_cache.tokens_per_block = 32
    config.kv_cache.max_tokens = 65536
    config.max_seq_len = 2048

    config.scheduler = ml_collections.ConfigDict()
    config.scheduler.max_num_tokens = 4096
    config.scheduler.prefill_chunk_size = 1024
    config.scheduler.max_batch_size = 8

    if preset == "tiny":
        config.model.vocab_size = 97
        config.model.d_model = 32
        config.model.num_layers = 3
        config.model.head_dim = 16
        config.model.ffn_dim = 64
        config.conversations = 2
        config.turns = 3
        config.system_tokens = 32
        config.first_user_tokens = 40
        config.user_tokens = 24
        config.output_tokens = 8
        config.intervals = (0, 64)
        config.max_snapshots = 32
        config.vllm_block_tokens = 256
        config.kv_cache.tokens_per_block = 16
        config.kv_cache.max_tokens = 4096
        config.max_seq_len = 512
        config.scheduler.max_batch_size = 4
    return config
