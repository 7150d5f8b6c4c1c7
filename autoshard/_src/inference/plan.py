"""Inference planning's config and plan record (pure): `autoshard.plan(fn, params, images,
mode="inference", ...)` and `autoshard.autoshard(mode="inference", ...)` read an `InferenceConfig` and
produce an `InferencePlan` (the BBGraP partition of every layer, its predicted latency, the
single-direction baselines, and the program form the bridge emits).

An inference plan is its own type: it has no parameters to shard, no gradients, no stages; what it
has -- per layer a split direction over the nodes, extents, halo bytes, kept and removed transfers
-- has no place in the training Plan.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

from ..core.errors import ConfigError, PlanError
from ..core.hardware import HardwareSpec, get_hardware
from ..core.mesh import MeshSpec, mesh_spec
from .partition import InferencePartition, LayerPlan

MODES = ("train", "inference")
EMISSIONS = ("auto", "constrained", "explicit")
_DIRECTIONS = {"N", "C", "H", "W", "replicated"}


@dataclasses.dataclass(frozen=True)
class InferenceConfig:
    """How to partition an inference function over the nodes of a one-axis mesh.

    speeds: relative node speeds (None: `hardware.node_speeds`, else equal); heterogeneous nodes get
    proportional, uneven parts. direction: None (the DP's mixed plan) or one of N, C, H, W,
    "replicated" (that direction wherever the layer has it). max_fuse: longest fused run (1: none).
    data_argnums: the arguments holding the images (the rest are weights every node holds whole).
    emission: "auto" (sharding constraints when every split is even and nothing fused, else the
    explicit shard_map program), "constrained" or "explicit"."""

    mesh: MeshSpec
    hardware: HardwareSpec | None = None
    speeds: tuple[float, ...] | None = None
    direction: str | None = None
    max_fuse: int = 4
    max_states: int = 4096
    data_argnums: tuple[int, ...] = (1,)
    emission: str = "auto"

    def __post_init__(self) -> None:
        if len(self.mesh.axes) != 1:
            raise ConfigError(f"autoshard (inference): mesh={dict(self.mesh.axes)} has {len(self.mesh.axes)} axes; "
                              "inference partitioning splits over one axis of nodes, e.g. mesh={'x': 3}.")
        if self.direction is not None and self.direction not in _DIRECTIONS:
            raise ConfigError(f"autoshard (inference): direction={self.direction!r} must be None (the mixed plan) or "
                              f"one of {sorted(_DIRECTIONS)}.")
        for name in ("max_fuse", "max_states"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"autoshard (inference): {name}={value!r} must be an int >= 1.")
        if self.emission not in EMISSIONS:
            raise ConfigError(f"autoshard (inference): emission={self.emission!r} must be one of {list(EMISSIONS)}.")
        if self.speeds is not None:
            speeds = tuple(self.speeds)
            if len(speeds) != self.num_nodes or not all(_positive(s) for s in speeds):
                raise ConfigError(f"autoshard (inference): speeds={speeds!r} must hold {self.num_nodes} finite numbers "
                                  f"> 0, one per node of mesh {dict(self.mesh.axes)}.")
            object.__setattr__(self, "speeds", tuple(float(s) for s in speeds))
        object.__setattr__(self, "data_argnums", tuple(self.data_argnums))

    @property
    def axis_name(self) -> str:
        return self.mesh.axes[0][0]

    @property
    def num_nodes(self) -> int:
        return self.mesh.axes[0][1]

    def node_speeds(self) -> tuple[float, ...] | None:
        """The speeds to plan with: given ones, else the hardware's, else None (equal nodes)."""
        if self.speeds is not None:
            return self.speeds
        speeds = getattr(self.hardware, "node_speeds", None)
        if speeds is not None and len(speeds) != self.num_nodes:
            raise ConfigError(f"autoshard (inference): hardware {self.hardware.name!r} gives node_speeds for "
                              f"{len(speeds)} nodes but mesh {dict(self.mesh.axes)} has {self.num_nodes}; pass "
                              "speeds=(...) with one per node.")
        return tuple(speeds) if speeds is not None else None

    @classmethod
    def make(cls, mesh: Any = None, hardware: Any = None, inference_options: Mapping[str, Any] | None = None,
             **kwargs: Any) -> InferenceConfig:
        """From the decorator's / plan's keywords: mesh, hardware, and the options above either as
        keywords or in `inference_options`."""
        if mesh is None:
            raise ConfigError("autoshard (inference): no mesh given; pass mesh={'x': 3} (one axis of nodes).")
        options = {**dict(inference_options or {}), **kwargs}
        fields = {f.name for f in dataclasses.fields(cls)} - {"mesh", "hardware"}
        unknown = sorted(set(options) - fields)
        if unknown:
            raise ConfigError(f"autoshard (inference): unknown options {unknown}; inference planning takes mesh, "
                              f"hardware and {sorted(fields)}.")
        spec = get_hardware(hardware) if hardware is not None else None
        return cls(mesh=mesh_spec(mesh), hardware=spec, **options)


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _direction_name(direction: str | None) -> str:
    return direction or "replicated"


@dataclasses.dataclass(frozen=True)
class InferencePlan:
    """A partitioned inference function: per layer its split, and how it runs."""

    axis_name: str
    hardware: str
    partition: InferencePartition
    emission: str                         # "constrained" or "explicit"
    signature: str                        # the argument shapes it was made for
    plan_seconds: float = 0.0

    @property
    def layers(self) -> tuple[LayerPlan, ...]:
        return self.partition.layers

    @property
    def num_nodes(self) -> int:
        return self.partition.num_nodes

    @property
    def latency(self) -> float:
        """Predicted seconds per inference on the plan's hardware."""
        return self.partition.latency

    @property
    def baselines(self) -> Mapping[str, float]:
        return self.partition.baselines

    @property
    def mesh(self) -> dict[str, int]:
        return {self.axis_name: self.num_nodes}

    def halo_nbytes(self) -> int:
        """Bytes every node receives in total (the transfers the graph optimiser keeps)."""
        return sum(sum(lp.received_nbytes) for lp in self.layers)

    def explain(self) -> str:
        """Per layer: direction, extents per node, bytes received, kept/removed, latency; then totals."""
        p = self.partition
        speeds = "equal" if len(set(p.speeds)) == 1 else ", ".join(f"{s:g}" for s in p.speeds) + (
            ", parts proportional to them" if p.proportional else ", even parts (predicted faster than proportional)")
        head = (f"inference plan: {self.num_nodes} nodes on axis {self.axis_name!r} ({self.hardware}; "
                f"speeds {speeds}); "
                f"emitted as {self.emission} program; planned in {self.plan_seconds:.2f} s")
        rows = [f"{'layer':<24} {'kind':<11} {'split':<10} {'extents per node':<34} {'recv B':>10} {'sent B':>10} "
                f"{'removed B':>10} {'ms':>9}"]
        for lp in self.layers:
            extents = " ".join("x".join(map(str, e)) for e in lp.extents)
            if len(extents) > 34:
                extents = extents[:31] + "..."
            fused = f"  (fused run from {lp.fused})" if lp.fused else ""
            rows.append(f"{lp.name:<24} {lp.kind:<11} {_direction_name(lp.direction):<10} {extents:<34} "
                        f"{sum(lp.received_nbytes):>10} {lp.kept_nbytes:>10} {lp.removed_nbytes:>10} "
                        f"{lp.latency * 1e3:>9.4f}{fused}")
        removed = sum(lp.removed_nbytes for lp in self.layers)
        kept = sum(lp.kept_nbytes for lp in self.layers)
        base = ", ".join(f"{k} {v * 1e3:.4f} ms" for k, v in self.baselines.items())
        best = min(self.baselines.items(), key=lambda kv: kv[1]) if self.baselines else None
        tail = [f"predicted latency {self.latency * 1e3:.4f} ms ({'exact DP' if p.exact else 'beam search'}; "
                f"{len(p.fused)} fused runs); transfers kept {kept} B, removed by the graph optimiser {removed} B",
                f"single-direction plans: {base}"]
        if best is not None:
            tail.append(f"vs the best single direction ({best[0]}): {best[1] / self.latency:.2f}x"
                        if self.latency > 0 else "")
        return "\n".join([head, *rows, *tail])

    # ---- JSON ------------------------------------------------------------------------------------------

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["kind"] = "inference"
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> InferencePlan:
        data = json.loads(text)
        if data.pop("kind", None) != "inference":
            raise PlanError("autoshard: this JSON is not an inference plan (no \"kind\": \"inference\").")
        part = data.pop("partition")
        layers = tuple(LayerPlan(**_tuples(lp)) for lp in part.pop("layers"))
        partition = InferencePartition(layers=layers, **_tuples({**part, "baselines": dict(part["baselines"])}))
        return cls(partition=partition, **data)


def _tuples(data: Mapping[str, Any]) -> dict[str, Any]:
    """JSON lists back to the tuples the frozen records hold (nested)."""
    def conv(v: Any) -> Any:
        return tuple(conv(x) for x in v) if isinstance(v, list) else v
    return {k: (v if isinstance(v, dict) else conv(v)) for k, v in data.items()}


def single_direction(name: str | None) -> str | None:
    """A direction name as the partitioner takes it ("replicated" -> None)."""
    return None if name == "replicated" else name
