"""RaNNC stage-level partitioning (Tanaka et al., §III-C, Algorithms 1 and 2) (pure: no jax import).

`form_stage_dp` is Algorithm 1: over topologically sorted units (blocks, or atomic components in
the no-block variant of §IV-C) it chooses S contiguous stages and the devices of each (its replicas,
data parallel inside the stage; each replica's share of a micro-batch of ⌊BS/R/MB⌋ samples is at
most ⌈⌊BS/R/MB⌋/replicas⌉, see `StageProblem.mbs`), every stage fitting memory with
the micro-batches the schedule keeps in flight (1F1B: stage s of S holds min(S-s+1, MB); GPipe: MB),
minimising V = max stage forward time + max stage backward time. Departures from the published
pseudo-code, both in the direction of exactness:

* the paper keeps one (t_f, t_b) pair per state (s, b, d), which can miss the optimum of a sum of
  two maxima; here each state keeps the Pareto front of its (max t_f, max t_b) pairs, so the
  result equals brute force over all contiguous splits and replica counts (`prune=False`);
* V_{0,b,d} = 0 only for b = d = 0 (the first stage starts at the first block).

The d_min pruning (lines 30-33: once (s, b, d) has no solution, fewer devices are not tried for
the following states either) is available as published with `prune=True`. It is exact in d for
one state but a heuristic across states: it can miss the optimum and even every feasible split
(a 96-layer model on 32 devices: 32 stages at 1.9x the step time of the exact 21-stage answer), so
the default is the exact search, which is fast enough (well under a second per Algorithm 2 call
on k = 32 blocks and 32 devices).

`form_stage` is Algorithm 2: for n = 1, 2, 4, ... nodes per pipeline (D = n · devices per node
devices, R = N/n copies of the pipeline), stage counts from the previous n's range up to D, and
micro-batch counts 1, 2, 4, ... it runs Algorithm 1 and returns the solution of least predicted
step time among those it tried. When it stops is `search`:

* "stage" (the paper): at the first stage count with a solution. That count is the least memory
  allows, every stage is nearly full, and the DP cannot even out the stages: on the 144-layer,
  hidden-2048 BERT on 32 V100s it gives 6 stages at 1.15x max/mean stage time (uniform: 1.09);
* "node": after every stage count of the first node count with a solution (at most D_node more
  stage counts, each at that small D): 8 stages there, 1.09x;
* "all" (default; `exhaustive=True`): every node count, and at each every stage count 1..D. The
  small stage counts on many nodes are placements the paper's ranges skip: 4 stages of 8 devices
  on 4 nodes, each stage inside one node (intra-node gradient all-reduce), where n = 1 copies a
  one-node 4-stage pipeline 4 times and every stage's all-reduce crosses nodes. On the 192-layer
  hidden-1024 BERT on 32 V100s that is 17.16 vs 16.75 samples/s; the search takes seconds, not
  tenths (2-20 s on the §IV BERTs).

"stage" and "node" follow the paper's stage ranges per n, D_node·(n-1)+1 .. D_node·n, except that
the range starts after the previous n's (the paper's leaves a gap at n = 4: 17..24).
Predicted step time: Σ_i (f_i + b_i) + (MB - 1) · (max f + max b).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...core.errors import InfeasiblePlanError, PipelineError
from ...core.graph import OpGraph
from ..atomic import AtomicPartition, atomic_partition
from ..costs import PipelineCosts, stage_cost
from .blocks import DEFAULT_MEMORY_FRACTION, BlockPartition, partition_blocks

SCHEDULES = ("1f1b", "gpipe")
SEARCHES = ("stage", "node", "all")


@dataclasses.dataclass(frozen=True)
class Stage:
    """One pipeline stage: units [start, stop), its components and ops, devices and costs."""

    index: int
    blocks: tuple[int, int]
    components: tuple[int, ...]
    ops: tuple[int, ...]
    replicas: int                    # devices running the stage (data parallel inside it)
    microbatch_size: int             # samples per replica per micro-batch (the busiest replica)
    predicted_forward: float         # seconds per micro-batch, incl. sending outputs
    predicted_backward: float        # seconds per micro-batch, incl. amortised all-reduce/update
    memory: float                    # bytes per device


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """A pipeline partition and its predicted costs."""

    stages: tuple[Stage, ...]
    microbatches: int
    batch_size: int
    devices: int
    pipelines: int                   # R: copies of the pipeline (stage replicas include them)
    schedule: str
    objective: float                 # max forward + max backward (Algorithm 1's V)
    step_time: float
    search_seconds: float
    method: str
    memory_budget: float
    dp_calls: int = 0

    @property
    def predicted_forward(self) -> tuple[float, ...]:
        return tuple(s.predicted_forward for s in self.stages)

    @property
    def predicted_backward(self) -> tuple[float, ...]:
        return tuple(s.predicted_backward for s in self.stages)

    @property
    def memory(self) -> tuple[float, ...]:
        return tuple(s.memory for s in self.stages)


@dataclasses.dataclass(frozen=True)
class _Tables:
    tf: np.ndarray      # [b', b, r] forward seconds (inf: invalid)
    tb: np.ndarray
    m0: np.ndarray      # memory = m0 + m1 * in-flight micro-batches
    m1: np.ndarray
    mbs: np.ndarray     # [r] micro-batch size per replica


class StageProblem:
    """Stage costs over contiguous ranges of topologically sorted units (lists of components)."""

    def __init__(self, costs: PipelineCosts, units: Sequence[Sequence[int]], *, batch_size: int | None = None,
                 schedule: str = "1f1b", recompute: bool = False, memory_budget: float | None = None) -> None:
        if schedule not in SCHEDULES:
            raise PipelineError(f"pipeline: schedule={schedule!r} is not one of {SCHEDULES}.")
        self.costs = costs
        self.units = [tuple(u) for u in units]
        self.n = len(self.units)
        self.rt = costs.range_tables(self.units)
        self.batch_size = int(batch_size or costs.batch)
        self.schedule, self.recompute = schedule, recompute
        self.budget = float(memory_budget if memory_budget is not None
                            else DEFAULT_MEMORY_FRACTION * costs.hardware.memory_bytes)
        self._cache: dict[tuple[int, int, int], _Tables] = {}

    def inflight(self, s: int, S: int, MB: int) -> int:
        """Micro-batches stage s (1-based) of S keeps activations for."""
        return MB if self.schedule == "gpipe" else min(S - s + 1, MB)

    def _comm(self, D: int, R: int) -> tuple[np.ndarray, np.ndarray]:
        dpn = self.costs.hardware.devices_per_node
        ar = [self.costs.allreduce(r * R, R > 1 or r > dpn) if r else (0.0, 0.0) for r in range(D + 1)]
        return np.array([a for a, _ in ar]), np.array([b for _, b in ar])

    def mbs(self, R: int, MB: int, r: int) -> int:
        """Samples the busiest of r replicas computes per micro-batch (0: some replica gets none).

        The paper profiles at ⌊BS/MB/R/r⌋, but a micro-batch of q samples over r replicas not
        dividing q leaves some replicas ⌈q/r⌉ samples, and they bound the stage: with the floor,
        5 replicas of an 8-sample micro-batch were costed at 1 sample each (5 of 8 samples),
        overstating throughput and favouring odd replica counts. Likewise q itself is the busiest
        micro-batch, ⌈BS/(R·MB)⌉, when R·MB does not divide the batch (the floor dropped samples)."""
        q = -(-self.batch_size // (R * MB))
        return -(-q // r) if q >= r else 0

    def tables(self, D: int, R: int, MB: int) -> _Tables:
        key = (D, R, MB)
        if key not in self._cache:
            rt = self.rt
            rs = np.arange(D + 1)
            mbs = np.array([self.mbs(R, MB, r) if r else 0 for r in rs])
            frac = (mbs / self.costs.batch)[None, None, :]
            t = {c: v[:, :, None] for c, v in rt.table.items()}
            alpha, beta = self._comm(D, R)
            kw = dict(fraction=frac, microbatches=MB, p2p=self.costs.p2p(),
                      allreduce=(alpha[None, None, :], beta[None, None, :]), recompute=self.recompute)
            cin, cout = rt.cut[:, None, None], rt.cut[None, :, None]
            f, b, m0 = stage_cost(t, cin, cout, inflight=0, **kw)
            _, _, m1 = stage_cost(t, cin, cout, inflight=1, **kw)
            idx = np.arange(self.n + 1)
            bad = (idx[:, None, None] >= idx[None, :, None]) | (mbs < 1)[None, None, :]
            f, b = np.where(bad, np.inf, f), np.where(bad, np.inf, b)
            self._cache[key] = _Tables(f, b, np.where(bad, np.inf, m0), np.where(bad, 0.0, m1 - m0), mbs)
        return self._cache[key]

    def stage(self, lo: int, hi: int, r: int, *, D: int, R: int, MB: int, s: int, S: int,
              direct: bool = False) -> tuple[float, float, float]:
        """(forward, backward, memory) of units [lo, hi) as stage s of S on r devices. `direct`
        recomputes the unions from the components (a check on the range tables)."""
        if not direct:
            T = self.tables(D, R, MB)
            return (float(T.tf[lo, hi, r]), float(T.tb[lo, hi, r]),
                    float(T.m0[lo, hi, r] + T.m1[lo, hi, r] * self.inflight(s, S, MB)))
        mbs = self.mbs(R, MB, r)
        if mbs < 1:
            return math.inf, math.inf, math.inf
        comps = [c for u in self.units[lo:hi] for c in u]
        before = [c for u in self.units[:lo] for c in u]
        upto = before + comps
        alpha, beta = self._comm(D, R)
        f, b, m = stage_cost(self.costs.totals(comps), self.costs.boundary_bytes(before) if lo else 0.0,
                             self.costs.boundary_bytes(upto) if hi < self.n else 0.0,
                             fraction=mbs / self.costs.batch, inflight=self.inflight(s, S, MB), microbatches=MB,
                             p2p=self.costs.p2p(), allreduce=(alpha[r], beta[r]), recompute=self.recompute)
        return float(f), float(b), float(m)

    def plan(self, splits: Sequence[tuple[int, int, int]], *, D: int, R: int, MB: int, method: str,
             seconds: float = 0.0, dp_calls: int = 0, with_ops: bool = True) -> StagePlan:
        """A StagePlan for stages given as (start unit, stop unit, devices in the pipeline);
        `with_ops=False` leaves `Stage.ops` empty (cheap, for comparing candidates)."""
        S = len(splits)
        stages = []
        for s, (lo, hi, r) in enumerate(splits, start=1):
            f, b, m = self.stage(lo, hi, r, D=D, R=R, MB=MB, s=s, S=S)
            comps = tuple(sorted(c for u in self.units[lo:hi] for c in u))
            ops = tuple(sorted({o for c in comps for o in self.costs.atomic.ops(c)})) if with_ops else ()
            stages.append(Stage(s - 1, (lo, hi), comps, ops, r * R, self.mbs(R, MB, r), f, b, m))
        fs, bs = [s.predicted_forward for s in stages], [s.predicted_backward for s in stages]
        step = sum(fs) + sum(bs) + (MB - 1) * (max(fs) + max(bs))
        return StagePlan(tuple(stages), MB, self.batch_size, D * R, R, self.schedule, max(fs) + max(bs),
                         step, seconds, method, self.budget, dp_calls)


def form_stage_dp(problem: StageProblem, S: int, D: int, R: int, MB: int, *,
                  prune: bool = False) -> list[tuple[int, int, int]] | None:
    """Algorithm 1: S stages over all units on exactly D devices (each stage's replicas ×R).
    Returns [(start, stop, devices)] per stage minimising max forward + max backward, or None."""
    n = problem.n
    if S < 1 or S > n or S > D:
        return None
    T = problem.tables(D, R, MB)
    budget = problem.budget
    pb, pd = np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64)
    pf, pw = np.zeros(1), np.zeros(1)
    history: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    dmin = 1
    for s in range(1, S + 1):
        bs = np.arange(s, n - (S - s) + 1)
        ds = np.arange(s, D - (S - s) + 1)
        feas_tab = (T.m0 + T.m1 * problem.inflight(s, S, MB)) <= budget
        nb, nd = len(bs), len(ds)
        out_b, out_d, out_f, out_w, out_p = [], [], [], [], []
        state_ok = np.zeros((nb, nd), dtype=bool)
        chunk = max(1, 2_000_000 // max(1, len(pb) * nd))
        for c0 in range(0, nb, chunk):
            bsc = bs[c0:c0 + chunk]
            B_, D_ = bsc[None, :, None], ds[None, None, :]
            P_b, P_d = pb[:, None, None], pd[:, None, None]
            r = D_ - P_d
            ok = (B_ > P_b) & (r >= 1)
            rc = np.clip(r, 0, D)
            ok &= feas_tab[P_b, B_, rc]
            cf = np.where(ok, np.maximum(pf[:, None, None], T.tf[P_b, B_, rc]), np.inf)
            cw = np.where(ok, np.maximum(pw[:, None, None], T.tb[P_b, B_, rc]), np.inf)
            order = np.lexsort((cw, cf), axis=0)
            sf = np.take_along_axis(cf, order, 0)
            sw = np.take_along_axis(cw, order, 0)
            prior = np.concatenate([np.full((1,) + sw.shape[1:], np.inf),
                                    np.minimum.accumulate(sw, axis=0)[:-1]], axis=0)
            keep = np.isfinite(sf) & (sw < prior)
            k_i, b_i, d_i = np.nonzero(keep)
            state_ok[c0 + b_i, d_i] = True
            out_b.append(bsc[b_i])
            out_d.append(ds[d_i])
            out_f.append(sf[k_i, b_i, d_i])
            out_w.append(sw[k_i, b_i, d_i])
            out_p.append(order[k_i, b_i, d_i])
        nb_, nd_ = np.concatenate(out_b), np.concatenate(out_d)
        nf, nw, npar = np.concatenate(out_f), np.concatenate(out_w), np.concatenate(out_p)
        if prune:
            drop = np.zeros((nb, nd), dtype=bool)
            for bi in range(nb):
                lo = max(dmin, s)
                drop[bi, ds < lo] = True
                for di in range(nd - 1, -1, -1):
                    if ds[di] < lo:
                        break
                    if not state_ok[bi, di]:
                        dmin = int(ds[di]) + 1
                        drop[bi, : di + 1] = True
                        break
            sel = ~drop[nb_ - bs[0], nd_ - ds[0]]
            nb_, nd_, nf, nw, npar = nb_[sel], nd_[sel], nf[sel], nw[sel], npar[sel]
        if not len(nb_):
            return None
        history.append((pb, pd, npar))
        pb, pd, pf, pw = nb_, nd_, nf, nw
    final = np.nonzero((pb == n) & (pd == D))[0]
    if not len(final):
        return None
    i = int(final[np.lexsort((pf[final], pf[final] + pw[final]))[0]])
    splits = []
    b, d = int(pb[i]), int(pd[i])
    for prev_b, prev_d, parents in reversed(history):
        j = int(parents[i])
        splits.append((int(prev_b[j]), b, d - int(prev_d[j])))
        i, b, d = j, int(prev_b[j]), int(prev_d[j])
    return splits[::-1]


def _node_counts(N: int) -> list[int]:
    out, n = [], 1
    while n <= N:
        if N % n == 0:
            out.append(n)
        n *= 2
    if out[-1] != N:
        out.append(N)
    return out


def form_stage(problem: StageProblem, nodes: int, devices_per_node: int, *, prune: bool = False,
               exhaustive: bool = False, method: str = "rannc",
               stage_counts: Sequence[int] | None = None, search: str = "all",
               microbatch_counts: Sequence[int] | None = None) -> StagePlan:
    """Algorithm 2: search node counts, stage counts and micro-batch counts (powers of two).
    `stage_counts` restricts the stage counts tried (e.g. to the size of a mesh's "pipe" axis);
    `microbatch_counts` replaces the powers of two (e.g. the user's num_microbatches);
    `search` ("stage", "node", "all") is when to stop (module doc); `exhaustive=True` means "all"."""
    if search not in SEARCHES:
        raise PipelineError(f"pipeline.form_stage: search={search!r} is not one of {SEARCHES} (stop after the "
                            "first stage count, the first node count, or never, with a solution).")
    if exhaustive and search != "all":
        raise PipelineError(f"pipeline.form_stage: exhaustive=True contradicts search={search!r}; exhaustive=True "
                            "is search='all' (the default).")
    t0 = time.perf_counter()
    found: list[tuple[StagePlan, list[tuple[int, int, int]]]] = []
    tried: dict[int, tuple[int, int]] = {}          # stage count -> (D, R) it was tried with
    calls, prev = 0, 0
    BS = problem.batch_size
    for n_ in _node_counts(nodes):
        D, R = devices_per_node * n_, nodes // n_
        for S in range(1 if search == "all" else devices_per_node * prev + 1, D + 1):
            if S > problem.n:
                break
            if stage_counts is not None and S not in stage_counts:
                continue
            tried[S] = (D, R)
            sols = []
            counts = [1 << i for i in range((BS // R).bit_length())] if microbatch_counts is None else \
                [m for m in microbatch_counts if m <= BS // R]
            for MB in counts:
                calls += 1
                splits = form_stage_dp(problem, S, D, R, MB, prune=prune)
                if splits is not None:
                    sols.append((problem.plan(splits, D=D, R=R, MB=MB, method=method, with_ops=False), splits))
            found += sols
            if sols and search == "stage":
                break
        if found and search != "all":
            break
        prev = n_
    seconds = time.perf_counter() - t0
    if not found:
        raise _infeasible(problem, nodes, devices_per_node, tried, stage_counts)
    best, splits = min(found, key=lambda ps: (ps[0].step_time, len(ps[0].stages), ps[0].microbatches))
    return problem.plan(splits, D=best.devices // best.pipelines, R=best.pipelines, MB=best.microbatches,
                        method=method, seconds=seconds, dp_calls=calls)


def min_peak_memory(problem: StageProblem, S: int, D: int, R: int, MB: int) -> float:
    """The least max-stage memory of any S-stage split on D devices (a min-max DP)."""
    n = problem.n
    T = problem.tables(D, R, MB)
    best = np.full((n + 1, D + 1), np.inf)
    best[0, 0] = 0.0
    for s in range(1, S + 1):
        mem = T.m0 + T.m1 * problem.inflight(s, S, MB)
        mem = np.where(np.isfinite(T.tf), mem, np.inf)                       # [b', b, r]
        r = np.arange(D + 1)[None, :] - np.arange(D + 1)[:, None]              # [d', d]
        rc = np.clip(r, 0, D)
        cand = np.maximum(best[:, None, :, None], mem[:, :, rc])               # [b', b, d', d]
        cand = np.where((r >= 1)[None, None], cand, np.inf)
        best = cand.min(axis=(0, 2))
    return float(best[n, D])


def _fmt(nbytes: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= size:
            return f"{nbytes / size:.3g} {unit}"
    return f"{nbytes:.3g} B"


def _infeasible(problem: StageProblem, nodes: int, dpn: int, tried: dict[int, tuple[int, int]],
                stage_counts: Sequence[int] | None = None) -> InfeasiblePlanError:
    # memory falls with more micro-batches (smaller ones; GPipe keeps the product constant), so
    # take the most, and a few stage counts down from the most tried, each on its (D, R)
    found, S_found, MB_found = math.inf, 0, 0
    S_max = max(tried, default=0)
    for S in sorted({S_max, S_max // 2, S_max // 4} & set(tried), reverse=True):
        D, R = tried[S]
        if problem.n > 64 or D > 64 or problem.batch_size // R < 1:
            continue
        MB = 1 << int(math.log2(problem.batch_size // R))
        while MB >= 1:   # the most micro-batches that still give every replica a sample
            mem = min_peak_memory(problem, S, D, R, MB)
            if math.isfinite(mem):
                break
            MB //= 2
        if mem < found:
            found, S_found, MB_found = mem, S, MB
    D = nodes * dpn
    floor = float(problem.costs.component_memory().max()) if len(problem.costs.atomic) else 0.0
    if not tried:
        peak = (f"No stage count was tried: the allowed ones ({sorted(set(stage_counts or ()))}) exceed the "
                f"{problem.n} units or the devices")
    elif math.isinf(found):   # too big for the min-max DP: report the floor, a lower bound
        found = floor
        peak = f"The per-device peak is at least {_fmt(floor)} (the largest atomic component)"
    else:
        peak = (f"The smallest per-device peak found is {_fmt(found)} ({S_found} stages, {MB_found} "
                f"micro-batches); one atomic component alone needs {_fmt(floor)}")
    return InfeasiblePlanError(
        f"pipeline: no stage split of {problem.n} units over {D} devices ({nodes} node(s) x {dpn}) fits the "
        f"memory budget of {_fmt(problem.budget)} per device with batch {problem.batch_size} and the "
        f"{problem.schedule} schedule. {peak}. Fixes: more devices or nodes, a smaller batch, recompute=True, "
        "more blocks (k), or hardware with more memory.",
        min_memory=found if not math.isinf(found) else floor, budget=problem.budget)


def plan_stages(graph: OpGraph, devices: int, hardware: Any, *, k: int = 32,
                batch_size: int | None = None, schedule: str = "1f1b", recompute: bool = False,
                memory_budget: float | None = None, use_blocks: bool = True, prune: bool = False,
                exhaustive: bool = False, cost_model: Any = None, atomic: AtomicPartition | None = None,
                blocks: BlockPartition | None = None, costs: PipelineCosts | None = None,
                stage_counts: Sequence[int] | None = None, op_time: Sequence[float] | None = None,
                search: str = "all", microbatch_counts: Sequence[int] | None = None) -> StagePlan:
    """RaNNC end to end: atomic components, k blocks (unless `use_blocks=False`: the §IV-C variant
    over atomic components), then Algorithm 2 over `devices` devices of `hardware`. Precomputed
    `atomic`, `blocks` or `costs` (which fix the hardware and cost model) are reused. `op_time`
    (seconds per op execution, e.g. measured) replaces the cost model's compute estimates;
    `stage_counts` restricts the stage counts Algorithm 2 tries; `search` is when it stops
    ("stage": the paper's first stage count with a solution; "node"; "all", see form_stage);
    `microbatch_counts` restricts the micro-batch counts tried (default: every power of two)."""
    t0 = time.perf_counter()
    atomic = atomic or (costs.atomic if costs is not None else blocks.atomic if blocks is not None
                        else atomic_partition(graph))
    costs = costs or PipelineCosts(atomic, hardware, cost_model=cost_model, op_time=op_time)
    dpn = costs.hardware.devices_per_node
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise PipelineError(f"pipeline.plan_stages: devices={devices!r} must be an int >= 1.")
    if devices <= dpn:
        nodes, per_node = 1, devices
    elif devices % dpn == 0:
        nodes, per_node = devices // dpn, dpn
    else:
        raise PipelineError(f"pipeline.plan_stages: devices={devices} is neither <= nor a multiple of the "
                         f"{dpn} devices per node of {costs.hardware.name!r}.")
    if use_blocks:
        blocks = blocks or partition_blocks(atomic, k, costs=costs, memory_budget=memory_budget)
        units: list[tuple[int, ...]] = list(blocks.blocks)
    else:
        units = [(c,) for c in range(len(atomic))]
    problem = StageProblem(costs, units, batch_size=batch_size, schedule=schedule, recompute=recompute,
                           memory_budget=memory_budget)
    plan = form_stage(problem, nodes, per_node, prune=prune, exhaustive=exhaustive,
                      method="rannc" if use_blocks else "rannc-no-blocks", stage_counts=stage_counts,
                      search=search, microbatch_counts=microbatch_counts)
    return dataclasses.replace(plan, search_seconds=time.perf_counter() - t0)
