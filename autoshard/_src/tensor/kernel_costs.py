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
from ..core.kernels import KERNEL_OPS, KernelModel, _tile_choices
from .factors import FactorGraph, OpFactors


@dataclasses.dataclass(frozen=True)
class _Gemm:
    weight: float                              # executions (instances x iterations)
    rate: float                                # achievable flop/s of the whole device
    dims: tuple[tuple[tuple[int, int], ...], ...]   # (batch, m, n, k): ((size, candidate index or -1), ...)
    memory: float                              # seconds to move the whole op's bytes
    loop: tuple[int, ...]                      # candidates splitting the op (its bytes divide by them)


class GemmCosts:
    """The matmuls and convolutions of an evaluator, priced per plan on `km`."""

    def __init__(self, km: KernelModel, cidx: dict[int, int]) -> None:
        self.km, self.cidx = km, cidx
        self.gemms: list[_Gemm] = []
        self.launches = 0.0                    # seconds of kernel launches per step (plan-independent)

    def add(self, op: Op, of: OpFactors, fg: FactorGraph, weight: float, rate: float, bandwidth: float,
            loop: tuple[int, ...]) -> bool:
        """Record `op` (True) if it is a matmul or convolution; count its launch if it is a kernel."""
        if op.primitive in KERNEL_OPS:
            self.launches += weight * self.km.launch
        dims = self._dims(op, fg)
        if dims is None:
            return False
        self.gemms.append(_Gemm(weight, rate, dims, op.bytes / (bandwidth * self.km.bandwidth_efficiency), loop))
        return True

    def _dims(self, op: Op, fg: FactorGraph):
        def of(v: int, shape, ds):
            fs = fg.value_factors(v, len(shape))
            return tuple((shape[d], self.cidx.get(fs[d], -1) if fs[d] is not None else -1) for d in ds)

        p, ins, shapes = op.params, op.inputs, op.in_shapes
        if op.primitive == "dot_general" and "contracting" in p and len(ins) == 2:
            (lc, rc), (lb, rb) = p["contracting"], p["batch"]
            (lv, ls), (rv, rs) = (ins[0], shapes[0]), (ins[1], shapes[1])
            free_l = [d for d in range(len(ls)) if d not in lc and d not in lb]
            free_r = [d for d in range(len(rs)) if d not in rc and d not in rb]
            return of(lv, ls, lb), of(lv, ls, free_l), of(rv, rs, free_r), of(lv, ls, lc)
        if op.primitive == "conv_general_dilated" and "lhs_spec" in p and len(ins) == 2 and op.outputs:
            if p.get("feature_group_count", 1) != 1:
                return None                    # grouped / depthwise: memory-bound, left to the roofline
            os_, rsp = p["out_spec"], p["rhs_spec"]
            out, oshape = op.outputs[0], op.out_shapes[0]
            m = of(out, oshape, [os_[0], *os_[2:]])
            return (), m, of(out, oshape, [os_[1]]), of(ins[1], shapes[1], [rsp[1], *rsp[2:]])
        return None

    def seconds(self, plans: np.ndarray, msize: np.ndarray, or_masks) -> np.ndarray:
        """Per plan: the matmuls' and convolutions' time on their shards, plus every launch."""
        out = np.full(plans.shape[0], self.launches)
        km = self.km
        tiles = _tile_choices(km)
        for g in self.gemms:
            b, m, n, k = (self._shard(plans, msize, part) for part in g.dims)
            compute = None
            for t in tiles:
                tm, tn = t.tile
                waves = np.ceil(b * np.ceil(m / tm) * np.ceil(n / tn) / km.sms)
                secs = waves * 2.0 * tm * tn * k / (g.rate / km.sms)
                compute = secs if compute is None else np.minimum(compute, secs)
            memory = g.memory / msize[or_masks(plans, g.loop)]
            out += g.weight * np.maximum(compute, memory)
        return out

    @staticmethod
    def _shard(plans: np.ndarray, msize: np.ndarray, dims) -> np.ndarray:
        size = np.ones(plans.shape[0])
        for full, c in dims:
            size = size * (np.ceil(full / msize[plans[:, c]]) if c >= 0 else full)
        return size

