"""One sequence's blended prefill end to end: prompt layout, reused-KV assembly, fusor, decode.

``Blender`` owns a page pool for one sequence (pages 1..pages_per_seq; ``NULL_PAGE`` stays
free) and runs every policy on the same prompt: full recompute and prefix caching through
``transformer.forward``; full KV reuse, CacheBlend and the other selectors through
``fusor.blend_prefill``. After any prefill the pool holds that policy's KV, so
``teacher_force`` and ``decode`` continue from it with ``transformer.forward``.

Prompt layout (``BlendPrompt``)::

    | prefix (exact, prefix-cached) | chunk 0 | ... | chunk n-1 | suffix |

Token counts are padded to ``token_bucket`` so prompts of similar length share compiled code.
Shapes: L = layers, T = padded tokens, K = kv heads, d = head_dim, V = vocab, N = continuation.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import attention
from kvjax.blend.chunk_store import ChunkStore
from kvjax.blend.fusor import BlendInputs, BlendPlan, blend_prefill, fill_pages, gather_kv
from kvjax.blend.selection import Roles, Selection, bucket
from kvjax.cache.layout import CacheLayout
from kvjax.cache.pool import init_pool
from kvjax.manager.hashing import check_token_ids
from kvjax.model import transformer
from kvjax.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class BlendPrompt:
    """A prompt made of an exact prefix, retrieved chunks and a suffix (token ids).

    The parts are validated and stored as tuples of Python ints: ids must be ints >= 0 (the
    model's vocabulary bound is checked by the call that runs the prompt, ``check_vocab``),
    every chunk holds at least one token and the suffix at least one.
    """

    prefix: tuple[int, ...]
    chunks: tuple[tuple[int, ...], ...]
    suffix: tuple[int, ...]

    def __post_init__(self) -> None:
        if isinstance(self.chunks, (str, bytes)) or not hasattr(self.chunks, "__iter__"):
            raise ValueError(f"chunks must be a sequence of token id sequences, got {type(self.chunks).__name__}")
        chunks = tuple(check_token_ids(c, f"chunks[{i}]") for i, c in enumerate(self.chunks))
        for i, chunk in enumerate(chunks):
            if not chunk:
                raise ValueError(f"chunks[{i}] is empty: every chunk must hold at least one token")
        object.__setattr__(self, "prefix", check_token_ids(self.prefix, "prefix"))
        object.__setattr__(self, "chunks", chunks)
        object.__setattr__(self, "suffix", check_token_ids(self.suffix, "suffix"))
        if not self.suffix:
            raise ValueError("suffix must hold at least one token (the last token yields the logits)")

    def check_vocab(self, vocab_size: int) -> None:
        """Raises ValueError naming the part (``prompt.chunks[i]``, ...) that holds an id outside [0, vocab_size)."""
        check_token_ids(self.prefix, "prompt.prefix", vocab_size)
        for i, chunk in enumerate(self.chunks):
            check_token_ids(chunk, f"prompt.chunks[{i}]", vocab_size)
        check_token_ids(self.suffix, "prompt.suffix", vocab_size)

    def describe(self) -> str:
        """The part lengths, for error messages: "prefix 5 + chunks [60, 60] + suffix 14"."""
        return f"prefix {len(self.prefix)} + chunks {[len(c) for c in self.chunks]} + suffix {len(self.suffix)}"

    @property
    def tokens(self) -> np.ndarray:
        return np.asarray([*self.prefix, *(t for c in self.chunks for t in c), *self.suffix], np.int32)

    @functools.cached_property
    def chunk_starts(self) -> tuple[int, ...]:
        starts, pos = [], len(self.prefix)
        for chunk in self.chunks:
            starts.append(pos)
            pos += len(chunk)
        return tuple(starts)

    @functools.cached_property
    def roles(self) -> Roles:
        spans = tuple((s, s + len(c)) for s, c in zip(self.chunk_starts, self.chunks))
        end = spans[-1][1] if spans else len(self.prefix)
        return Roles(num_tokens=end + len(self.suffix), prefix_len=len(self.prefix), chunk_spans=spans, suffix_start=end)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _place_prefix(k: jax.Array, v: jax.Array, prefix_k: jax.Array, prefix_v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Writes the exact prefix KV [L, n_p, K, d] into tokens [0, n_p) of [L, T, K, d]."""
    return jax.lax.dynamic_update_slice(k, prefix_k, (0, 0, 0, 0)), jax.lax.dynamic_update_slice(v, prefix_v, (0, 0, 0, 0))


class Blender:
    """Runs prefill policies for one sequence over a private page pool.

    Args:
      params, cfg: the model.
      store: the chunk store (its tier and start variant).
      prefix: the shared exact prefix (system prompt), prefix-cached once here.
      max_tokens: longest prompt plus continuation, in [1, cfg.max_seq_len]; every call
        checks its tokens against it (``check_prompt``) before touching the pool.
      page_size: tokens per page.
      token_bucket: prompt lengths are padded to a multiple of this.
      attn_impl: attention implementation for prefill and decode.

    Raises:
      ValueError: naming the argument that is out of range.
    """

    def __init__(
        self,
        params: transformer.Params,
        cfg: ModelConfig,
        store: ChunkStore,
        prefix: Sequence[int],
        *,
        max_tokens: int,
        page_size: int = 32,
        token_bucket: int = 256,
        attn_impl: attention.Impl = "auto",
    ) -> None:
        for name, value, high in (("max_tokens", max_tokens, cfg.max_seq_len), ("page_size", page_size, None),
                                  ("token_bucket", token_bucket, None)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (high is not None and value > high):
                allowed = f"[1, cfg.max_seq_len={high}]" if high is not None else ">= 1"
                raise ValueError(f"{name}={value!r} must be an int in {allowed}")
        self.prefix = check_token_ids(prefix, "prefix", cfg.vocab_size)
        if len(self.prefix) > max_tokens:
            raise ValueError(f"len(prefix)={len(self.prefix)} must be <= max_tokens={max_tokens}")
        self.params, self.cfg, self.store = params, cfg, store
        self.max_tokens, self.token_bucket, self.attn_impl = max_tokens, token_bucket, attn_impl
        self.pages_per_seq = -(-bucket(max_tokens, token_bucket) // page_size)
        self.layout = CacheLayout(
            layer_windows=cfg.layer_windows,
            num_pages=(self.pages_per_seq + 1,) * len(dict.fromkeys(cfg.layer_windows)),
            page_size=page_size, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, max_seq_len=cfg.max_seq_len,
        )
        self.table = np.arange(1, self.pages_per_seq + 1, dtype=np.int32)
        self._table_dev = jnp.asarray(self.table[None])
        self.pool = init_pool(self.layout)
        self.prefix_kv = self._exact_prefix_kv() if self.prefix else None

    # ------------------------------------------------------------------ helpers
    def check_prompt(self, prompt: BlendPrompt) -> None:
        """Raises ValueError unless ``prompt`` fits this Blender: its own prefix, token ids in
        [0, vocab_size) and at most ``max_tokens`` tokens (more would write past the block table)."""
        if not isinstance(prompt, BlendPrompt):
            raise ValueError(f"prompt must be a BlendPrompt, got {type(prompt).__name__}")
        if prompt.prefix != self.prefix:
            raise ValueError("the prompt's prefix differs from the Blender's cached prefix")
        prompt.check_vocab(self.cfg.vocab_size)
        if prompt.roles.num_tokens > self.max_tokens:
            raise ValueError(
                f"the prompt holds {prompt.roles.num_tokens} tokens ({prompt.describe()}); this Blender was "
                f"built for max_tokens={self.max_tokens}"
            )

    def _check_span(self, start: int, num_tokens: int, what: str) -> None:
        """Raises ValueError unless positions [start, start + num_tokens) lie in [0, max_tokens)."""
        if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or start < 0:
            raise ValueError(f"{what} starts at position {start!r}; it must be an int >= 0")
        if start + num_tokens > self.max_tokens:
            raise ValueError(
                f"{what} spans positions [{start}, {start + num_tokens}), past max_tokens={self.max_tokens} "
                "of this Blender"
            )

    def _tables(self) -> tuple[jax.Array, ...]:
        return (self._table_dev,) * self.layout.num_groups

    def padded(self, num_tokens: int) -> int:
        return bucket(num_tokens, self.token_bucket)

    def _forward(self, tokens: np.ndarray, positions: np.ndarray, length: int, logits_mode: str) -> jax.Array | None:
        logits, self.pool = transformer.forward(
            self.params, self.pool, jnp.asarray(tokens[None]), jnp.asarray(positions[None]), self._tables(),
            jnp.asarray([length], jnp.int32), cfg=self.cfg, layout=self.layout, logits_mode=logits_mode,
            attn_impl=self.attn_impl,
        )
        return logits

    def padded_span(self, tokens: np.ndarray, start: int, padded: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens [padded] int32, positions [padded] int32 from ``start``, -1 past the tokens)."""
        tok = np.zeros(padded, np.int32)
        tok[: len(tokens)] = tokens
        pos = np.full(padded, -1, np.int32)
        pos[: len(tokens)] = np.arange(start, start + len(tokens))
        return tok, pos

    def _exact_prefix_kv(self) -> tuple[jax.Array, jax.Array]:
        tok, pos = self.padded_span(np.asarray(self.prefix, np.int32), 0, self.padded(len(self.prefix)))
        self._forward(tok, pos, len(self.prefix), "none")
        k, v = gather_kv(self.pool, jnp.asarray(self.table), self.padded(len(self.prefix)))
        return k[:, : len(self.prefix)], v[:, : len(self.prefix)]

    def reused_kv(self, prompt: BlendPrompt, padded: int) -> tuple[jax.Array, jax.Array]:
        """Loads the prompt's reused KV: [L, padded, K, d] K (stored rotation) and V."""
        self.check_prompt(prompt)
        chunks = [self.store.get(c) for c in prompt.chunks]
        k, v = self.store.assemble(chunks, prompt.chunk_starts, padded)
        if self.prefix_kv is not None:
            k, v = _place_prefix(k, v, *self.prefix_kv)
        return k, v

    def deltas(self, prompt: BlendPrompt, padded: int) -> np.ndarray:
        """[padded] int32 actual minus stored position of every token (0 outside chunks)."""
        deltas = np.zeros(padded, np.int32)
        for (s, e), _ in zip(prompt.roles.chunk_spans, prompt.chunks):
            deltas[s:e] = s - self.store.stored_start
        return deltas

    # ------------------------------------------------------------------ policies
    def full_recompute(self, prompt: BlendPrompt) -> jax.Array:
        """The reference: the whole prompt through ``transformer.forward``; logits [V]."""
        self.check_prompt(prompt)
        tokens = prompt.tokens
        tok, pos = self.padded_span(tokens, 0, self.padded(len(tokens)))
        return self._forward(tok, pos, len(tokens), "last")[0]

    def exact_prefix_len(self, prompt: BlendPrompt) -> int:
        """Tokens whose stored KV is exact: the prefix, plus chunk 0 when it was stored behind it."""
        exact = len(prompt.prefix)
        if prompt.chunks and self.store.variant_prefix == prompt.prefix:
            exact += len(prompt.chunks[0])
        return exact

    def prefix_caching(self, prompt: BlendPrompt) -> jax.Array:
        """Reuses only the exact prefix KV, computes the rest with ``transformer.forward``; logits [V]."""
        self.check_prompt(prompt)
        tokens = prompt.tokens
        exact = self.exact_prefix_len(prompt)
        padded_exact = self.padded(exact)
        if exact > len(prompt.prefix):
            chunk = self.store.get(prompt.chunks[0])
            k, v = self.store.assemble([chunk], [len(prompt.prefix)], padded_exact)
        else:
            shape = (self.cfg.num_layers, padded_exact, self.cfg.num_kv_heads, self.cfg.head_dim)
            k, v = jnp.zeros(shape), jnp.zeros(shape)
        if self.prefix_kv is not None:
            k, v = _place_prefix(k, v, *self.prefix_kv)
        _, pos = self.padded_span(tokens[:exact], 0, padded_exact)
        self.pool = fill_pages(self.pool, k, v, jnp.asarray(pos), self._table_dev, layout=self.layout)
        tok, pos = self.padded_span(tokens[exact:], exact, self.padded(len(tokens) - exact))
        return self._forward(tok, pos, len(tokens), "last")[0]

    def blend(
        self,
        prompt: BlendPrompt,
        selection: Selection,
        num_probes: int = 0,
        reused: tuple[jax.Array, jax.Array] | None = None,
    ) -> tuple[jax.Array, dict | None]:
        """Blended prefill with ``selection``; returns (logits [V], trace or None).

        Args:
          num_probes: > 0 traces the first ``num_probes`` suffix tokens (``BlendPlan``).
          reused: KV [L, padded, K, d] at the actual positions to use instead of the store's
            (e.g. the full-recompute KV, for a reference trace of the suffix).
        """
        self.check_prompt(prompt)
        roles = prompt.roles
        padded = self.padded(roles.num_tokens)
        tok, pos = self.padded_span(prompt.tokens, 0, padded)
        k, v = self.reused_kv(prompt, padded) if reused is None else reused
        deltas = self.deltas(prompt, padded) if reused is None else np.zeros(padded, np.int32)
        selectable, forced = roles.masks(padded)
        probes = np.full(num_probes, -1, np.int32)
        suffix_pos = np.arange(roles.suffix_start, roles.num_tokens)[:num_probes]
        probes[: len(suffix_pos)] = suffix_pos
        inputs = BlendInputs(
            tokens=tok, positions=pos, reused_k=k, reused_v=v, deltas=deltas,
            selectable=selectable, forced=forced, rows=selection.rows, rows_valid=selection.rows_valid,
            counts=selection.counts, block_table=self.table[None], length=np.asarray([roles.num_tokens], np.int32),
            probes=probes, num_cached=np.int32(0),
        )
        plan = BlendPlan(checks=selection.checks, deviation=selection.deviation, num_probes=num_probes)
        logits, self.pool, trace = blend_prefill(
            self.params, self.pool, inputs, cfg=self.cfg, layout=self.layout, plan=plan, attn_impl=self.attn_impl
        )
        return logits, trace

    # ------------------------------------------------------------------ after the prefill
    def kv(self, num_tokens: int) -> tuple[jax.Array, jax.Array]:
        """The first ``num_tokens`` KV slots of the sequence: [L, num_tokens, K, d] each."""
        k, v = gather_kv(self.pool, jnp.asarray(self.table), self.padded(num_tokens))
        return k[:, :num_tokens], v[:, :num_tokens]

    def teacher_force(self, prompt_len: int, continuation: np.ndarray) -> jax.Array:
        """Logits [N - 1, V] after feeding continuation[:-1] at positions prompt_len, ... (KV from the pool)."""
        continuation = check_token_ids(continuation, "continuation", self.cfg.vocab_size)
        n = len(continuation) - 1
        if n < 1:
            raise ValueError(f"len(continuation)={len(continuation)} must be >= 2 (it feeds all but the last token)")
        self._check_span(prompt_len, n, "the continuation")
        tok, pos = self.padded_span(np.asarray(continuation[:-1], np.int32), prompt_len, n)
        return self._forward(tok, pos, prompt_len + n, "all")[0]

    def decode(self, first: int, start: int, steps: int, stop_ids: Sequence[int] = ()) -> tuple[list[int], np.ndarray]:
        """Greedy decode: feeds ``first`` at position ``start`` and ``steps - 1`` more tokens.

        Returns:
          (tokens generated after ``first``, their logits [steps, V] as numpy). Stops early
          after a token in ``stop_ids``.
        """
        (token,) = check_token_ids((first,), "first", self.cfg.vocab_size)
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps={steps!r} must be an int >= 1")
        self._check_span(start, steps, "decoding")
        out, logits_all = [], []
        for i in range(steps):
            logits = self._forward(np.asarray([token], np.int32), np.asarray([start + i], np.int32), start + i + 1, "last")
            logits = np.asarray(logits[0])
            logits_all.append(logits)
            token = int(np.argmax(logits))
            out.append(token)
            if token in stop_ids:
                break
        return out, np.stack(logits_all)
