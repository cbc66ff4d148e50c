"""Precomputed KV of text chunks, keyed by BLAKE3, in a device, host or disk tier (SPEC C1).

A chunk's KV is computed alone, once, in one of three *start variants*:

  "pos0"    the chunk alone from position 0;
  "bos"     behind the BOS token (the chunk starts at position 1);
  "system"  behind the shared system prompt (starts at ``len(prefix)``).

The key is a manager block key (``kvjax.manager.hashing``) chained from a chunk root whose
salt (an ``InternalScope``, which no user ``cache_salt`` can produce) names the variant and,
for "system", the prefix tokens; so the same text stored in two variants gets two keys, and
no chunk key can collide with a request prefix key.

Tiers:
  device  one arena ``[L, capacity, K, d]`` for K and one for V with a bump allocator of token
          slots; assembling a prompt's reused KV is one jitted gather (no per-prompt recompile).
  host    numpy arrays per chunk; assembly concatenates on the host, then one device transfer.
  disk    one ``.npy`` file per chunk for K and one for V under ``disk_dir``, memory-mapped
          when read (a layer can be read alone, which the layer-wise pipeline uses), and a
          ``.b3`` file of per-layer BLAKE3 digests bound to the chunk key (``layer_digest``),
          checked on every read: a damaged file, or another chunk's, raises
          ``ChunkIntegrityError`` naming the chunk, which is dropped (``put`` recomputes it).

Shapes: L = layers, n = chunk tokens, K = kv heads, d = head_dim, T = padded prompt tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from collections.abc import Sequence
from typing import Literal

import blake3
import jax
import jax.numpy as jnp
import numpy as np

from kvjax.blend.fusor import gather_kv
from kvjax.cache.layout import CacheLayout
from kvjax.cache.pool import init_pool
from kvjax.manager.hashing import InternalScope, block_key, check_token_ids, root_key
from kvjax.model import transformer
from kvjax.model.config import ModelConfig

Tier = Literal["device", "host", "disk"]
TIERS = ("device", "host", "disk")
Variant = Literal["pos0", "bos", "system"]
VARIANTS = ("pos0", "bos", "system")
_DIGEST_DOMAIN = b"kvjax-chunk-kv\x00"


class ChunkIntegrityError(ValueError):
    """A disk chunk's files are missing, unreadable, or do not match their digests."""


def layer_digest(key: bytes, layer: int, k: np.ndarray, v: np.ndarray) -> bytes:
    """BLAKE3 of one layer's stored K and V ([n, K, d] each), bound to the chunk key (hence to
    its tokens, variant and prefix), the layer index, and the arrays' shape and dtype."""
    hasher = blake3.blake3(_DIGEST_DOMAIN + key)
    hasher.update(f"{layer}|{k.shape}|{k.dtype.str}|{v.shape}|{v.dtype.str}".encode())
    hasher.update(np.ascontiguousarray(k).reshape(-1).view(np.uint8))
    hasher.update(np.ascontiguousarray(v).reshape(-1).view(np.uint8))
    return hasher.digest()


@dataclasses.dataclass(frozen=True, slots=True)
class StoredChunk:
    """Where a chunk's KV lives.

    Attributes:
      key: 32-byte BLAKE3 block key.
      num_tokens: chunk tokens n.
      stored_start: position of the chunk's first token when its KV was computed.
      tier: "device", "host" or "disk".
      slot: first arena slot (device tier), else -1.
    """

    key: bytes
    num_tokens: int
    stored_start: int
    tier: str
    slot: int = -1


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _arena_put(arena_k: jax.Array, arena_v: jax.Array, k: jax.Array, v: jax.Array, slot: jax.Array):
    """Writes [L, n, K, d] into arena slots [slot, slot + n)."""
    start = (0, slot, 0, 0)
    return jax.lax.dynamic_update_slice(arena_k, k, start), jax.lax.dynamic_update_slice(arena_v, v, start)


@jax.jit
def _arena_gather(arena_k: jax.Array, arena_v: jax.Array, slots: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[L, T, K, d] K and V of arena ``slots`` [T]."""
    return arena_k[:, slots], arena_v[:, slots]


class ChunkStore:
    """Computes, stores and loads chunk KV in one tier.

    Args:
      params, cfg: the model.
      variant: start variant ("pos0", "bos", "system").
      prefix_tokens: the shared system prompt (used by the "system" variant).
      tier: "device", "host" or "disk".
      device_capacity: arena token slots (device tier; slot 0 stays zero for padding).
      disk_dir: folder of the disk tier.
      page_size, token_bucket: scratch-pool page size; precompute lengths round up to
        ``token_bucket`` so chunk lengths share compiled prefills.
    """

    def __init__(
        self,
        params: transformer.Params,
        cfg: ModelConfig,
        *,
        variant: Variant = "system",
        prefix_tokens: Sequence[int] = (),
        tier: Tier = "device",
        device_capacity: int = 8192,
        disk_dir: str | pathlib.Path | None = None,
        page_size: int = 32,
        token_bucket: int = 64,
    ) -> None:
        if variant not in VARIANTS:
            raise ValueError(f"variant={variant!r} must be one of {VARIANTS}")
        if tier not in TIERS:
            raise ValueError(f"tier={tier!r} must be one of {TIERS}")
        if tier == "disk" and disk_dir is None:
            raise ValueError("tier='disk' needs disk_dir (a folder for the .npy files)")
        if variant == "system" and not prefix_tokens:
            raise ValueError("variant='system' needs the shared prefix_tokens")
        self.prefix_tokens = check_token_ids(prefix_tokens, "prefix_tokens", cfg.vocab_size)
        if len(self.prefix_tokens) >= cfg.max_seq_len:
            raise ValueError(
                f"len(prefix_tokens)={len(self.prefix_tokens)} must be < cfg.max_seq_len={cfg.max_seq_len} "
                "(chunks are computed behind it)"
            )
        self.params, self.cfg = params, cfg
        self.variant, self.tier = variant, tier
        self.variant_prefix: tuple[int, ...] = {"pos0": (), "bos": (cfg.bos_id,), "system": self.prefix_tokens}[variant]
        self.page_size, self.token_bucket = page_size, token_bucket
        self.disk_dir = pathlib.Path(disk_dir) if disk_dir is not None else None
        if self.disk_dir is not None:
            self.disk_dir.mkdir(parents=True, exist_ok=True)
        self._root = root_key(InternalScope(f"chunk:{variant}:" + ",".join(map(str, self.variant_prefix))), None)
        self._chunks: dict[bytes, StoredChunk] = {}
        self._host: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}
        self.device_capacity = device_capacity
        self._arena: tuple[jax.Array, jax.Array] | None = None
        self._next_slot = 1
        self.bytes_loaded = 0
        self.computed = 0

    # ------------------------------------------------------------------ keys and lookup
    def key(self, tokens: Sequence[int]) -> bytes:
        """BLAKE3 block key of ``tokens`` under this store's chunk root."""
        return block_key(self._root, tuple(int(t) for t in tokens), ())

    def __contains__(self, tokens: Sequence[int]) -> bool:
        return self.key(tokens) in self._chunks

    def get(self, tokens: Sequence[int]) -> StoredChunk:
        key = self.key(tokens)
        if key not in self._chunks:
            raise KeyError(f"chunk of {len(tokens)} tokens (key {key.hex()[:16]}...) is not stored")
        return self._chunks[key]

    @property
    def stored_start(self) -> int:
        return len(self.variant_prefix)

    def _paths(self, key: bytes) -> tuple[pathlib.Path, pathlib.Path, pathlib.Path]:
        """The disk tier's K, V and digest files of a chunk."""
        name = key.hex()
        return self.disk_dir / f"{name}.k.npy", self.disk_dir / f"{name}.v.npy", self.disk_dir / f"{name}.b3"

    def clear(self) -> None:
        """Drops every chunk (the arena is reused, files are deleted)."""
        for key in self._chunks:
            if self.disk_dir is not None:
                for path in self._paths(key):
                    path.unlink(missing_ok=True)
        self._chunks.clear()
        self._host.clear()
        self._next_slot = 1

    # ------------------------------------------------------------------ precompute
    def compute(self, tokens: Sequence[int]) -> tuple[jax.Array, jax.Array]:
        """KV of ``tokens`` computed behind the variant's prefix: ([L, n, K, d], [L, n, K, d])."""
        full = np.asarray([*self.variant_prefix, *tokens], np.int32)
        padded = -(-len(full) // self.token_bucket) * self.token_bucket
        pages = padded // self.page_size + 1
        layout = CacheLayout(
            layer_windows=self.cfg.layer_windows, num_pages=(pages + 1,) * len(dict.fromkeys(self.cfg.layer_windows)),
            page_size=self.page_size, num_kv_heads=self.cfg.num_kv_heads, head_dim=self.cfg.head_dim,
            max_seq_len=self.cfg.max_seq_len,
        )
        tok = np.zeros((1, padded), np.int32)
        tok[0, : len(full)] = full
        pos = np.full((1, padded), -1, np.int32)
        pos[0, : len(full)] = np.arange(len(full))
        table = np.arange(1, pages + 1, dtype=np.int32)
        tables = (jnp.asarray(table[None]),) * layout.num_groups
        _, pool = transformer.forward(
            self.params, init_pool(layout), jnp.asarray(tok), jnp.asarray(pos), tables,
            jnp.asarray([len(full)], jnp.int32), cfg=self.cfg, layout=layout, logits_mode="none",
        )
        k, v = gather_kv(pool, jnp.asarray(table), padded)
        start = len(self.variant_prefix)
        return k[:, start : len(full)], v[:, start : len(full)]

    def put(self, tokens: Sequence[int]) -> StoredChunk:
        """Stores ``tokens``' KV (computed now unless already stored).

        Raises:
          ValueError: before any work, for an empty chunk, a token id outside [0, vocab_size),
            a chunk that does not fit ``cfg.max_seq_len`` behind the variant prefix, or a full
            device arena.
        """
        tokens = check_token_ids(tokens, "tokens", self.cfg.vocab_size)
        n = len(tokens)
        if not 1 <= n <= self.cfg.max_seq_len - self.stored_start:
            raise ValueError(
                f"a chunk of {n} tokens must hold between 1 and cfg.max_seq_len={self.cfg.max_seq_len} - "
                f"{self.stored_start} (the {self.variant!r} prefix) = {self.cfg.max_seq_len - self.stored_start} tokens"
            )
        key = self.key(tokens)
        if key in self._chunks:
            return self._chunks[key]
        if self.tier == "device" and self._next_slot + n > self.device_capacity:
            raise ValueError(
                f"device_capacity={self.device_capacity} token slots are full ({self._next_slot - 1} used, "
                f"{n} more needed); raise device_capacity or clear() the store"
            )
        k, v = self.compute(tokens)
        self.computed += 1
        slot = -1
        if self.tier == "device":
            if self._arena is None:
                shape = (self.cfg.num_layers, self.device_capacity, self.cfg.num_kv_heads, self.cfg.head_dim)
                self._arena = (jnp.zeros(shape, k.dtype), jnp.zeros(shape, v.dtype))
            slot = self._next_slot
            self._arena = _arena_put(*self._arena, k, v, jnp.int32(slot))
            self._next_slot += n
        elif self.tier == "host":
            self._host[key] = (np.asarray(k), np.asarray(v))
        else:
            k, v = np.asarray(k), np.asarray(v)
            k_path, v_path, digest_path = self._paths(key)
            np.save(k_path, k)
            np.save(v_path, v)
            digest_path.write_bytes(b"".join(layer_digest(key, layer, k[layer], v[layer]) for layer in range(len(k))))
        chunk = StoredChunk(key=key, num_tokens=n, stored_start=self.stored_start, tier=self.tier, slot=slot)
        self._chunks[key] = chunk
        return chunk

    # ------------------------------------------------------------------ loading
    def read_host(self, chunk: StoredChunk, layer: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """K and V of a host or disk chunk as numpy ([L, n, K, d], or [n, K, d] for one layer)."""
        if chunk.tier == "disk":
            return self._read_disk(chunk, layer)
        if chunk.tier != "host":
            raise ValueError(f"chunk tier={chunk.tier!r}; read_host reads 'host' or 'disk' chunks")
        k, v = self._host[chunk.key]
        return (k, v) if layer is None else (k[layer], v[layer])

    def _read_disk(self, chunk: StoredChunk, layer: int | None) -> tuple[np.ndarray, np.ndarray]:
        """Reads a disk chunk (one layer, or all) into memory and checks it against its digests.

        Raises:
          ChunkIntegrityError: naming the chunk, which is dropped from the store.
        """
        num_layers = self.cfg.num_layers
        k_path, v_path, digest_path = self._paths(chunk.key)
        try:
            k_map, v_map = np.load(k_path, mmap_mode="r"), np.load(v_path, mmap_mode="r")
            digests = digest_path.read_bytes()
        except (OSError, ValueError) as err:
            raise self._drop_corrupt(chunk, f"its files are unreadable ({err})") from err
        shape = (num_layers, chunk.num_tokens, self.cfg.num_kv_heads, self.cfg.head_dim)
        if k_map.shape != shape or v_map.shape != shape or len(digests) != 32 * num_layers:
            raise self._drop_corrupt(
                chunk, f"K {k_map.shape} / V {v_map.shape} must both be {shape} with {num_layers} digests, "
                f"found {len(digests) / 32:g}"
            )
        layers = range(num_layers) if layer is None else (layer,)
        k, v = (np.array(k_map), np.array(v_map)) if layer is None else (np.array(k_map[layer]), np.array(v_map[layer]))
        for i, layer_i in enumerate(layers):
            k_l, v_l = (k[i], v[i]) if layer is None else (k, v)
            if layer_digest(chunk.key, layer_i, k_l, v_l) != digests[32 * layer_i : 32 * (layer_i + 1)]:
                raise self._drop_corrupt(chunk, f"layer {layer_i} does not match its BLAKE3 digest")
        return k, v

    def _drop_corrupt(self, chunk: StoredChunk, reason: str) -> ChunkIntegrityError:
        """Forgets a damaged disk chunk and deletes its files; returns the error to raise."""
        self._chunks.pop(chunk.key, None)
        for path in self._paths(chunk.key):
            path.unlink(missing_ok=True)
        return ChunkIntegrityError(
            f"disk chunk {chunk.key.hex()} ({chunk.num_tokens} tokens, variant {self.variant!r}) under "
            f"{str(self.disk_dir)!r} failed its integrity check: {reason}. It was dropped; put() its tokens "
            "again to recompute it"
        )

    def assemble(
        self, chunks: Sequence[StoredChunk], starts: Sequence[int], padded: int
    ) -> tuple[jax.Array, jax.Array]:
        """The reused KV of a prompt: chunk ``i`` placed at token ``starts[i]``; zeros elsewhere.

        Returns:
          (k, v), each [L, padded, K, d] on the device, keys still at their stored rotation.
        """
        if self.tier == "device" and self._arena is None:  # nothing stored yet (a prompt without chunks)
            shape = (self.cfg.num_layers, padded, self.cfg.num_kv_heads, self.cfg.head_dim)
            return jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32)
        if self.tier == "device":
            slots = np.zeros(padded, np.int32)
            for chunk, start in zip(chunks, starts):
                slots[start : start + chunk.num_tokens] = np.arange(chunk.slot, chunk.slot + chunk.num_tokens)
            self.bytes_loaded += 2 * int(np.count_nonzero(slots)) * self._token_bytes()
            return _arena_gather(*self._arena, jnp.asarray(slots))
        shape = (self.cfg.num_layers, padded, self.cfg.num_kv_heads, self.cfg.head_dim)
        k_host, v_host = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
        for chunk, start in zip(chunks, starts):
            k, v = self.read_host(chunk)
            k_host[:, start : start + chunk.num_tokens] = k
            v_host[:, start : start + chunk.num_tokens] = v
            self.bytes_loaded += 2 * chunk.num_tokens * self._token_bytes()
        return jax.device_put(k_host), jax.device_put(v_host)

    def _token_bytes(self) -> int:
        """Bytes of one token's K (or V) over all layers."""
        return self.cfg.num_layers * self.cfg.num_kv_heads * self.cfg.head_dim * 4
