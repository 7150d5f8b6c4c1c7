"""3-D search: stages x per-stage submesh and tensor plan x remat x micro-batches x schedule
(pure: no jax import).

The space (Alpa's inter-op pass over equal submeshes, with the intra-op choice taken from our own
tensor search): for every stage count S dividing the device count N (at most the number of units),
every submesh shape data d x model t with d * t = N / S (t at most a node: tensor parallelism
stays on the fast links), every micro-batch count M (powers of two dividing the batch; 1 without
stages) and schedule (1F1B, GPipe): the best contiguous split of the unit chain (`partition`), each
stage with its own best (tensor plan, storage mode, remat policy) for its units and in-flight
micro-batches (`stage_choice`). Tensor-only plans are the points S = 1; pipeline-only plans the
points with t = 1 and no tensor split. The formula ranks every point; the best few are then timed
by the event simulator, and the shortest simulated step wins. Deterministic: ties keep the earlier
point in enumeration order (fewer stages, less tensor parallelism, fewer micro-batches, 1F1B).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import numpy as np

from ..core.cost import AnalyticalCostModel, CostModel, alpha_beta
from ..core.graph import OpGraph
from ..core.grouping import Grouping
from ..core.hardware import HardwareSpec
from ..core.mesh import MeshSpec, mesh_spec
from ..pipeline.costs import traced_batch
from ..pipeline.schedules.registry import schedule as make_schedule
from ..pipeline.schedules.simulate import simulate
from ..tensor.search import SearchOptions, analysis, plan_space
from .partition import best_split
from .stage_choice import REMAT, ChoiceTable, choice_table, split_choice
from .tables import ShapeTables, shape_tables
from .units import Units, build_units, kinds_per_range

SCHEDULES = ("1f1b", "gpipe")
SIMULATED = 8            # formula-ranked points the event simulator times


@dataclasses.dataclass(frozen=True)
class JointOptions:
    """What the 3-D search may choose. `stages`: a fixed stage count (a "pipe" mesh axis);
    `max_model`: largest tensor-parallel size (None: the hardware's devices per node);
    `tensor_in_stages=False` keeps pipeline stages data parallel inside; `remat` the policies it
    may choose (("none",) when the step cannot be rematerialised)."""

    schedules: tuple[str, ...] = SCHEDULES
    remat: tuple[str, ...] = REMAT
    stages: int | None = None
    max_model: int | None = None
    tensor_in_stages: bool = True
    max_microbatches: int = 512


@dataclasses.dataclass(frozen=True)
class JointStage:
    """One stage of a 3-D point: units [start, stop), its tensor plan (row of axis masks over the
    shape's candidate factors), storage and remat, and its costs per micro-batch."""

    start: int
    stop: int
    row: tuple[int, ...]
    storage: str
    remat: str
    forward: float
    backward: float
    tail: float                  # per step: exposed gradient sync + optimizer
    memory: float
    inflight: int


@dataclasses.dataclass(frozen=True)
class JointPoint:
    """A point of the 3-D space with its best split and predicted step."""

    stages: tuple[JointStage, ...]
    data: int
    model: int
    microbatches: int
    schedule: str
    objective: float             # the formula the split minimises
    step_time: float             # event-simulated step + the slowest stage's tail (inf: not simulated)
    label: str = ""

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def devices(self) -> int:
        return self.num_stages * self.data * self.model

    @property
    def memory(self) -> float:
        return max(s.memory for s in self.stages)

    def describe(self) -> str:
        rm = sorted({s.remat for s in self.stages})
        return (f"{self.num_stages} stage(s) x data {self.data} x model {self.model}, {self.microbatches} "
                f"micro-batch(es), {self.schedule}, remat {'/'.join(rm)}")


@dataclasses.dataclass
class JointResult:
    best: JointPoint | None
    tensor_only: JointPoint | None
    pipeline_only: JointPoint | None
    units: Units
    tables: dict[tuple[int, int], ShapeTables]
    points: int
    seconds: float
    least_memory: JointPoint | None        # when nothing fits: the point needing least memory
    notes: list[str]


def submesh(data: int, model: int) -> MeshSpec:
    axes = [(n, s) for n, s in (("data", data), ("model", model)) if s > 1] or [("data", 1)]
    return mesh_spec(dict(axes))


def _shapes(per_stage: int, max_model: int, tensor: bool) -> list[tuple[int, int]]:
    ts = [t for t in range(1, min(per_stage, max_model) + 1) if per_stage % t == 0] if tensor else [1]
    return [(per_stage // t, t) for t in ts]


def _microbatch_counts(batch: int, stages: int, cap: int) -> list[int]:
    if stages == 1:
        return [1]
    out, m = [], 1
    while m <= min(batch, cap):
        if batch % m == 0:
            out.append(m)
        m *= 2
    return out


class _Search:
    """State shared by every point: units, compositions, tables per submesh shape."""

    def __init__(self, graph: OpGraph, grouping: Grouping, devices: int, hw: HardwareSpec,
                 options: SearchOptions, joint: JointOptions, cost: Callable[[MeshSpec], CostModel]) -> None:
        self.graph, self.grouping, self.N, self.hw = graph, grouping, devices, hw
        self.options, self.joint, self.cost = options, joint, cost
        self.budget = options.memory_budget if options.memory_budget is not None else 0.9 * hw.memory_bytes
        self.analysed = analysis(graph, grouping)
        self.units = build_units(graph, grouping, self.analysed.periods)
        self.batch = traced_batch(graph)
        U = len(self.units)
        counts = kinds_per_range(self.units)                        # [U+1, U+1, K]
        i, j = np.triu_indices(U + 1, k=1)
        self.comps, inverse = np.unique(counts[i, j], axis=0, return_inverse=True)
        self.comp_id = np.full((U + 1, U + 1), -1, dtype=np.int64)
        self.comp_id[i, j] = inverse.reshape(-1)
        # bytes entering a unit of each kind (what remat keeps per unit)
        K = len(self.units.kinds)
        self.kind_inputs = np.zeros(K)
        for u, k in enumerate(self.units.kind_of):
            self.kind_inputs[k] = max(self.kind_inputs[k], self.units.cut_dep[u])
        self.tables: dict[tuple[int, int], ShapeTables] = {}

    def table(self, d: int, t: int) -> ShapeTables:
        if (d, t) not in self.tables:
            mesh = submesh(d, t)
            space = plan_space(self.graph, self.grouping, mesh, self.options, self.analysed)
            self.tables[(d, t)] = shape_tables(space, self.units, self.hw, self.cost(mesh), self.options)
        return self.tables[(d, t)]

    def p2p(self, per_stage: int) -> tuple[float, float]:
        hw = self.hw
        inter = per_stage >= hw.devices_per_node and self.N > hw.devices_per_node
        bw, lat = ((hw.inter_node_bandwidth, hw.inter_node_latency) if inter
                   else (hw.intra_node_bandwidth, hw.intra_node_latency))
        return alpha_beta("collective-permute", 2, bw, lat, hw.collective_efficiency["collective-permute"])

    def sends(self, d: int, M: int, per_stage: int) -> tuple[np.ndarray, np.ndarray]:
        """(seconds a stage ending before unit j sends forward, a stage starting at unit i sends back)."""
        alpha, beta = self.p2p(per_stage)
        fwd_bytes = self.units.cut_dep / (M * d) + self.units.cut_const
        bwd_bytes = self.units.cut_dep / (M * d)
        t = lambda b: np.where(b > 0, alpha + beta * b, 0.0)  # noqa: E731
        return t(fwd_bytes), t(bwd_bytes)


def _inflight(schedule: str, S: int, M: int) -> list[int]:
    return [min(S - s, M) for s in range(S)] if schedule == "1f1b" else [M] * S


def _point(srch: _Search, tables: ShapeTables, ct: ChoiceTable, d: int, t: int, S: int, M: int,
           schedule: str) -> JointPoint | None:
    """The best split of one (S, d x t, M, schedule) point, or None when no split fits."""
    U = len(srch.units)
    qs = _inflight(schedule, S, M)
    distinct = sorted(set(qs))
    val, pos = ct.best(np.array(distinct))
    send_f, send_b = srch.sends(d, M, d * t)
    extra = send_f[None, :] + send_b[:, None]                        # [i, j]
    extra[0, :] -= send_b[0]
    extra[:, U] -= send_f[U]
    valid = srch.comp_id >= 0
    cost = []
    for q in qs:
        row = val[distinct.index(q)]
        c = np.where(valid, row[np.where(valid, srch.comp_id, 0)] + extra, np.inf)
        cost.append(c)
    obj, bounds = best_split(cost, M)
    if not bounds:
        return None
    stages = []
    for s in range(S):
        i, j = bounds[s], bounds[s + 1]
        u = srch.comp_id[i, j]
        k = int(pos[distinct.index(qs[s]), u])
        p, z, r = split_choice(ct.order[u, k], ct.shape)
        f = float(ct.f[u, k] + (send_f[j] if j < U else 0.0))
        b = float(ct.b[u, k] + (send_b[i] if i > 0 else 0.0))
        mem = float(ct.static[u, k] + ct.transient[u, k] + qs[s] * ct.held[u, k])
        stages.append(JointStage(i, j, tuple(int(x) for x in tables.rows[p]), tables.storage_modes[z],
                                 srch.joint.remat[r], f, b, float(ct.tail[u, k]), mem, qs[s]))
    return JointPoint(tuple(stages), d, t, M, schedule, float(obj), math.inf)


def simulated(p: JointPoint) -> JointPoint:
    """`p` with its step timed by the event simulator (plus the slowest stage's per-step tail)."""
    S = p.num_stages
    if S == 1:
        st = p.stages[0]
        step = p.microbatches * (st.forward + st.backward) + st.tail
    else:
        sched = make_schedule(p.schedule, num_stages=S, num_microbatches=p.microbatches)
        sim = simulate(sched, forward=[s.forward for s in p.stages], backward=[s.backward for s in p.stages])
        step = sim.makespan + max(s.tail for s in p.stages)
    return dataclasses.replace(p, step_time=float(step))


def joint_search(graph: OpGraph, grouping: Grouping, devices: int, hw: HardwareSpec,
                 options: SearchOptions | None = None, joint: JointOptions | None = None,
                 cost: Callable[[MeshSpec], CostModel] | None = None) -> JointResult:
    """The best 3-D point for `graph` on `devices` devices of `hw` (see the module docstring)."""
    t0 = time.perf_counter()
    options, joint = options or SearchOptions(), joint or JointOptions()
    cost = cost or (lambda m: AnalyticalCostModel(m, hw))
    srch = _Search(graph, grouping, devices, hw, options, joint, cost)
    U = len(srch.units)
    notes: list[str] = []
    if srch.units.scanned:
        notes.append("the step's repeated layers run in one scan loop: one unit, so no pipeline stages")
    max_model = joint.max_model or hw.devices_per_node
    counts = [S for S in range(1, min(U, devices) + 1) if devices % S == 0]
    if joint.stages is not None:
        counts = [joint.stages] if joint.stages <= U and devices % joint.stages == 0 else []
    points: list[JointPoint] = []
    n_points = 0
    for S in counts:
        for d, t in _shapes(devices // S, max_model, joint.tensor_in_stages or S == 1):
            tables = srch.table(d, t)
            for M in _microbatch_counts(srch.batch, S, joint.max_microbatches):
                valid = (srch.batch // M) % tables.batch_split.astype(np.int64) == 0
                if srch.batch % M or not valid.any():
                    continue
                ct = choice_table(tables, srch.comps, M, srch.budget, srch.kind_inputs, joint.remat, valid,
                                  options.overlap)
                for sched in (joint.schedules if S > 1 else joint.schedules[:1]):
                    n_points += 1
                    p = _point(srch, tables, ct, d, t, S, M, sched)
                    if p is not None:
                        points.append(p)
    ranked = sorted(points, key=lambda p: p.objective)
    timed = [simulated(p) for p in ranked[:SIMULATED]]
    best = min(timed, key=lambda p: p.step_time) if timed else None
    tensor = _best_of([p for p in points if p.num_stages == 1])
    pipe = _best_of([p for p in points if p.num_stages > 1 and p.model == 1])   # stages data parallel inside
    least = None if best is not None else _least_memory(srch, counts, max_model)
    return JointResult(best, tensor, pipe, srch.units, srch.tables, n_points, time.perf_counter() - t0, least, notes)


def _best_of(points: Sequence[JointPoint]) -> JointPoint | None:
    if not points:
        return None
    ranked = sorted(points, key=lambda p: p.objective)[:SIMULATED]
    return min((simulated(p) for p in ranked), key=lambda p: p.step_time)


def _least_memory(srch: _Search, counts: list[int], max_model: int) -> JointPoint | None:
    """When nothing fits: the point needing least memory (every stage at its least-memory choice)."""
    best = None
    for S in counts:
        for d, t in _shapes(srch.N // S, max_model, srch.joint.tensor_in_stages or S == 1):
            tables = srch.table(d, t)
            M = max(_microbatch_counts(srch.batch, S, srch.joint.max_microbatches))
            valid = (srch.batch // M) % tables.batch_split.astype(np.int64) == 0
            if not valid.any():
                continue
            p = _least_memory_point(srch, tables, d, t, S, M, valid)
            if p is not None and (best is None or p.memory < best.memory):
                best = p
    return best


def _least_memory_point(srch: _Search, tables: ShapeTables, d: int, t: int, S: int, M: int,
                        valid: np.ndarray) -> JointPoint | None:
    """Uniform split, each stage at the (plan, storage, remat) of least memory."""
    U = len(srch.units)
    if U < S:
        return None
    bounds = [round(s * U / S) for s in range(S + 1)]
    qs = _inflight("1f1b", S, M)
    stages = []
    for s in range(S):
        comp = srch.comps[srch.comp_id[bounds[s], bounds[s + 1]]][None, :]
        ct = choice_table(tables, comp, M, math.inf, srch.kind_inputs, srch.joint.remat, valid, 0.0)
        mem = ct.static[0] + ct.transient[0] + qs[s] * ct.held[0]
        mem = np.where(np.isfinite(ct.value[0]), mem, np.inf)
        k = int(np.argmin(mem))
        p, z, r = split_choice(ct.order[0, k], ct.shape)
        stages.append(JointStage(bounds[s], bounds[s + 1], tuple(int(x) for x in tables.rows[p]),
                                 tables.storage_modes[z], srch.joint.remat[r], float(ct.f[0, k]),
                                 float(ct.b[0, k]), float(ct.tail[0, k]), float(mem[k]), qs[s]))
    return JointPoint(tuple(stages), d, t, M, "1f1b", math.inf, math.inf)
