"""The fidelity gate for blending: before a model's chunk KV is blended, two checks on a short
calibration prompt, once per model and gate settings (cached in memory and on disk).

1. **Re-rotation.** CacheBlend moves a stored chunk to its new start by rotating its keys by
   the position delta (``reposition_keys``). That is exact only when the model's RoPE, its
   scaling included, composes (rotating by p then by delta equals rotating by p + delta). For
   every layer the gate computes the keys of the calibration tokens at positions p in place
   (``transformer.qkv``), re-rotates them by deltas up to the engine's context, and compares
   them with the keys computed in place at p + delta: the largest error relative to the
   keys' magnitude must stay under a float tolerance of the weights' dtype.
2. **Blended KL.** On a separate small engine (the caller's cache is not touched), the
   calibration prompt (a prefix, chunks stored alone, a suffix) is prefilled by full
   recompute and blended by CacheBlend at ``FidelityConfig.recompute_ratio``; the mean KL
   (nats) of the suffix positions' next-token distributions, full recompute against
   blended, must stay under ``max_kl``.

A model that fails is refused for blending (``FidelityError``, naming the check and the
measured value); a model that passes is not checked again in this process, nor in another one
sharing the kvjax cache folder (``<cache>/fidelity/<key>.json``). LMCache's users ask for
this gate because re-RoPE is fragile across architectures (LMCache issue 4666).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import blake3
import jax.numpy as jnp
import numpy as np

from kvjax.blend.engine_blend import ChunkReuse
from kvjax.blend.reposition import reposition_keys
from kvjax.blend.selection import SelectionConfig
from kvjax.config import KvCacheConfig
from kvjax.engine import Engine
from kvjax.metrics import kl_divergence
from kvjax.model import transformer
from kvjax.model.config import ModelConfig
from kvjax.paths import cache_dir
from kvjax.sampling import SamplingParams

if TYPE_CHECKING:
    from kvjax.blend.chunk_store import ChunkStore
    from kvjax.model.registry import Model

log = logging.getLogger(__name__)

ROTATION_TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 4e-3}
"""Re-rotation error allowed at position 0, relative to the keys' largest magnitude, per weight
dtype; ``rotation_tolerance`` adds the float32 angle rounding that grows with the position.
A rotation that does not compose is off by O(1) at large deltas."""


def rotation_tolerance(dtype: str, max_position: int) -> float:
    """Allowed relative re-rotation error for weights of ``dtype`` at positions up to
    ``max_position``: the dtype's rounding plus ~4 float32 ulps of the largest angle."""
    return ROTATION_TOLERANCE.get(dtype, 1e-4) + max_position * 2.0**-22


@dataclasses.dataclass(frozen=True)
class FidelityConfig:
    """Settings of the gate (part of its cache key).

    Attributes:
      recompute_ratio: CacheBlend's ratio on the calibration prompt, in (0, 1].
      max_kl: bound on the mean KL (nats) of blended against full recompute, > 0.
      chunk_tokens: tokens per calibration chunk (>= 16).
      num_chunks: calibration chunks (>= 2: a chunk behind another is what blending moves).
      suffix_tokens: suffix tokens whose next-token distributions are compared (>= 1).
      seed: the calibration prompt's token draw.
    """

    recompute_ratio: float = 0.15
    max_kl: float = 1.0
    chunk_tokens: int = 96
    num_chunks: int = 3
    suffix_tokens: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        checks = (
            ("recompute_ratio", self.recompute_ratio, 0 < self.recompute_ratio <= 1, "in (0, 1]"),
            ("max_kl", self.max_kl, self.max_kl > 0, "> 0"),
            ("chunk_tokens", self.chunk_tokens, self.chunk_tokens >= 16, "an int >= 16"),
            ("num_chunks", self.num_chunks, self.num_chunks >= 2, "an int >= 2"),
            ("suffix_tokens", self.suffix_tokens, self.suffix_tokens >= 1, "an int >= 1"),
        )
        for name, value, ok, allowed in checks:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok:
                raise ValueError(f"fidelity.{name}={value!r} must be {allowed}")


@dataclasses.dataclass(frozen=True)
class FidelityReport:
    """What the gate measured for one model.

    Attributes:
      key: the cache key (model config, weight and KV dtypes, page size, context, gate settings).
      rotation_error: per layer, max |re-rotated - in place| / max |in place| over the deltas.
      rotation_tolerance: the bound on it.
      kl: mean KL (nats) of CacheBlend against full recompute on the calibration suffix.
      max_kl: the bound on it.
    """

    key: str
    rotation_error: tuple[float, ...]
    rotation_tolerance: float
    kl: float
    max_kl: float

    @property
    def failure(self) -> str | None:
        """Why the model is refused (the check and its measured value), or None."""
        worst = int(np.argmax(self.rotation_error))
        if not self.rotation_error[worst] <= self.rotation_tolerance:
            return (
                f"re-rotated keys differ from keys computed in place at layer {worst}: relative error "
                f"{self.rotation_error[worst]:.3g} > {self.rotation_tolerance:g} (the layer's RoPE, with its "
                "scaling, does not compose: its chunk KV cannot be moved to a new position)"
            )
        if not self.kl <= self.max_kl:
            return f"blended KL against full recompute {self.kl:.4g} nats > max_kl={self.max_kl:g}"
        return None


class FidelityError(ValueError):
    """A model failed the fidelity gate: it is refused for blending."""


_REPORTS: dict[str, FidelityReport] = {}
"""Reports of the models checked in this process, by key."""


def gate_key(model: Model, kv: KvCacheConfig, max_seq_len: int, config: FidelityConfig) -> str:
    """The cache key of a gate result: a digest of the model config, the weights' dtype, the
    KV dtype and scales, the page size, the context checked and the gate settings."""
    parts = (repr(model.config), str(model.params.embed.dtype), kv.dtype, kv.scale_granularity, kv.tokens_per_block,
             max_seq_len)
    return blake3.blake3(repr((*parts, config)).encode()).hexdigest()[:24]


def rotation_errors(
    params: transformer.Params, cfg: ModelConfig, tokens: Sequence[int], deltas: Sequence[int]
) -> np.ndarray:
    """Per layer, the largest error of re-rotated keys against keys computed in place.

    Every layer sees the embedded ``tokens`` (the check is of the layer's RoPE, its base and
    scaling, not of the stream entering it); recurrent layers have no keys and report 0.

    Args:
      tokens: q calibration token ids.
      deltas: position shifts to check (each >= 1).

    Returns:
      [L] float64: max over deltas of max |rotate(k(p), delta) - k(p + delta)| / max |k(p + delta)|.
    """
    x = transformer.embed_tokens(params, cfg, jnp.asarray([list(tokens)], jnp.int32))  # [1, q, D]
    positions = jnp.arange(len(tokens), dtype=jnp.int32)[None]  # [1, q]
    errors = np.zeros(cfg.num_layers)
    for layer, lp in enumerate(params.layers):
        if cfg.is_recurrent(layer):
            continue
        theta, scaling = cfg.layer_rope_theta[layer], cfg.layer_rope_scaling[layer]
        _, stored, _ = transformer.qkv(lp, cfg, layer, x, positions)  # [1, q, h, d]
        for delta in deltas:
            _, in_place, _ = transformer.qkv(lp, cfg, layer, x, positions + delta)
            moved = reposition_keys(stored, jnp.full_like(positions, delta), theta, scaling)
            diff = jnp.max(jnp.abs(moved.astype(jnp.float32) - in_place.astype(jnp.float32)))
            scale = jnp.max(jnp.abs(in_place.astype(jnp.float32)))
            errors[layer] = max(errors[layer], float(diff / scale))
    return errors


def _calibration_prompt(
    cfg: ModelConfig, tokens_per_block: int, config: FidelityConfig
) -> tuple[list[list[int]], list[int]]:
    """(chunks, suffix) of seeded token ids in [3, vocab); chunks shortened (to 16 tokens at
    least) so that the prompt and a page of room fit the model's context."""
    rng = np.random.default_rng(config.seed)

    def draw(n: int) -> list[int]:
        return [int(t) for t in rng.integers(3, cfg.vocab_size, n)]

    fit = (cfg.max_seq_len - config.suffix_tokens - 2 * tokens_per_block) // config.num_chunks
    length = max(16, min(config.chunk_tokens, fit))
    return [draw(length) for _ in range(config.num_chunks)], draw(config.suffix_tokens)


def _calibration_selection(cfg: ModelConfig, config: FidelityConfig) -> SelectionConfig:
    """CacheBlend at ``config.recompute_ratio`` with its default checks (layers 1-3, gradual
    filtering), on the layers the model has; a one-layer model, with no layer to check, gets
    EPIC's chunk-start selection at the same ratio."""
    default = SelectionConfig()
    layers = tuple(layer for layer in default.check_layers if layer < cfg.num_layers)
    if not layers:
        return SelectionConfig(selector="epic", recompute_ratio=config.recompute_ratio)
    return SelectionConfig(recompute_ratio=config.recompute_ratio, check_layers=layers,
                           budgets=default.budgets[len(default.budgets) - len(layers):])


def blended_kl(model: Model, kv: KvCacheConfig, config: FidelityConfig, store_type: type[ChunkStore]) -> float:
    """Mean KL (nats) of CacheBlend at ``config.recompute_ratio`` against full recompute, over
    the calibration suffix's next-token distributions, on an engine of its own with a
    ``store_type`` chunk store (passed in: the chunk store runs this gate)."""
    chunks, suffix = _calibration_prompt(model.config, kv.tokens_per_block, config)
    tokens = [t for c in chunks for t in c] + suffix
    tpb = kv.tokens_per_block
    room = min((len(tokens) // tpb + 2) * tpb, model.config.max_seq_len)
    cache = KvCacheConfig(
        tokens_per_block=tpb, max_tokens=4 * room, dtype=kv.dtype, scale_granularity=kv.scale_granularity
    )
    engine = Engine(model, cache, max_seq_len=room)
    store = store_type(engine, variant="pos0", fidelity=None)
    for chunk in chunks:
        store.put(chunk)
    ends = np.cumsum([len(c) for c in chunks]).tolist()
    spans = tuple(zip([0, *ends[:-1]], ends))
    n = config.suffix_tokens
    sampling = SamplingParams(max_new_tokens=1, ignore_eos=True, return_logits=True, prompt_logits=n)
    [full] = engine.generate([tokens], sampling)
    reuse = ChunkReuse(store, spans, _calibration_selection(model.config, config), num_prompt_logits=n)
    rid = engine.submit(tokens, SamplingParams(max_new_tokens=1, ignore_eos=True, return_logits=True), chunks=reuse)
    while not engine.requests[rid].finished:
        engine.step()
    blended = engine.pop_output(rid)
    if blended.error is not None:
        raise RuntimeError(f"the fidelity gate's blended calibration prefill failed: {blended.error}")
    return float(np.mean(kl_divergence(np.asarray(full.prompt_logits), np.asarray(blended.prompt_logits))))


def check(
    model: Model, kv: KvCacheConfig, max_seq_len: int, config: FidelityConfig, store_type: type[ChunkStore]
) -> FidelityReport:
    """Runs both checks (no cache) and returns what they measured; ``store_type`` builds the
    calibration engine's chunk store."""
    chunks, _ = _calibration_prompt(model.config, kv.tokens_per_block, config)
    deltas = sorted({1, config.chunk_tokens, max(1, max_seq_len - config.chunk_tokens)})
    errors = rotation_errors(model.params, model.config, chunks[0], deltas)
    return FidelityReport(
        key=gate_key(model, kv, max_seq_len, config),
        rotation_error=tuple(float(e) for e in errors),
        rotation_tolerance=rotation_tolerance(str(model.params.embed.dtype), max_seq_len),
        kl=blended_kl(model, kv, config, store_type),
        max_kl=config.max_kl,
    )


def require(store: ChunkStore, config: FidelityConfig) -> FidelityReport:
    """The gate: returns the report of ``store``'s model if it passed; raises ``FidelityError``
    naming the failed check and its measured value otherwise. The checks run once per key:
    their report is kept in this process and in ``<cache>/fidelity/<key>.json``."""
    engine = store.engine
    key = gate_key(engine.model, engine.kv_config, engine.max_seq_len, config)
    path = cache_dir() / "fidelity" / f"{key}.json"
    report = _REPORTS.get(key)
    if report is None and path.exists():
        saved = json.loads(path.read_text())
        report = FidelityReport(**{**saved, "rotation_error": tuple(saved["rotation_error"])})
    if report is None:
        report = check(engine.model, engine.kv_config, engine.max_seq_len, config, type(store))
        log.info("fidelity gate, %s: %s", engine.model.config.name, report.failure or "passed")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dataclasses.asdict(report)))
    _REPORTS[key] = report
    if report.failure is not None:
        raise FidelityError(f"model {engine.model.config.name!r} is refused for blending: {report.failure}")
    return report
