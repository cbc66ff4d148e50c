"""CacheBlend: reuse of non-prefix chunk KV with selective recompute (SPEC C1-C7)."""

from kvjax.blend.blender import Blender, BlendPrompt
from kvjax.blend.chunk_store import ChunkIntegrityError, ChunkStore, StoredChunk
from kvjax.blend.engine_blend import BlendReport, blend_salt, submit_blended
from kvjax.blend.fusor import BlendInputs, BlendPlan, blend_prefill
from kvjax.blend.managed_store import ManagedChunkStore
from kvjax.blend.reposition import reposition_keys, reposition_layers
from kvjax.blend.selection import Roles, Selection, SelectionConfig

__all__ = [
    "BlendInputs",
    "BlendPlan",
    "BlendPrompt",
    "BlendReport",
    "Blender",
    "ChunkIntegrityError",
    "ChunkStore",
    "ManagedChunkStore",
    "Roles",
    "Selection",
    "SelectionConfig",
    "StoredChunk",
    "blend_prefill",
    "blend_salt",
    "reposition_keys",
    "reposition_layers",
    "submit_blended",
]
