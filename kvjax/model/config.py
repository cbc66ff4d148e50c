"""Static description of a decoder-only transformer (Llama family, Gemma 3 variants)."""

from __future__ import annotations

import dataclasses
import functools
import math

from kvjax.model.rope import RopeScaling

LAYER_TYPES = ("attention", "recurrent")
"""Token mixers a layer can have (``ModelConfig.layer_types``)."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hashable model hyper-parameters (a jit static argument).

    Attributes:
      name: registry name.
      vocab_size, d_model, num_layers, num_heads, num_kv_heads, head_dim, ffn_dim: shapes.
      rope_theta: RoPE base of full-attention layers.
      rope_local_theta: RoPE base of sliding-window layers (None = rope_theta).
      rope_scaling: frequency scaling of long-context models (``kvjax.model.rope.RopeScaling``;
        None = plain RoPE); it applies to every layer but those with their own local base.
      rms_eps: RMSNorm epsilon.
      max_seq_len: context length the model was trained for.
      sliding_window: window of the local layers (None = no local layers).
      global_layer_period: every ``global_layer_period``-th layer (1-based) is global when a
        sliding window is set (Gemma 3: 6); None = all layers local.
      activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU).
      qk_norm: RMSNorm on queries and keys per head (Gemma 3).
      sandwich_norm: extra norms after attention and after the MLP (Gemma 3).
      embed_scale: multiply embeddings by sqrt(d_model) (Gemma).
      query_scale: softmax scale; None = 1/sqrt(head_dim).
      bos_id, eos_ids: special tokens.
      layer_types: token mixer per layer, cycled over the layers like attention windows:
        "attention" or "recurrent" (gated linear attention, ``kvjax.model.recurrent``; its
        heads are ``num_heads`` of width ``head_dim``). None = every layer attends. A model
        with a recurrent layer is hybrid: its forward carries a per-sequence recurrent state.
      prefers_kv_cache_manager_v2: the family's preference, followed by
        ``KvCacheConfig.use_kv_cache_manager_v2="auto"`` (False = V1, the host manager).
    """

    name: str
    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_dim: int
    rope_theta: float = 10_000.0
    rope_local_theta: float | None = None
    rope_scaling: RopeScaling | None = None
    rms_eps: float = 1e-5
    max_seq_len: int = 8192
    sliding_window: int | None = None
    global_layer_period: int | None = None
    activation: str = "silu"
    qk_norm: bool = False
    sandwich_norm: bool = False
    embed_scale: bool = False
    query_scale: float | None = None
    bos_id: int = 1
    eos_ids: tuple[int, ...] = (2,)
    layer_types: tuple[str, ...] | None = None
    prefers_kv_cache_manager_v2: bool = False

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"activation={self.activation!r} must be 'silu' or 'gelu_tanh'")
        if self.layer_types is not None and (
            not isinstance(self.layer_types, tuple)
            or not self.layer_types
            or any(t not in LAYER_TYPES for t in self.layer_types)
        ):
            raise ValueError(f"layer_types={self.layer_types!r} must be None or a non-empty tuple of {LAYER_TYPES}")

    @property
    def sm_scale(self) -> float:
        return self.query_scale if self.query_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def is_local(self, layer: int) -> bool:
        if self.sliding_window is None:
            return False
        return self.global_layer_period is None or (layer + 1) % self.global_layer_period != 0

    @functools.cached_property
    def layer_windows(self) -> tuple[int, ...]:
        """The model's own attention window per layer (max_seq_len for global layers)."""
        window = self.sliding_window
        return tuple(window if window is not None and self.is_local(i) else self.max_seq_len
                     for i in range(self.num_layers))

    @functools.cached_property
    def layer_rope_theta(self) -> tuple[float, ...]:
        local = self.rope_local_theta or self.rope_theta
        return tuple(local if self.is_local(i) else self.rope_theta for i in range(self.num_layers))

    @functools.cached_property
    def layer_rope_scaling(self) -> tuple[RopeScaling | None, ...]:
        """The RoPE scaling of each layer: ``rope_scaling``, except on local layers that have
        their own base (``rope_local_theta``, Gemma 3), which rotate unscaled."""
        own_local = self.rope_local_theta is not None
        return tuple(None if own_local and self.is_local(i) else self.rope_scaling for i in range(self.num_layers))

    def is_recurrent(self, layer: int) -> bool:
        return self.layer_types is not None and self.layer_types[layer % len(self.layer_types)] == "recurrent"

    @functools.cached_property
    def recurrent_layers(self) -> tuple[int, ...]:
        """Indices of the recurrent layers; the r-th one owns row r of the recurrent state."""
        return tuple(i for i in range(self.num_layers) if self.is_recurrent(i))

    @property
    def is_hybrid(self) -> bool:
        """Whether some layer is recurrent (the forward then carries a recurrent state)."""
        return bool(self.recurrent_layers)
