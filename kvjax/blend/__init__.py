"""CacheBlend: reuse of non-prefix chunk KV with selective recompute, as engine requests."""

from kvjax.blend.chunk_store import ChunkStore
from kvjax.blend.engine_blend import BlendReport, ChunkReuse, blended_prefill
from kvjax.blend.fusor import BlendInputs, BlendPlan, blend_prefill
from kvjax.blend.prompt import BlendPrompt
from kvjax.blend.reposition import reposition_keys, reposition_layers
from kvjax.blend.selection import Roles, Selection, SelectionConfig, plan

__all__ = [
    "BlendInputs",
    "BlendPlan",
    "BlendPrompt",
    "BlendReport",
    "ChunkReuse",
    "ChunkStore",
    "Roles",
    "Selection",
    "SelectionConfig",
    "blend_prefill",
    "blended_prefill",
    "plan",
    "reposition_keys",
    "reposition_layers",
]
