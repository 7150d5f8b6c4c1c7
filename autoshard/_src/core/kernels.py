"""Kernel efficiency on a GPU (pure: no jax import): why small kernels do not run at peak.

A roofline prices an op as max(flops / peak, bytes / bandwidth), so splitting work into smaller
micro-batches or narrower shards looks free. On a GPU it is not (NVIDIA's "Matrix Multiplication
Background User's Guide", sections on tile and wave quantization):

* a matmul's output is computed in whole tiles (256 x 128 elements for the largest tensor-core
  kernels): a 257-row output costs two tile rows (*tile quantization*);
* tiles run in waves of one tile per streaming multiprocessor: 109 tiles on a 108-SM A100 take two
  waves, the second nearly empty (*wave quantization*), so time grows in steps of whole waves;
* each kernel pays a launch, and memory-bound kernels reach only part of the peak bandwidth.

`KernelModel` holds those facts per GPU; `matmul_seconds` and `memory_seconds` apply them. A
convolution runs as an implicit GEMM (M = output positions x batch, N = output channels, K = input
channels x window), as cuDNN's tensor-core kernels do.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from .errors import HardwareError


@dataclasses.dataclass(frozen=True)
class KernelModel:
    """Per-GPU kernel facts: streaming multiprocessors, the matmul output tile, the launch cost per
    kernel and the achievable fraction of peak memory bandwidth."""

    sms: int                          # streaming multiprocessors (one tile each per wave)
    tile: tuple[int, int] = (256, 128)  # the largest matmul output tile (rows, columns)
    launch: float = 4e-6              # seconds per kernel launch (host and device overhead)
    bandwidth_efficiency: float = 0.9  # achievable fraction of peak HBM bandwidth (STREAM-like copy)

    def __post_init__(self) -> None:
        if not (isinstance(self.sms, int) and self.sms >= 1):
            raise HardwareError(f"KernelModel: sms={self.sms!r} must be an int >= 1 (streaming multiprocessors).")
        if len(self.tile) != 2 or any(not isinstance(t, int) or t < 1 for t in self.tile):
            raise HardwareError(f"KernelModel: tile={self.tile!r} must be two ints >= 1 (output rows, columns).")
        if not (0 <= self.launch < 1):
            raise HardwareError(f"KernelModel: launch={self.launch!r} must be seconds per kernel in [0, 1).")
        if not (0 < self.bandwidth_efficiency <= 1):
            raise HardwareError(f"KernelModel: bandwidth_efficiency={self.bandwidth_efficiency!r} must be in (0, 1].")


# per GPU: SM counts from NVIDIA's datasheets (V100 SXM2 80, A100 SXM4 108, H100 SXM5 132); tiles, launch
# and achievable bandwidth are the KernelModel defaults (order-of-magnitude, see its fields)
GPU_KERNELS: dict[str, KernelModel] = {}


def kernel_model(value: Any) -> KernelModel | None:
    """A KernelModel from itself, a GPU name of GPU_KERNELS, a mapping of its fields (a JSON round
    trip), or None."""
    if value is None or isinstance(value, KernelModel):
        return value
    if isinstance(value, str) and value in GPU_KERNELS:
        return GPU_KERNELS[value]
    if isinstance(value, Mapping):
        fields = {f.name for f in dataclasses.fields(KernelModel)}
        kw = {k: (tuple(v) if k == "tile" else v) for k, v in value.items() if k in fields}
        return KernelModel(**kw)
    raise HardwareError(f"HardwareSpec kernels={value!r} must be a KernelModel, one of {sorted(GPU_KERNELS)}, a "
                        "dict of its fields or None.")


def tiles(km: KernelModel, batch: int, m: int, n: int) -> int:
    """Output tiles of `batch` independent m x n products (tile quantization)."""
    tm, tn = km.tile
    return batch * math.ceil(m / tm) * math.ceil(n / tn)


def waves(km: KernelModel, batch: int, m: int, n: int) -> int:
    """Waves of tiles over the SMs (wave quantization)."""
    return math.ceil(tiles(km, batch, m, n) / km.sms)


def matmul_seconds(km: KernelModel, batch: int, m: int, n: int, k: int, flop_rate: float) -> float:
    """Compute time of `batch` m x k by k x n products at `flop_rate` (the achievable rate of the whole
    GPU): whole waves of whole tiles, each tile at the rate of one SM. Large products approach
    2*batch*m*n*k / flop_rate; a product smaller than one wave costs a whole one. Like cuBLAS's
    heuristics, the fastest of the model's tile and its halvings (down to 64 x 64) is used: small
    products run in small tiles over more SMs."""
    return min(waves(t, batch, m, n) * 2.0 * t.tile[0] * t.tile[1] * k / (flop_rate / km.sms)
               for t in _tile_choices(km))


def _tile_choices(km: KernelModel) -> list[KernelModel]:
    out, (tm, tn) = [km], km.tile
    while tm > 64 or tn > 64:
        tm, tn = (tm // 2, tn) if tm >= tn else (tm, tn // 2)
        out.append(dataclasses.replace(km, tile=(max(tm, 1), max(tn, 1))))
    return out


def memory_seconds(km: KernelModel, nbytes: float, bandwidth: float) -> float:
    """Time to move `nbytes` to and from HBM at the achievable share of `bandwidth`."""
    return nbytes / (bandwidth * km.bandwidth_efficiency)


def gemm_roles(primitive: str, params: Mapping[str, Any], ranks: Sequence[int]
               ) -> tuple[tuple[tuple[int, int], ...], ...] | None:
    """Where a matmul's or an ungrouped convolution's (batch, m, n, k) come from: per role, the
    (operand, dim) pairs whose sizes multiply into it (operand 0 / 1: the inputs, 2: the output;
    `ranks`: the two inputs' and the output's ranks). None for other ops and grouped convolutions."""
    if primitive == "dot_general" and "contracting" in params and len(ranks) == 3:
        (lc, rc), (lb, rb) = params["contracting"], params["batch"]
        free_l = tuple((0, d) for d in range(ranks[0]) if d not in lc and d not in lb)
        free_r = tuple((1, d) for d in range(ranks[1]) if d not in rc and d not in rb)
        return tuple((0, d) for d in lb), free_l, free_r, tuple((0, d) for d in lc)
    if primitive == "conv_general_dilated" and "lhs_spec" in params and len(ranks) == 3 \
            and int(params.get("feature_group_count", 1)) == 1:
        rs, os_ = params["rhs_spec"], params["out_spec"]
        return ((), ((2, os_[0]), *((2, d) for d in os_[2:])), ((2, os_[1]),),
                ((1, rs[1]), *((1, d) for d in rs[2:])))
    return None


def gemm_dims(primitive: str, params: Mapping[str, Any], in_shapes: Sequence[Sequence[int]],
              out_shape: Sequence[int]) -> tuple[int, int, int, int] | None:
    """(batch, m, n, k) of a matmul or convolution (a grouped one: groups as the batch), or None."""
    if len(in_shapes) != 2:
        return None
    groups = max(1, int(params.get("feature_group_count", 1))) if primitive == "conv_general_dilated" else 1
    roles = gemm_roles(primitive, dict(params, feature_group_count=1) if groups > 1 else params,
                       [len(in_shapes[0]), len(in_shapes[1]), len(out_shape)])
    if roles is None:
        return None
    shapes = (in_shapes[0], in_shapes[1], out_shape)
    b, m, n, k = (math.prod(shapes[o][d] for o, d in role) for role in roles)
    return b * groups, m, n // groups, k


# ops that start a kernel of their own after XLA's fusion (elementwise ops fuse into them: no launch)
KERNEL_OPS = frozenset({"dot_general", "conv_general_dilated", "reduce_sum", "reduce_max", "reduce_min",
                        "reduce_prod", "argmax", "argmin", "cumsum", "cumprod", "cummax", "cummin",
                        "cumlogsumexp", "gather", "scatter", "scatter-add", "scatter_add", "sort",
                        "dynamic_slice", "dynamic_update_slice", "reduce_window_sum", "select_and_scatter_add"})


def op_seconds(km: KernelModel, primitive: str, params: Mapping[str, Any], in_shapes: Sequence[Sequence[int]],
               out_shape: Sequence[int], flops: float, nbytes: float, flop_rate: float, bandwidth: float,
               launches: float | None = None) -> float:
    """One op: the larger of its (tile- and wave-quantized) compute and its memory traffic, plus
    `launches` kernel launches (None: one when it is a kernel of its own, KERNEL_OPS; pass the count
    of `core.fusion` with its fused `nbytes`). Ops that are not matmuls or convolutions are priced at
    their flops' roofline rate."""
    dims = gemm_dims(primitive, params, in_shapes, out_shape)
    compute = matmul_seconds(km, *dims, flop_rate) if dims is not None and all(dims) else flops / flop_rate
    launch = km.launch * (launches if launches is not None else float(primitive in KERNEL_OPS))
    return launch + max(compute, memory_seconds(km, nbytes, bandwidth))


GPU_KERNELS.update(v100=KernelModel(sms=80), a100=KernelModel(sms=108), h100=KernelModel(sms=132))
