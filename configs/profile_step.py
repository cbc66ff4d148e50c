"""Per-op profile of the engine's forward at the shapes of the speed benchmark's rows.

    python -m experiments.run --config=configs/profile_step.py
    python -m experiments.run --config=configs/profile_step.py:tiny   # a fast smoke run

Each row runs the jitted ``transformer.forward`` with exactly the arguments the engine builds
for that step (padded rows, block tables of the bucketed width, pages of a ``decode_context``
token sequence per decoding row), traced with ``jax.profiler``. The trace's XLA ops are joined
with the compiled HLO of the same executable, so every op gets a label (a dot with its operand
shapes, a gather, the cache scatter, ...), its CPU time per step, and for dots the reached
GFLOP/s and weight-streaming GB/s, beside this machine's matmul rate and copy bandwidth.

Rows: ``decode_b<S>`` (S sequences, one token each), ``prefill_<T>`` (one sequence, T new
tokens, no cached prefix) and ``extend_<T>_<C>`` (one sequence, T new tokens after C cached
ones: bench_engine's shared-prefix row is ``extend_124_900``, its repeated prompt
``extend_1_1023``). The trace files stay in the run folder (``trace/<row>``, readable by
Perfetto or TensorBoard), and each row's compiled HLO as hlo_<row>.txt.

The trace's CPU times miss work XLA:CPU hands to its thread pool (a few-row product's dot
shows a fraction of its wall time), so each row is also split by wall clock
(``components.csv``): the forward, the K/V writes and attention calls alone, the weight
products alone and the output head alone, each compiled as its own program at the row's
shapes; the rest (norms, RoPE, SiLU, residuals, embedding) is what the parts leave of the
forward.

Decode rows also get an in-process A/B of the attention algorithm (``decode_ab.csv``): the
blocked decode algorithm against the general blocked algorithm run with one query row.
"""

import ml_collections


def get_config(preset: str = "") -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.experiment = "profile_step"  # module experiments.profile_step
    config.model = "smollm2-135m"  # registry name: smollm2-135m | gemma3-270m
    config.rows = ("decode_b1", "decode_b8", "prefill_512", "prefill_2048", "extend_124_900", "extend_1_1023")
    config.decode_context = 128  # cached tokens of each decoding sequence (bench_engine's decode rows)
    config.warmup = 2  # untimed calls per row after compilation
    config.traced_steps = 10  # calls traced per row; op times are per call
    config.component_rounds = 3  # interleaved rounds of the wall-clock split (components.csv)
    config.component_calls = 3  # timed calls per part per round, after one warm-up call
    config.attn_impl = "blocked"  # kvjax.attention impl: auto | blocked | reference
    config.top_ops = 12  # ops listed per row in the summary (all of them go to ops_<row>.csv)
    # per decode row: alternating calls of the decode vs the general attention algorithm (0 = skip)
    config.decode_ab_rounds = 15

    config.kv_cache = ml_collections.ConfigDict()
    config.kv_cache.tokens_per_block = 32
    config.kv_cache.max_tokens = 32768

    if preset == "tiny":
        config.rows = ("decode_b2", "prefill_64")
        config.decode_context = 16
        config.warmup = 1
        config.traced_steps = 2
        config.component_rounds = 1
        config.component_calls = 1
        config.decode_ab_rounds = 2
        config.kv_cache.max_tokens = 4096
    elif preset:
        raise ValueError(f"unknown preset {preset!r}; allowed: '' (default) or 'tiny'")
    return config
