"""Time collectives on the local devices and fit a `MeasuredCostModel` to them.

    samples = measure_collectives(mesh)                       # every kind, every axis of size > 1
    cost = MeasuredCostModel(mesh_spec(mesh), "h100-sxm", samples)

Each collective runs alone in a jitted `shard_map` over one mesh axis (the other axes carry
independent copies, as in a real step) on buffers of several sizes; the median of a few runs after
a warm-up is kept. The sizes are full-buffer bytes per device, the convention of `CostModel`.
On this CPU-only machine the numbers are host-memory copies, not a network; on a GPU node they
are the NCCL collectives XLA emits.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ...core.collectives import KINDS
from ...core.cost import CollectiveSample
from ...core.errors import ConfigError


def _body(kind: str, axis: str, n: int):
    """Per-device function of one collective on a (n * k,) float32 local buffer."""
    if kind == "all-reduce":
        return lambda x: jax.lax.psum(x, axis)
    if kind == "all-gather":
        return lambda x: jax.lax.all_gather(x, axis, tiled=True)
    if kind == "reduce-scatter":
        return lambda x: jax.lax.psum_scatter(x, axis, tiled=True)
    if kind == "all-to-all":
        return lambda x: jax.lax.all_to_all(x, axis, 0, 0, tiled=True)
    perm = [(i, (i + 1) % n) for i in range(n)]
    return lambda x: jax.lax.ppermute(x, axis, perm)


def _local_elements(kind: str, nbytes: int, n: int) -> int:
    """Elements of the per-device input so the collective's full buffer is ~`nbytes` (all-gather's
    full buffer is its output, n times its input) and every split divides."""
    full = max(n, (nbytes // 4) // n * n)
    return full // n if kind == "all-gather" else full


def _time(fn: Any, x: Any, runs: int) -> float:
    jax.block_until_ready(fn(x))                          # compile and warm up
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def measure_collectives(mesh: jax.sharding.Mesh, *, kinds: Sequence[str] = KINDS,
                        sizes: Sequence[int] = (2**14, 2**18, 2**21), runs: int = 5) -> list[CollectiveSample]:
    """Time every `kind` over every axis of `mesh` larger than 1 at each full-buffer size in bytes."""
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or len(set(int(s) for s in sizes)) < 2 or min(sizes) < 4 or runs < 1:
        raise ConfigError(f"autoshard: measure_collectives(kinds={list(kinds)}, sizes={list(sizes)}, runs={runs}) "
                          f"needs kinds from {list(KINDS)}, at least two distinct sizes >= 4 bytes and runs >= 1.")
    samples = []
    for axis in (a for a in mesh.axis_names if mesh.shape[a] > 1):
        n = mesh.shape[axis]
        for kind in kinds:
            fn = jax.jit(jax.shard_map(_body(kind, axis, n), mesh=mesh, in_specs=PartitionSpec(axis),
                                       out_specs=PartitionSpec(axis)))
            for nbytes in sizes:
                local = _local_elements(kind, int(nbytes), n)
                x = jax.device_put(jnp.ones((local * n,), jnp.float32), NamedSharding(mesh, PartitionSpec(axis)))
                full = local * 4 * (n if kind == "all-gather" else 1)
                samples.append(CollectiveSample(kind, (axis,), float(full), _time(fn, x, runs)))
    return samples
