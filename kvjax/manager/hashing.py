"""Block keys and multimodal content hashes.

A full block's key chains from its parent's key, so one key names a whole prefix::

    root  = BLAKE3("kvjax-root" || len(salt) || salt || lora_id)
    key_i = BLAKE3(key_{i-1} || token ids as int32 little-endian || extra keys of block i)

A prompt's token ids are packed once (``array("i", ids).tobytes()``) and each block hashes a
slice of that buffer in a single BLAKE3 call (:func:`chain_keys`).

``cache_salt`` and the LoRA id enter through the root, so requests of different tenants or
adapters never share a single block. kvjax's own scopes (chunk stores, blend scopes) are
``InternalScope`` salts, whose root is hashed under another domain tag ("kvjax-scope"
instead of "kvjax-root"), so no user ``cache_salt`` string can produce an internal root.
Extra keys are the multimodal items that overlap the block: each contributes its content
hash and its token span. Keys are full 32-byte digests. ``KeyExtras`` carries what besides
its tokens enters a prompt's keys (salt, adapter, items) from the request to the manager.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import struct
import sys
from array import array
from collections.abc import Mapping, Sequence, Set

import blake3
import numpy as np

from kvjax.config import check_optional_str

BlockKey = bytes
"""A 32-byte BLAKE3 digest naming a block and, through the chain, its whole prefix."""

MAX_TOKEN_ID = 2**31 - 1
"""Token ids are hashed as int32, so they must lie in [0, MAX_TOKEN_ID]."""

_ROOT_DOMAIN = b"kvjax-root\x00"
_SCOPE_DOMAIN = b"kvjax-scope\x00"
_BIG_ENDIAN = sys.byteorder == "big"
assert array("i").itemsize == 4, "token ids are hashed as int32"


@dataclasses.dataclass(frozen=True, slots=True)
class MultimodalItem:
    """A multimodal input occupying the placeholder tokens ``[offset, offset + length)``.

    Attributes:
      modality: "image", "video", "audio", ... (any non-empty string).
      content: the raw bytes of the item (pixels, encoded file, ...).
      offset: index of the first placeholder token in the prompt, >= 0.
      length: number of placeholder tokens, >= 1.
      uuid: a user identifier hashed with the content (one content under two UUIDs = two entries);
        None = BLAKE3(content) alone.
    """

    modality: str
    content: bytes
    offset: int
    length: int
    uuid: str | None = None

    def validate(self, prompt_len: int, index: int) -> None:
        """Raises ValueError naming the field when the item does not fit a prompt of ``prompt_len`` tokens."""
        where = f"mm_items[{index}]"
        if not isinstance(self.modality, str) or not self.modality:
            raise ValueError(f"{where}.modality={self.modality!r} must be a non-empty string")
        if not isinstance(self.content, (bytes, bytearray, memoryview)):
            raise ValueError(f"{where}.content must be bytes, got {type(self.content).__name__}")
        if self.uuid is not None and not isinstance(self.uuid, str):
            raise ValueError(f"{where}.uuid={self.uuid!r} must be a string or None")
        if not isinstance(self.offset, int) or not isinstance(self.length, int) or self.length < 1 or self.offset < 0:
            raise ValueError(
                f"{where}: offset={self.offset!r} must be an int >= 0 and length={self.length!r} an int >= 1"
            )
        if self.offset + self.length > prompt_len:
            raise ValueError(
                f"{where}: span [{self.offset}, {self.offset + self.length}) must lie inside the prompt "
                f"[0, {prompt_len})"
            )


@dataclasses.dataclass(frozen=True, slots=True)
class HashedItem:
    """A multimodal item reduced to what block keys and events need."""

    offset: int
    length: int
    digest: bytes
    label: str
    """The user's UUID where given, else the hex content hash (what events report)."""


@dataclasses.dataclass(frozen=True)
class KeyExtras:
    """What besides its tokens enters a prompt's block keys (vLLM's "extra keys"): the
    tenant's salt and the LoRA adapter through the root key, multimodal items through the
    blocks they overlap. Validated when made, each error naming its field.

    Attributes:
      cache_salt: a tenant's scope (a non-empty string), an ``InternalScope`` (kvjax's own
        scopes), or None.
      lora_id: the adapter's id, an int >= 0, or None.
      mm_items: placeholder spans with their content, kept as a tuple (checked against the
        prompt, and for overlaps, when its keys are made: ``hash_items``).
    """

    cache_salt: str | None = None
    lora_id: int | None = None
    mm_items: Sequence[MultimodalItem] = ()

    def __post_init__(self) -> None:
        check_optional_str("cache_salt", self.cache_salt)
        lora = self.lora_id
        if lora is not None:
            if isinstance(lora, bool) or not isinstance(lora, int | np.integer) or lora < 0:
                raise ValueError(f"lora_id={lora!r} must be None or an int >= 0")
            object.__setattr__(self, "lora_id", int(lora))
        if isinstance(self.mm_items, str | bytes) or not isinstance(self.mm_items, Sequence):
            raise ValueError(f"mm_items must be a sequence of MultimodalItem, got {type(self.mm_items).__name__}")
        for i, item in enumerate(self.mm_items):
            if not isinstance(item, MultimodalItem):
                raise ValueError(f"mm_items[{i}] must be a MultimodalItem, got {type(item).__name__}")
        object.__setattr__(self, "mm_items", tuple(self.mm_items))

    def root(self) -> BlockKey:
        """The prompt's root key (``root_key`` of the salt and the adapter)."""
        return root_key(self.cache_salt, self.lora_id)


NO_EXTRAS = KeyExtras()
"""A prompt keyed by its tokens alone."""


def check_extras(extras: object) -> KeyExtras:
    """``extras`` if it is a ``KeyExtras``, else a ValueError naming the field."""
    if not isinstance(extras, KeyExtras):
        raise ValueError(f"extras must be a kvjax.manager.hashing.KeyExtras, got {type(extras).__name__}")
    return extras


def mm_hash(item: MultimodalItem) -> bytes:
    """Content hash of a multimodal item, 32 bytes.

    BLAKE3(content) without a UUID; BLAKE3(len(uuid) || uuid || content) with one. The UUID is
    length-prefixed (u32 little-endian) so ("ab", b"c") and ("a", b"bc") hash differently: same
    UUID with different content and same content with different UUIDs both give new entries.
    """
    hasher = blake3.blake3()
    if item.uuid is not None:
        uuid = item.uuid.encode("utf-8")
        hasher.update(struct.pack("<I", len(uuid)))
        hasher.update(uuid)
    hasher.update(bytes(item.content))
    return hasher.digest()


def hash_items(items: Sequence[MultimodalItem], prompt_len: int) -> tuple[HashedItem, ...]:
    """Validates items against the prompt and hashes them, sorted by offset.

    Raises:
      ValueError: an item is malformed, outside the prompt, or overlaps another item.
    """
    for i, item in enumerate(items):
        item.validate(prompt_len, i)
    ordered = sorted(items, key=lambda it: it.offset)
    for a, b in itertools.pairwise(ordered):
        if a.offset + a.length > b.offset:
            raise ValueError(
                f"mm_items spans [{a.offset}, {a.offset + a.length}) and [{b.offset}, {b.offset + b.length}) "
                "overlap; placeholder spans must be disjoint"
            )
    hashed = []
    for item in ordered:
        digest = mm_hash(item)
        hashed.append(
            HashedItem(item.offset, item.length, digest, item.uuid if item.uuid is not None else digest.hex())
        )
    return tuple(hashed)


class InternalScope(str):
    """A name of kvjax itself: a cache scope (a chunk store, a blend scope), passed wherever a
    ``cache_salt`` goes, or the id of a request kvjax submits for itself (a chunk store's).

    Its root is hashed under its own domain tag, so a user's ``cache_salt`` string, whatever
    its characters, never yields the root of an internal scope. An ``InternalScope`` equals
    (and hashes like) only an ``InternalScope`` of the same text, so dicts keyed by salt keep
    ``InternalScope("chunk:pos0")`` and the user salt ``"chunk:pos0"`` apart, and a user's
    ``request_id`` never names, replaces or aborts an internal request.
    """

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, InternalScope) and str.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash((InternalScope, str(self)))

    def __repr__(self) -> str:
        return f"InternalScope({str.__repr__(self)})"


def root_key(cache_salt: str | None, lora_id: int | None) -> BlockKey:
    """Parent key of a request's first block: mixes in the tenant salt and the adapter id.

    ``InternalScope`` salts hash under a separate domain tag from user salts.
    """
    hasher = blake3.blake3(_SCOPE_DOMAIN if isinstance(cache_salt, InternalScope) else _ROOT_DOMAIN)
    salt = b"" if cache_salt is None else cache_salt.encode("utf-8")
    hasher.update(struct.pack("<?I", cache_salt is not None, len(salt)))
    hasher.update(salt)
    hasher.update(struct.pack("<?q", lora_id is not None, -1 if lora_id is None else lora_id))
    return hasher.digest()


def items_in(items: tuple[HashedItem, ...], start: int, end: int) -> tuple[HashedItem, ...]:
    """The items whose span overlaps the token range ``[start, end)``."""
    return tuple(it for it in items if it.offset < end and it.offset + it.length > start)


def block_key(parent: BlockKey, token_ids: Sequence[int], extra: tuple[HashedItem, ...]) -> BlockKey:
    """Key of a full block.

    Args:
      parent: key of the previous block, or the request root for block 0.
      token_ids: the block's tokens (tokens_per_block of them), each in [0, MAX_TOKEN_ID].
      extra: multimodal items overlapping the block (see :func:`items_in`).
    """
    return _key(parent, pack_ids(token_ids), extra)


def _key(parent: BlockKey, token_bytes: bytes, extra: tuple[HashedItem, ...]) -> BlockKey:
    """One block's key from its packed tokens; a single BLAKE3 call when there are no extras
    (the same digest as hashing ``parent`` and the tokens in two updates)."""
    if not extra:
        return blake3.blake3(parent + token_bytes).digest()
    hasher = blake3.blake3(parent)
    hasher.update(token_bytes)
    for it in extra:
        hasher.update(it.digest)
        hasher.update(struct.pack("<qq", it.offset, it.length))
    return hasher.digest()


def pack_ids(token_ids: Sequence[int]) -> bytes:
    """Validated token ids as int32 little-endian bytes, in one C call."""
    packed = array("i", token_ids)
    if _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def chain_keys(
    parent: BlockKey, token_bytes: bytes, tokens_per_block: int, items: tuple[HashedItem, ...] = ()
) -> list[BlockKey]:
    """Keys of consecutive full blocks, each chained from the one before.

    Args:
      parent: key of the block before the first one (a request root for block 0).
      token_bytes: the blocks' token ids as int32 little-endian (:func:`pack_ids`),
        ``4 * tokens_per_block`` bytes per block; a trailing partial block is ignored.
      tokens_per_block: tokens per block.
      items: multimodal items of the whole range; offsets count from the first token of
        ``token_bytes`` (a prompt's positions).

    Each key equals :func:`block_key` of that block with the items overlapping it.
    """
    width = 4 * tokens_per_block
    keys = []
    for b in range(len(token_bytes) // width):
        start = b * tokens_per_block
        extra = items_in(items, start, start + tokens_per_block) if items else ()
        parent = _key(parent, token_bytes[b * width : (b + 1) * width], extra)
        keys.append(parent)
    return keys


def check_token_ids(token_ids: Sequence[int], field: str, vocab_size: int | None = None) -> tuple[int, ...]:
    """Returns the ids (a sequence or a numpy array) as a tuple of Python ints, or raises
    ValueError naming ``field`` and the allowed range.

    Integer-like ids (numpy scalars) are converted; bools and anything else are rejected.
    Ids must lie in [0, vocab_size) when ``vocab_size`` is given, else in [0, MAX_TOKEN_ID].
    """
    if isinstance(token_ids, (str, bytes, Set, Mapping)) or not hasattr(token_ids, "__iter__"):
        raise ValueError(
            f"{field} must be a sequence of int token ids (a list, tuple or 1-D array), got {type(token_ids).__name__}"
        )
    high = MAX_TOKEN_ID if vocab_size is None else min(vocab_size - 1, MAX_TOKEN_ID)
    ids = token_ids if type(token_ids) is tuple else tuple(
        token_ids.tolist() if hasattr(token_ids, "tolist") else token_ids
    )
    if not ids or (set(map(type, ids)) == _INT_TYPE and min(ids) >= 0 and max(ids) <= high):
        return ids  # fast path: three C loops, no per-token Python
    out = []
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not hasattr(t, "__index__") or not 0 <= operator.index(t) <= high:
            raise ValueError(f"{field}[{i}]={t!r} must be an int token id in [0, {high}]")
        out.append(operator.index(t))
    return tuple(out)


_INT_TYPE = {int}
