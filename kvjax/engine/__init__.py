"""The engine: requests in, tokens out, over one shared page pool (``kvjax.engine.engine``).

Its rooms, one concept each: ``scheduler`` (what each step computes), ``requests``
(submission checks), ``runner`` (a step's forwards: inputs, block tables, sampling),
``speculative_step``, ``manager_v2`` (Manager V2: device-side allocation and its decode loop), ``recurrent``
(hybrid models' state), ``page_ops`` (tier moves), ``buckets`` (shapes), ``outputs`` (records
and outputs) and ``manager_choice`` (V1 or V2)."""

from kvjax.engine.buckets import MIN_TABLE_WIDTH, PREFILL_STEP, pow2_bucket, prefill_bucket, table_width
from kvjax.engine.engine import Engine
from kvjax.engine.manager_choice import choose_manager_v2, manager_builder
from kvjax.engine.outputs import RequestOutput, RequestRecord
from kvjax.engine.requests import ChunkedPrompt, check_token_ids

__all__ = [
    "MIN_TABLE_WIDTH",
    "PREFILL_STEP",
    "ChunkedPrompt",
    "Engine",
    "RequestOutput",
    "RequestRecord",
    "check_token_ids",
    "choose_manager_v2",
    "manager_builder",
    "pow2_bucket",
    "prefill_bucket",
    "table_width",
]
