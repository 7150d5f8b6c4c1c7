"""What every point of the 3-D space shares: units, compositions, submesh tables, options and
the point/stage types (pure: no jax import). See `search` for the space itself."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from ..core.cost import CostModel, alpha_beta
from ..core.graph import OpGraph
from ..core.grouping import Grouping
from ..core.hardware import HardwareSpec
from ..core.mesh import MeshSpec, mesh_spec
from ..pipeline.costs import traced_batch
from ..tensor.search import SearchOptions, analysis, plan_space, sequence_parallel_analysis
from .chain_sim import chain_makespan, interleaved_inflight
from .stage_choice import REMAT, cheapest_fitting, compositions, restrict
from .tables import ShapeTables, shape_tables
from .units import build_units, kinds_per_range

INTERLEAVED = "interleaved-1f1b"
SCHEDULES = ("1f1b", "gpipe", INTERLEAVED)
VIRTUAL = (2, 3, 4)      # virtual stages per rank the interleaved schedule tries (Megatron's runs use 2-3)
SIMULATED = 8            # formula-ranked points the event simulator times


@dataclasses.dataclass(frozen=True)
class JointOptions:
    """What the 3-D search may choose. `stages`: a fixed stage count (a "pipe" mesh axis);
    `max_model`: largest tensor-parallel size (None: the hardware's devices per node);
    `tensor_in_stages=False` keeps pipeline stages data parallel inside; `remat` the policies it
    may choose (("none",) when the step cannot be rematerialised); `shape` a fixed (data, model)
    submesh and `microbatches` a fixed micro-batch count (a mesh with a "pipe" axis fixes all three);
    `virtual`: the virtual stage counts per rank the interleaved schedule may take (Megatron's
    interleaved 1F1B: rank r runs chunks r, r + S, ...);
    `equal_submeshes=True` keeps to points whose stages share one submesh shape (the runnable ones)."""

    schedules: tuple[str, ...] = SCHEDULES
    remat: tuple[str, ...] = REMAT
    stages: int | None = None
    max_model: int | None = None
    tensor_in_stages: bool = True
    max_microbatches: int = 512
    shape: tuple[int, int] | None = None
    microbatches: int | None = None
    equal_submeshes: bool = False
    virtual: tuple[int, ...] = VIRTUAL


@dataclasses.dataclass(frozen=True)
class JointStage:
    """One stage of a 3-D point: units [start, stop), its submesh (data x model), its tensor plan
    (row of axis masks over that shape's candidate factors), storage and remat, and its costs per
    micro-batch (transfers to and from its neighbours included)."""

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
    data: int
    model: int
    sequence_parallel: bool = False   # `row` is a plan of the submesh's sequence-parallel space

    @property
    def devices(self) -> int:
        return self.data * self.model


@dataclasses.dataclass(frozen=True)
class JointPoint:
    """A point of the 3-D space with its best split and predicted step. `data` x `model` is the
    submesh every stage shares; None for points whose stages have unequal submeshes (Alpa's
    inter-op space: planned and priced, not `runnable` by the pipeline runtime yet)."""

    stages: tuple[JointStage, ...]
    data: int | None
    model: int | None
    microbatches: int
    schedule: str
    objective: float             # the formula the split minimises
    step_time: float             # event-simulated step + the slowest stage's tail (inf: not simulated)
    label: str = ""
    virtual: int = 1             # stages per rank (interleaved 1F1B: stage k on rank k % ranks)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def ranks(self) -> int:
        """Device groups along the pipeline (stages / virtual stages per rank)."""
        return len(self.stages) // self.virtual

    @property
    def devices(self) -> int:
        return sum(s.devices for s in self.stages[:self.ranks])

    @property
    def runnable(self) -> bool:
        """Every stage on the same submesh shape: one pipe x data x model mesh, which the runtime runs."""
        return len({(s.data, s.model) for s in self.stages}) == 1

    @property
    def memory(self) -> float:
        """Peak bytes on the fullest device: a rank holds all of its virtual stages."""
        R = self.ranks
        return max(sum(s.memory for s in self.stages[r::R]) for r in range(R))

    def describe(self) -> str:
        rm = sorted({s.remat for s in self.stages})
        shape = (f"x data {self.data} x model {self.model}" if self.runnable else
                 f"on unequal submeshes {submesh_runs([(s.data, s.model) for s in self.stages])}")
        sched = self.schedule + (f" (v {self.virtual}: {self.ranks} ranks)" if self.virtual > 1 else "")
        return (f"{self.num_stages} stage(s) {shape}, {self.microbatches} micro-batch(es), {sched}, "
                f"remat {'/'.join(rm)}")


def submesh_runs(shapes: list[tuple[int, int]]) -> str:
    """Stage submeshes in order, runs of one shape folded: "[2x1 x2, 2x2]" (data x model)."""
    runs: list[list] = []
    for shape in shapes:
        if runs and runs[-1][0] == shape:
            runs[-1][1] += 1
        else:
            runs.append([shape, 1])
    return "[" + ", ".join(f"{d}x{t}" + (f" x{n}" if n > 1 else "") for (d, t), n in runs) + "] (data x model)"


def submesh(data: int, model: int) -> MeshSpec:
    axes = [(n, s) for n, s in (("data", data), ("model", model)) if s > 1] or [("data", 1)]
    return mesh_spec(dict(axes))


def shapes(per_stage: int, max_model: int, tensor: bool, fixed: tuple[int, int] | None = None) -> list[tuple[int, int]]:
    if fixed is not None:
        return [fixed] if fixed[0] * fixed[1] == per_stage else []
    ts = [t for t in range(1, min(per_stage, max_model) + 1) if per_stage % t == 0] if tensor else [1]
    return [(per_stage // t, t) for t in ts]


def microbatch_counts(batch: int, cap: int, fixed: int | None = None, replicas: int = 1) -> list[int]:
    """Every count M <= cap that cuts the batch into equal micro-batches splitting evenly over
    `replicas` data-parallel copies (one stage with several micro-batches accumulates gradients)."""
    if fixed is not None:
        return [fixed] if batch % fixed == 0 and (batch // fixed) % replicas == 0 else []
    return [m for m in range(1, min(batch, cap) + 1) if batch % m == 0 and (batch // m) % replicas == 0]


class SearchState:
    """State shared by every point: units, compositions, tables per submesh shape."""

    def __init__(self, graph: OpGraph, grouping: Grouping, devices: int, hw: HardwareSpec,
                 options: SearchOptions, joint: JointOptions, cost: Callable[[MeshSpec], CostModel],
                 default_cost: bool = False) -> None:
        self.graph, self.grouping, self.N, self.hw = graph, grouping, devices, hw
        self.options, self.joint, self.cost = options, joint, cost
        self.budget = options.memory_budget if options.memory_budget is not None else 0.9 * hw.memory_bytes
        self.analysed = analysis(graph, grouping)
        self.units = build_units(graph, grouping, self.analysed)
        self.batch = traced_batch(graph)
        U = len(self.units)
        counts = kinds_per_range(self.units)                        # [U+1, U+1, K]
        i, j = np.triu_indices(U + 1, k=1)
        self.comps, inverse = np.unique(counts[i, j], axis=0, return_inverse=True)
        self.comp_id = np.full((U + 1, U + 1), -1, dtype=np.int64)
        self.comp_id[i, j] = inverse.reshape(-1)
        self.kind_counts = counts[0, U].astype(np.float64)           # units of each kind in the chain
        # bytes entering a unit of each kind (what remat keeps per unit)
        K = len(self.units.kinds)
        self.kind_inputs = np.zeros(K)
        for u, k in enumerate(self.units.kind_of):
            self.kind_inputs[k] = max(self.kind_inputs[k], self.units.cut_dep[u])
        self._restricted: dict[tuple, dict[str, np.ndarray]] = {}
        self._sp_analysed: list = []          # [the sequence-parallel analysis or None], computed once
        self.cost_key = (repr(hw), repr(dataclasses.replace(options, memory_budget=None)), self.units.labels,
                         tuple(self.units.kind_of)) if default_cost else None
        self.tables: dict[tuple[int, int], ShapeTables] = {}
        self.combos: dict[tuple[int, int], dict[str, np.ndarray]] = {}
        self.kind_combos: dict[int, dict[str, np.ndarray]] = {}      # id(tables) -> one unit of each kind

    def table(self, d: int, t: int) -> ShapeTables:
        if (d, t) in self.tables:
            return self.tables[(d, t)]
        # tables do not depend on the memory budget or device count: searches of the same traced step
        # on the same hardware share them (the default cost model only: a custom one may differ)
        key = None if self.cost_key is None else ("joint-tables", self.cost_key, d, t)
        hit = self.graph.cache.get(key) if key is not None else None
        if hit is not None:
            self.tables[(d, t)], self.combos[(d, t)] = hit
        else:
            mesh = submesh(d, t)
            space = plan_space(self.graph, self.grouping, mesh, self.options, self.analysed)
            sp = self.sp_analysed() if t > 1 else None
            sp_space = plan_space(self.graph, self.grouping, mesh, self.options, sp) if sp is not None else None
            self.tables[(d, t)] = shape_tables(space, self.units, self.hw, self.cost(mesh), self.options, sp_space)
            self.combos[(d, t)] = compositions(self.tables[(d, t)], self.comps, self.kind_inputs)
            if key is not None:
                self.graph.cache[key] = (self.tables[(d, t)], self.combos[(d, t)])
        tables = self.tables[(d, t)]
        if id(tables) not in self.kind_combos:
            K = len(self.units.kinds)
            self.kind_combos[id(tables)] = compositions(tables, np.eye(K), self.kind_inputs)
        return tables

    def restricted(self, d: int, t: int, valid: np.ndarray) -> dict[str, np.ndarray] | None:
        """The compositions of submesh d x t over the plans `valid` marks (`stage_choice.restrict`), once
        per mask; None when every plan is valid (the compositions themselves)."""
        if valid.all():
            return None
        key = (d, t, valid.tobytes())
        hit = self._restricted.get(key)
        if hit is None:
            hit = self._restricted[key] = restrict(self.combos[(d, t)], np.flatnonzero(valid))
        return hit

    def sp_analysed(self):
        """The step's sequence-parallel analysis (None: off, or no regions to cut the stream from)."""
        if not self._sp_analysed:
            off = self.options.sequence_parallel == "off"
            self._sp_analysed.append(None if off else
                                     sequence_parallel_analysis(self.graph, self.grouping, self.analysed))
        return self._sp_analysed[0]

    def p2p(self, per_stage: int) -> tuple[float, float]:
        hw = self.hw
        inter = per_stage >= hw.devices_per_node and self.N > hw.devices_per_node
        bw, lat = ((hw.inter_node_bandwidth, hw.inter_node_latency) if inter
                   else (hw.intra_node_bandwidth, hw.intra_node_latency))
        return alpha_beta("collective-permute", 2, bw, lat, hw.collective_efficiency["collective-permute"])

    def gather(self, model: int) -> tuple[float, float]:
        """(latency s, s per full-buffer byte) of an all-gather over `model` devices inside a node."""
        hw = self.hw
        return alpha_beta("all-gather", model, hw.intra_node_bandwidth, hw.intra_node_latency,
                          hw.collective_efficiency["all-gather"])

    def sends(self, d: int, M: int, per_stage: int, model: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """(seconds a stage ending before unit j sends forward, a stage starting at unit i sends back).
        With a model axis of `model` devices each sends 1/model of the boundary activation over its own
        link and the receivers all-gather it inside their node (Megatron-LM's scatter/gather, Narayanan
        et al. SC'21 §4.1; a sequence-parallel stream is split that way already) when that is faster
        than sending it whole."""
        alpha, beta = self.p2p(per_stage)
        per = self.units.cut_dep / (M * d)
        gather = np.zeros_like(per)
        if model > 1:
            a_g, b_g = self.gather(model)
            gather = np.where(per > 0, a_g + b_g * per, 0.0)
        t = lambda b: np.where(b > 0, alpha + beta * b, 0.0)  # noqa: E731
        const = self.units.cut_const
        # the scatter/gather pays an all-gather's latency: small activations go whole
        return (np.minimum(t(per + const), t(per / model + const) + gather),
                np.minimum(t(per), t(per / model) + gather))


def lower_bound_work(srch: SearchState, tables: ShapeTables, M: int, valid: np.ndarray,
                     budget: float = math.inf) -> float:
    """A lower bound on the stages' summed time per micro-batch at M micro-batches: every unit at its
    kind's cheapest choice (plan, storage, remat) that fits `budget` alone with one micro-batch in
    flight -- a stage's choice holds for all its units and its memory is at least any one unit's --
    without sends or exposed gradient sync (inf when some kind fits nowhere). The formula
    Σ v_s / v + (M v - 1) max v_s is at least (M v + S - 1) / (S v) times that sum."""
    if math.isinf(budget):
        v = tables.values
        per_mb = (v["fwd"] + v["bwd"] + v["step"]) / M + v["gather"] + v["const"]       # [K, Z, P]
        per_kind = np.where(valid[None, None, :], per_mb, np.inf).min(axis=(1, 2))
    else:
        kinds = {**srch.kind_combos[id(tables)], "sync": np.zeros_like(srch.kind_combos[id(tables)]["sync"])}
        per_kind = cheapest_fitting(kinds, M, budget, srch.joint.remat, valid, 1.0)
    return float(srch.kind_counts @ per_kind) if np.isfinite(per_kind).all() else math.inf


def inflight(schedule: str, S: int, M: int, virtual: int = 1) -> list[int]:
    """Micro-batches each stage keeps in flight at its peak. Interleaved (S ranks x `virtual` stages):
    a rank's peak count of (stage, micro-batch) activations spread over its stages, rounded up."""
    if schedule == INTERLEAVED and virtual > 1:
        peaks = interleaved_inflight(S, virtual, M)
        return [-(-peaks[k % S] // virtual) for k in range(S * virtual)]
    return [min(S - s, M) for s in range(S)] if schedule == "1f1b" else [M] * S


def simulated(p: JointPoint) -> JointPoint:
    """`p` with its step timed by the event simulator (plus the slowest stage's per-step tail; a
    rank's tail is its stages' together)."""
    if p.num_stages == 1:
        st = p.stages[0]
        step = p.microbatches * (st.forward + st.backward) + st.tail
    else:
        R = p.ranks
        tail = max(sum(s.tail for s in p.stages[r::R]) for r in range(R))
        step = chain_makespan(p.schedule, [s.forward for s in p.stages], [s.backward for s in p.stages],
                              p.microbatches, virtual=p.virtual) + tail
    return dataclasses.replace(p, step_time=float(step))


