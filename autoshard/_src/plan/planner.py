"""Tensor sharding plans: group → search → Plan (the step's specs by keypath) (pure: no jax import)."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import numpy as np

from ..core.errors import InfeasiblePlanError, PlanError
from ..core.graph import PHASES, OpGraph, collector_paused, fingerprint, inputs_with_role, op_keys_of
from ..core.grouping import Grouping, group
from ..core.hardware import HardwareSpec, hardware_dict
from ..core.mesh import MeshSpec, candidate_meshes, mesh_spec
from ..core.optable import PHASE_CODES
from ..core.version import VERSION
from ..pipeline.costs import traced_batch
from ..tensor.comm_records import comm_bytes_of
from ..tensor.experts import EXPERTS, expert_assignments
from ..tensor.instances import input_maps, instance_map_arrays
from ..tensor.regions import REDUCE_SCATTERED
from ..tensor.search import (
    PlanChoice,
    SearchOptions,
    SearchResult,
    _grad_ops,
    analysis,
    evaluate_assignment,
    evaluate_assignments,
    search,
    sequence_parallel_analysis,
    with_sequence_parallel,
)
from .plan import ParamReport, Plan, Stage
from .specs import Spec

_CONSTRAINED = frozenset({"dot_general", "gather", "conv_general_dilated"})


def tensor_plan(graph: OpGraph, *, mesh: Any, hw: HardwareSpec, options: SearchOptions,
                devices: int | None = None, grouping: Grouping | None = None) -> Plan:
    """The tensor sharding plan of the traced step `graph` on `mesh` (a MeshSpec, or "auto": every
    factorisation of `devices`, the fastest feasible wins). Raises InfeasiblePlanError when nothing fits."""
    with collector_paused():
        return _tensor_plan(graph, mesh, hw, options, devices, grouping)


def _tensor_plan(graph: OpGraph, mesh: Any, hw: HardwareSpec, options: SearchOptions, devices: int | None,
                 grouping: Grouping | None) -> Plan:
    grouping = grouping if grouping is not None else group(graph)
    if isinstance(mesh, str):
        if mesh != "auto":
            raise PlanError(f"autoshard.plan: mesh={mesh!r} is not a mesh; pass a dict such as {{'data': 8}}, a "
                            "jax Mesh, or 'auto' with devices=<count>.")
        if devices is None:
            raise PlanError("autoshard.plan: mesh='auto' needs devices=<count>.")
        meshes = candidate_meshes(devices)
    else:
        meshes = [mesh_spec(mesh)]
    t0 = time.perf_counter()
    best = None
    # the mesh-independent analyses once, not per candidate mesh (mesh="auto" may price thousands)
    analysed = analysis(graph, grouping)
    sp = (sequence_parallel_analysis(graph, grouping, analysed),) if options.sequence_parallel != "off" else None
    for m in meshes:
        res = search(graph, grouping, m, hw, options, analysed=analysed, sp_analysed=sp)
        if best is None or _prefer(res, best[1]):
            best = (m, res)
    seconds = time.perf_counter() - t0
    if not best[1].best.feasible:
        b = best[1]
        splits = [f"{what} -> {'x'.join(axes)}" for _, what, _, axes in
                  describe_factors(graph, b.factors, b.candidates, b.best.factor_axes) if axes]
        raise InfeasiblePlanError(
            f"autoshard.plan: no plan fits the memory budget of {_size(b.budget)} per "
            f"device on mesh {best[0]} ({hw.name}); the plan needing least memory (storage {b.best.storage}; "
            f"{', '.join(splits[:4]) or 'nothing split'}{' ...' if len(splits) > 4 else ''}) takes "
            f"{_size(b.best.memory['total'])} per device (parameters "
            f"{_size(b.best.memory['params'])}, optimizer state {_size(b.best.memory['optimizer'])}, "
            f"activations {_size(b.best.memory['activations'])}). Fix: raise memory_budget, "
            "use more devices or a smaller batch, or plan in 3-D (mesh='auto' with devices=N, or a 'pipe' axis "
            "with pipeline='auto'), which adds pipeline stages and chooses rematerialisation per stage (on a mesh "
            "whose axes are named 'data' and/or 'model', rematerialisation was tried and did not fit either).",
            min_memory=b.best.memory["total"], budget=b.budget)
    experts = compare_experts(graph, grouping, best[0], best[1])
    return build_plan(graph, grouping, best[0], hw, best[1], options, seconds, experts=experts)


def _size(n: float) -> str:
    """Bytes in the largest binary unit that keeps a digit before the point (a budget of 1000 bytes
    is "0.98 KiB", not "0.00 GiB")."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 2**10:.2f} KiB"


def compare_experts(graph: OpGraph, grouping: Grouping, mesh: MeshSpec, res: SearchResult) -> dict[str, Any]:
    """Each expert plan priced by the same model: {name: {step_time, memory, feasible,
    breakdown} or {reason}}."""
    in_map = input_maps(graph, grouping, res.periods)
    out: dict[str, Any] = {}
    assignments = expert_assignments(graph, res.factors, in_map, mesh)
    sp = with_sequence_parallel(res, grouping)   # Megatron-SP is priced where the stream is cut
    if sp is not None and sp is not res:
        assignments["megatron-sp"] = expert_assignments(graph, sp.factors, in_map, mesh)["megatron-sp"]
    by_space: dict[int, tuple[SearchResult, list[str]]] = {}      # the experts priced in each space, together
    for name, a in assignments.items():
        if isinstance(a, str):
            out[name] = {"reason": str(a)}      # a plain str in the plan (NotApplicable's fix is for errors)
            continue
        priced = sp if name == "megatron-sp" and sp is not None else res
        by_space.setdefault(id(priced), (priced, []))[1].append(name)
    for priced, names in by_space.values():
        choices = evaluate_assignments(priced, [assignments[n] for n in names])   # as autoshard.expert_plan prices
        for name, (c, _) in zip(names, choices, strict=True):
            out[name] = {"step_time": c.step_time, "memory": c.memory["total"], "feasible": c.feasible,
                         "breakdown": dict(c.breakdown)}
    return {name: out[name] for name in assignments}


def expert_tensor_plan(name: str, graph: OpGraph, *, mesh: Any, hw: HardwareSpec, options: SearchOptions,
                       grouping: Grouping | None = None) -> Plan:
    """The hand-written reference plan `name` (one of EXPERTS) for the traced step `graph` on `mesh`,
    as a Plan with the planner's predicted costs, so it can be compared, audited and run like an auto plan."""
    if name not in EXPERTS:
        raise PlanError(f"autoshard.expert_plan: name={name!r} is unknown; valid: {list(EXPERTS)}.")
    grouping = grouping if grouping is not None else group(graph)
    m = mesh_spec(mesh)
    t0 = time.perf_counter()
    if name == "megatron-sp":    # priced in the space whose residual stream is cut from the regions
        options = dataclasses.replace(options, sequence_parallel="on")
    res = search(graph, grouping, m, hw, options)
    a = expert_assignments(graph, res.factors, input_maps(graph, grouping, res.periods), m)[name]
    if isinstance(a, str):
        fix = getattr(a, "fix", "") or "Fix: choose a mesh whose axis sizes divide the split dimensions."
        raise PlanError(f"autoshard.expert_plan: the {name} plan does not apply on mesh {m}: {a}. {fix}")
    fa, storage = a
    choice, ev = evaluate_assignment(res, fa, storage)      # every dim it splits priced, as emitted
    expert_res = dataclasses.replace(res, best=choice, candidates=ev.cands)
    expert_res._evaluator = ev
    return build_plan(graph, grouping, m, hw, expert_res, options, time.perf_counter() - t0, expert=name)


def _prefer(a: SearchResult, b: SearchResult) -> bool:
    if a.best.feasible != b.best.feasible:
        return a.best.feasible
    return a.best.step_time < b.best.step_time


def _spec_for(factors: tuple, axes_of: dict[int, tuple[str, ...]]) -> list[tuple[str, ...]]:
    return [tuple(axes_of.get(f, ())) if f is not None else () for f in factors]


def add_storage_axes(spec: list[tuple[str, ...]], shape: tuple[int, ...], mesh: MeshSpec) -> list:
    """ZeRO: split a tensor further over the mesh axes its factors leave unused, on the largest dim
    that divides (the same rule the search's memory model used)."""
    used = {a for axes in spec for a in axes}
    free = tuple(a for a in mesh.names if a not in used)
    n = 1
    for a in free:
        n *= mesh.axis_size(a)
    if not free or n == 1:
        return spec
    order = sorted(range(len(shape)), key=lambda d: -shape[d])
    for d in order:
        cur = 1
        for a in spec[d]:
            cur *= mesh.axis_size(a)
        if (shape[d] // cur) % n == 0 and shape[d] % cur == 0:
            spec = list(spec)
            spec[d] = tuple(spec[d]) + free
            return spec
    return spec


def describe_factors(graph: OpGraph, fg, candidates: tuple[int, ...],
                     axes_of: dict[int, tuple[str, ...]]) -> list[tuple[int, str, int, tuple[str, ...]]]:
    """(factor, "keypath dim d" of the first parameter or data input it splits, size, mesh axes) per
    candidate factor: how a plan shows its logical dims."""
    desc: dict[int, str] = {}
    for v in fg.factored_inputs():
        val = graph.values[v]
        if val.role not in ("parameter", "data"):
            continue
        for d, f in enumerate(fg.value_factors(v)):
            if f is not None and f not in desc:
                desc[f] = f"{val.keypath} dim {d}"
    # a fused projection's heads: a dim of its weight's exposed view only (trace/fused.py)
    for i in sorted(fg.op_factors):
        op = graph.ops[i]
        if op.primitive == "reshape" and op.outputs and len(op.out_shapes[0]) > len(op.in_shapes[0]):
            src = _parameter_behind(graph, op.inputs[0])
            if src is None:
                continue
            for d, f in enumerate(fg.value_factors(op.outputs[0])):
                if f is not None and f not in desc:
                    view = "x".join(map(str, op.out_shapes[0]))
                    desc[f] = f"{graph.values[src].keypath} viewed as {view}, dim {d}"
    for v, _, after in getattr(fg, "cuts", ()):    # a region's own dims: where the values cross into it
        for d, f in enumerate(after):
            if f is not None and f not in desc:
                p = graph.values[v].producer
                where = graph.ops[p].module if p is not None else ""
                desc[f] = f"{where or 'region'} boundary dim {d} (as its consumers read it)"
    for f in getattr(fg, "sequence", ()):       # the stream outside tensor-parallel regions
        desc[f] = ", ".join(x for x in (desc.get(f), "residual stream (sequence parallel)") if x)
    return [(f, desc.get(f, f"factor {f}"), fg.factor_size(f), axes_of.get(f, ())) for f in candidates]


def _parameter_behind(graph: OpGraph, v: int) -> int | None:
    """The parameter input `v` is a transpose or cast of, if any."""
    for _ in range(4):
        val = graph.values[v]
        if val.role == "parameter":
            return v
        p = val.producer
        if p is None or graph.ops[p].primitive not in ("transpose", "convert_element_type") or not graph.ops[p].inputs:
            return None
        v = graph.ops[p].inputs[0]
    return None


def activation_constraints(graph: OpGraph, op_map: dict[int, int] | tuple[np.ndarray, np.ndarray], fg: Any,
                           axes_of: dict[int, tuple[str, ...]],
                           ops: set[int] | None = None, keys: list[str] | None = None,
                           storage: str = "replicated") -> list[tuple[str, Spec]]:
    """(op key, spec) of the forward matmul / gather / convolution outputs the plan splits (of `ops`
    only, when given): what emission pins so XLA follows the plan between the parameters. A value cut
    at a region boundary (an MoE dispatch or expert output) gets a second entry for the same op: the
    layout its consumers read, so XLA reshards it in place (an all-to-all) before any transpose. `keys`:
    `op_keys(graph)`, for callers asking once per stage (it walks the whole graph)."""
    cut_after = {v: after for v, _, after in getattr(fg, "cuts", ())}
    # with the sequence split outside the tensor-parallel regions XLA may also gather a region's big
    # activations for a weight gradient instead of the stream's cotangent: pin the backward matmuls too
    backward_too = any(axes_of.get(f) for f in getattr(fg, "sequence", ()))
    pinned = _pinned(graph, fg) | (_stored_reads(graph) if storage == "zero3" else set())
    phases = constrained_phases(graph, fg, axes_of, storage)     # an op maps to one of its own phase
    # with the sequence split, the residual adds keep the plan's layout: left free, XLA carries a split
    # through them into regions priced whole
    stream = _stream_ops(graph, fg) if backward_too else frozenset()
    # the ops asked: an analysed op stands for itself, another for its representative (`op_map`); the
    # rest have no factors. Not a walk over every op: a deep step's layers share their representatives'
    idx, src = _asked(graph, op_map, fg, ops)
    t = graph.table()
    codes = [PHASE_CODES[p] for p in phases]
    keep = np.isin(t.phase[idx], codes) & _has_factors(graph, fg)[src]
    idx, src = idx[keep], src[keep]
    # corresponding ops get their representative's layouts, evaluated once per representative (an op and the
    # one standing for it share phase and primitive: instances are matched on both)
    present = np.zeros(len(graph.ops), dtype=bool)
    present[src] = True
    ctx = (graph, fg, axes_of, cut_after, pinned, stream, backward_too)
    specs = {s: sp for s in np.flatnonzero(present).tolist() if (sp := _src_constraints(ctx, s, graph.ops[s]))}
    has_specs = np.zeros(len(graph.ops), dtype=bool)
    has_specs[list(specs)] = True
    # a nested op is pinned in a remat call's body (emission re-binds the call), or where it leaves its call
    with_specs = has_specs[src]
    chosen = with_specs & (~t.nested[idx] | t.in_remat[idx])
    outputs = frozenset(graph.outputs)      # a list of every gradient: membership once per op is O(n^2)
    nested_free = with_specs & ~chosen
    if cut_after and nested_free.any():
        for k in np.flatnonzero(nested_free).tolist():
            chosen[k] = _escapes(graph, graph.ops[int(idx[k])], outputs)
    sel = np.flatnonzero(chosen)
    order = sel[np.argsort(idx[sel], kind="stable")]     # program order (an op's own layout before its steps)
    constrained = idx[order]
    # keys of the ops constrained only (an op's key does not depend on which others are asked)
    keys = keys if keys is not None else op_keys_of(graph, constrained)
    return [(keys[i], spec) for i, s in zip(constrained.tolist(), src[order].tolist(), strict=True)
            for spec in specs[s]]


def _asked(graph: OpGraph, op_map: dict[int, int] | tuple[np.ndarray, np.ndarray], fg: Any,
           ops: set[int] | None) -> tuple[np.ndarray, np.ndarray]:
    """(op indices, the analysed op each stands for): every analysed op and every op `op_map` maps, or `ops`.
    `op_map`: `instance_maps`, or `instance_map_arrays` (the same pairs as two arrays)."""
    if ops is None:
        own = np.fromiter(fg.op_factors, dtype=np.int64, count=len(fg.op_factors))
        if isinstance(op_map, tuple):
            b, a = op_map
        else:
            b = np.fromiter(op_map.keys(), dtype=np.int64, count=len(op_map))
            a = np.fromiter(op_map.values(), dtype=np.int64, count=len(op_map))
        other = ~_has_factors(graph, fg)[b]
        return np.concatenate([own, b[other]]), np.concatenate([own, a[other]])
    if isinstance(op_map, tuple):
        op_map = dict(zip(op_map[0].tolist(), op_map[1].tolist(), strict=True))
    asked = sorted(ops)
    return (np.asarray(asked, dtype=np.int64).reshape(-1),
            np.asarray([i if i in fg.op_factors else op_map.get(i, i) for i in asked], dtype=np.int64).reshape(-1))


def _has_factors(graph: OpGraph, fg: Any) -> np.ndarray:
    """Per op: does the factor graph analyse it (a boolean column)?"""
    has = np.zeros(len(graph.ops), dtype=bool)
    has[np.fromiter(fg.op_factors, dtype=np.int64, count=len(fg.op_factors))] = True
    return has


def _src_constraints(ctx: tuple, src: int, op) -> list[tuple]:
    """The layouts `activation_constraints` pins on an op of `op`'s phase and primitive standing for the
    analysed op `src`: its own (when split, pinned or a boundary kept before its steps), then the steps
    to its consumers' layout at a region boundary; [] when the op is left free."""
    graph, fg, axes_of, cut_after, pinned, stream, backward_too = ctx
    if not graph.ops[src].outputs:
        return []
    boundary = graph.ops[src].outputs[0] in cut_after
    pin = graph.ops[src].outputs[0] in pinned or (src in stream and op.phase == "forward")
    if not boundary and not pin and (op.phase not in ("forward", "backward" if backward_too else "forward")
                                     or op.primitive not in _CONSTRAINED):
        return []                 # the backward pass follows, except at region boundaries (its all-to-alls)
    spec = _spec_for(fg.op_factors[src].out_factors, axes_of)
    after = cut_after.get(graph.ops[src].outputs[0])
    # a partial sum its consumers read split along the reduced axes (a row-parallel output entering
    # the sequence-parallel stream) goes straight to their layout: a reduce-scatter, as priced
    scattered = after is not None and graph.ops[src].primitive in REDUCE_SCATTERED and \
        {a for f in fg.op_factors[src].reduced for a in axes_of.get(f, ())} & \
        {a for f in after if f is not None for a in axes_of.get(f, ())}
    steps = list(reshard_steps(spec, _spec_for(after, axes_of))) if after is not None else []
    # a boundary value resharded for its consumers keeps its own layout first, even whole: the
    # backward then reshards the cotangent back before the producer's transpose reads it (a whole
    # embedding output sliced into the sequence-parallel stream: its table gradient from the gathered
    # cotangent, as priced, not all-reduced from a split one)
    out = [tuple(tuple(a) for a in spec)] if (any(spec) or pin or steps) and not scattered else []
    return out + steps            # a region boundary: its consumers' layout


def _stream_ops(graph: OpGraph, fg: Any) -> frozenset[int]:
    """The analysed forward adds whose output carries a sequence-parallel stream factor (the residual adds
    and the biases added on the stream)."""
    seq = getattr(fg, "sequence", frozenset())
    return frozenset(i for i, of in fg.op_factors.items()
                     if graph.ops[i].phase == "forward" and graph.ops[i].primitive == "add"
                     and graph.ops[i].outputs and any(f in seq for f in of.out_factors if f is not None))


def _escapes(graph: OpGraph, op, outputs: frozenset[int]) -> bool:
    """Does a nested op's output leave its enclosing call (`jnp.take`'s `jit(_take)` gather)? Emission
    constrains the call's output of that shape. `outputs`: the step's output values."""
    if not op.nested or not op.outputs:
        return False
    v = op.outputs[0]
    return v in outputs or any(graph.ops[c].top_eqn != op.top_eqn for c in graph.values[v].consumers)


def _stored_reads(graph: OpGraph) -> set[int]:
    """Under ZeRO-3, the forward reads of parameters outside the matmuls (a bias reshaped for its add, a
    norm's scale) and the ops using them (the add): pinned to the layouts the plan computes with, so XLA
    gathers the small parameter as priced. Left free, XLA keeps the add split like the stored bias and
    gathers the activation (and its cotangent) instead."""
    def free_forward(i: int) -> bool:
        op = graph.ops[i]
        return op.phase == "forward" and bool(op.outputs) and op.primitive not in _CONSTRAINED and not op.nested

    reads = {i for v in inputs_with_role(graph, "parameter") for i in graph.values[v].consumers if free_forward(i)}
    users = {c for i in reads for c in graph.values[graph.ops[i].outputs[0]].consumers if free_forward(c)}
    # and the gradients computed outside the matmuls (a bias's sum over the batch): whole as computed, so
    # XLA slices the stored shard off the result rather than splitting the cotangent the sum reads
    grads = {i for i in _grad_ops(graph, [op.index for op in graph.ops if op.phase == "backward"])
             if graph.ops[i].primitive not in _CONSTRAINED and graph.ops[i].outputs and not graph.ops[i].nested}
    return {graph.ops[i].outputs[0] for i in reads | users | grads}


def _pinned(graph: OpGraph, fg: Any) -> set[int]:
    """The other operands of an MoE dispatch / combine (routing weights, masks): they keep their planned
    layout even when it is replicated (left free, XLA shards them like the experts and gathers back)."""
    return {u for v in getattr(fg, "expert_cuts", ()) for c in graph.values[v].consumers
            for u in graph.ops[c].inputs if u != v and graph.values[u].producer is not None}


def constrained_phases(graph: OpGraph, fg: Any, axes_of: dict[int, tuple[str, ...]],
                       storage: str = "replicated") -> frozenset[str]:
    """The phases of the ops `activation_constraints` may constrain: the forward pass (and the backward
    with a split sequence or ZeRO-3's gradients), and those of the ops making region boundaries and
    pinned operands."""
    backward = storage == "zero3" or any(axes_of.get(f) for f in getattr(fg, "sequence", ()))
    phases = {"forward", "backward"} if backward else {"forward"}
    values = graph.values
    for v in (*(v for v, _, _ in getattr(fg, "cuts", ())), *_pinned(graph, fg)):
        if values[v].producer is not None:
            phases.add(graph.ops[values[v].producer].phase)
    return frozenset(phases)


def reshard_steps(spec: list[tuple[str, ...]], target: list[tuple[str, ...]]) -> list[tuple[tuple[str, ...], ...]]:
    """Layouts from `spec` to `target` moving one mesh axis at a time (each an all-to-all, or a
    local slice when the axis was unused), in the target's axis order so every step keeps each dim's
    axes in mesh order; axes the target leaves unused are gathered last. XLA reshards one axis
    between two dims cleanly, but replicates a tensor to move several at once -- except axes that
    are the minor ones of both dims (a suffix leaving one dim to end another, in order): the two
    tilings then run over the same devices, one all-to-all over them all (the evaluator's
    `_all_to_alls` prices it so), which this takes in one step."""
    cur = [list(t) for t in spec]
    steps: list[tuple[tuple[str, ...], ...]] = []
    for d, want in enumerate(target):
        for n, a in enumerate(want):
            if a in cur[d]:
                continue
            run = [a]
            src = next((dims for dims in cur if a in dims), None)
            if src is not None and cur[d] == list(want[:n]):
                tail = list(want[n:])
                if len(tail) > 1 and src[-len(tail):] == tail:
                    run = tail
            for dims in cur:
                for x in run:
                    if x in dims:
                        dims.remove(x)
            cur[d] = [x for x in want if x in cur[d] or x in run] + [x for x in cur[d] if x not in want]
            steps.append(tuple(tuple(t) for t in cur))
    final = tuple(tuple(t) for t in target)
    if (steps[-1] if steps else tuple(tuple(t) for t in spec)) != final:
        steps.append(final)
    return steps


def build_plan(graph: OpGraph, grouping: Grouping, mesh: MeshSpec, hw: HardwareSpec,
               res: SearchResult, options: SearchOptions, seconds: float, experts: dict | None = None,
               expert: str | None = None) -> Plan:
    fg = res.factors
    axes_of = dict(res.best.factor_axes)
    storage = res.best.storage
    in_map = input_maps(graph, grouping, res.periods)
    vals = [graph.values[v] for v in graph.inputs]
    # gradients are summed over the axes that split the batch (the data inputs' factors)
    batch_axes = {a for v in inputs_with_role(graph, "data") for f in fg.value_factors(v) if f is not None
                  for a in axes_of.get(f, ())}
    # a weight's gradient sums what the batch and a split sequence (the stream's weights) spread
    grad_axes = batch_axes | {a for f in getattr(fg, "sequence", ()) for a in axes_of.get(f, ())}
    # an input's layout follows from its representative's, its shape and role: the layers share them
    keys = [(in_map.get(v, v), val.shape, val.role) for v, val in zip(graph.inputs, vals, strict=True)]
    layouts: dict[tuple, tuple[Spec, int, str]] = {}
    for key, val in zip(keys, vals, strict=True):
        if key not in layouts:
            layouts[key] = _input_layout(graph, fg, key[0], val, axes_of, storage, mesh, grad_axes)
    laid = [layouts[key] for key in keys]
    specs: list[Spec] = [hit[0] for hit in laid]
    reports = [ParamReport(val.keypath or "", val.shape, val.dtype, spec_t, val.nbytes // shards, sync)
               for val, (spec_t, shards, sync) in zip(vals, laid, strict=True) if val.role == "parameter"]
    by_kp = {val.keypath: (spec_t, val.shape) for val, spec_t in zip(vals, specs, strict=True)}
    out_specs: list[Spec] = []
    for vid, kp in zip(graph.outputs, graph.output_keypaths, strict=True):
        hit = by_kp.get(kp)
        shape = graph.values[vid].shape
        out_specs.append(hit[0] if hit is not None and hit[1] == shape else tuple(() for _ in shape))

    # only the constrained phases' ops are mapped (ops correspond phase by phase)
    phases = tuple(p for p in PHASES if p in constrained_phases(graph, fg, axes_of, res.best.storage))
    constraints = activation_constraints(graph, instance_map_arrays(graph, grouping, res.periods, phases), fg, axes_of,
                                         storage=res.best.storage)

    warnings = tuple(f"unknown primitive '{graph.ops[i].primitive}' in module "
                     f"'{graph.ops[i].module or '(root)'}': its operands are replicated"
                     for i in fg.unknown_ops) + tuple(res.notes) + idle_axes(mesh, res, specs)
    b = res.best
    ev = res._evaluator
    records = ev.comm_records(ev.row(b.factor_axes), b.storage)
    collectives = tuple({"kind": k, "axes": tuple(axes), "phase": ph, "bytes": v[0], "count": v[1]}
                        for (k, axes, ph), v in sorted(records.items()))
    predicted = {"step_time": b.step_time, "breakdown": dict(b.breakdown), "memory": dict(b.memory),
                 "comm_bytes": comm_bytes_of(records), "collectives": collectives,
                 "memory_budget": res.budget, "feasible": b.feasible,
                 # the factor graph the plan's factor ids index (plan.platform_memory re-prices in it)
                 "space": "sequence_parallel" if getattr(fg, "sequence", None) else "tensor",
                 "plans_evaluated": b.plans_evaluated, "search_seconds": seconds}
    if experts is not None:
        predicted["experts"] = experts
    if expert is not None:
        predicted["expert"] = expert
    if b.hint_note:         # the mesh axis names decided between plans of the same predicted step
        predicted["axis_hint"] = b.hint_note
    provenance = {"autoshard": VERSION, "fingerprint": fingerprint(graph),
                  "step": graph.name, "options": dataclasses.asdict(options),
                  "hardware": hardware_dict(hw)}
    factors = tuple(describe_factors(graph, res.factors, res.candidates, res.best.factor_axes))
    stage = _whole_mesh_stage(graph, mesh, b, batch_axes, factors, tuple(constraints))
    return Plan(
        mesh=tuple(mesh.axes), hardware=hw.name,
        input_keypaths=tuple([val.keypath or "" for val in vals]),
        input_specs_flat=tuple(specs), output_keypaths=tuple(graph.output_keypaths),
        output_specs_flat=tuple(out_specs), stages=(stage,), predicted=predicted, params=tuple(reports),
        warnings=warnings, provenance=provenance)


def _input_layout(graph: OpGraph, fg: Any, src: int, val: Any, axes_of: dict, storage: str, mesh: MeshSpec,
                  grad_axes: set[str]) -> tuple[Spec, int, str]:
    """(spec, shards, gradient sync) of an input whose representative is `src`."""
    if val.role == "rng":           # a PRNG key: every device draws from the whole key
        return tuple(() for _ in val.shape), 1, ""
    spec = _spec_for(fg.value_factors(src), axes_of) if len(graph.values[src].shape) == len(val.shape) \
        else [()] * len(val.shape)
    own = {a for axes in spec for a in axes}      # the axes its logical dims are split over
    if (val.role == "parameter" and storage == "zero3") or (val.role == "state" and storage != "replicated"):
        spec = add_storage_axes(spec, val.shape, mesh)
    spec_t: Spec = tuple(tuple(a) for a in spec)
    if val.role != "parameter":
        return spec_t, 1, ""
    shards = 1
    for axes in spec_t:
        for a in axes:
            shards *= mesh.axis_size(a)
    return spec_t, shards, _gradient_sync(own, grad_axes, storage, val.shape, spec, mesh)


def _gradient_sync(own: set[str], grad_axes: set[str], storage: str, shape: tuple[int, ...], spec: list,
                   mesh: MeshSpec) -> str:
    """How a parameter's gradient is summed: over the axes splitting the batch (or the sequence) that
    do not split the parameter itself; reduce-scattered over the axes ZeRO shards it (or its
    optimizer state) over, all-reduced over the others."""
    sync = [a for a in mesh.names if a not in own and a in grad_axes]
    if not sync:
        return "none"
    stored = {a for axes in add_storage_axes(list(spec), shape, mesh) for a in axes} - own \
        if storage != "replicated" else set()
    scattered = [a for a in sync if a in stored]
    reduced = [a for a in sync if a not in stored]
    return " + ".join(f"{k} over {','.join(axes)}" for k, axes in
                      (("reduce-scatter", scattered), ("all-reduce", reduced)) if axes)


IDLE_AXIS = "mesh axis"      # warnings the decorator raises as Python warnings (results stay right, speed suffers)


def idle_axes(mesh: MeshSpec, res: SearchResult, specs: list[Spec]) -> tuple[str, ...]:
    """A warning per mesh axis the plan cannot use because no dimension of the step divides it: every
    device along it repeats the same work on the same data (silent replication)."""
    used = {a for spec in specs for axes in spec for a in axes} | {a for axes in res.best.factor_axes.values()
                                                                   for a in axes}
    out = []
    for name, size in mesh.axes:
        if size == 1 or name in used or any(res.factors.divides(f, size) for f in res.candidates):
            continue
        dims = sorted({res.factors.factor_size(f) for f in res.candidates})[:6]
        if not dims:           # a step with no array work (identity, constants): nothing is wasted
            continue
        out.append(f"{IDLE_AXIS} {name!r} (size {size}) splits nothing: no dimension of the step divides by {size} "
                   f"(candidate dims {dims}), so the {size} devices along it repeat the same work. Fix: a mesh whose "
                   "axis sizes divide the batch and model dims, or fewer devices on that axis.")
    return tuple(out)


def _whole_mesh_stage(graph: OpGraph, mesh: MeshSpec, choice: PlanChoice, batch_axes: set[str],
                      factors: tuple, constraints: tuple) -> Stage:
    """A tensor plan as its one stage: every op on the whole mesh, replicated over the axes that split
    the batch. Its step time is split into forward and backward by the compute's flop shares (the
    search prices a whole step; communication stays with the phase it belongs to)."""
    replicas = math.prod(mesh.axis_size(a) for a in mesh.names if a in batch_axes)
    flops = graph.flops_by_phase()
    total = sum(flops.values()) or 1.0
    bd = choice.breakdown
    forward = bd["compute"] * flops["forward"] / total + bd["fwd_comm"]
    # the forward ops' modules in order of their first forward op, each name split once
    t = graph.table()
    fwd_modules = t.module[t.phase == PHASE_CODES["forward"]]
    ids, first = np.unique(fwd_modules, return_index=True)
    in_order = [t.modules[k] for k in ids[np.argsort(first)].tolist()]
    modules = tuple(dict.fromkeys("/".join(m.split("/")[:2]) for m in in_order if m))
    return Stage(index=0, mesh=tuple(mesh.axes), replicas=replicas,
                 microbatch_size=max(1, traced_batch(graph) // replicas), predicted_forward=forward,
                 predicted_backward=max(choice.step_time - forward, 0.0), memory=choice.memory["total"],
                 modules=modules, params=tuple(graph.values[v].keypath or "" for v in graph.inputs
                                               if graph.values[v].role == "parameter"),
                 factors=factors, storage=choice.storage, activation_constraints=constraints)
