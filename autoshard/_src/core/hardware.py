"""Hardware descriptions for the cost model (pure: no jax import).

A `HardwareSpec` holds the few numbers an analytical cost model needs: peak flop/s per dtype, HBM
size and bandwidth, and the two link classes of a GPU cluster (NVLink inside a node, the network
between nodes). Presets cover the GPUs of the papers we reproduce (V100 in TAP and RaNNC), the
current ones (A100, H100) and BBGraP's desktop CPU nodes on gigabit Ethernet; `get_hardware` also
takes explicit numbers, so a user on other hardware never has to edit this file. `node_speeds`
describes heterogeneous nodes (relative speeds, None when all are alike).

Conventions: all rates are per device; link bandwidths are per direction, as a ring uses them; flop
rates are dense (datasheets headline the 2:4-sparsity number, twice as large). On A100 and H100 the
"float32" number is TF32 tensor-core throughput, because XLA runs float32 matmuls in TF32 there by
default (jax `default_matmul_precision`); pass `{"base": ..., "flops": {"float32": ...}}` to model
full-precision float32 (67 TFLOP/s H100, 19.5 TFLOP/s A100).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import types
from collections.abc import Mapping
from typing import Any

from .collectives import DEFAULT_EFFICIENCY, KINDS
from .errors import HardwareError
from .kernels import GPU_KERNELS, KernelModel, kernel_model

FLOAT_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class HardwareSpec:
    """Per-device performance numbers of one accelerator type and its interconnect."""

    name: str
    flops: Mapping[str, float]          # peak dense flop/s by dtype name; must hold "float32"
    memory_bytes: int                   # device memory (HBM)
    memory_bandwidth: float             # bytes/s
    devices_per_node: int
    intra_node_bandwidth: float         # bytes/s per device per direction (NVLink/NVSwitch)
    intra_node_latency: float           # seconds per collective step
    inter_node_bandwidth: float         # bytes/s per device per direction (InfiniBand/Ethernet)
    inter_node_latency: float
    collective_efficiency: Mapping[str, float]  # kind -> achievable fraction of link bandwidth
    compute_efficiency: float           # achievable fraction of peak flops for large matmuls
    source: str                         # where the numbers come from
    node_speeds: tuple[float, ...] | None = None   # relative speed per node (heterogeneous); None: all equal
    # GPU kernel facts (tile and wave quantization, launch, achievable bandwidth; kernels.py) used by
    # the tensor search, the pipeline partitioners' op costs and micro-batch curves and the 3-D
    # tables; the GPU presets carry their GPU's (kernels.GPU_KERNELS). None: the pure roofline, the
    # CPU presets' and the switch for comparison ({"base": "v100-sxm", "kernels": None})
    kernels: KernelModel | None = None

    def __post_init__(self) -> None:
        # Validate here, so presets, overrides and hand-built specs all fail at construction with
        # the field named, rather than as a ZeroDivisionError deep inside the planner.
        def bad(field: str, value: Any, why: str) -> HardwareError:
            return HardwareError(f"HardwareSpec {self.name!r}: {field}={value!r} {why}.")

        if not isinstance(self.name, str) or not self.name:
            raise bad("name", self.name, "must be a non-empty string")
        for field in ("memory_bytes", "devices_per_node"):
            value = getattr(self, field)
            if _number(value) and float(value).is_integer():
                object.__setattr__(self, field, int(value))     # accept 40e9 for 40 GB, numpy ints
            else:
                raise bad(field, value, "must be a whole number")
            if getattr(self, field) < 1:
                raise bad(field, value, "must be >= 1")
        for field in ("memory_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth"):
            if not _positive(getattr(self, field)):
                raise bad(field, getattr(self, field), "must be a finite number > 0 (bytes/s)")
        for field in ("intra_node_latency", "inter_node_latency"):
            value = getattr(self, field)
            if not (_number(value) and 0 <= value < math.inf):
                raise bad(field, value, "must be a finite number >= 0 (seconds per step)")
        if not (_number(self.compute_efficiency) and 0 < self.compute_efficiency <= 1):
            raise bad("compute_efficiency", self.compute_efficiency, "must be in (0, 1]")
        if not isinstance(self.flops, Mapping) or "float32" not in self.flops:
            raise bad("flops", self.flops, "must be a mapping of dtype name -> flop/s holding at least 'float32' "
                      "(the fallback for other dtypes)")
        for dtype, rate in self.flops.items():
            if not _positive(rate):
                raise bad(f"flops[{dtype!r}]", rate, "must be a finite number > 0 (flop/s)")
        eff = self.collective_efficiency
        missing = [k for k in KINDS if not isinstance(eff, Mapping) or k not in eff]
        if missing:
            raise bad("collective_efficiency", eff, f"lacks kinds {missing}; give a fraction in (0, 1] for each "
                      f"of {list(KINDS)}")
        for kind, frac in eff.items():
            if kind not in KINDS:
                raise bad("collective_efficiency", eff, f"has unknown kind {kind!r}; valid: {list(KINDS)}")
            if not (_number(frac) and 0 < frac <= 1):
                raise bad(f"collective_efficiency[{kind!r}]", frac, "must be in (0, 1]")
        if self.node_speeds is not None:
            speeds = self.node_speeds
            fix = ("give one finite number > 0 per node, relative to this spec's flop rates (e.g. (2, 1, 1) "
                   "for one node twice as fast), or None when all nodes are alike")
            if isinstance(speeds, (str, bytes, Mapping)) or not hasattr(speeds, "__iter__"):
                raise bad("node_speeds", speeds, f"is not a sequence; {fix}")
            speeds = tuple(speeds)
            if not speeds:
                raise bad("node_speeds", self.node_speeds, f"is empty; {fix}")
            for i, speed in enumerate(speeds):
                if not _positive(speed):
                    raise bad(f"node_speeds[{i}]", speed, f"must be a finite number > 0; {fix}")
            object.__setattr__(self, "node_speeds", tuple(float(x) for x in speeds))   # lists, numpy arrays
        object.__setattr__(self, "kernels", kernel_model(self.kernels))   # a dict after a JSON round trip
        # read-only copies: a frozen spec must not change under a planner that cached it
        object.__setattr__(self, "flops", types.MappingProxyType(dict(self.flops)))
        object.__setattr__(self, "collective_efficiency", types.MappingProxyType(dict(eff)))

    def __hash__(self) -> int:   # the mappings are not hashable; hash their items
        return hash(tuple(sorted(self.flops.items())) + tuple(sorted(self.collective_efficiency.items()))
                    + tuple(getattr(self, f.name) for f in dataclasses.fields(self)
                            if f.name not in ("flops", "collective_efficiency")))

    def peak_flops(self, dtype: Any) -> float:
        """Peak dense flop/s for `dtype` (a name, or anything with a numpy-style `.name`/`__name__`).

        Unknown dtypes (integers, float64, fp8) get the float32 number: a neutral guess that keeps
        the planner running; add the dtype to `flops` to model it.
        """
        name = dtype if isinstance(dtype, str) else getattr(dtype, "name", None) or getattr(dtype, "__name__", "")
        return float(self.flops.get(name, self.flops["float32"]))


def _number(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and not math.isnan(x)


def _positive(x: Any) -> bool:
    return _number(x) and 0 < x < math.inf


_EFFICIENCY = DEFAULT_EFFICIENCY   # per collective kind: see collectives.py (TAP §4.6's ordering)
_LATENCY_NOTE = ("Latencies (NVLink 2 us, InfiniBand 5 us, Ethernet 30 us per collective step) are "
                 "order-of-magnitude estimates, not datasheet values.")
_EFF_NOTE = "Collective efficiencies: estimates ordered as TAP §4.6 observes (all-reduce > all-gather > all-to-all)."

_V100_FLOPS = {"float32": 15.7e12, "float16": 125e12, "bfloat16": 15.7e12}
_V100_SOURCE = ("NVIDIA V100 SXM2 32GB datasheet: 15.7 TFLOP/s float32 (Volta has no TF32), 125 TFLOP/s "
                "float16 tensor core, no bfloat16 tensor cores (bfloat16 given the float32 rate), 32 GB HBM2 "
                "at 900 GB/s. 8 per node as in TAP §6 (8x V100 SXM2 32GB) and RaNNC §IV (Hardware).")


def _v100(name: str, intra: float, inter: float, inter_latency: float, note: str) -> HardwareSpec:
    return HardwareSpec(
        name=name, flops=_V100_FLOPS, memory_bytes=32 * 10**9, memory_bandwidth=900e9, devices_per_node=8,
        intra_node_bandwidth=intra, intra_node_latency=2e-6, inter_node_bandwidth=inter,
        inter_node_latency=inter_latency, collective_efficiency=_EFFICIENCY, compute_efficiency=0.6,
        kernels=GPU_KERNELS["v100"], source=f"{_V100_SOURCE} {note} {_LATENCY_NOTE} {_EFF_NOTE}")


_RANNC_NET = ("RaNNC §IV (Hardware): V100s joined by NVLink at '25 GB/s or 50 GB/s' (NVLink2 is 25 GB/s per "
              "link per direction; DGX-1-style pairs share one or two links); nodes joined by InfiniBand "
              "at 100 Gbps = 12.5 GB/s, taken per device (the paper does not say how many NICs a node has; "
              "override inter_node_bandwidth if 8 GPUs share one).")

_I5_10400_FLOPS = 6 * 2.9e9 * 32    # cores x base clock x float32 flop/cycle (2 AVX2 FMA x 8 lanes x 2)

_PRESETS: dict[str, HardwareSpec] = {
    "h100-sxm": HardwareSpec(
        name="h100-sxm",
        flops={"float32": 494.7e12, "bfloat16": 989.4e12, "float16": 989.4e12},
        memory_bytes=80 * 10**9, memory_bandwidth=3.35e12, devices_per_node=8,
        intra_node_bandwidth=450e9, intra_node_latency=2e-6,
        inter_node_bandwidth=50e9, inter_node_latency=5e-6,
        collective_efficiency=_EFFICIENCY, compute_efficiency=0.6, kernels=GPU_KERNELS["h100"],
        source=("NVIDIA H100 SXM5 datasheet: 989 TFLOP/s dense bf16/fp16 and 495 TFLOP/s dense TF32 (float32 "
                "matmuls; halves of the sparsity figures 1979/989), 80 GB HBM3 at 3.35 TB/s; NVLink4 900 GB/s "
                "total = 450 GB/s per direction through NVSwitch; DGX H100: 8 GPUs per node, one 400 Gb/s "
                f"(50 GB/s) ConnectX-7 InfiniBand NDR port per GPU. {_LATENCY_NOTE} {_EFF_NOTE}")),
    "a100-sxm": HardwareSpec(
        name="a100-sxm",
        flops={"float32": 156e12, "bfloat16": 312e12, "float16": 312e12},
        memory_bytes=80 * 10**9, memory_bandwidth=2.039e12, devices_per_node=8,
        intra_node_bandwidth=300e9, intra_node_latency=2e-6,
        inter_node_bandwidth=25e9, inter_node_latency=5e-6,
        collective_efficiency=_EFFICIENCY, compute_efficiency=0.6, kernels=GPU_KERNELS["a100"],
        source=("NVIDIA A100 SXM4 80GB datasheet (the 80 GB variant; the 40 GB one has 1.555 TB/s): 312 "
                "TFLOP/s dense bf16/fp16, 156 TFLOP/s dense TF32 (float32 matmuls), 80 GB HBM2e at 2039 GB/s; "
                "NVLink3 600 GB/s total = 300 GB/s per direction through NVSwitch; DGX A100: 8 GPUs per node, "
                f"one 200 Gb/s (25 GB/s) HDR InfiniBand port per GPU. {_LATENCY_NOTE} {_EFF_NOTE}")),
    "v100-sxm": _v100("v100-sxm", 50e9, 12.5e9, 5e-6, _RANNC_NET + " This preset: the 50 GB/s pairs."),
    "v100-16gb-25gbps": dataclasses.replace(
        _v100("v100-16gb-25gbps", 150e9, 25e9 / 8, 5e-6, ""), memory_bytes=16 * 10**9,
        source=(f"{_V100_SOURCE} Alpa's GPT benchmark cluster (Zheng et al., OSDI 2022, §8): AWS p3.16xlarge, "
                "8 V100-SXM2-16GB per node with NVLink (6 NVLink2 links x 25 GB/s = 150 GB/s per direction per "
                "GPU), nodes joined at 25 Gb/s = 3.125 GB/s per node, taken per ring (rings crossing nodes at "
                f"the same time share it). {_LATENCY_NOTE} {_EFF_NOTE}")),
    "v100-sxm-nvlink25": _v100("v100-sxm-nvlink25", 25e9, 12.5e9, 5e-6,
                               _RANNC_NET + " This preset: the 25 GB/s (single-link) pairs."),
    "v100-sxm-eth32": _v100(
        "v100-sxm-eth32", 50e9, 4e9, 30e-6,
        "TAP §4.6 profiling cluster: two nodes of 8 GPUs 'interconnected by 32 Gbps Ethernet' = 4 GB/s, "
        "taken per device. TAP calls its intra-node link 'PCI-e'; this preset keeps the V100 SXM2 NVLink2 "
        "50 GB/s of its evaluation node (§6) -- override intra_node_bandwidth (~12e9, PCIe 3.0 x16) for PCIe."),
    "i5-10400-1gbe": HardwareSpec(
        name="i5-10400-1gbe",
        flops={"float32": _I5_10400_FLOPS, "bfloat16": _I5_10400_FLOPS, "float16": _I5_10400_FLOPS},
        memory_bytes=16 * 2**30, memory_bandwidth=41.6e9, devices_per_node=1,
        intra_node_bandwidth=41.6e9, intra_node_latency=1e-6,
        inter_node_bandwidth=125e6, inter_node_latency=50e-6,
        collective_efficiency={**_EFFICIENCY, "collective-permute": 0.94}, compute_efficiency=0.6,
        source=("BBGraP §4 (Mateu Cuadrat, Park, Egger): each node is 'an Intel i5-10400 6-core/12-thread "
                "processor and sufficient memory', operators run by oneDNN; one node = one device. Intel ARK "
                "i5-10400 (Comet Lake): 6 cores, 2.9 GHz base (4.3 GHz max turbo), dual-channel DDR4-2666, "
                "max memory bandwidth 41.6 GB/s. float32 peak = 6 cores x 2.9 GHz base x 32 flop/cycle (two "
                "256-bit AVX2 FMA units x 8 float32 lanes x 2 flops per FMA, the Skylake core Comet Lake "
                "reuses) = 556.8 GFLOP/s; the base clock, as sustained all-core AVX2 load at the 65 W TDP "
                "runs near it (the 4.0 GHz all-core turbo would give 768 GFLOP/s). No AVX-512 BF16/FP16: "
                "bfloat16 and float16 get the float32 rate. Memory: 16 GiB assumed (the paper says only "
                "'sufficient memory'). The paper does not name its network; gigabit Ethernet assumed: 1 Gb/s "
                "= 125 MB/s per direction per node; collective-permute (a point-to-point send) efficiency "
                "0.94 = TCP payload per wire bytes at MTU 1500 (1448 of 1538 B with TCP timestamps, the "
                "~941 Mb/s iperf shows on 1 GbE); other collective kinds keep the defaults. Inter-node latency "
                "50 us = half the ~100 us small-message TCP round trip typical of commodity 1 GbE NICs through a "
                "switch (NetPIPE / netperf TCP_RR ping-pong report RTT/2) -- an order-of-magnitude estimate, not "
                "measured on the paper's nodes. Intra-node numbers are unused (one device per node): the memory "
                "bandwidth and 1 us stand in. compute_efficiency 0.6 is an assumption (oneDNN AVX2 "
                f"convolutions reach roughly half to two thirds of peak), not a measurement. {_EFF_NOTE}")),
    "cpu-sim": HardwareSpec(
        name="cpu-sim",
        flops={"float32": 1e11, "bfloat16": 1e11, "float16": 1e11},
        memory_bytes=3 * 2**30, memory_bandwidth=10e9, devices_per_node=8,
        intra_node_bandwidth=10e9, intra_node_latency=10e-6,
        inter_node_bandwidth=10e9, inter_node_latency=10e-6,
        collective_efficiency=_EFFICIENCY, compute_efficiency=0.5,
        source=("Simulated CPU devices of the test suite (jax_num_cpu_devices=8 in one process): rough, "
                "self-consistent numbers (100 GFLOP/s, 24 GiB host memory / 8 devices, ~10 GB/s memory copies "
                "between devices). Not a performance model of any real hardware.")),
}

# the H100's die, links and efficiencies with HBM3e: only memory and its bandwidth differ
_PRESETS["h200-sxm"] = dataclasses.replace(
    _PRESETS["h100-sxm"], name="h200-sxm", memory_bytes=141 * 10**9, memory_bandwidth=4.8e12,
    kernels=GPU_KERNELS["h200"],
    source=("NVIDIA H200 SXM datasheet: the H100's Hopper die and tensor-core rates (989 TFLOP/s dense "
            "bf16/fp16, 495 TFLOP/s dense TF32), 141 GB HBM3e at 4.8 TB/s; NVLink4 900 GB/s total = 450 GB/s "
            "per direction through NVSwitch; DGX/HGX H200: 8 GPUs per node, one 400 Gb/s (50 GB/s) "
            f"ConnectX-7 InfiniBand NDR port per GPU. {_LATENCY_NOTE} {_EFF_NOTE}"))


def presets() -> list[str]:
    """Names of the built-in hardware presets, sorted."""
    return sorted(_PRESETS)


def get_hardware(spec: str | HardwareSpec | Mapping[str, Any]) -> HardwareSpec:
    """Resolve a hardware description.

    `spec` is a preset name (see `presets()`), a `HardwareSpec` (returned as is) or a mapping of
    field overrides on a preset, e.g. `{"base": "h100-sxm", "memory_bytes": 40e9}`. `flops` and
    `collective_efficiency` overrides are merged into the base's mappings. A mapping without
    "base" must give every field except those with a default (`node_speeds`). `node_speeds` takes
    any sequence of numbers (a JSON list), kept as a tuple.
    """
    if isinstance(spec, HardwareSpec):
        return spec
    if isinstance(spec, str):
        if spec not in _PRESETS:
            raise HardwareError(
                f"autoshard: hardware={spec!r} is not a known preset; valid names: {presets()}. For other "
                "hardware pass explicit numbers: a HardwareSpec, or a dict of overrides on the closest preset "
                "such as {'base': 'h100-sxm', 'memory_bytes': 40e9}.")
        return _PRESETS[spec]
    if isinstance(spec, Mapping):
        return _from_mapping(spec)
    raise HardwareError(
        f"autoshard: hardware={spec!r} has type {type(spec).__name__}; pass a preset name (one of {presets()}), "
        "a HardwareSpec or a dict of overrides such as {'base': 'h100-sxm', 'memory_bytes': 40e9}.")


def _from_mapping(spec: Mapping[str, Any]) -> HardwareSpec:
    fields = [f.name for f in dataclasses.fields(HardwareSpec)]
    overrides = {k: v for k, v in spec.items() if k != "base"}
    unknown = [k for k in overrides if k not in fields]
    if unknown:
        raise HardwareError(
            f"autoshard: hardware override field(s) {unknown} do not exist; valid fields: {fields} (plus 'base', "
            "the preset the overrides apply to).")
    if "base" not in spec:
        missing = [f.name for f in dataclasses.fields(HardwareSpec)
                   if f.name not in overrides and f.default is dataclasses.MISSING]
        if missing:
            raise HardwareError(
                f"autoshard: hardware dict {dict(spec)!r} has no 'base' preset and lacks fields {missing}; add "
                f"'base': one of {presets()}, or give every field.")
        return HardwareSpec(**overrides)
    if not isinstance(spec["base"], (str, HardwareSpec)):
        raise HardwareError(f"autoshard: hardware 'base'={spec['base']!r} must be a preset name or a "
                                   f"HardwareSpec; valid names: {presets()}.")
    base = get_hardware(spec["base"])
    for field in ("flops", "collective_efficiency"):
        if field in overrides:
            if not isinstance(overrides[field], Mapping):
                raise HardwareError(f"autoshard: hardware override {field}={overrides[field]!r} must be a "
                                           "mapping (merged into the base preset's).")
            overrides[field] = {**getattr(base, field), **overrides[field]}
    if overrides and "source" not in overrides:
        shown = ", ".join(f"{k}={v!r}" for k, v in overrides.items() if k not in ("flops", "collective_efficiency"))
        shown += "".join(f", {k} overridden" for k in ("flops", "collective_efficiency") if k in overrides)
        overrides["source"] = f"{base.source} Overridden by the user: {shown.lstrip(', ')}."
    return dataclasses.replace(base, **overrides)


def hardware_dict(hw: HardwareSpec) -> dict[str, Any]:
    """Every field of `hw` as plain data (for plan provenance); `get_hardware` of it, also after a JSON
    round trip, gives back an equal spec (node_speeds and a kernel tile travel as lists)."""
    def plain(value: Any) -> Any:
        if isinstance(value, KernelModel):
            return {k: plain(v) for k, v in dataclasses.asdict(value).items()}
        if isinstance(value, Mapping):
            return dict(value)
        return value        # tuples stay tuples, as a plan read back from JSON holds them
    return {f.name: plain(getattr(hw, f.name)) for f in dataclasses.fields(hw)}
