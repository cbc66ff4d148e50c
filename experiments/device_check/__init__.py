"""The GPU device check: one prepared call on a lent GPU machine, guarded by a CPU dry run.

``bash experiments/device_check.sh`` (``docs/kernels.md``, "The device check") runs four stages
in one process, each after warm-up, its compile seconds reported apart, each guarded so that a
failure is recorded and the next stage still runs:

  kernels    correctness grid of the Pallas Triton kernels (paged decode, partial attention;
             float, int8 and fp8 pages) against the plain-jnp references (``correctness``);
  bandwidth  paged decode's achieved HBM bytes/s against the measured device copy bandwidth,
             over batches and contexts, bf16 / int8 / fp8 pages (``bandwidth``);
  engine     ``kvjax.engine`` on SmolLM2-135M's shapes with random bf16 weights: TTFT cold and
             with a prefix hit, decode tokens/s by batch (``engine_speed``);
  blend      CacheBlend (15 %) against full recompute, TTFT of a synthetic multi-chunk
             prompt (``blend_speed``).

``--dry-run`` runs every stage on the CPU at the tiny sizes of ``sizes.DRY_RUN``, the Pallas
kernels in interpret mode; ``tests/experiments/test_device_check.py`` runs it with imports
limited to what the GPU machine holds (``machine``). Units: seconds (``_s``), milliseconds
(``_ms``), microseconds (``_us``), bytes per second as GB/s (1e9).
"""
