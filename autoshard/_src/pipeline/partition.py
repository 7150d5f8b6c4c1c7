"""What every stage partitioner takes and returns (pure: no jax import).

A partitioner (RaNNC, GraphPipe, or one registered from outside) turns a traced step into a
`StagePartition`: stages, each with the units and ops it holds, its replicas (data parallel inside
the stage), micro-batch size and count, predecessors and predicted costs, plus the schedule that
runs them. The plan layer turns any `StagePartition` into a Plan the same way, and times every
candidate with the same event simulator, so partitioners are interchangeable.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..core.graph import OpGraph
from ..core.hardware import HardwareSpec
from ..core.mesh import MeshSpec
from .schedules.schedule import Schedule


@dataclasses.dataclass(frozen=True)
class PartitionedStage:
    """One stage of a partition: what it holds, where it runs and what it costs per micro-batch."""

    units: tuple[int, ...]           # partitioner units it holds: RaNNC blocks, GraphPipe layer nodes
    ops: tuple[int, ...]             # op indices of the traced step
    replicas: int                    # devices running it (data parallel inside the stage)
    microbatch_size: int             # samples per replica per micro-batch (the busiest replica)
    forward: float                   # seconds per micro-batch
    backward: float                  # seconds per micro-batch, incl. amortised gradient sync / update
    memory: float                    # peak bytes per device
    microbatches: int                # micro-batches per step
    after: tuple[int, ...] = ()      # stages feeding this one (a chain, or a DAG)


@dataclasses.dataclass(frozen=True)
class Baseline:
    """The partitioner's own reference split on the same costs (e.g. RaNNC vs the uniform layer split)."""

    name: str
    stages: int
    depth: int
    microbatches: int
    step_time: float
    max_over_mean: float
    hint: str                        # why the partitioner may lose to it


@dataclasses.dataclass(frozen=True)
class StagePartition:
    """A partitioner's result. `info` holds method-specific numbers for reports (plain data)."""

    method: str
    stages: tuple[PartitionedStage, ...]
    schedule: Schedule
    step_time: float                 # the partitioner's own estimate (the plan also simulates)
    memory_budget: float             # bytes per device it planned against
    batch_size: int
    pipelines: int                   # copies of the whole pipeline (RaNNC's node replication)
    search_seconds: float
    units: int                       # how many units it chose from
    unit: str                        # what a unit is ("blocks", "layer nodes", ...)
    warnings: tuple[str, ...] = ()
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    baseline: Baseline | None = None
    baseline_name: str = ""
    baseline_reason: str = ""        # why there is no baseline when it is None ("" when there is one)


class Profiler(Protocol):
    """Measured costs of the traced step on the local device (the jax bridge implements it)."""

    def op_times(self, graph: OpGraph, estimate: Callable[[int], float]) -> tuple[list[float], list[str]]:
        """Seconds per execution of every op (`estimate(i)` where op i cannot run alone) and notes."""
        ...

    def layer_costs(self, graph: OpGraph, hardware: HardwareSpec) -> tuple[list[float], np.ndarray, list[str]]:
        """(op times at the traced batch, op times at every `curve_sizes(batch)` micro-batch size, notes)."""
        ...


@dataclasses.dataclass(frozen=True)
class PartitionProblem:
    """Everything a partitioner may use. `stage_counts` fixes the stage count (a "pipe" mesh axis);
    `profiler` is given with profile="measured"; `num_microbatches`, when given, is the micro-batch
    count the plan must have (the runtime runs it: a partitioner that chooses another is refused)."""

    graph: OpGraph
    mesh: MeshSpec
    hardware: HardwareSpec
    memory_budget: float | None
    schedule: str
    options: Mapping[str, Any]
    profile: str = "model"
    profiler: Profiler | None = None
    num_microbatches: int | None = None

    @property
    def devices(self) -> int:
        return self.mesh.size

    @property
    def stage_counts(self) -> list[int] | None:
        return [self.mesh.axis_size("pipe")] if "pipe" in self.mesh.names else None


@runtime_checkable
class Partitioner(Protocol):
    """A stage partitioner: `name` (its registry key), the `schedules` it plans for (first = default),
    the `options` keys it accepts, and `partition`. `unsupported(mesh, options)` returns why it
    cannot plan on `mesh` with `options` (a typed error is raised with that text), or None."""

    name: str
    schedules: tuple[str, ...]
    options: frozenset[str]

    def unsupported(self, mesh: MeshSpec, options: Mapping[str, Any]) -> str | None: ...

    def partition(self, problem: PartitionProblem) -> StagePartition: ...


def max_over_mean(forward: Sequence[float], backward: Sequence[float]) -> float:
    """Balance of stage times: the slowest stage's forward + backward over the mean."""
    t = [f + b for f, b in zip(forward, backward, strict=True)]
    return max(t) / (sum(t) / len(t)) if t and sum(t) > 0 else 1.0


def microbatch_counts_for(batch: int, replicas: int) -> list[int]:
    """The micro-batch counts M that cut `batch` into M micro-batches of whole samples per replica
    (M x replicas divides the batch): the divisors of batch / replicas, none if replicas does not divide it."""
    if batch < 1 or replicas < 1 or batch % replicas:
        return []
    per = batch // replicas
    small = [m for m in range(1, math.isqrt(per) + 1) if per % m == 0]
    return sorted({*small, *(per // m for m in small)})


def microbatch_split_error(who: str, batch: int, replicas: int, num_microbatches: int | None, mesh: str,
                           axes: str) -> str | None:
    """Why `batch` samples cannot run as `num_microbatches` (None: any count) micro-batches on the
    `replicas` data-parallel devices (mesh axes `axes`) of `mesh` (text), with the counts that can;
    None when they can. The runtime gives every replica whole samples of every micro-batch, so
    M x replicas must divide the batch: checked where the batch is first known, before any search."""
    valid = microbatch_counts_for(batch, replicas)
    if num_microbatches in valid or num_microbatches is None and valid:
        return None
    asked = "" if num_microbatches is None else f"num_microbatches={num_microbatches}: "
    if not valid:
        return (f"{who}: {asked}batch size {batch} cannot be split over the {replicas} data-parallel replicas "
                f"({axes}) of mesh {mesh}: each replica needs whole samples of every micro-batch, so no micro-batch "
                f"count fits. Fix: a batch that is a multiple of {replicas}, or a mesh whose {axes} "
                f"size divides {batch}.")
    need = num_microbatches * replicas
    shown = ", ".join(map(str, valid[:12])) + (", ..." if len(valid) > 12 else "")
    return (f"{who}: batch size {batch} does not split into {num_microbatches} micro-batches x {replicas} "
            f"data-parallel replicas (num_microbatches={num_microbatches}; {axes} of mesh {mesh}): each replica "
            f"computes whole samples of every micro-batch, so the batch must be a multiple of {num_microbatches} x "
            f"{replicas} = {need}. Fix: "
            f"num_microbatches among [{shown}] (the counts that split batch {batch} on this mesh), or a batch that "
            f"is a multiple of {need}.")
