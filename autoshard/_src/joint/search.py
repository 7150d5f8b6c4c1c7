"""3-D search: stages x per-stage submesh and tensor plan x remat x micro-batches x schedule
(pure: no jax import).

The space (Alpa's inter-op pass, with the intra-op choice taken from our own tensor search),
first over equal submeshes: for every stage count S dividing the device count N (at most the number of units),
every submesh shape data d x model t with d * t = N / S (t at most a node: tensor parallelism
stays on the fast links), every micro-batch count M that splits the batch evenly over the data
replicas (with one stage, M > 1 accumulates gradients) and schedule (1F1B, GPipe, interleaved 1F1B
with v stages per rank: S v stages, stage k on rank k % S): the best contiguous split of the
unit chain (`partition`), each stage with its own best (tensor plan -- sequence parallel or not --,
storage mode, remat policy) for its units and in-flight micro-batches (`stage_choice`). Tensor-only
plans are the points S = 1; pipeline-only plans the points with t = 1. The points are visited in
order of a memory-aware lower bound on their formula and skipped once it cannot reach the best few
(`_Bounds`), or once fewer micro-batches did not fit (`_MemoryFloor`); the formula ranks the rest,
the best few are timed by the event simulator, and the shortest simulated step wins.
Deterministic: ties keep the earlier point in enumeration order (fewer stages, less tensor
parallelism, fewer micro-batches, 1F1B). Then stages with unequal submeshes (`unequal_points`: Alpa's stages of 2, 2
and 4 devices) for the best equal points' micro-batch counts and schedules; the pipeline runtime
runs one pipe x data x model mesh, so the result carries the best point and the best `runnable`
one (equal submeshes) beside it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import numpy as np

from ..core.cost import AnalyticalCostModel, CostModel
from ..core.graph import OpGraph
from ..core.grouping import Grouping
from ..core.hardware import HardwareSpec
from ..core.mesh import MeshSpec
from ..tensor.search import SearchOptions
from .grid import GridResult, megatron_grid
from .partition import _reachable, best_split
from .space import (
    INTERLEAVED,
    SIMULATED,
    JointOptions,
    JointPoint,
    JointStage,
    SearchState,
    inflight,
    lower_bound_work,
    microbatch_counts,
    shapes,
    simulated,
)
from .stage_choice import ChoiceTable, choice_table, keep_heap_warm, split_choice
from .tables import ShapeTables
from .unequal_points import unequal_points
from .units import Units


@dataclasses.dataclass
class JointResult:
    best: JointPoint | None
    runnable: JointPoint | None            # the best point with equal stage submeshes (`best` when it is one)
    tensor_only: JointPoint | None
    pipeline_only: JointPoint | None
    grid: GridResult
    units: Units
    tables: dict[tuple[int, int], ShapeTables]
    points: int
    seconds: float
    least_memory: JointPoint | None        # when nothing fits: the point needing least memory
    notes: list[str]
    candidates: int = 0                    # equal-submesh points before the lower bound pruned them


def _point(srch: SearchState, tables: ShapeTables, ct: ChoiceTable, d: int, t: int, S: int, M: int,
           schedule: str, virtual: int = 1) -> JointPoint | None:
    """The best split of one (S ranks, d x t, M, schedule, virtual stages) point, or None when no split fits."""
    U = len(srch.units)
    qs = inflight(schedule, S, M, virtual)
    distinct = sorted(set(qs))
    val, pos = ct.best(np.array(distinct))
    send_f, send_b = srch.sends(d, M, d * t, t)
    extra = send_f[None, :] + send_b[:, None]                        # [i, j]
    extra[0, :] -= send_b[0]
    extra[:, U] -= send_f[U]
    valid = srch.comp_id >= 0
    cost = []
    for q in qs:
        row = val[distinct.index(q)]
        c = np.where(valid, row[np.where(valid, srch.comp_id, 0)] + extra, np.inf)
        cost.append(c)
    # interleaved: sum/v + (M v - 1) max over the S v stages (v = 1: sum + (M - 1) max, see partition)
    obj, bounds = best_split(cost, M * virtual * virtual - virtual + 1)
    if not bounds:
        return None
    stages = []
    for s in range(len(qs)):
        i, j = bounds[s], bounds[s + 1]
        u = srch.comp_id[i, j]
        k = int(pos[distinct.index(qs[s]), u])
        p, z, r = split_choice(ct.order[u, k], ct.shape)
        f = float(ct.f[u, k] + (send_f[j] if j < U else 0.0))
        b = float(ct.b[u, k] + (send_b[i] if i > 0 else 0.0))
        mem = float(ct.static[u, k] + ct.transient[u, k] + qs[s] * ct.held[u, k])
        row, sp = tables.plan(p)
        stages.append(JointStage(i, j, row, tables.storage_modes[z], srch.joint.remat[r], f, b,
                                 float(ct.tail[u, k]), mem, qs[s], d, t, sp))
    return JointPoint(tuple(stages), d, t, M, schedule, float(obj) / virtual, math.inf, virtual=virtual)


@dataclasses.dataclass(frozen=True, order=True)
class _Candidate:
    """One (micro-batch count, schedule, virtual stages) of one (S, d x t), with a lower bound on its
    formula (`lower_bound`); `key` is the enumeration order that breaks ties."""

    bound: float
    key: tuple
    S: int
    d: int
    t: int
    M: int
    schedule: str
    virtual: int


def _candidates(srch: SearchState, S: int, d: int, t: int, tables: ShapeTables) -> list[_Candidate]:
    joint, U = srch.joint, len(srch.units)
    out = []
    for M in microbatch_counts(srch.batch, joint.max_microbatches, joint.microbatches, d):
        valid = (srch.batch // M) % tables.batch_split.astype(np.int64) == 0
        if not valid.any():
            continue
        work: dict[int, float] = {}
        for si, sched in enumerate(joint.schedules if S > 1 else joint.schedules[:1]):
            for v in (joint.virtual if sched == INTERLEAVED else (1,)):
                if sched == INTERLEAVED and (M % S or U < S * v or v < 2):
                    continue
                if v not in work:      # a rank holds its v stages: each fits 1/v of the budget
                    work[v] = lower_bound_work(srch, tables, M, valid, srch.budget / v)
                if math.isinf(work[v]):
                    continue           # some unit fits no stage: no split of this point can fit
                bound = work[v] * (M * v + S - 1) / (S * v)
                out.append(_Candidate(bound, (S, t, M, si, v), S, d, t, M, sched, v))
    return out


class _Bounds:
    """The SIMULATED best formulas so far of each set the result reads (all, tensor-only, pipeline-only):
    a candidate whose lower bound exceeds them in every set it belongs to can never be simulated."""

    def __init__(self) -> None:
        self.best: dict[str, list[float]] = {"all": [], "tensor": [], "pipe": []}

    @staticmethod
    def sets(S: int, t: int) -> tuple[str, ...]:
        return ("all", "tensor") if S == 1 else (("all", "pipe") if t == 1 else ("all",))

    def prunes(self, c: _Candidate) -> bool:
        return all(len(self.best[k]) >= SIMULATED and c.bound > self.best[k][-1] for k in self.sets(c.S, c.t))

    def add(self, p: JointPoint) -> None:
        for k in self.sets(p.ranks, p.model):
            self.best[k] = sorted([*self.best[k], p.objective])[:SIMULATED]


def _equal_points(srch: SearchState, counts: list[int], max_model: int) -> tuple[list[JointPoint], int, int]:
    """Every equal-submesh point whose formula could reach the simulator: candidates in order of their
    lower bound, skipped once the bound is beaten in every set they belong to."""
    joint, options = srch.joint, srch.options
    cands = []
    for S in counts:
        for d, t in shapes(srch.N // S, max_model, joint.tensor_in_stages or S == 1, joint.shape):
            cands += _candidates(srch, S, d, t, srch.table(d, t))
    groups: dict[tuple, list[_Candidate]] = {}
    for c in sorted(cands):         # one choice table per (d, t, M, v): its candidates together
        groups.setdefault((c.d, c.t, c.M, c.virtual), []).append(c)
    bounds, floor, found, n_points = _Bounds(), _MemoryFloor(), [], 0
    for (d, t, M, v), group in groups.items():      # in order of each group's least bound
        tables = srch.tables[(d, t)]
        valid = (srch.batch // M) % tables.batch_split.astype(np.int64) == 0
        live = [c for c in group if not bounds.prunes(c) and not floor.skips(c, valid)]
        if not live:
            continue
        fits: dict[_Candidate, bool] = {}

        def any_fits(most, live=live, fits=fits):
            fits.update((c, _splittable(srch, most, c)) for c in live)
            return any(fits.values())

        # a rank holds its v stages: each stage's choice fits 1/v of the budget. Unsorted: a table
        # answers a few in-flight counts, and scanning for each is cheaper than sorting its choices
        ct = choice_table(srch.combos[(d, t)], M, srch.budget / v, joint.remat, valid, options.overlap,
                          fits=any_fits, sort=False, restricted=srch.restricted(d, t, valid))
        for c in live:
            if bounds.prunes(c):
                continue
            n_points += 1
            p = _point(srch, tables, ct, d, t, c.S, M, c.schedule, v) if fits[c] else None
            if p is not None:
                bounds.add(p)
                found.append((c.key, p))
            else:
                floor.record(c, valid)
    return [p for _, p in sorted(found, key=lambda kp: kp[0])], n_points, len(cands)


class _MemoryFloor:
    """Per (submesh, schedule, v): the largest micro-batch count found not to fit memory. Fewer, larger
    micro-batches need at least as much memory for every choice (in-flight count times micro-batch size
    never shrinks), so they do not fit either -- unless they admit plans the larger count did not (the
    batch splitting evenly over more devices)."""

    def __init__(self) -> None:
        self.seen: dict[tuple, tuple[int, np.ndarray]] = {}

    def record(self, c: _Candidate, valid: np.ndarray) -> None:
        key = (c.d, c.t, c.schedule, c.virtual)
        if key not in self.seen or c.M > self.seen[key][0]:
            self.seen[key] = (c.M, valid)

    def skips(self, c: _Candidate, valid: np.ndarray) -> bool:
        hit = self.seen.get((c.d, c.t, c.schedule, c.virtual))
        return hit is not None and c.M < hit[0] and not (valid & ~hit[1]).any()


def _splittable(srch: SearchState, most: np.ndarray, c: _Candidate) -> bool:
    """Whether some split of the unit chain gives every stage of `c` a choice that fits its in-flight
    micro-batches (`most[u]`: the most any choice of composition u allows): the memory side of
    `_point`, without sorting any choices."""
    valid = srch.comp_id >= 0
    per = np.where(valid, most[np.where(valid, srch.comp_id, 0)], -np.inf)
    cost = [np.where(per >= q, 0.0, np.inf) for q in inflight(c.schedule, c.S, c.M, c.virtual)]
    return _reachable(cost, 0.0)


def joint_search(graph: OpGraph, grouping: Grouping, devices: int, hw: HardwareSpec,
                 options: SearchOptions | None = None, joint: JointOptions | None = None,
                 cost: Callable[[MeshSpec], CostModel] | None = None) -> JointResult:
    """The best 3-D point for `graph` on `devices` devices of `hw` (see the module docstring)."""
    t0 = time.perf_counter()
    keep_heap_warm()
    options, joint = options or SearchOptions(), joint or JointOptions()
    default_cost = cost is None
    cost = cost or (lambda m: AnalyticalCostModel(m, hw))
    srch = SearchState(graph, grouping, devices, hw, options, joint, cost, default_cost)
    U = len(srch.units)
    notes: list[str] = []
    if srch.units.scanned:
        notes.append("the step's repeated layers run in one scan loop: one unit, so no pipeline stages")
    max_model = joint.max_model or hw.devices_per_node
    counts = [S for S in range(1, min(U, devices) + 1) if devices % S == 0]
    if joint.stages is not None:
        counts = [joint.stages] if joint.stages <= U and devices % joint.stages == 0 else []
    points, n_points, n_cands = _equal_points(srch, counts, max_model)
    unequal = unequal_points(srch, points)
    timer = _Timer()
    best = timer.best_of(points + unequal)
    runnable = timer.best_of(points)
    tensor = timer.best_of([p for p in points if p.num_stages == 1])
    pipe = timer.best_of([p for p in points if p.num_stages > 1 and p.model == 1])   # stages data parallel inside
    least = None if runnable is not None else _least_memory(srch, counts, max_model)
    grid = megatron_grid(srch)
    # the formula ranks pipelines only approximately; the reference points are points of this space
    # too, timed by the same simulator, so the chosen one is never slower than any of them
    runnable = min((p for p in (runnable, tensor, pipe, grid.best) if p is not None), key=lambda p: p.step_time,
                   default=None)
    if best is None or (runnable is not None and runnable.step_time <= best.step_time):
        best = runnable
    return JointResult(best, runnable, tensor, pipe, grid, srch.units, srch.tables, n_points + len(unequal),
                       time.perf_counter() - t0, least, notes, n_cands)


class _Timer:
    """The best of some points by simulated step, among the SIMULATED best by the formula; each
    point simulated once however many of these sets it is in."""

    def __init__(self) -> None:
        self._done: dict[int, JointPoint] = {}

    def best_of(self, points: Sequence[JointPoint]) -> JointPoint | None:
        ranked = sorted(points, key=lambda p: p.objective)[:SIMULATED]
        for p in ranked:
            if id(p) not in self._done:
                self._done[id(p)] = simulated(p)
        return min((self._done[id(p)] for p in ranked), key=lambda p: p.step_time, default=None)


def _least_memory(srch: SearchState, counts: list[int], max_model: int) -> JointPoint | None:
    """When nothing fits: the point needing least memory (every stage at its least-memory choice)."""
    best = None
    for S in counts:
        for d, t in shapes(srch.N // S, max_model, srch.joint.tensor_in_stages or S == 1, srch.joint.shape):
            tables = srch.table(d, t)
            counts_m = microbatch_counts(srch.batch, srch.joint.max_microbatches, srch.joint.microbatches, d)
            if not counts_m:
                continue
            M = max(counts_m)
            valid = (srch.batch // M) % tables.batch_split.astype(np.int64) == 0
            if not valid.any():
                continue
            p = _least_memory_point(srch, tables, d, t, S, M, valid)
            if p is not None and (best is None or p.memory < best.memory):
                best = p
    return best


def _least_memory_point(srch: SearchState, tables: ShapeTables, d: int, t: int, S: int, M: int,
                        valid: np.ndarray) -> JointPoint | None:
    """Uniform split, each stage at the (plan, storage, remat) of least memory."""
    U = len(srch.units)
    if U < S:
        return None
    bounds = [round(s * U / S) for s in range(S + 1)]
    qs = inflight("1f1b", S, M)
    stages = []
    for s in range(S):
        u = srch.comp_id[bounds[s], bounds[s + 1]]
        ct = choice_table({k: v[u:u + 1] for k, v in srch.combos[(d, t)].items()}, M, math.inf, srch.joint.remat,
                          valid, 0.0)
        mem = ct.static[0] + ct.transient[0] + qs[s] * ct.held[0]
        mem = np.where(np.isfinite(ct.value[0]), mem, np.inf)
        k = int(np.argmin(mem))
        p, z, r = split_choice(ct.order[0, k], ct.shape)
        row, sp = tables.plan(p)
        stages.append(JointStage(bounds[s], bounds[s + 1], row, tables.storage_modes[z], srch.joint.remat[r],
                                 float(ct.f[0, k]), float(ct.b[0, k]), float(ct.tail[0, k]), float(mem[k]), qs[s],
                                 d, t, sp))
    return JointPoint(tuple(stages), d, t, M, "1f1b", math.inf, math.inf)
