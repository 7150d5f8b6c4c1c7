"""Matmul and convolution time per plan on a GPU kernel model (pure: no jax import).

With `HardwareSpec.kernels` set, the tensor search prices each matmul or convolution on its shard's
own shape: a plan that splits a dim leaves each device a narrower product, which runs in whole tiles
and whole waves over the SMs (core/kernels.py), so narrow shards do not speed up linearly. Every
other op keeps the roofline's work / shards (memory at the achievable bandwidth); each kernel pays one
launch whatever the plan.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..core.graph import Op
from ..core.kernels import SPLIT_K_OPS, KernelModel, gemm_roles, split_k_seconds, tile_columns, tile_seconds
from .factors import FactorGraph, OpFactors


@dataclasses.dataclass(frozen=True)
class _Gemm:
    weight: float                              # executions (instances x iterations)
    peak: float                                # dense peak flop/s of the device for the op's dtype
    dims: tuple[tuple[tuple[int, int], ...], ...]   # (batch, m, n, k): ((size, candidate index or -1), ...)
    memory: float                              # seconds to move the whole op's bytes
    loop: tuple[int, ...]                      # candidates splitting the op (its bytes divide by them)
    scale: float = 1.0                         # multiplier of its compute (FlashAttention: causal, recompute)
    split_bandwidth: float | None = None       # HBM bandwidth where K may split over idle SMs (SPLIT_K_OPS)


class GemmCosts:
    """The matmuls and convolutions of an evaluator, priced per plan on `km`."""

    def __init__(self, km: KernelModel, cidx: dict[int, int]) -> None:
        self.km, self.cidx = km, cidx
        self.gemms: list[_Gemm] = []
        self.launches = 0.0                    # seconds of kernel launches per step (plan-independent)

    def add(self, op: Op, of: OpFactors, fg: FactorGraph, weight: float, peak: float, bandwidth: float,
            loop: tuple[int, ...], launches: float = 1.0, scale: float = 1.0,
            nbytes: float | None = None) -> bool:
        """Record `op` (True) if it is a matmul or convolution, priced at the kernel model's MMA rate of
        `peak` (its dtype's dense flop/s); count the kernels it starts (`launches`: from `core.fusion`,
        one per fusion and per library call). `scale` multiplies its compute and `nbytes` replaces the
        bytes it moves (a FlashAttention core, core/attention.py: causal tiles skipped, no scores in HBM)."""
        self.launches += weight * self.km.launch * launches
        dims = self._dims(op, of, fg)
        if dims is None:
            return False
        moved = op.bytes if nbytes is None else nbytes
        self.gemms.append(_Gemm(weight, peak, dims, moved / (bandwidth * self.km.bandwidth_efficiency), loop, scale,
                                bandwidth if op.primitive in SPLIT_K_OPS else None))
        return True

    def _dims(self, op: Op, of: OpFactors, fg: FactorGraph):
        """(batch, m, n, k) as ((size, candidate index or -1) per tensor dim), from `gemm_roles`. The
        operands' factors are those the op reads them under: past a region cut (the sequence-parallel
        stream entering a column-parallel matmul) they are the region's, not the producer's."""
        if not op.outputs or len(op.inputs) != 2:
            return None
        values = (op.inputs[0], op.inputs[1], op.outputs[0])
        shapes = (op.in_shapes[0], op.in_shapes[1], op.out_shapes[0])
        roles = gemm_roles(op.primitive, op.params, [len(s) for s in shapes])
        if roles is None:
            return None                        # grouped / depthwise convolutions: memory-bound, the roofline's
        factors = [of.in_factors[i] if len(of.in_factors) == len(op.inputs) else fg.value_factors(v, len(s))
                   for i, (v, s) in enumerate(zip(values[:2], shapes[:2], strict=True))]
        factors.append(fg.value_factors(values[2], len(shapes[2])))
        return tuple(tuple((shapes[o][d], self.cidx.get(factors[o][d], -1) if factors[o][d] is not None else -1)
                           for o, d in role) for role in roles)

    def seconds(self, plans: np.ndarray, msize: np.ndarray, or_masks) -> np.ndarray:
        """Per plan: the matmuls' and convolutions' time on their shards, plus every launch."""
        out = np.full(plans.shape[0], self.launches)
        km = self.km
        tm, tn = tile_columns(km)                                  # every tile at once: [T, 1]
        for g in self.gemms:
            b, m, n, k = (self._shard(plans, msize, part) for part in g.dims)
            n_tiles = b * np.ceil(m / tm) * np.ceil(n / tn)        # [T, C]
            secs = np.ceil(n_tiles / km.sms) * tile_seconds(km, (tm, tn), k, g.peak)
            if g.split_bandwidth is not None:
                secs = np.minimum(secs, split_k_seconds(km, (tm, tn), n_tiles, b * m * n, k, g.peak,
                                                        g.split_bandwidth))
            compute = secs.min(axis=0)
            memory = g.memory / msize[or_masks(plans, g.loop)]
            out += g.weight * np.maximum(g.scale * compute, memory)
        return out

    @staticmethod
    def _shard(plans: np.ndarray, msize: np.ndarray, dims) -> np.ndarray:
        size = np.ones(plans.shape[0])
        for full, c in dims:
            size = size * (np.ceil(full / msize[plans[:, c]]) if c >= 0 else full)
        return size

