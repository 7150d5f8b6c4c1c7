"""Event simulator: run a schedule's rank orders with per-stage task durations and transfer times.

Each rank runs its tasks in order; a task starts when its rank is free and every dependency has
finished (plus the transfer time of the stage edge it crosses). Because ranks never reorder, the
start times follow from one pass over the dependency DAG; the outputs are what the planner compares
schedules by: makespan, idle (bubble) fraction and peak activation memory per rank.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ...core.errors import ScheduleError
from .schedule import Schedule, Task, dependency_table, validate

Per = Literal["microbatch", "minibatch"]


@dataclass(frozen=True)
class TaskTiming:
    rank: int
    task: Task
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    """Simulated timeline. Per-rank outputs are lists indexed by rank (= stage unless the schedule
    places several stages on a rank, as interleaved 1F1B does)."""

    schedule: Schedule
    makespan: float
    bubble_fraction: float  # 1 - busy / (ranks * makespan): the idle share of all rank-time
    peak_inflight: list[int]  # per rank: most (stage, micro-batch)s whose forward is done and backward is not
    peak_activation_bytes: list[float] | None  # per rank: peak of the live (stage, micro-batch)s' bytes
    busy: list[float]  # seconds each rank computes
    timings: tuple[TaskTiming, ...]  # rank by rank, in execution order

    def gantt(self, unit: float | None = None, max_width: int = 160) -> str:
        """Text Gantt chart: one row per rank, one column per `unit` of time (default: the shortest
        task, coarsened to fit `max_width` columns); a task prints its label then '-' for its length."""
        durations = [t.end - t.start for t in self.timings if t.end > t.start]
        if not durations or self.makespan <= 0:
            return "(empty timeline)"
        unit = unit or min(durations)
        unit = max(unit, self.makespan / max_width)
        columns = math.ceil(self.makespan / unit - 1e-9)
        cw = max(len(t.task.label) for t in self.timings) + 1
        lines = [f"time unit per column: {unit:g} (makespan {self.makespan:g}, bubble {self.bubble_fraction:.1%})"]
        name_w = len(f"rank {len(self.schedule.ranks) - 1}")
        for r in range(len(self.schedule.ranks)):
            row = [".".ljust(cw)] * columns
            for t in (t for t in self.timings if t.rank == r):
                a, b = round(t.start / unit), max(round(t.end / unit), round(t.start / unit) + 1)
                text = t.task.label.ljust((b - a) * cw, "-")
                for c in range(a, min(b, columns)):
                    row[c] = text[(c - a) * cw : (c - a + 1) * cw]
            lines.append(f"rank {r}".ljust(name_w) + " |" + "".join(row).rstrip())
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schedule": self.schedule.name,
            "makespan": self.makespan,
            "bubble_fraction": self.bubble_fraction,
            "peak_inflight": list(self.peak_inflight),
            "peak_activation_bytes": None if self.peak_activation_bytes is None else list(self.peak_activation_bytes),
            "busy": list(self.busy),
            "tasks": [[t.rank, *t.task.to_list(), t.start, t.end] for t in self.timings],
        }


def simulate(
    sched: Schedule,
    forward: float | Sequence[float] = 1.0,
    backward: float | Sequence[float] = 2.0,
    transfer: float | Sequence[float] | Mapping[tuple[int, int], float] = 0.0,
    activation_bytes: float | Sequence[float] | None = None,
    per: Per = "microbatch",
) -> SimResult:
    """Simulate `sched`. `forward`/`backward`/`activation_bytes`: a scalar or one value per stage,
    for one micro-batch of that stage (per="microbatch") or for the whole mini-batch, divided by
    the stage's micro-batch count (per="minibatch", for graph schedules with per-stage sizes).
    `transfer`: seconds per message across a stage edge (both directions), a scalar, one value per
    `sched.edges` entry, or a mapping {(u, v): seconds} (absent edges cost 0)."""
    validate(sched)
    p, n_ranks = sched.num_stages, len(sched.ranks)
    if per not in ("microbatch", "minibatch"):
        raise ScheduleError(f"simulate: per must be 'microbatch' or 'minibatch', got {per!r}.")
    scale = [1.0 / n if per == "minibatch" else 1.0 for n in sched.num_microbatches]
    tf = [x * s for x, s in zip(_per_stage("forward", forward, p), scale, strict=True)]
    tb = [x * s for x, s in zip(_per_stage("backward", backward, p), scale, strict=True)]
    lag = _per_edge(transfer, sched.edges)

    deps = dependency_table(sched)
    end: dict[Task, float] = {}
    free = [0.0] * n_ranks
    heads = [0] * n_ranks
    timings: list[list[TaskTiming]] = [[] for _ in range(n_ranks)]
    remaining = sum(len(rank) for rank in sched.ranks)
    while remaining:
        progressed = False
        for r, rank in enumerate(sched.ranks):
            while heads[r] < len(rank) and all(d in end for d in deps[rank[heads[r]]]):
                task = rank[heads[r]]
                start = max([free[r]] + [end[d] + _edge_lag(lag, d, task) for d in deps[task]])
                end[task] = free[r] = start + (tf[task.stage] if task.kind == "F" else tb[task.stage])
                timings[r].append(TaskTiming(r, task, start, end[task]))
                heads[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # unreachable after validate(); kept so a bug cannot loop forever
            raise ScheduleError(f"simulate: schedule {sched.name!r} deadlocked after validation; please report.")

    makespan = max(free, default=0.0)
    busy = [sum(t.end - t.start for t in row) for row in timings]
    bubble = 1.0 - sum(busy) / (n_ranks * makespan) if makespan > 0 else 0.0
    peaks = [_peak_inflight(rank, [1.0] * p) for rank in sched.ranks]
    act = None
    if activation_bytes is not None:
        per_mb = [a * s for a, s in zip(_per_stage("activation_bytes", activation_bytes, p), scale, strict=True)]
        # one stage on a rank: count x bytes exactly (a running sum of bytes could round differently)
        act = [peak * per_mb[rank[0].stage] if len({t.stage for t in rank}) == 1 else _peak_inflight(rank, per_mb)
               for peak, rank in zip(peaks, sched.ranks, strict=True)]
    return SimResult(
        schedule=sched,
        makespan=makespan,
        bubble_fraction=bubble,
        peak_inflight=[int(x) for x in peaks],
        peak_activation_bytes=act,
        busy=busy,
        timings=tuple(t for row in timings for t in row),
    )


def _peak_inflight(rank: Sequence[Task], weight: Sequence[float]) -> float:
    """Peak of the live weight (count or bytes) on one rank; it depends only on the order: + the
    stage's weight per finished forward, - per finished backward."""
    live = peak = 0.0
    for task in rank:
        live += weight[task.stage] if task.kind == "F" else -weight[task.stage]
        peak = max(peak, live)
    return peak


def _per_stage(arg: str, value: Any, p: int) -> list[float]:
    values = [value] * p if isinstance(value, numbers.Real) else list(value)
    if len(values) != p or not all(isinstance(v, numbers.Real) and math.isfinite(v) and v >= 0 for v in values):
        raise ScheduleError(
            f"simulate: {arg} must be a finite non-negative number or one per stage ({p}), got {value!r}."
        )
    return [float(v) for v in values]


def _per_edge(transfer: Any, edges: tuple[tuple[int, int], ...]) -> dict[tuple[int, int], float]:
    if isinstance(transfer, Mapping):
        unknown = [e for e in transfer if tuple(e) not in edges]
        if unknown:
            raise ScheduleError(f"simulate: transfer names edges {unknown} that are not stage edges {list(edges)}.")
        lag = {tuple(e): t for e, t in transfer.items()}
    elif isinstance(transfer, numbers.Real):
        lag = dict.fromkeys(edges, transfer)
    else:
        values = list(transfer)
        if len(values) != len(edges):
            raise ScheduleError(
                f"simulate: transfer has {len(values)} values for {len(edges)} stage edges {list(edges)}; "
                "give one per edge, a scalar, or a mapping {(u, v): seconds}."
            )
        lag = dict(zip(edges, values, strict=True))
    if not all(isinstance(t, numbers.Real) and math.isfinite(t) and t >= 0 for t in lag.values()):
        raise ScheduleError(f"simulate: transfer times must be finite and non-negative, got {transfer!r}.")
    return {e: float(t) for e, t in lag.items()}


def _edge_lag(lag: dict[tuple[int, int], float], dep: Task, task: Task) -> float:
    if dep.stage == task.stage:
        return 0.0
    # Activations flow producer -> consumer, gradients back along the same edge.
    edge = (dep.stage, task.stage) if task.kind == "F" else (task.stage, dep.stage)
    return lag.get(edge, 0.0)
