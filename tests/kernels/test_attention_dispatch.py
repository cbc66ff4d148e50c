"""``kvjax.attention`` picks the blocked XLA implementation on CPU and runs either kernel when asked to interpret."""

from __future__ import annotations

import jax
import pytest

from kvjax import attention
from kvjax.testing.paged_inputs import assert_close, make_inputs
from pallas_kernels.common import AttentionSpec
from pallas_kernels.paged_attention.reference import paged_attention_ref
from pallas_kernels.partial_attention.reference import partial_attention_ref


@pytest.fixture(scope="module")
def inputs():
    return make_inputs(
        1, lengths=[9, 1, 4], num_heads=4, num_kv_heads=2, tokens_per_block=4, pages_per_seq=3, num_queries=3
    )


def test_auto_is_blocked_on_cpu(inputs):
    assert jax.default_backend() == "cpu"
    args = (inputs.q, inputs.q_positions, inputs.kv)

    def jaxpr_of(**impl: str) -> str:
        return str(jax.make_jaxpr(lambda *a: attention.partial_attention(*a, AttentionSpec(0.5), **impl))(*args))

    jaxpr = jaxpr_of()
    assert jaxpr == jaxpr_of(impl="blocked") != jaxpr_of(impl="reference")
    assert "pallas_call" not in jaxpr
    assert "pallas_call" in jaxpr_of(impl="interpret")


@pytest.mark.parametrize("interpret_kernel", ["gpu", "tpu"])
def test_interpret_matches_reference_under_jit(inputs, interpret_kernel):
    spec = AttentionSpec(0.5, sliding_window=6)
    options = dict(impl="interpret", interpret_kernel=interpret_kernel)
    partial = jax.jit(lambda *a: attention.partial_attention(*a, spec, **options))
    decode = jax.jit(lambda *a: attention.paged_attention(*a, spec, **options))
    assert_close(
        partial(inputs.q, inputs.q_positions, inputs.kv),
        partial_attention_ref(inputs.q, inputs.q_positions, inputs.clean_kv, spec),
    )
    q = inputs.q[:, 0]
    assert_close(decode(q, inputs.kv), paged_attention_ref(q, inputs.clean_kv, spec))


def test_rejects_unknown_impl(inputs):
    with pytest.raises(ValueError, match="impl='triton' must be one of"):
        attention.paged_attention(inputs.q[:, 0], inputs.kv, AttentionSpec(1.0), impl="triton")
    with pytest.raises(ValueError, match="interpret_kernel='mgpu' must be one of"):
        attention.paged_attention(
            inputs.q[:, 0], inputs.kv, AttentionSpec(1.0), impl="interpret", interpret_kernel="mgpu"
        )
