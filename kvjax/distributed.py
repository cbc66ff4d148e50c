"""Scale-out: the page pool, the weights and the forward over a JAX device mesh.

Mesh axes (fixed here, used by every ``PartitionSpec`` in this module)::

    pages   splits the page dimension of every pool (more cache capacity per device added)
    kv      splits the KV heads of the pool and, consistently, the attention heads and the
            MLP hidden units of the weights (Megatron-style tensor parallelism)

Sharding of each array (``-`` = replicated)::

    pool k/v     [P, t, h, d]                                     (pages, -, kv, -)
    wq; wk, wv   [D, H*d]; [D, h*d]                               (-, kv)     column-parallel
    bq; bk, bv   [H*d]; [h*d]                                     (kv)        with their columns
    wo           [H*d, D]                                         (kv, -)     row-parallel
    w_gate, w_up [D, F]                                           (-, mlp)    column-parallel
    w_down       [F, D]                                           (mlp, -)    row-parallel
    norms, embed, lm_head, block tables, lengths, tokens, positions replicated

``mlp`` is ``("pages", "kv")`` (all devices) when ``ffn_dim`` divides evenly by the mesh,
else ``"kv"`` (else replicated). The embedding (tied with the output projection) is replicated: splitting the
vocabulary would add an all-reduce to the lookup and an all-gather of the logits for
sampling, for a table that is a small share of memory next to a large cache.

Why this is collective-free in attention: query head ``i`` only reads KV head ``i // g``
(g = H / h), so splitting the h KV heads over ``kv`` and the H query heads the same way
(laid out ``(h g)`` in ``wq``'s columns) keeps each device's attention local. Each layer
then needs exactly two all-reduces of the ``[s, q, D]`` residual stream (after ``wo`` and
after ``w_down``), as in Megatron-LM. The pool is never all-gathered; ``collectives`` reads
the compiled HLO so tests can check that.

The ``pages`` axis: each device holds ``num_pages / pages`` of every pool. Writing a token
is a scatter that only the owning device applies. Reading a sequence's pages is a gather
that every device runs over its own pages (others read as zeros), followed by an all-reduce
of the gathered ``[s, p, t, h / kv, d]`` KV (``kv``: that mesh axis's size) — the price of a
larger cache; the pool itself is still never gathered.

Choosing the mesh when the device count does not divide the KV heads (SmolLM2 has 3 KV
heads, Gemma 3 270M has 1): ``kv`` gets ``gcd(num_kv_heads, num_devices)`` devices and
``pages`` the rest, so every device holds a distinct slice of the cache and nothing is
padded or duplicated (8 devices: SmolLM2 -> pages 8 x kv 1, an 8-head MHA -> pages 1 x kv 8,
a 4-KV-head GQA -> pages 2 x kv 4). To trade capacity for collective-free attention instead,
pass ``devices=jax.devices()[:3]`` for a 3-way ``kv`` mesh.

The model code is unchanged: ``kvjax.model.transformer.forward`` and the CacheBlend fusor
are ordinary jitted functions, and XLA's SPMD partitioner (``AxisType.Auto`` mesh axes)
splits them from the shardings of their inputs. Attention is the exception:
``sharded_forward`` passes the mesh down, and ``kvjax.attention`` runs the chosen
implementation (a Pallas kernel on TPU/GPU, the XLA reference or the blocked one on CPU) per
device under ``shard_map``, since the partitioner cannot split a kernel's custom call.

Multi-host: call ``initialize_distributed()`` first in every process, then build the mesh
from ``jax.devices()`` (all hosts' devices) as on one host.

Axis letters are ``kvjax/axes.py``'s.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from kvjax import attention
from kvjax.cache.layout import CacheLayout
from kvjax.cache.pool import PagePool
from kvjax.model.config import ModelConfig
from kvjax.model.transformer import LogitsMode, Params, forward

PAGES = attention.PAGES_AXIS
KV = attention.KV_AXIS
AXES = (PAGES, KV)
POOL_SPEC = PartitionSpec(PAGES, None, KV, None)
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: Sequence[int] | None = None,
    initialization_timeout: int = 300,
) -> None:
    """Joins a multi-host job (``jax.distributed.initialize``); a no-op for one process.

    On Cloud TPU, SLURM and Open MPI every argument is detected from the environment; else
    give ``coordinator_address`` ("host:port" of process 0), ``num_processes`` and this
    ``process_id`` in every process. Call it before any other JAX call. CPU devices exchange
    their collectives through gloo (set here; accelerators use their own).

    Args:
      initialization_timeout: seconds to wait for every process to join before raising.
    """
    if num_processes == 1:
        return
    if process_id is not None and num_processes is not None and not 0 <= process_id < num_processes:
        raise ValueError(f"process_id={process_id} must lie in [0, num_processes={num_processes})")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id,
        local_device_ids=local_device_ids, initialization_timeout=initialization_timeout,
    )


def mesh_shape(num_kv_heads: int, num_devices: int, kv: int | None = None) -> tuple[int, int]:
    """(pages, kv) axis sizes for ``num_devices``; ``kv`` defaults to gcd(num_kv_heads, num_devices)."""
    if num_devices < 1:
        raise ValueError(f"num_devices={num_devices} must be >= 1")
    kv = math.gcd(num_kv_heads, num_devices) if kv is None else kv
    if kv < 1 or num_kv_heads % kv or num_devices % kv:
        raise ValueError(f"kv={kv} must divide both num_kv_heads={num_kv_heads} and num_devices={num_devices}")
    return num_devices // kv, kv


def make_mesh(num_kv_heads: int, *, kv: int | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ("pages", "kv") mesh over ``devices`` (default: all devices of all hosts).

    Args:
      num_kv_heads: the model's KV heads (the ``kv`` axis must divide them).
      kv: devices along ``kv``; default gcd(num_kv_heads, len(devices)), the rest go to ``pages``.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(num_kv_heads, len(devices), kv)
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)


def mlp_axes(cfg: ModelConfig, mesh: Mesh) -> str | tuple[str, str] | None:
    """Mesh axes that split the MLP hidden units: all devices when ``ffn_dim`` divides by the
    mesh size, else ``kv`` when it divides by that, else None (the MLP is replicated)."""
    if cfg.ffn_dim % mesh.size == 0:
        return AXES
    return KV if cfg.ffn_dim % mesh.shape[KV] == 0 else None


def param_specs(params: Params, cfg: ModelConfig, mesh: Mesh) -> Params:
    """A ``Params`` pytree of ``PartitionSpec`` (see the module docstring)."""
    _check_divides("num_kv_heads", cfg.num_kv_heads, mesh, KV)
    mlp = mlp_axes(cfg, mesh)
    split = {
        "wq": PartitionSpec(None, KV), "wk": PartitionSpec(None, KV), "wv": PartitionSpec(None, KV),
        "wo": PartitionSpec(KV, None), "w_gate": PartitionSpec(None, mlp), "w_up": PartitionSpec(None, mlp),
        "w_down": PartitionSpec(mlp, None), "bq": PartitionSpec(KV), "bk": PartitionSpec(KV), "bv": PartitionSpec(KV),
    }

    def spec(path: tuple[Any, ...], _: jax.Array) -> PartitionSpec:
        """A weight's spec by its field name, ``path[-1]`` (absent weights, None, have none)."""
        field = path[-1]
        if isinstance(field, jax.tree_util.GetAttrKey):
            return split.get(field.name, PartitionSpec())
        return PartitionSpec()

    return jax.tree_util.tree_map_with_path(spec, params)


def shard_params(params: Params, cfg: ModelConfig, mesh: Mesh) -> Params:
    """``params`` placed on ``mesh`` by ``param_specs``."""
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), param_specs(params, cfg, mesh))
    return jax.device_put(params, shardings)


def pool_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of every [num_pages, tokens_per_block, num_kv_heads, head_dim] pool array."""
    return NamedSharding(mesh, POOL_SPEC)


def check_layout(layout: CacheLayout, mesh: Mesh) -> None:
    """Raises unless every group's pages split over ``pages`` and the KV heads over ``kv``, and
    the KV dtype is a float one (quantized pages are not sharded yet)."""
    if layout.quantized:
        raise ValueError(f"layout.dtype={layout.dtype!r}: quantized KV pages are not supported over a mesh; "
                         "use float32, bfloat16 or float16")
    _check_divides("num_kv_heads", layout.num_kv_heads, mesh, KV)
    for group, n in enumerate(layout.num_pages):
        _check_divides(f"num_pages[{group}]", n, mesh, PAGES)


def pages_multiple(mesh: Mesh) -> int:
    """Pool sizes (null page included) must be a multiple of this on ``mesh``."""
    return mesh.shape[PAGES]


def shard_pool(pool: PagePool, layout: CacheLayout, mesh: Mesh) -> PagePool:
    """``pool`` placed on ``mesh`` (pages over ``pages``, KV heads over ``kv``)."""
    check_layout(layout, mesh)
    return jax.device_put(pool, pool_sharding(mesh))


def init_sharded_pool(layout: CacheLayout, mesh: Mesh) -> PagePool:
    """A zeroed pool created in place on ``mesh`` (no device ever holds the whole pool)."""
    check_layout(layout, mesh)
    sharding = pool_sharding(mesh)
    k = tuple(_sharded_zeros(layout.page_shape(i), layout.dtype, sharding) for i in range(layout.num_layers))
    v = tuple(_sharded_zeros(layout.page_shape(i), layout.dtype, sharding) for i in range(layout.num_layers))
    return PagePool(k=k, v=v)


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "sharding"))
def _sharded_zeros(shape: tuple[int, ...], dtype: str, sharding: NamedSharding) -> jax.Array:
    return jax.lax.with_sharding_constraint(jnp.zeros(shape, dtype), sharding)


def replicate(tree, mesh: Mesh):
    """Every leaf of ``tree`` replicated on ``mesh`` (block tables, lengths, tokens, positions)."""
    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))


def sharded_forward(
    params: Params,
    pool: PagePool,
    tokens: jax.Array | np.ndarray,
    positions: jax.Array | np.ndarray,
    block_tables: tuple[jax.Array | np.ndarray, ...],
    lengths: jax.Array | np.ndarray,
    *,
    cfg: ModelConfig,
    layout: CacheLayout,
    mesh: Mesh,
    logits_mode: LogitsMode = "last",
    attn_impl: attention.Impl = "auto",
) -> tuple[jax.Array | None, PagePool]:
    """``transformer.forward`` over ``mesh``: params from ``shard_params``, pool from
    ``shard_pool``/``init_sharded_pool`` (donated); the step's host inputs are replicated.

    Args:
      tokens, positions: [s, q] int32; block_tables: one [s, p] int32 per group;
        lengths: [s] int32 (as in ``forward``).

    Returns:
      (logits replicated, or None; the updated pool, sharded like the input pool).
    """
    tokens, positions, block_tables, lengths = replicate((tokens, positions, tuple(block_tables), lengths), mesh)
    return forward(
        params, pool, tokens, positions, block_tables, lengths,
        cfg=cfg, layout=layout, logits_mode=logits_mode, attn_impl=attn_impl, mesh=mesh,
    )


def collectives(hlo_text: str) -> dict[str, list[str]]:
    """Result shapes of each cross-device collective in compiled HLO text, by op name.

    Usage: ``collectives(jax.jit(f).lower(*args).compile().as_text())``.
    """
    found: dict[str, list[str]] = {op: [] for op in COLLECTIVES}
    for line in hlo_text.splitlines():
        match = re.match(r"\s*(?:ROOT )?\S+ = (.+?) (" + "|".join(COLLECTIVES) + r")(?:-start)?\(", line)
        if match:
            found[match.group(2)].append(match.group(1))
    return found


def _check_divides(field: str, value: int, mesh: Mesh, axes: str | tuple[str, ...]) -> None:
    names = (axes,) if isinstance(axes, str) else axes
    size = math.prod(mesh.shape[a] for a in names)
    if value % size:
        raise ValueError(f"{field}={value} must be divisible by the mesh axes {names} of size {size}")
