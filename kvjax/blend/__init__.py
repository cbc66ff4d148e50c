"""CacheBlend: reuse of non-prefix chunk KV with selective recompute (SPEC C1-C7)."""

from kvjax.blend.blender import Blender, BlendPrompt
from kvjax.blend.chunk_store import ChunkStore, StoredChunk
from kvjax.blend.fusor import BlendInputs, BlendPlan, blend_prefill
from kvjax.blend.reposition import reposition_keys, reposition_layers
from kvjax.blend.selection import Roles, Selection, SelectionConfig

__all__ = [
    "BlendInputs",
    "BlendPlan",
    "BlendPrompt",
    "Blender",
    "ChunkStore",
    "Roles",
    "Selection",
    "SelectionConfig",
    "StoredChunk",
    "blend_prefill",
    "reposition_keys",
    "reposition_layers",
]
