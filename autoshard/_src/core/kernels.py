"""Kernel efficiency on a GPU (pure: no jax import): why small kernels do not run at peak.

A roofline prices an op as max(flops / peak, bytes / bandwidth), so splitting work into smaller
micro-batches or narrower shards looks free. On a GPU it is not (NVIDIA's "Matrix Multiplication
Background User's Guide", sections on tile and wave quantization):

* a matmul's output is computed in whole tiles (256 x 128 elements for the largest tensor-core
  kernels): a 257-row output costs two tile rows (*tile quantization*);
* tiles run in waves of one tile per streaming multiprocessor: 109 tiles on a 108-SM A100 take two
  waves, the second nearly empty (*wave quantization*), so time grows in steps of whole waves;
* a tile's main loop runs the tensor cores below their datasheet peak (clocks sag under the power
  limit; operand loads and synchronisation take issue slots): `mma_efficiency`;
* each tile also pays a fixed prologue (filling the operand pipeline before the first MMA) and
  epilogue (converting and storing its outputs): `k_overhead`, as extra K steps, so a K = 128 product
  runs far below peak however well its tiles fill the SMs;
* a tile smaller than the kernel's largest reuses each loaded operand over fewer outputs: its
  flops per operand byte, tm * tn / (tm + tn), fall, and with the operand feed of an SM sized for the
  largest tile it runs at that ratio of the largest tile's rate (128 x 128: 0.75, 64 x 64: 0.375);
* each kernel pays a launch, and memory-bound kernels reach only part of the peak bandwidth.

`KernelModel` holds those facts per GPU; `matmul_seconds` and `memory_seconds` apply them. A
convolution runs as an implicit GEMM (M = output positions x batch, N = output channels, K = input
channels x window), as cuDNN's tensor-core kernels do.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .errors import HardwareError


@dataclasses.dataclass(frozen=True)
class KernelModel:
    """Per-GPU kernel facts: streaming multiprocessors, the matmul output tile, the launch cost per
    kernel, the achievable fraction of peak memory bandwidth, and a matmul tile's sustained tensor-core
    rate and fixed per-tile cost. The presets' values and their sources: `GPU_KERNELS` below."""

    sms: int                          # streaming multiprocessors (one tile each per wave)
    tile: tuple[int, int] = (256, 128)  # the largest matmul output tile (rows, columns)
    launch: float = 4e-6              # seconds per kernel inside a compiled program (launch + tail)
    bandwidth_efficiency: float = 0.9  # achievable fraction of peak HBM bandwidth (STREAM-like copy)
    # fraction of the dtype's dense peak a largest-tile main loop sustains (the whole-GPU rate of a
    # large GEMM in whole waves, before per-tile overheads); 0.6: the old single compute_efficiency
    mma_efficiency: float = 0.6
    # each tile's prologue and epilogue, in K steps of its main loop: a tile costs K + k_overhead
    k_overhead: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.sms, int) and self.sms >= 1):
            raise HardwareError(f"KernelModel: sms={self.sms!r} must be an int >= 1 (streaming multiprocessors).")
        if len(self.tile) != 2 or any(not isinstance(t, int) or t < 1 for t in self.tile):
            raise HardwareError(f"KernelModel: tile={self.tile!r} must be two ints >= 1 (output rows, columns).")
        if not (0 <= self.launch < 1):
            raise HardwareError(f"KernelModel: launch={self.launch!r} must be seconds per kernel in [0, 1).")
        if not (0 < self.bandwidth_efficiency <= 1):
            raise HardwareError(f"KernelModel: bandwidth_efficiency={self.bandwidth_efficiency!r} must be in (0, 1].")
        if not (isinstance(self.mma_efficiency, (int, float)) and 0 < self.mma_efficiency <= 1):
            raise HardwareError(f"KernelModel: mma_efficiency={self.mma_efficiency!r} must be in (0, 1] (the "
                                "fraction of the dense peak a large tile's main loop sustains).")
        if not (isinstance(self.k_overhead, int) and not isinstance(self.k_overhead, bool) and self.k_overhead >= 0):
            raise HardwareError(f"KernelModel: k_overhead={self.k_overhead!r} must be an int >= 0 (K steps a tile "
                                "spends in its prologue and epilogue).")


# per GPU (filled at the end of this module, with the sources of every number)
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


def matmul_seconds(km: KernelModel, batch: int, m: int, n: int, k: int, peak: float,
                   split_bandwidth: float | None = None) -> float:
    """Compute time of `batch` m x k by k x n products on a GPU whose dense peak for their dtype is
    `peak` flop/s: whole waves of whole tiles, each tile at one SM's share of the sustained MMA rate,
    paying K + k_overhead steps and running slower when smaller than the largest tile (tile_seconds).
    Like cuBLAS's heuristics, the fastest of the model's tile and its halvings (down to 64 x 64) is
    used: small products run in small tiles over more SMs. With `split_bandwidth` (the HBM bandwidth)
    a product whose tiles leave SMs idle may also split its K over them (split_k_seconds)."""
    best = min(waves(t, batch, m, n) * tile_seconds(km, t.tile, k, peak) for t in _tile_choices(km))
    if split_bandwidth is None:
        return best
    return min(best, *(split_k_seconds(km, t.tile, tiles(t, batch, m, n), batch * m * n, k, peak, split_bandwidth)
                       for t in _tile_choices(km)))


def split_k_seconds(km: KernelModel, tile: tuple[int, int], n_tiles: Any, outputs: Any, k: Any, peak: float,
                    bandwidth: float) -> Any:
    """Time of a product of `n_tiles` output tiles (`outputs` elements) with its K split into
    sms // n_tiles slices, one tile-slice per SM in a single wave, each slice's float32 partial sums
    written to a workspace and read back by the reduction (numbers or numpy arrays; one slice, in whole
    waves, when the tiles fill the SMs: then slower than unsplit by the partials' traffic).

    cuDNN's weight-gradient convolutions run so. In the compiled ResNet-50 step on an H200
    (bench/results/gpu_step_dumps_h200.tar.xz, its `__cudnn$convBackwardFilter` calls) each 1x1 filter
    gradient's workspace is 132 / tiles times its float32 output (132, 66, 33, 16 for 1, 2, 4, 8 tiles
    of 256 x 128 on the 132 SMs), and the stem's algorithm sets split-K knob 120; CUTLASS's "split-K"
    GEMM is the same scheme (partial products over K slices, then a reduction)."""
    slices = km.sms // n_tiles
    slices = slices + (slices < 1)                     # tiles that fill the SMs: one slice, whole waves
    partials = 2.0 * 4.0 * slices * outputs           # float32 partial outputs, written then read once
    n_waves = -(-(n_tiles * slices) // km.sms)
    return n_waves * tile_seconds(km, tile, -(-k // slices), peak) + partials / (bandwidth * km.bandwidth_efficiency)


def tile_seconds(km: KernelModel, tile: tuple[int, int], k: Any, peak: float) -> Any:
    """One SM's time for one tm x tn output tile over `k` (a number or a numpy array): its main loop
    plus prologue and epilogue (k + k_overhead steps) at the SM's share of the sustained MMA rate,
    scaled by the tile's operand reuse against the largest tile's (tile_feed)."""
    tm, tn = tile
    rate = peak * km.mma_efficiency * tile_feed(km, tile) / km.sms
    return 2.0 * tm * tn * (k + km.k_overhead) / rate


def tile_feed(km: KernelModel, tile: tuple[int, int]) -> float:
    """A tile's rate relative to the largest tile's: flops per operand element loaded, tm*tn/(tm+tn),
    over the largest tile's, at most 1. An SM's operand feed (shared-memory and L2 bandwidth) is built to
    keep the largest tile's tensor cores busy, so a tile reusing each operand over fewer outputs waits
    on its loads (NVIDIA's matrix multiplication guide: smaller tiles have lower data reuse)."""
    def reuse(t: tuple[Any, Any]) -> Any:
        return t[0] * t[1] / (t[0] + t[1])
    return np.minimum(1.0, reuse(tile) / reuse(km.tile))    # elementwise: tiles may be arrays

@functools.lru_cache(maxsize=64)
def _tile_choices(km: KernelModel) -> tuple[KernelModel, ...]:
    """The largest tile, then halves of its larger side down to 64 (the tiles a library picks from)."""
    out, (tm, tn) = [km], km.tile
    while tm > 64 or tn > 64:
        tm, tn = (tm // 2, tn) if tm >= tn else (tm, tn // 2)
        out.append(dataclasses.replace(km, tile=(max(tm, 1), max(tn, 1))))
    return tuple(out)


@functools.lru_cache(maxsize=64)
def tile_columns(km: KernelModel) -> tuple[np.ndarray, np.ndarray]:
    """(rows [T, 1], columns [T, 1]) of `_tile_choices`: every tile priced in one array operation."""
    tiles = np.array([t.tile for t in _tile_choices(km)], dtype=np.int64)
    return tiles[:, :1], tiles[:, 1:]


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


# products whose library kernels split K over idle SMs (split_k_seconds): cuDNN's convolutions, seen in
# their workspaces; cuBLAS's matmuls are priced unsplit (the H100's measured weight-gradient GEMMs,
# bench/results/gemm_validate_h100.md, already run slower than the unsplit model)
SPLIT_K_OPS = frozenset({"conv_general_dilated"})

# ops that start a kernel of their own after XLA's fusion (elementwise ops fuse into them: no launch)
KERNEL_OPS = frozenset({"dot_general", "conv_general_dilated", "reduce_sum", "reduce_max", "reduce_min",
                        "reduce_prod", "argmax", "argmin", "cumsum", "cumprod", "cummax", "cummin",
                        "cumlogsumexp", "gather", "scatter", "scatter-add", "scatter_add", "sort",
                        "dynamic_slice", "dynamic_update_slice", "reduce_window_sum", "select_and_scatter_add"})


def compute_dtype(primitive: str, in_dtypes: Sequence[str], out_dtypes: Sequence[str]) -> str:
    """The dtype an op computes in: a matmul's or convolution's tensor cores run on its operands'
    type (bf16 operands accumulating into float32 run at the bf16 rate: `preferred_element_type`),
    every other op in its result's."""
    if primitive in ("dot_general", "conv_general_dilated") and in_dtypes:
        return in_dtypes[0]
    return out_dtypes[0] if out_dtypes else "float32"


def op_seconds(km: KernelModel, primitive: str, params: Mapping[str, Any], in_shapes: Sequence[Sequence[int]],
               out_shape: Sequence[int], flops: float, nbytes: float, flop_rate: float, bandwidth: float, *,
               peak: float, launches: float | None = None, scale: float = 1.0) -> float:
    """One op: the larger of its compute and its memory traffic, plus `launches` kernel launches
    (None: one when it is a kernel of its own, KERNEL_OPS; pass the count of `core.fusion` with its
    fused `nbytes`). Matmuls and convolutions run in tiles and waves at the kernel model's MMA rate
    of `peak` (the dtype's dense peak, matmul_seconds); other ops at `flop_rate` (the roofline's
    achievable rate, peak x compute_efficiency). `scale` multiplies the compute (a FlashAttention core's
    matmuls: core/attention.py)."""
    dims = gemm_dims(primitive, params, in_shapes, out_shape)
    split = bandwidth if primitive in SPLIT_K_OPS else None
    compute = scale * (matmul_seconds(km, *dims, peak, split) if dims is not None and all(dims) else flops / flop_rate)
    launch = km.launch * (launches if launches is not None else float(primitive in KERNEL_OPS))
    return launch + max(compute, memory_seconds(km, nbytes, bandwidth))


# SM counts: NVIDIA's datasheets (V100 SXM2 80, A100 SXM4 108, H100 SXM5 132).
# H100: measured on one H100 SXM 80GB, jax 0.11.2 (bench/results/gpu_calibrate_h100.{md,json}):
#   launch 2.4 us = the mean of the 2.01 and 2.83 us one more kernel costs inside a compiled program
#     (its "per kernel" section);
#   bandwidth_efficiency 0.77 = the mean copy bandwidth of 256 MiB - 2 GiB (2631, 2509, 2634 GB/s) over
#     the 3.35 TB/s peak (0.79, 0.75, 0.79);
#   mma_efficiency 0.75 and k_overhead 384: the grid search of `python bench/gemm_validate.py --fit` on the
#     large bf16 GEMMs (tensor-parallel 1, hidden >= 4096; 0.46-0.76 of peak, median 0.68) and the tile /
#     wave sweep, with launch and bandwidth as above; checked on the tensor-parallel 8, small and TF32 ones.
#     0.75 of 989 TFLOP/s = 742 TFLOP/s, below the 794.5 (0.803) of Bekman's Maximum Achievable Matmul
#     FLOPS table (github.com/stas00/ml-engineering compute/accelerator, H100 SXM bf16, torch 2.7 cuBLAS,
#     the best of a shape search) as a sustained rate should be.
# A100: mma_efficiency 0.81 = the same table's A100 SXM bf16 MAMF, 271.2 of 312 TFLOP/s (0.869), times the
#   H100's ratio of our sustained rate to its MAMF (0.75 / 0.803 = 0.93); k_overhead 384 as the H100's (a
#   tile's prologue and epilogue are a fixed number of its own K steps, to first order the same on
#   Ampere's 256 x 128 cp.async pipelines; an assumption, not a measurement). launch 4 us and
#   bandwidth 0.9 stay the order-of-magnitude defaults: no published per-kernel or copy measurement
#   found for A100 SXM 80GB; the H100's 0.77 suggests 0.9 is optimistic.
# V100: no published cuBLAS large-GEMM efficiency found; mma_efficiency 0.6 (the old compute_efficiency),
#   k_overhead 384 by the A100's argument (without it a tiny float32 GEMM on a V100 would price below
#   the same on an A100), launch and bandwidth the defaults.
GPU_KERNELS.update(
    v100=KernelModel(sms=80, k_overhead=384),
    a100=KernelModel(sms=108, mma_efficiency=0.81, k_overhead=384),
    h100=KernelModel(sms=132, launch=2.4e-6, bandwidth_efficiency=0.77, mma_efficiency=0.75, k_overhead=384))
# H200: the H100's die (132 SMs, same tensor cores and clocks per NVIDIA's datasheet) with HBM3e: the H100's
#   launch, mma_efficiency and k_overhead (not refitted); bandwidth_efficiency 0.68 by the H100's rule, the
#   mean copy bandwidth of 256 MiB - 2 GiB measured on one H200 (3056, 3409, 3354 GB/s) over its 4.8 TB/s
#   peak (bench/results/gpu_calibrate_h200.md, whose whole-step rows were priced with 0.77 before this).
GPU_KERNELS["h200"] = dataclasses.replace(GPU_KERNELS["h100"], bandwidth_efficiency=0.68)
