"""3-D plans: the joint search's best point as a Plan (pure: no jax import).

A point with one stage, one micro-batch and no rematerialisation is a tensor plan and is built as
one (the search's chosen factor assignment on its data x model submesh, priced by the tensor
evaluator). Any other point is a plan of stages on a pipe x data x model mesh, each stage with its
units, submesh, tensor plan (factors -> axes, parameter specs by keypath, the axes splitting its
micro-batch, activation constraints), storage and remat policy, and predicted costs; the decorator
runs it on that mesh (`@autoshard(mesh={"pipe": ..}, pipeline="auto")` or `plan=`).
`predicted["3d"]` compares it with the best tensor-only and pipeline-only points and the best
Megatron-LM grid point. When the best point gives its stages unequal submeshes (Alpa's stages of
2, 2 and 4 devices) the plan is that point, each stage on its own submesh and the plan's mesh its
devices as one axis, `predicted["3d"]["equal_submeshes"]` False (the plan's `runtime` is "mpmd": each
stage its own program) and `spmd_alternative` the best point one SPMD program runs
(`pipeline_options={"equal_submeshes": True}` plans only those).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from ..core.attention import selective_ops
from ..core.errors import ConfigError, InfeasiblePlanError, PlanError
from ..core.graph import OpGraph, fingerprint, op_keys
from ..core.grouping import Grouping, group
from ..core.hardware import HardwareSpec, hardware_dict
from ..core.mesh import MeshSpec
from ..core.quantities import fmt_bytes
from ..core.version import VERSION
from ..joint.search import JointResult, joint_search
from ..joint.space import INTERLEAVED, SCHEDULES, VIRTUAL, JointOptions, JointPoint, submesh
from ..joint.stage_choice import REMAT, remat_notes
from ..pipeline.costs import traced_batch
from ..tensor.instances import instance_maps
from ..tensor.search import PlanSpace, SearchOptions, search
from .pipeline_planner import _modules, _params
from .plan import ParamReport, Plan, Stage
from .planner import _CONSTRAINED, activation_constraints, build_plan, describe_factors
from .specs import Spec

JOINT_OPTION_KEYS = ("remat", "max_microbatches", "max_model", "expert", "equal_submeshes", "virtual_stages")
EXPERTS_3D = ("megatron",)
STAGE_AXES = ("data", "model")


def fixed_shape_options(mesh: MeshSpec, schedule: str, num_microbatches: int | None,
                        options: Mapping[str, Any]) -> JointOptions:
    """The 3-D search restricted to a mesh with a "pipe" axis (pipeline="auto"): its stage count and
    data x model submesh, the config's schedule and micro-batch count, and `pipeline_options` among
    JOINT_OPTION_KEYS."""
    others = [n for n in mesh.names if n != "pipe"]
    if any(n not in STAGE_AXES for n in others):
        raise ConfigError(
            f"autoshard: pipeline='auto' on mesh {mesh} plans 3-D stages (pipe x data x model): the axes besides "
            f"'pipe' must be named 'data' and/or 'model', got {others}. Fix: rename them, e.g. "
            f"mesh={{'pipe': {mesh.axis_size('pipe')}, 'data': ..., 'model': ...}}.")
    if schedule not in SCHEDULES:
        raise ConfigError(f"autoshard: pipeline='auto' on a 'pipe' mesh runs a chain of stages; schedule={schedule!r} "
                          f"is not one of {list(SCHEDULES)}.")
    if options.get("expert") not in (None, *EXPERTS_3D):
        raise ConfigError(f"autoshard: pipeline_options expert={options.get('expert')!r}: valid {list(EXPERTS_3D)} "
                          "(the best Megatron-LM grid point of the mesh's shape) or None (the 3-D search's best).")
    remat = _remat_policies(options)
    shape = tuple(mesh.axis_size(n) if n in others else 1 for n in STAGE_AXES)
    _check_fixed_shape(mesh, shape[1], num_microbatches, options)
    virtual = _virtual_stages(options)
    if schedule != INTERLEAVED and options.get("virtual_stages") not in (None, 1):
        raise ConfigError(f"autoshard: pipeline_options virtual_stages={options.get('virtual_stages')!r} needs "
                          f"schedule={INTERLEAVED!r} (schedule={schedule!r} runs one stage per pipe rank). Fix: "
                          f"pass schedule={INTERLEAVED!r}, or drop virtual_stages.")
    if schedule == INTERLEAVED and num_microbatches is not None and num_microbatches % mesh.axis_size("pipe"):
        raise ConfigError(f"autoshard: schedule={INTERLEAVED!r} needs a micro-batch count divisible by the 'pipe' "
                          f"axis ({mesh.axis_size('pipe')}), got num_microbatches={num_microbatches}. Fix: a multiple "
                          f"of {mesh.axis_size('pipe')}, or schedule='1f1b'.")
    return JointOptions(schedules=(schedule,), remat=remat, stages=mesh.axis_size("pipe"),
                        shape=shape, microbatches=num_microbatches,
                        max_microbatches=int(options.get("max_microbatches", JointOptions.max_microbatches)),
                        max_model=options.get("max_model"), equal_submeshes=_equal_submeshes(options),
                        virtual=virtual)


def _check_fixed_shape(mesh: MeshSpec, model: int, num_microbatches: int | None, options: Mapping[str, Any]) -> None:
    """Caps that a fixed mesh shape or micro-batch count already decides: a contradiction is refused, not
    dropped (the search would run the mesh's shape and the given count whatever the cap says)."""
    cap = options.get("max_model")
    if cap is not None and model > cap:
        raise ConfigError(f"autoshard: pipeline_options max_model={cap} contradicts mesh {mesh}, whose 'model' axis "
                          f"fixes the tensor-parallel size to {model}. Fix: drop max_model (the mesh decides), or pass "
                          f"a mesh whose 'model' axis is <= {cap}, or mesh='auto' with devices=N to let max_model "
                          "bound the search.")
    most = options.get("max_microbatches")
    if most is not None and num_microbatches is not None and num_microbatches > most:
        raise ConfigError(f"autoshard: num_microbatches={num_microbatches} exceeds pipeline_options "
                          f"max_microbatches={most}. Fix: drop one of them, or raise max_microbatches.")


def auto_mesh_options(options: Mapping[str, Any]) -> JointOptions:
    """The 3-D search of mesh="auto" under `pipeline_options` (keys among JOINT_OPTION_KEYS but
    "expert"): remat policies, micro-batch cap, tensor-parallel cap, equal_submeshes."""
    if options.get("expert") is not None:
        raise ConfigError("autoshard: pipeline_options expert=... picks the Megatron-LM grid point of a fixed "
                          "shape; with mesh='auto' pass a mesh with a 'pipe' axis and pipeline='auto' instead.")
    return JointOptions(remat=_remat_policies(options), max_model=options.get("max_model"),
                        max_microbatches=int(options.get("max_microbatches", JointOptions.max_microbatches)),
                        equal_submeshes=_equal_submeshes(options), virtual=_virtual_stages(options))


def _virtual_stages(options: Mapping[str, Any]) -> tuple[int, ...]:
    """Virtual stages per rank the interleaved schedule may take: an int or a sequence of ints >= 2."""
    value = options.get("virtual_stages", VIRTUAL)
    vs = (value,) if isinstance(value, int) and not isinstance(value, bool) else value
    try:
        vs = tuple(vs)
        ok = bool(vs) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in vs)
    except TypeError:
        ok = False
    if not ok:
        raise ConfigError(f"autoshard: pipeline_options virtual_stages={value!r}: give an int >= 2 (model chunks "
                          f"per pipe rank under schedule={INTERLEAVED!r}) or a sequence of them to search, e.g. "
                          "(2, 3, 4).")
    return tuple(v for v in vs if v > 1) or (1,)


def _remat_policies(options: Mapping[str, Any]) -> tuple[str, ...]:
    remat = options.get("remat", REMAT)
    remat = (remat,) if isinstance(remat, str) else tuple(remat)
    if not remat or any(r not in REMAT for r in remat):
        raise ConfigError(f"autoshard: pipeline_options remat={options.get('remat')!r}: give policies among "
                          f"{list(REMAT)}.")
    return remat


def _equal_submeshes(options: Mapping[str, Any]) -> bool:
    value = options.get("equal_submeshes", False)
    if not isinstance(value, bool):
        raise ConfigError(f"autoshard: pipeline_options equal_submeshes={value!r} must be True (only plans whose "
                          "stages share one submesh shape: one SPMD program runs those) or False (also stages on "
                          "unequal submeshes, run MPMD: each stage its own program on its own devices).")
    return value


def joint_plan(graph: OpGraph, *, devices: int, hw: HardwareSpec, options: SearchOptions,
               joint: JointOptions | None = None, grouping: Grouping | None = None, expert: str | None = None) -> Plan:
    """The best 3-D plan of the traced step `graph` on `devices` devices (InfeasiblePlanError, naming
    the least-memory point and its breakdown, when nothing fits); `expert="megatron"`: the best
    Megatron-LM grid point instead, priced and compared the same way."""
    grouping = grouping if grouping is not None else group(graph)
    res = joint_search(graph, grouping, devices, hw, options, joint)
    if joint is not None and joint.stages is not None and joint.stages > len(res.units):
        raise PlanError(
            f"autoshard.plan: the mesh's 'pipe' axis has {joint.stages} ranks but the step has only "
            f"{len(res.units)} pipeline unit(s) (repeated blocks: {', '.join(res.units.labels[:4])}"
            f"{' ...' if len(res.units) > 4 else ''}); each stage needs at least one. Fix: a 'pipe' axis of at most "
            f"{len(res.units)}, with the other devices on 'data' / 'model'.")
    if expert is not None:
        if res.grid.best is None:
            raise InfeasiblePlanError(
                f"autoshard.plan: no Megatron-LM grid point applies on {devices} devices ({hw.name}): "
                f"{res.grid.reason}. Fix: drop pipeline_options['expert'] to use the 3-D search's plan.",
                min_memory=res.least_memory.memory if res.least_memory else math.inf,
                budget=options.memory_budget or 0.9 * hw.memory_bytes)
        res = dataclasses.replace(res, best=res.grid.best)
    if res.best is None:
        raise _infeasible(res, devices, hw, options)
    best = res.best
    summary = _summary(res, best)
    if joint is not None and joint.stages is not None and joint.shape is not None:
        summary["fixed_shape"] = f"pipe {joint.stages} x data {joint.shape[0]} x model {joint.shape[1]}"
    notes = remat_notes(graph, res.units, best.stages)
    if _tensor_point(best):
        plan = _tensor_plan(graph, grouping, res, best, hw, options)
        return dataclasses.replace(plan, predicted={**plan.predicted, "3d": summary}, warnings=plan.warnings + notes)
    plan = _staged_plan(graph, grouping, res, best, hw, options, summary)
    return dataclasses.replace(plan, warnings=plan.warnings + notes)


def _tensor_point(p: JointPoint) -> bool:
    """One stage, one micro-batch: a tensor plan (its remat policy emitted by autoshard.value_and_grad)."""
    return p.num_stages == 1 and p.microbatches == 1



def point_summary(p: JointPoint | None) -> dict[str, Any] | None:
    """A point as plain data for reports and JSON (`data` / `model` None when its stages' submeshes
    differ: `submeshes` has them per stage)."""
    if p is None:
        return None
    return {"stages": p.num_stages, "data": p.data, "model": p.model, "equal_submeshes": p.runnable,
            "submeshes": tuple((s.data, s.model) for s in p.stages), "microbatches": p.microbatches,
            "schedule": p.schedule, "virtual_stages": p.virtual, "step_time": p.step_time, "memory": p.memory,
            "remat": tuple(sorted({s.remat for s in p.stages})),
            "storage": tuple(sorted({s.storage for s in p.stages})),
            "units_per_stage": tuple(s.stop - s.start for s in p.stages), "label": p.label or p.describe()}


def _summary(res: JointResult, best: JointPoint) -> dict[str, Any]:
    grid = res.grid
    return {"chosen": point_summary(best), "tensor_only": point_summary(res.tensor_only),
            "pipeline_only": point_summary(res.pipeline_only), "megatron_grid": point_summary(grid.best),
            "megatron_grid_points": grid.points, "megatron_grid_reason": grid.reason,
            "equal_submeshes": best.runnable,
            "spmd_alternative": None if best.runnable else point_summary(res.runnable),
            "points": res.points, "candidates": res.candidates, "units": len(res.units),
            "unit_labels": tuple(res.units.labels),
            "search_seconds": res.seconds, "notes": tuple(res.notes)}


def _infeasible(res: JointResult, devices: int, hw: HardwareSpec, options: SearchOptions) -> InfeasiblePlanError:
    budget = options.memory_budget if options.memory_budget is not None else 0.9 * hw.memory_bytes
    least = res.least_memory
    if least is None:
        return InfeasiblePlanError(
            f"autoshard.plan: no 3-D plan of the step fits {fmt_bytes(budget)} per device on {devices} devices "
            f"({hw.name}), and no point could be priced. Fix: raise memory_budget or use more devices.",
            min_memory=math.inf, budget=budget)
    worst = max(least.stages, key=lambda s: s.memory)
    return InfeasiblePlanError(
        f"autoshard.plan: no 3-D plan fits {fmt_bytes(budget)} per device on {devices} devices ({hw.name}); "
        f"the plan needing least memory ({least.describe()}, storage {worst.storage}) takes "
        f"{fmt_bytes(least.memory)} on its fullest stage ({worst.stop - worst.start} of "
        f"{len(res.units)} units, {worst.inflight} micro-batch(es) in flight). Fix: more devices, a smaller "
        "batch, or a larger memory_budget.", min_memory=least.memory, budget=budget)


def _factor_axes(space: PlanSpace, row: tuple[int, ...]) -> dict[int, tuple[str, ...]]:
    names = space.mesh.names
    return {f: tuple(n for i, n in enumerate(names) if mask >> i & 1)
            for f, mask in zip(space.candidates, row, strict=True) if mask}


def _tensor_plan(graph: OpGraph, grouping: Grouping, res: JointResult, best: JointPoint, hw: HardwareSpec,
                 options: SearchOptions) -> Plan:
    """A one-stage point as the tensor plan it is: its factor assignment on its submesh."""
    mesh = submesh(best.data, best.model)
    st = best.stages[0]
    space = res.tables[(best.data, best.model)].space_of(st.sequence_parallel)
    # the point's factors are those of its space in the 3-D tables (the stream cut or not)
    sr = search(graph, grouping, mesh, hw, dataclasses.replace(options, sequence_parallel="off"),
                analysed=space.analysis)
    choice = sr.evaluate(_factor_axes(space, st.row), st.storage)
    if st.remat != "none":     # the 3-D tables price remat; the tensor evaluator keeps every activation
        mem = dict(choice.memory)
        g = sr._evaluator.evaluate(sr._evaluator.row(choice.factor_axes).reshape(1, -1), st.storage)
        # as the tables count them: every gradient and its reduction's result (XLA:CPU's is whole)
        mem["grads"] = float(g["grads_before"][0] + g["grads_scattered"][0])
        mem["cpu_temp_extra"] = float(g["grads_reduced"][0] - g["grads_scattered"][0])
        mem["activations"] = max(0.0, st.memory - mem["params"] - mem["grads"] - mem["optimizer"] - mem["data"])
        mem["total"] = st.memory
        choice = dataclasses.replace(choice, memory=mem, feasible=True,
                                     step_time=st.forward + st.backward + st.tail)
    chosen = dataclasses.replace(sr, best=choice)
    chosen._evaluator = sr._evaluator
    plan = build_plan(graph, grouping, mesh, hw, chosen, options, res.seconds)
    if st.remat != "none":
        replayed = _replayed_collectives(graph, res, sr, choice, st.remat, hw, options)
        plan = dataclasses.replace(plan, predicted={**plan.predicted,
                                                    "collectives": (*plan.predicted["collectives"], *replayed)})
    return dataclasses.replace(plan, stages=(dataclasses.replace(plan.stages[0], remat=st.remat),))


def _replayed_collectives(graph: OpGraph, res: JointResult, sr: Any, choice: Any, policy: str, hw: HardwareSpec,
                          options: SearchOptions) -> list[dict[str, Any]]:
    """The forward collectives the backward pass issues again when it replays the blocks' forward under
    `policy` (bridge/emit/remat_jaxpr.py): those of the block ops the policy recomputes ('full' all, 'dots' all
    but matmuls, whose reduced results are kept, 'selective' the attention cores'), at the plan's layout."""
    unit_of = {o: u for u, ops in enumerate(res.units.ops) for o in ops}
    attn = selective_ops(graph) if policy == "selective" else None
    _, space, _, cost, _ = sr._context
    allowed = {o for o, w in space.weights.items()
               if w > 0 and o in unit_of and graph.ops[o].phase == "forward"
               and (policy != "dots" or graph.ops[o].primitive not in ("dot_general", "conv_general_dilated"))
               and (attn is None or o in attn)}
    # replayed: the ops whose results the backward reads, and what they are computed from in their block
    todo = [o for o in allowed if any(graph.ops[c].phase != "forward" for v in graph.ops[o].outputs
                                      for c in graph.values[v].consumers)]
    replayed: set[int] = set()
    while todo:
        o = todo.pop()
        if o in replayed:
            continue
        replayed.add(o)
        for v in graph.ops[o].inputs:
            p = graph.values[v].producer
            if p is not None and p in allowed and unit_of.get(p) == unit_of[o]:
                todo.append(p)
    ev = space.evaluator(hw, cost, options, {o: space.weights[o] for o in sorted(replayed)})
    records = ev.comm_records(ev.row(choice.factor_axes), choice.storage)
    return [{"kind": k, "axes": tuple(axes), "phase": "backward", "bytes": b, "count": c}
            for (k, axes, phase), (b, c) in sorted(records.items()) if phase == "forward"]


def _staged_plan(graph: OpGraph, grouping: Grouping, res: JointResult, best: JointPoint, hw: HardwareSpec,
                 options: SearchOptions, summary: dict[str, Any]) -> Plan:
    first = res.tables[(best.stages[0].data, best.stages[0].model)]
    # the same for every stage: computed once (each walks the whole graph); factors per submesh
    op_map, keys = instance_maps(graph, grouping, first.space.periods), op_keys(graph)
    described: dict[tuple[int, int, bool], list] = {}
    stages, batch = [], traced_batch(graph)
    # the pipeline runtime traces and differentiates each stage's loss itself: constraints name forward
    # matmuls / gathers / convolutions only, whose op keys the loss alone shares with the step (the step's
    # differentiation adds elementwise forward ops, e.g. a norm's derivative, which shift their keys)
    forward = {i for i, op in enumerate(graph.ops) if op.phase == "forward" and op.primitive in _CONSTRAINED}
    for i, st in enumerate(best.stages):
        tables = res.tables[(st.data, st.model)]
        space, shape = tables.space_of(st.sequence_parallel), (st.data, st.model, st.sequence_parallel)
        fg, sub = space.fg, tuple(tables.mesh.axes)
        if shape not in described:
            described[shape] = describe_factors(graph, fg, space.candidates, {})
        ops = tuple(sorted({o for u in range(st.start, st.stop) for o in res.units.ops[u]}))
        axes_of = _factor_axes(space, st.row)
        split = int(tables.batch_split[tables.index(st.row, st.sequence_parallel)])
        params = _params(graph, ops)
        stages.append(Stage(
            index=i, mesh=sub, replicas=split, microbatch_size=max(1, batch // best.microbatches // split),
            predicted_forward=st.forward, predicted_backward=st.backward, memory=st.memory,
            microbatches=best.microbatches, after=(i - 1,) if i else (), units=tuple(range(st.start, st.stop)),
            ops=ops, modules=_modules(graph, ops), params=params,
            factors=tuple((f, desc, size, axes_of.get(f, ())) for f, desc, size, _ in described[shape]),
            storage=st.storage, remat=st.remat, param_specs=_param_specs(graph, space, axes_of, set(params)),
            batch_axes=_batch_axes(graph, space, axes_of),
            activation_constraints=tuple(activation_constraints(graph, op_map, fg, axes_of, forward & set(ops), keys))))
    # the runtime's mesh: always a pipe axis (one stage with several micro-batches accumulates gradients);
    # stages on unequal submeshes share no such mesh: their devices as one axis, each stage's its own
    mesh = (("pipe", best.ranks), *((n, s) for n, s in sub if s > 1)) if best.runnable else \
        (("devices", best.devices),)
    reports = tuple(ParamReport(graph.values[v].keypath or "", graph.values[v].shape, graph.values[v].dtype,
                                tuple(() for _ in graph.values[v].shape), 0, "see the stage holding it")
                    for v in graph.inputs if graph.values[v].role == "parameter")
    predicted = {"step_time": best.step_time, "memory": {"total": best.memory},
                 "memory_budget": options.memory_budget if options.memory_budget is not None
                 else 0.9 * hw.memory_bytes, "feasible": True, "search_seconds": res.seconds, "3d": summary}
    warnings = ()
    provenance = {"autoshard": VERSION, "fingerprint": fingerprint(graph), "step": graph.name,
                  "options": {"mesh": "auto", "search": dataclasses.asdict(options)}, "hardware": hardware_dict(hw)}
    return Plan(mesh=mesh, hardware=hw.name,
                input_keypaths=tuple(graph.values[v].keypath or "" for v in graph.inputs),
                input_specs_flat=tuple(tuple(() for _ in graph.values[v].shape) for v in graph.inputs),
                output_keypaths=tuple(graph.output_keypaths),
                output_specs_flat=tuple(tuple(() for _ in graph.values[v].shape) for v in graph.outputs),
                stages=tuple(stages), predicted=predicted, params=reports, warnings=warnings + tuple(res.notes),
                provenance=provenance, schedule=best.schedule, microbatches=best.microbatches)


def _param_specs(graph: OpGraph, space: PlanSpace, axes_of: dict[int, tuple[str, ...]],
                 keypaths: set[str]) -> tuple[tuple[str, Spec], ...]:
    """(keypath, spec) of the stage's parameters under its tensor plan (ZeRO-3 storage axes are the
    runtime's to add: `planner.storage_spec`)."""
    fg, in_map = space.fg, space.in_map
    out = []
    for v in graph.inputs:
        val = graph.values[v]
        if val.role != "parameter" or val.keypath not in keypaths:
            continue
        src = in_map.get(v, v)
        spec = [tuple(axes_of.get(f, ())) if f is not None else () for f in fg.value_factors(src)] \
            if len(graph.values[src].shape) == len(val.shape) else [()] * len(val.shape)
        out.append((val.keypath or "", tuple(spec)))
    return tuple(out)


def _batch_axes(graph: OpGraph, space: PlanSpace, axes_of: dict[int, tuple[str, ...]]) -> tuple[str, ...]:
    """The submesh axes the stage's plan splits the batch over (the data inputs' leading factor)."""
    fg, axes = space.fg, []
    for v in graph.inputs:
        if graph.values[v].role == "data" and graph.values[v].shape:
            f = fg.value_factors(space.in_map.get(v, v))[0]
            axes += [a for a in axes_of.get(f, ()) if a not in axes] if f is not None else []
    return tuple(a for a in space.mesh.names if a in axes)
