"""Result types of the GraphPipe and SPP partitioners (`partition.py`, `spp.py`): plain data."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..schedules.schedule import Schedule


@dataclasses.dataclass(frozen=True)
class GraphStage:
    """One stage of a plan: its LayerGraph nodes, replicas, micro-batching and predicted costs."""

    index: int
    nodes: tuple[int, ...]        # LayerGraph node indices
    devices: int                  # data-parallel replicas of this stage
    microbatch_size: int          # samples per micro-batch for the stage (split over its devices)
    num_microbatches: int         # batch_size // microbatch_size
    forward: float                # seconds per micro-batch (incl. sending outputs)
    backward: float               # seconds per micro-batch (incl. amortised gradient all-reduce)
    memory: float                 # peak bytes per device

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "nodes": list(self.nodes)}


@dataclasses.dataclass(frozen=True)
class GraphPipePlan:
    """A GraphPipe or SPP plan: the stages, their DAG, schedule and predicted times."""

    method: str                   # "graphpipe" or "spp"
    stages: tuple[GraphStage, ...]
    edges: tuple[tuple[int, int], ...]   # stage DAG
    depth: int                    # stages on the longest path of the stage DAG
    time_per_sample: float        # the bottleneck the search achieved
    step_time: float              # simulated seconds per mini-batch (pipeline.simulate on the schedule)
    throughput: float             # samples per second = batch_size / step_time
    schedule: Schedule            # graph-1f1b schedule of the stages
    search_seconds: float
    devices: int
    batch_size: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "stages": [s.to_dict() for s in self.stages],
            "edges": [list(e) for e in self.edges],
            "depth": self.depth,
            "time_per_sample": self.time_per_sample,
            "step_time": self.step_time,
            "throughput": self.throughput,
            "schedule": self.schedule.to_dict(),
            "search_seconds": self.search_seconds,
            "devices": self.devices,
            "batch_size": self.batch_size,
        }
