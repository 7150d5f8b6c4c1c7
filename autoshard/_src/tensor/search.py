"""Tensor-sharding search (pure: no jax import).

A plan assigns mesh axes to factors (logical dims, see factors.py) plus a storage mode for
parameters and optimizer state (replicated where the factors leave them whole, ZeRO-1: optimizer
state split over the remaining axes, ZeRO-3/FSDP: parameters too). Data parallel (batch on every
axis), FSDP, Megatron column/row (heads+ffn+vocab on a model axis), 2-D data×model and TAP's partial
plans (heads only, ffn only) are all points of this space.

Following TAP, only the unique blocks are analysed: the remainder plus, per block type, its first
and last instances (which differ from the others: no input gradient into the first layer) and one
middle instance per period that stands for all the others. The space is small (a few factors, a few axes),
so it is enumerated exactly, vectorised with numpy: every op is summarised by the factors that
split it and those it reduces over, ops with the same summary are summed into groups, and a plan's
cost is a table lookup per group. Same inputs, same plan: enumeration order is canonical and ties
go to the plan that shards less.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Sequence

import numpy as np

from ..core.cost import AnalyticalCostModel, CostModel
from ..core.graph import OpGraph
from ..core.grouping import Grouping
from ..core.hardware import HardwareSpec
from ..core.liveness import live_weights
from ..core.mesh import MeshSpec
from .axis_hints import break_tie, choice_hint, hint_note, ties
from .candidates import _candidate_factors, _enumerate_plans
from .evaluator import (
    STORAGE_MODES,
    PlanChoice,
    SearchOptions,
    SearchResult,
    _Evaluator,
    _Shared,
)
from .experts import batch_factors, region_twins, tensor_parallel_factors
from .factors import FactorGraph, corresponding_ops
from .instances import input_maps, instance_roles
from .regions import analyze

__all__ = ["STORAGE_MODES", "Analysis", "PlanChoice", "PlanSpace", "SearchOptions", "SearchResult", "analysis",
           "plan_space", "search"]

def _period(graph: OpGraph, bt, remainder: Sequence[int]) -> int:
    """1 when consecutive instances can share every factor (a residual stream: the block's input
    and output are the same logical dims); 2 when sharing would put one factor on two dims of a
    weight (a chain of square layers, whose Megatron plan alternates column and row splits)."""
    if bt.count < 2:
        return 1
    a, b = bt.instances[0].ops, bt.instances[1].ops
    fg = analyze(graph, [*remainder, *a, *b], corresponding_ops(graph, a, b))
    for i in a:
        for v in graph.ops[i].inputs:
            if graph.values[v].role == "parameter":
                fs = [f for f in fg.value_factors(v) if f is not None]
                if len(set(fs)) < len(fs):
                    return 2
    return 1


_TO_UPDATE = frozenset({"add_any", "transpose", "reshape", "convert_element_type", "copy", "squeeze",
                        "expand_dims", "scatter-add", "scatter_add"})


def _grad_ops(graph: OpGraph, ops: Sequence[int]) -> frozenset[int]:
    """Backward ops whose result is a parameter gradient: it reaches an optimizer op directly or
    through accumulation/layout ops only (add_any of tied weights, transposes, reshapes, the
    embedding scatter). Their all-reduce is the overlappable gradient sync; every other backward
    all-reduce (Megatron's activation gradients) stalls the backward pass."""
    # only the analysed ops (the remainder and representative instances: independent of depth);
    # a gradient's path to its update stays within its own instance or the remainder
    feeds_update: dict[int, bool] = {}
    for i in sorted(ops, reverse=True):
        op = graph.ops[i]
        if op.phase != "backward":
            continue
        feeds_update[i] = any(
            graph.ops[c].phase == "optimizer"
            or (graph.ops[c].primitive in _TO_UPDATE and feeds_update.get(c, False))
            for v in op.outputs for c in graph.values[v].consumers)
    return frozenset(i for i, f in feeds_update.items() if f)


def search(graph: OpGraph, grouping: Grouping, mesh: MeshSpec, hw: HardwareSpec,
           options: SearchOptions = SearchOptions(), cost: CostModel | None = None,
           analysed: Analysis | None = None,
           sp_analysed: tuple[Analysis | None] | None = None) -> SearchResult:
    """Find the fastest memory-feasible assignment of mesh axes to factors and a storage mode
    (`analysed`: a previous `analysis(graph, grouping)` to reuse; `sp_analysed`: a previous
    `(sequence_parallel_analysis(graph, grouping, analysed),)`, a 1-tuple since None is a result)."""
    cost = cost or AnalyticalCostModel(mesh, hw)
    analysed = analysed if analysed is not None else analysis(graph, grouping)
    result = _search_space(plan_space(graph, grouping, mesh, options, analysed), hw, cost, options)
    mode = options.sequence_parallel
    if mode != "off":
        sp = sp_analysed[0] if sp_analysed is not None else sequence_parallel_analysis(graph, grouping, analysed)
        result._sp_analysis = sp          # with_sequence_parallel prices experts in it without redoing it
        if sp is not None:
            sp_result = _search_space(plan_space(graph, grouping, mesh, options, sp), hw, cost, options)
            # by time only: the two spaces' factors differ, so their axis-name hints are not compared
            if mode == "on" or _better(sp_result.best, result.best, hints=False):
                n = sp_result.best.plans_evaluated + result.best.plans_evaluated
                sp_result.best = dataclasses.replace(sp_result.best, plans_evaluated=n)
                result = sp_result
    return result


def _search_space(space: PlanSpace, hw: HardwareSpec, cost: CostModel, options: SearchOptions) -> SearchResult:
    budget = options.memory_budget if options.memory_budget is not None else 0.9 * hw.memory_bytes
    ev = space.evaluator(hw, cost, options, space.weights)
    ev.budget = budget
    best = _best_choice(ev, space.plans, options.storage_modes, budget)
    result = SearchResult(best, space.fg, space.candidates, space.weights, space.grad_ops, budget, space.notes,
                          space.periods)
    result._evaluator = ev
    result._context = (space.graph, space, hw, cost, options)
    return result


_UNSET = object()


def evaluate_assignment(result: SearchResult, factor_axes: dict[int, tuple[str, ...]], storage: str):
    """(choice, evaluator) of an assignment that may split factors outside `result`'s candidates (an
    expert plan's): those join the candidates of a wider evaluator, so the price is that of the layout
    the plan runs, and the plan's verdict and `autoshard.expert_plan` agree."""
    return evaluate_assignments(result, [(factor_axes, storage)])[0]


def evaluate_assignments(result: SearchResult, assignments: Sequence[tuple[dict[int, tuple[str, ...]], str]]
                         ) -> list[tuple[PlanChoice, _Evaluator]]:
    """`evaluate_assignment` of each (factor axes, storage): those within `result`'s candidates priced together
    by its evaluator, each of the others by a wider one."""
    inside = [k for k, (fa, _) in enumerate(assignments) if all(f in result.candidates for f in fa)]
    out: list = [None] * len(assignments)
    for k, choice in zip(inside, result._evaluator.evaluate_many([assignments[k] for k in inside]), strict=True):
        out[k] = (choice, result._evaluator)
    for k, (fa, storage) in enumerate(assignments):
        if out[k] is None:
            out[k] = _evaluate_wider(result, fa, storage)
    return out


def _evaluate_wider(result: SearchResult, factor_axes: dict[int, tuple[str, ...]], storage: str):
    """(choice, evaluator) of an assignment splitting factors outside `result`'s candidates, on an evaluator
    whose candidates include them."""
    outside = sorted(f for f in factor_axes if f not in result.candidates)
    graph, space, hw, cost, options = result._context
    wider = dataclasses.replace(space, candidates=tuple(sorted({*space.candidates, *outside})))
    ev = wider.evaluator(hw, cost, options, space.weights)
    ev.budget = result.budget
    return ev.evaluate_one(factor_axes, storage), ev


def with_sequence_parallel(result: SearchResult, grouping: Grouping) -> SearchResult | None:
    """`result`'s space with the residual stream cut from the tensor-parallel regions, for pricing
    given plans (the Megatron-SP expert) without enumerating it; None when it has no such regions."""
    if result.factors.sequence:
        return result
    graph, space, hw, cost, options = result._context
    sp = getattr(result, "_sp_analysis", _UNSET)
    if sp is _UNSET:
        sp = sequence_parallel_analysis(graph, grouping, space.analysis)
    if sp is None:
        return None
    cands, _ = _candidate_factors(graph, sp.fg, sp.weights, space.mesh, options, [])
    # its own shared tables: the candidate-mask cache is keyed by factor ids, which differ between spaces
    sp_space = dataclasses.replace(space, fg=sp.fg, candidates=cands, plans=np.zeros((0, len(cands)), np.int64),
                                   _shared=_Shared())
    ev = sp_space.evaluator(hw, cost, options, sp_space.weights)
    ev.budget = result.budget
    out = dataclasses.replace(result, factors=sp.fg, candidates=cands)
    out._evaluator = ev
    out._context = (graph, sp_space, hw, cost, options)
    return out


def sequence_parallel_analysis(graph: OpGraph, grouping: Grouping, analysed: Analysis) -> Analysis | None:
    """`analysed` with the residual stream cut from the tensor-parallel regions (regions.py), so the
    sequence can be split over the tensor-parallel axes outside them; None without such regions (or
    with mixture-of-experts regions). Computed once per grouping and `analysed`."""
    if graph is not grouping.graph:
        return _sequence_parallel_analysis(graph, grouping, analysed)
    # keyed by identity, `analysed` kept beside the result so a recycled id cannot match
    hit = grouping.memo(("sequence_parallel", id(analysed)),
                        lambda: (analysed, _sequence_parallel_analysis(graph, grouping, analysed)))
    return hit[1] if hit[0] is analysed else _sequence_parallel_analysis(graph, grouping, analysed)


def _sequence_parallel_analysis(graph: OpGraph, grouping: Grouping, analysed: Analysis) -> Analysis | None:
    if analysed.fg.sequence:
        return analysed
    if analysed.fg.expert_cuts:
        # mixture-of-experts regions: their dispatched tokens' capacity and groups are no sequence;
        # the two kinds of cuts together are not validated against compiled programs yet (grouped-query
        # attention's repeat cuts are: the audit of Megatron-SP on Mistral)
        return None
    weights, ops, pairs, _ = _analysed_ops(graph, grouping)
    batch = set(region_twins(analysed.fg, batch_factors(graph, analysed.fg)))
    tp = [f for f in tensor_parallel_factors(graph, analysed.fg, analysed.in_map) if f not in batch]
    if not tp:
        return None
    # analysed.fg is these ops' factor graph without cuts: analyze starts from it instead of relinking
    fg = analyze(graph, ops, pairs, (analysed.fg, tp), linked=analysed.fg)
    if not fg.sequence:
        return None
    return dataclasses.replace(analysed, fg=fg)


@dataclasses.dataclass
class PlanSpace:
    """What a search enumerates on one mesh: the analysed ops and their weights, the factor graph,
    the candidate factors and every plan over them (rows of axis masks, canonical order)."""

    graph: OpGraph
    mesh: MeshSpec
    weights: dict[int, float]
    fg: FactorGraph
    grad_ops: frozenset[int]
    candidates: tuple[int, ...]
    plans: np.ndarray
    periods: tuple[int, ...]
    in_map: dict[int, int]
    notes: list[str]
    fused_update: bool = True
    window: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    _shared: _Shared = dataclasses.field(default_factory=_Shared, repr=False, compare=False)

    @property
    def analysis(self) -> Analysis:
        """The mesh-independent part this space was built from (reusable for other meshes)."""
        return Analysis(self.weights, self.fg, self.grad_ops, self.periods, self.in_map, self.fused_update,
                        self.window)

    def evaluator(self, hw: HardwareSpec, cost: CostModel, options: SearchOptions, weights: dict[int, float],
                  inputs: Sequence[int] | None = None, accumulate: bool = False, keep_all: bool = False) -> _Evaluator:
        """An evaluator of this space's plans over the ops in `weights` (op -> how many times it
        counts) and the bytes of `inputs` (None: every input of the step); `accumulate`: gradients
        accumulate over micro-batches (a pipeline stage's); `keep_all`: every forward result of the
        weighted ops counts as kept (remat 'dots' keeps each matmul result, a residual or not)."""
        # the fusion of the analysed ops' window is exact for the live analysed ops only
        window = self.window if self.window is not None and (weights is self.weights or all(
            self.weights.get(i, 0.0) > 0 for i, w in weights.items() if w > 0)) else None
        ev = _Evaluator(self.graph, self.fg, weights, self.grad_ops, self.candidates, self.mesh, hw, cost,
                        options, self.in_map, inputs, self.fused_update, self._shared, accumulate, window, keep_all)
        bwd = ev.phase_work.get("backward", 0.0) + ev.phase_work.get("grad", 0.0)
        ev.bwd_share = bwd / (sum(ev.phase_work.values()) or 1.0)
        ev.budget = math.inf
        return ev


@dataclasses.dataclass(frozen=True)
class Analysis:
    """The mesh-independent part of a search: analysed ops and weights, factor graph, gradient
    ops, block periods and the input map (computed once, shared by every mesh shape)."""

    weights: dict[int, float]
    fg: FactorGraph
    grad_ops: frozenset[int]
    periods: tuple[int, ...]
    in_map: dict[int, int]
    fused_update: bool               # the step applies the optimizer (gradients die as they are used)
    window: tuple[tuple[int, ...], tuple[int, ...]] | None = None    # fusion_window's


def analysis(graph: OpGraph, grouping: Grouping) -> Analysis:
    """The mesh-independent part of a search, computed once per grouping (the tensor, 3-D and expert
    planners of one step share it; do not modify)."""
    if graph is not grouping.graph:
        return _analysis(graph, grouping)
    return grouping.memo(("analysis",), lambda: _analysis(graph, grouping))


def _analysis(graph: OpGraph, grouping: Grouping) -> Analysis:
    weights, ops, pairs, periods, fg = _linked_analysis(graph, grouping)
    grad_ops = _grad_ops(graph, [i for i, w in weights.items() if w > 0])
    return Analysis(weights, fg, grad_ops, tuple(periods), input_maps(graph, grouping, tuple(periods)),
                    any(op.phase == "optimizer" for op in reversed(graph.ops)), fusion_window(graph, grouping))


def plan_space(graph: OpGraph, grouping: Grouping, mesh: MeshSpec, options: SearchOptions = SearchOptions(),
               analysed: Analysis | None = None) -> PlanSpace:
    """The analysed ops, factor graph, candidate factors and enumerated plans of `graph` on `mesh`
    (`analysed`: a previous `analysis(graph, grouping)` to reuse)."""
    a = analysed if analysed is not None else analysis(graph, grouping)
    notes: list[str] = []
    cands_t, masks_of = _candidate_factors(graph, a.fg, a.weights, mesh, options, notes)
    plans = _enumerate_plans(a.fg, cands_t, masks_of)
    return PlanSpace(graph, mesh, a.weights, a.fg, a.grad_ops, cands_t, plans, a.periods, a.in_map, notes,
                     a.fused_update, a.window)


def _linked_analysis(graph: OpGraph, grouping: Grouping) -> tuple:
    """(`_analysed_ops`'s four, their factor graph). Every block type is first taken to repeat with period 1:
    when that linking puts no factor twice on one of a type's parameters, neither does the linking of two
    instances that `_period` tries (it unites a subset of the same dims), so the periods are 1 and the
    factor graph stands. Otherwise the periods are found one by one and the ops linked again."""
    if graph is grouping.graph and grouping.__dict__.get("_memo", {}).get(("analysed_ops",)) is None:
        first = _find_analysed_ops(graph, grouping, [1] * len(grouping.block_types))
        fg = analyze(graph, first[1], first[2])
        if not any(_repeats_a_factor(graph, bt, fg) for bt in grouping.block_types):
            grouping.memo(("analysed_ops",), lambda: first)
            return (*first, fg)
    weights, ops, pairs, periods = _analysed_ops(graph, grouping)
    return weights, ops, pairs, periods, analyze(graph, ops, pairs)


def _repeats_a_factor(graph: OpGraph, bt, fg: FactorGraph) -> bool:
    """Does the linking put one factor on two dims of a parameter of the type's first instance?"""
    if bt.count < 2 or bt.scanned:
        return False
    for i in bt.instances[0].ops:
        for v in graph.ops[i].inputs:
            if graph.values[v].role == "parameter":
                fs = [f for f in fg.value_factors(v) if f is not None]
                if len(set(fs)) < len(fs):
                    return True
    return False


def _analysed_ops(graph: OpGraph, grouping: Grouping
                  ) -> tuple[dict[int, float], list[int], list[tuple[int, int]], list[int]]:
    """The ops to analyse (the remainder and representative instances of each block type) with
    the weight each stands for, the pairs of corresponding ops linking instances, and the period
    of each block type (once per grouping: finding a period links factors too)."""
    if graph is not grouping.graph:
        return _find_analysed_ops(graph, grouping)
    return grouping.memo(("analysed_ops",), lambda: _find_analysed_ops(graph, grouping))


def _find_analysed_ops(graph: OpGraph, grouping: Grouping, periods_given: list[int] | None = None
                       ) -> tuple[dict[int, float], list[int], list[tuple[int, int]], list[int]]:
    repeat = graph.table().repeat

    def runs(ops: Sequence[int], times: int = 1) -> list[float]:
        return (repeat[np.fromiter(ops, dtype=np.int64, count=len(ops))] * times).tolist()

    weights: dict[int, float] = dict(zip(grouping.remainder, runs(grouping.remainder), strict=True))
    ops: list[int] = list(grouping.remainder)
    pairs: list[tuple[int, int]] = []
    periods: list[int] = []
    for bt in grouping.block_types:
        insts = bt.instances
        if bt.scanned:  # one body; its ops repeat via op.repeat
            weights.update(zip(insts[0].ops, runs(insts[0].ops), strict=True))
            ops.extend(insts[0].ops)
            periods.append(1)
            continue
        period = periods_given[len(periods)] if periods_given is not None else _period(graph, bt, grouping.remainder)
        periods.append(period)
        # the first `period` instances, the last and those bordering the remainder count for themselves;
        # one middle instance per residue class stands for the rest (instances.instance_roles).
        # Linking the analysed instances to the first ones makes factors run through the model.
        exact, stands = instance_roles(graph, grouping, bt, period)
        middle = Counter(stands.values())
        for k in sorted(exact | set(middle)):
            weights.update(zip(insts[k].ops, runs(insts[k].ops, 1 if k in exact else middle[k]), strict=True))
            ops.extend(insts[k].ops)
            if k >= period:
                pairs.extend(corresponding_ops(graph, insts[k % period].ops, insts[k].ops))
    # ops XLA deletes as dead code cost nothing (they stay analysed: their dims still link factors)
    return live_weights(graph, weights), ops, pairs, periods


WINDOW_SHARE = 0.5       # a window over more of the graph than this: the whole graph is fused


def fusion_window(graph: OpGraph, grouping: Grouping) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(scope, core) for core.fusion.window_fusion: the ops fused (the remainder and the analysed
    instances, padded by the instances beside them) for those priced (the live analysed ops); None
    when that is most of the graph (fuse it whole)."""
    if graph is not grouping.graph:
        return None
    return grouping.memo(("fusion_window",), lambda: _fusion_window(graph, grouping))


def _fusion_window(graph: OpGraph, grouping: Grouping) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    weights = _analysed_ops(graph, grouping)[0]
    pads: set[tuple[int, int]] = set()
    for t, bt in enumerate(grouping.block_types):      # the layers before and after each analysed one
        for k, inst in enumerate(bt.instances):
            if inst.ops and inst.ops[0] in weights:
                pads.update((t, j) for j in range(max(k - 1, 0), min(k + 2, bt.count)))
    values, ops = graph.values, graph.ops
    # and the layers an analysed op reads from or feeds (the remainder's first and last layers of
    # each branch), but not every layer reading one value (a mask, a learning rate: no fusion spans them)
    block_of = grouping.block_of
    for i in weights:
        op = ops[i]
        pads.update(b for v in op.inputs if (p := values[v].producer) is not None and p not in weights
                    and (b := block_of(p)))
        for v in op.outputs:
            near = set()       # stop at a third block: a value every layer reads (Adam's step) pads none
            for c in values[v].consumers:
                if c not in weights and (b := block_of(c)):
                    near.add(b)
                    if len(near) > 2:
                        break
            if len(near) <= 2:
                pads |= near
    scope = set(weights)
    for t, k in pads:
        scope.update(grouping.block_types[t].instances[k].ops)
    if len(scope) > WINDOW_SHARE * len(graph.ops) or len(scope) == len(graph.ops):
        return None
    return tuple(sorted(scope)), tuple(sorted(i for i, w in weights.items() if w > 0))


def _best_choice(ev: _Evaluator, plans: np.ndarray, storage_modes: tuple[str, ...], budget: float) -> PlanChoice:
    """The best plan of each storage mode, then the best of those."""
    best = None
    by_mode = ev.evaluate_modes(plans, storage_modes)
    batch = set(region_twins(ev.fg, batch_factors(ev.graph, ev.fg)))
    for storage in storage_modes:
        res = by_mode[storage]
        feasible = res["memory"] <= budget
        # lexicographic: feasible first, then time (rounded so float noise cannot break ties), then the mesh
        # axis names (axis_hints: within TIE of the fastest), then fewer sharded factors, then enumeration order
        t = np.round(res["step_time"], 12)
        score = np.where(feasible, t, np.inf)
        i = i0 = int(np.argmin(score)) if feasible.any() else int(np.argmin(res["memory"]))
        if feasible.any():
            i = break_tie(i0, res["step_time"], feasible, plans, ev.cands, batch, ev.mesh)
        choice = ev._choice(plans[i], res, i, storage, plans.shape[0])
        note = hint_note(choice.factor_axes, ev._choice(plans[i0], res, i0, storage, 0).factor_axes, batch) \
            if i != i0 else ""
        choice = dataclasses.replace(choice, hint=choice_hint(choice.factor_axes, batch), hint_note=note)
        if best is None or _better(choice, best):
            if best is not None and _hint_decides(choice, best):
                choice = dataclasses.replace(choice, hint_note=hint_note(choice.factor_axes, best.factor_axes, batch))
            best = choice
    return best


def _hint_decides(a: PlanChoice, b: PlanChoice) -> bool:
    """Does `a` beat `b` on the axis-name hint alone (feasible, same predicted step within TIE)?"""
    return a.feasible and b.feasible and ties(a.step_time, b.step_time) and a.hint > b.hint \
        and round(a.step_time, 12) >= round(b.step_time, 12)


def _better(a: PlanChoice, b: PlanChoice, hints: bool = True) -> bool:
    if a.feasible != b.feasible:
        return a.feasible
    if not a.feasible:
        return a.memory["total"] < b.memory["total"]
    if hints and a.hint != b.hint and ties(a.step_time, b.step_time):
        return a.hint > b.hint          # the same predicted step: the mesh axis names decide (axis_hints)
    return round(a.step_time, 12) < round(b.step_time, 12)
