"""The engine: requests in, tokens out, over one shared page pool (``kvjax.engine.engine``),
with its shape buckets, submission checks and request outputs beside it."""

from kvjax.engine.buckets import MIN_TABLE_WIDTH, PREFILL_STEP, pow2_bucket, prefill_bucket, table_width
from kvjax.engine.engine import Engine, choose_manager_v2
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
    "pow2_bucket",
    "prefill_bucket",
    "table_width",
]
