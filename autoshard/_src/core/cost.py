"""Analytical cost model: seconds for collectives and compute on a mesh (pure: no jax import).

Collectives follow the bandwidth-optimal ring algorithms (Patarasuk & Yuan, "Bandwidth optimal
all-reduce algorithms for clusters of workstations", JPDC 2009; Thakur, Rabenseifner & Gropp,
"Optimization of collective communication operations in MPICH", IJHPCA 2005), in the alpha-beta
form `time = steps * latency + bytes_on_wire / bandwidth`, with bandwidth scaled by a per-kind
efficiency because NCCL does not run all kinds equally well (TAP §4.6). Compute is a roofline
(Williams, Waterman & Patterson, CACM 2009). TAP (§4.6) costs a plan by its communication; this
model also prices compute so that fewer flops per device can pay for more communication.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from .collectives import COLLECTIVES, KINDS
from .errors import ConfigError
from .hardware import HardwareSpec, get_hardware
from .mesh import MeshSpec, axis_links, mesh_spec


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ConfigError(f"autoshard: collective kind={kind!r} is unknown; valid kinds: {list(KINDS)}.")


def bytes_on_wire(kind: str, nbytes: float, n: int) -> float:
    """Bytes each device sends in a ring `kind` over `n` devices.

    `nbytes` is the per-device size of the FULL buffer: the unreduced input of an all-reduce or
    reduce-scatter, the gathered output of an all-gather, the whole send buffer of an all-to-all.

    Formulas per kind: collectives.py. n == 1 moves nothing.
    """
    _check_kind(kind)
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ConfigError(f"autoshard: collective group size n={n!r} must be an int >= 1.")
    if not nbytes >= 0:
        raise ConfigError(f"autoshard: collective nbytes={nbytes!r} must be >= 0.")
    return COLLECTIVES[kind].bytes_on_wire(float(nbytes), int(n))


def latency_steps(kind: str, n: int) -> int:
    """Sequential ring steps, each paying the link latency once: all-reduce 2(n-1) (reduce-scatter
    then all-gather), all-gather / reduce-scatter / all-to-all n-1, collective-permute 1; n == 1: 0."""
    _check_kind(kind)
    return COLLECTIVES[kind].latency_steps(n)


def alpha_beta(kind: str, n: int, bandwidth: float, latency: float, efficiency: float) -> tuple[float, float]:
    """(seconds per collective, seconds per full-buffer byte) of `kind` over `n` devices on one link
    class: time(B) = alpha + beta * B. The one place the alpha-beta model is written down."""
    _check_kind(kind)
    if n <= 1:
        return 0.0, 0.0
    return latency_steps(kind, n) * latency, bytes_on_wire(kind, 1.0, n) / (bandwidth * efficiency)


@runtime_checkable
class CostModel(Protocol):
    """What the planner asks a cost model: `AnalyticalCostModel` (alpha-beta + roofline on a hardware
    spec) or `MeasuredCostModel` (lines fitted to timings on the machine)."""

    def collective(self, kind: str, nbytes: float, axes: Sequence[str]) -> float:
        """Seconds for collective `kind` on a full buffer of `nbytes` over the mesh `axes`."""
        ...

    def compute(self, flops: float, bytes_accessed: float, dtype: str = "float32") -> float:
        """Seconds for a kernel doing `flops` and moving `bytes_accessed` to/from HBM."""
        ...


class AnalyticalCostModel:
    """Alpha-beta collectives and roofline compute for a mesh on a hardware spec.

    `mesh` is anything `mesh_spec` takes, `hardware` anything `get_hardware` takes.
    """

    def __init__(self, mesh: Any, hardware: Any) -> None:
        self.mesh: MeshSpec = mesh_spec(mesh)
        self.hardware: HardwareSpec = get_hardware(hardware)
        self.links = axis_links(self.mesh, self.hardware)

    def __repr__(self) -> str:
        return f"AnalyticalCostModel(mesh='{self.mesh}', hardware={self.hardware.name!r})"

    def collective(self, kind: str, nbytes: float, axes: Sequence[str]) -> float:
        """time = latency_steps * latency + bytes_on_wire / (bandwidth * efficiency[kind]).

        Over several axes the group is their product (n = product of sizes) and a ring through it
        is as slow as its slowest hop: bandwidth = min over the axes' links, latency = max. Axes of
        size 1 take no part; with none left the collective is free.
        """
        _check_kind(kind)
        axes = (axes,) if isinstance(axes, str) else tuple(axes)   # a lone name, not its characters
        for axis in axes:
            if axis not in self.links:
                raise ConfigError(f"autoshard: mesh axis {axis!r} is not in mesh {self.mesh}; valid axes: "
                                     f"{list(self.mesh.names)}.")
        if len(set(axes)) != len(axes):
            raise ConfigError(f"autoshard: collective axes={axes!r} repeat an axis; name each axis once.")
        active = [a for a in axes if self.mesh.axis_size(a) > 1]
        if not active:
            return 0.0
        n = math.prod(self.mesh.axis_size(a) for a in active)
        bandwidth = min(self.links[a].bandwidth for a in active)
        latency = max(self.links[a].latency for a in active)
        alpha, beta = alpha_beta(kind, n, bandwidth, latency, self.hardware.collective_efficiency[kind])
        return alpha + beta * nbytes

    def compute(self, flops: float, bytes_accessed: float, dtype: str = "float32") -> float:
        """Roofline: max(flops / (peak(dtype) * compute_efficiency), bytes_accessed / memory_bandwidth)."""
        if not (flops >= 0 and bytes_accessed >= 0):
            raise ConfigError(f"autoshard: compute flops={flops!r} and bytes_accessed={bytes_accessed!r} "
                                 "must be >= 0.")
        hw = self.hardware
        return max(flops / (hw.peak_flops(dtype) * hw.compute_efficiency), bytes_accessed / hw.memory_bandwidth)


@dataclasses.dataclass(frozen=True)
class CollectiveSample:
    """One timed collective: `kind` over the mesh `axes` on a full buffer of `nbytes` took `seconds`."""

    kind: str
    axes: tuple[str, ...]
    nbytes: float
    seconds: float


class MeasuredCostModel:
    """A `CostModel` from timings on the real machine: per (kind, axes) the alpha-beta line
    time = alpha + beta * nbytes fitted to the samples by non-negative least squares (a fit needs
    two distinct sizes); a group over several axes each measured alone combines their fits as the
    analytical model combines links (slowest bandwidth, largest latency); `compute` from a measured
    flop rate and memory bandwidth when given. Whatever was not measured falls back to
    `AnalyticalCostModel(mesh, hardware)`; `fitted()` says what was measured.

    Samples come from `autoshard` on the devices (`bridge.audit.calibrate.measure_collectives`) or from any
    benchmark (nccl-tests, a previous run) as `CollectiveSample`s.
    """

    def __init__(self, mesh: Any, hardware: Any, samples: Sequence[CollectiveSample] = (),
                 flop_rate: float | None = None, memory_bandwidth: float | None = None) -> None:
        self.fallback = AnalyticalCostModel(mesh, hardware)
        self.mesh, self.hardware = self.fallback.mesh, self.fallback.hardware
        for name, rate in (("flop_rate", flop_rate), ("memory_bandwidth", memory_bandwidth)):
            if rate is not None and not (isinstance(rate, numbers.Real) and math.isfinite(rate) and rate > 0):
                raise ConfigError(f"autoshard: MeasuredCostModel {name}={rate!r} must be a finite number > 0 "
                                  "(per second), or None to use the hardware spec's.")
        self.flop_rate, self.memory_bandwidth = flop_rate, memory_bandwidth
        self._lines = _fit_lines(samples, self.mesh)

    def __repr__(self) -> str:
        return (f"MeasuredCostModel(mesh='{self.mesh}', hardware={self.hardware.name!r}, "
                f"fitted={sorted(self._lines)})")

    def fitted(self) -> dict[tuple[str, tuple[str, ...]], tuple[float, float]]:
        """(kind, axes) -> (alpha seconds, beta seconds per byte) for every measured collective."""
        return dict(self._lines)

    def collective(self, kind: str, nbytes: float, axes: Sequence[str]) -> float:
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        active = tuple(a for a in axes if a in self.mesh.names and self.mesh.axis_size(a) > 1)
        if not active:
            return 0.0
        line = self._lines.get((kind, active))
        if line is not None:
            return line[0] + line[1] * nbytes
        singles = [self._lines.get((kind, (a,))) for a in active]
        if any(x is None for x in singles):
            return self.fallback.collective(kind, nbytes, axes)
        # a group over several measured axes: each axis's fit gives its per-step latency and
        # effective bandwidth; the ring over the product is as slow as its slowest axis (as in
        # AnalyticalCostModel.collective)
        latency = max(alpha / max(latency_steps(kind, self.mesh.axis_size(a)), 1)
                      for a, (alpha, _) in zip(active, singles, strict=True))
        bandwidth = min(bytes_on_wire(kind, 1.0, self.mesh.axis_size(a)) / beta if beta > 0 else math.inf
                        for a, (_, beta) in zip(active, singles, strict=True))
        alpha, beta = alpha_beta(kind, math.prod(self.mesh.axis_size(a) for a in active), bandwidth, latency, 1.0)
        return alpha + beta * nbytes

    def compute(self, flops: float, bytes_accessed: float, dtype: str = "float32") -> float:
        if self.flop_rate is None and self.memory_bandwidth is None:
            return self.fallback.compute(flops, bytes_accessed, dtype)
        if not (flops >= 0 and bytes_accessed >= 0):
            raise ConfigError(f"autoshard: compute flops={flops!r} and bytes_accessed={bytes_accessed!r} "
                              "must be >= 0.")
        hw = self.hardware
        rate = self.flop_rate or hw.peak_flops(dtype) * hw.compute_efficiency
        return max(flops / rate, bytes_accessed / (self.memory_bandwidth or hw.memory_bandwidth))


def _fit_lines(samples: Sequence[CollectiveSample], mesh: MeshSpec) -> dict:
    """(kind, active axes) -> (alpha, beta) >= 0 by non-negative least squares over the samples."""
    groups: dict[tuple[str, tuple[str, ...]], list[tuple[float, float]]] = {}
    for i, smp in enumerate(samples):
        _check_kind(smp.kind)
        unknown = [a for a in smp.axes if a not in mesh.names]
        if unknown or not (smp.nbytes >= 0 and smp.seconds >= 0):
            raise ConfigError(f"autoshard: samples[{i}]={smp!r} needs axes of mesh {mesh} (unknown: {unknown}), "
                              "nbytes >= 0 and seconds >= 0.")
        active = tuple(a for a in smp.axes if mesh.axis_size(a) > 1)
        if active:
            groups.setdefault((smp.kind, active), []).append((float(smp.nbytes), float(smp.seconds)))
    lines = {}
    for key, pts in groups.items():
        sizes = np.array([b for b, _ in pts])
        if len(set(sizes.tolist())) < 2:
            raise ConfigError(f"autoshard: the samples of {key[0]} over {list(key[1])} have one buffer size "
                              f"({sizes[0]:.0f} bytes); time at least two sizes so latency and bandwidth separate.")
        a = np.stack([np.ones_like(sizes), sizes], axis=1)
        scale = np.array([1.0, 1.0 / sizes.max()])            # condition the columns before solving
        from scipy.optimize import nnls  # here: importing it costs ~0.4 s; only measured samples need it
        coef, _ = nnls(a * scale, np.array([t for _, t in pts]))
        lines[key] = (float(coef[0] * scale[0]), float(coef[1] * scale[1]))
    return lines


def pack_gradients(grad_bytes: Sequence[int], bucket_bytes: int = 25 * 2**20) -> list[int]:
    """Message sizes after gradient packing (TAP §4.7.1): one collective per small gradient pays the
    setup/latency cost each time, so gradients smaller than `bucket_bytes` are fused, in the given
    (backward) order, into buckets of at most `bucket_bytes`; a gradient >= `bucket_bytes` is its
    own message. A big gradient closes the open bucket first, so messages keep gradient order (each
    is a contiguous run) and the total is preserved. The 25 MiB default is PyTorch DDP's bucket_cap_mb.
    """
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, numbers.Integral) or bucket_bytes < 1:
        raise ConfigError(f"autoshard: bucket_bytes={bucket_bytes!r} must be an int >= 1.")
    messages: list[int] = []
    bucket, open_bucket = 0, False
    for i, size in enumerate(grad_bytes):
        if not size >= 0:
            raise ConfigError(f"autoshard: grad_bytes[{i}]={size!r} must be >= 0.")
        if size >= bucket_bytes or (open_bucket and bucket + size > bucket_bytes):
            if open_bucket:
                messages.append(bucket)
            bucket, open_bucket = 0, False
        if size >= bucket_bytes:
            messages.append(size)
        else:
            bucket, open_bucket = bucket + size, True
    if open_bucket:
        messages.append(bucket)
    return messages


def overlapped(comm: float, compute: float, overlap: float = 1.0) -> float:
    """Seconds that communication adds to the critical path when it can run alongside `compute`
    seconds of independent work (TAP §4.6: backward gradient communication overlaps computation):
    max(0, comm - overlap * compute), `overlap` in [0, 1] being the fraction that actually hides."""
    if not 0.0 <= overlap <= 1.0:
        raise ConfigError(f"autoshard: overlap={overlap!r} must be in [0, 1] (1 = communication fully hidden "
                             "behind compute, 0 = no overlap).")
    if not (comm >= 0 and compute >= 0):
        raise ConfigError(f"autoshard: overlapped comm={comm!r} and compute={compute!r} must be >= 0 seconds.")
    return max(0.0, comm - overlap * compute)
