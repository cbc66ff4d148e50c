"""Host bookkeeping cost of the KV cache manager vs the model's step time (issue 7).

Replays a long synthetic trace (shared system prompts, Zipf-popular documents, multi-turn
chats, priorities, eviction pressure) through the manager alone and through the scheduler,
with and without host offload, and measures SmolLM2's prefill and decode step through the
engine in the same run.

    python -m experiments.run --config=configs/bench_manager.py
    python -m experiments.run --config=configs/bench_manager.py --config.model_steps.enabled=False  # host only
    python -m experiments.run --config=configs/bench_manager.py:tiny  # smoke run (seconds)
"""

from __future__ import annotations

import ml_collections

from configs import eviction


def get_config(preset: str = "") -> ml_collections.ConfigDict:
    """Defaults: 12k requests, ~1 minute of replays plus ~1 minute on SmolLM2 (2-core CPU).

    Args:
      preset: "" (defaults) or "tiny": the eviction experiment's tiny trace, 4 requests in
        flight and a 64-token, batch-2 model step, for smoke tests.
    """
    config = eviction.get_config(preset)  # the same trace and manager sizing as the eviction experiment
    config.experiment = "bench_manager"  # module experiments.bench_manager
    if not preset:
        config.trace.num_requests = 12000  # requests in the trace
    config.concurrency = 8  # requests in flight in the manager-only replay (decode round-robin)
    config.scheduler = ml_collections.ConfigDict()
    config.scheduler.max_batch_size = 8  # scheduler replay: sequences per step
    config.scheduler.max_num_tokens = 2048  # scheduler replay: token budget per step
    config.scheduler.prefill_chunk_size = 1024  # scheduler replay: prefill chunk, tokens
    del config.engine  # no engine hit-rate check here
    config.model_steps = ml_collections.ConfigDict()
    config.model_steps.enabled = True  # measure the model's step times through the engine
    config.model_steps.prompt_tokens = 512  # prefill length of each timed request, tokens
    config.model_steps.batch_size = 8  # requests decoded together
    config.model_steps.new_tokens = 16  # decode steps timed per request
    config.model_steps.max_seq_len = 1024  # engine max_seq_len, tokens
    config.model_steps.max_tokens = 16384  # engine device cache, tokens
    if preset == "tiny":
        config.concurrency = 4
        config.model_steps.update(prompt_tokens=64, batch_size=2, new_tokens=3, max_seq_len=256, max_tokens=256)
    return config
