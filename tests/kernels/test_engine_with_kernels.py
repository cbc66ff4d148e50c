"""Decode through the engine with the Pallas kernels forced (interpret mode) on the real
model gives the XLA reference's tokens and logits."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.config import KvCacheConfig, SchedulerConfig
from kvjax.engine import Engine
from kvjax.sampling import SamplingParams

pytestmark = pytest.mark.real_model


def test_engine_tokens_with_interpreted_kernels_equal_reference(smollm2):
    prompt = smollm2.tokenizer.encode("The lighthouse keeper wrote in her journal that the storm")
    sampling = SamplingParams(max_new_tokens=4, ignore_eos=True, return_logits=True)
    outputs = {}
    for impl in ("reference", "interpret"):
        engine = Engine(
            smollm2,
            KvCacheConfig(tokens_per_block=16, max_tokens=256),
            SchedulerConfig(max_num_tokens=64, prefill_chunk_size=64),
            max_seq_len=128,
            attn_impl=impl,
        )
        [outputs[impl]] = engine.generate([prompt], sampling)
    assert outputs["interpret"].output == outputs["reference"].output
    ref = np.stack(outputs["reference"].logits)
    assert np.max(np.abs(np.stack(outputs["interpret"].logits) - ref)) / np.max(np.abs(ref)) < 1e-4
