"""autoshard.plan(..., pipeline="rannc" | "graphpipe" | "auto"): pipeline stages as a Plan (`pipeline/`).

The partitioner works over all devices of the mesh: it chooses the stages, the devices (replicas,
data parallel) of each stage and the micro-batch count. A mesh axis named "pipe" fixes the stage
count to its size. Tensor specs inside a stage are replicated (each replica holds its stage's
parameters whole); the plan's `stages` say which parameters and ops each stage holds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from ._errors import PlanError
from ._graph import OpGraph
from ._group import group
from ._hardware import HardwareSpec
from ._mesh import MeshSpec
from ._plan import ParamReport, PipelineStage, Plan
from ._trace import trace

PIPELINES = ("rannc", "graphpipe")
PROFILES = ("model", "measured")
PIPELINE_OPTIONS = {"rannc": frozenset({"k", "recompute", "use_blocks", "search", "prune"}),
                    "graphpipe": frozenset({"max_microbatch_size", "depth", "per_stage_microbatch"})}
SCHEDULES = {"rannc": ("1f1b", "gpipe"), "graphpipe": ("1f1b", "graph-1f1b")}


def _check(pipeline: str, schedule: str, profile: str, options: Mapping[str, Any], mesh: MeshSpec) -> None:
    if pipeline not in PIPELINES:
        raise PlanError(f"autoshard.plan: pipeline={pipeline!r} is unknown; valid: {[*PIPELINES, 'auto']} "
                        "(or None for tensor sharding only).")
    if schedule not in SCHEDULES[pipeline]:
        raise PlanError(f"autoshard.plan: schedule={schedule!r} is not supported by the {pipeline} partitioner; "
                        f"valid: {list(SCHEDULES[pipeline])}.")
    if profile not in PROFILES:
        raise PlanError(f"autoshard.plan: profile={profile!r} is unknown; valid: {list(PROFILES)} ('model' "
                        "prices ops with the hardware spec's roofline, 'measured' times them on the local device).")
    unknown = sorted(set(options) - PIPELINE_OPTIONS[pipeline])
    if unknown:
        raise PlanError(f"autoshard.plan: pipeline_options keys {unknown} are unknown for pipeline={pipeline!r}; "
                        f"valid: {sorted(PIPELINE_OPTIONS[pipeline])}.")
    if options.get("search", "all") not in ("stage", "node", "all"):
        raise PlanError(f"autoshard.plan: pipeline_options search={options['search']!r} is unknown; valid: 'all' "
                        "(every node and stage count, default), 'node', 'stage' (the paper's first feasible count).")
    if pipeline == "graphpipe" and "pipe" in mesh.names:
        raise PlanError(f"autoshard.plan: mesh {mesh} has a 'pipe' axis, but GraphPipe chooses the stage DAG and "
                        "each stage's devices itself. Fix: pass the devices as one axis (e.g. {'data': "
                        f"{math.prod(s for _, s in mesh.axes)}}}), or pipeline='rannc' to fix the stage count.")


def _modules(graph: OpGraph, ops: tuple[int, ...]) -> tuple[str, ...]:
    """Top two levels of the forward ops' module paths, in first-use order."""
    seen: dict[str, None] = {}
    for o in ops:
        op = graph.ops[o]
        if op.phase == "forward" and op.module:
            seen.setdefault("/".join(op.module.split("/")[:2]), None)
    return tuple(seen)


def _params(graph: OpGraph, ops: tuple[int, ...]) -> tuple[str, ...]:
    held = {v for o in ops for v in graph.ops[o].inputs
            if graph.values[v].kind == "input" and graph.values[v].role == "parameter"}
    return tuple(graph.values[v].keypath or "" for v in graph.inputs if v in held)


def _max_over_mean(fwd: list[float], bwd: list[float]) -> float:
    t = [f + b for f, b in zip(fwd, bwd, strict=True)]
    return max(t) / (sum(t) / len(t)) if t and sum(t) > 0 else 1.0


def _rannc(pipe_pkg: Any, graph: OpGraph, devices: int, hw: HardwareSpec, memory_budget: float | None,
           schedule: str, profile: str, options: Mapping[str, Any], stage_counts: list[int] | None) -> dict:
    atomic = pipe_pkg.atomic_partition(graph)
    warnings: list[str] = []
    op_time = None
    if profile == "measured":
        from ._profile import measure_op_times

        model_costs = pipe_pkg.PipelineCosts(atomic, hw)
        reps = [op.repeat for op in graph.ops]
        op_time, warnings = measure_op_times(graph, lambda i: model_costs.op_time[i] / reps[i])
    costs = pipe_pkg.PipelineCosts(atomic, hw, op_time=op_time)
    kw = {k: options[k] for k in ("recompute",) if k in options}
    sp = pipe_pkg.plan_stages(graph, devices, hw, k=int(options.get("k", 32)), schedule=schedule,
                              memory_budget=memory_budget, use_blocks=bool(options.get("use_blocks", True)),
                              search=str(options.get("search", "all")), prune=bool(options.get("prune", False)),
                              costs=costs, stage_counts=stage_counts, **kw)
    uniform = pipe_pkg.best_uniform(costs, devices, grouping=group(graph), schedule=schedule,
                                    memory_budget=sp.memory_budget, stage_counts=stage_counts, **kw)
    stages = [dict(units=tuple(range(*s.blocks)), ops=s.ops, replicas=s.replicas, microbatch_size=s.microbatch_size,
                   forward=s.predicted_forward, backward=s.predicted_backward, memory=s.memory,
                   microbatches=sp.microbatches, after=(s.index - 1,) if s.index else ()) for s in sp.stages]
    sched = pipe_pkg.schedule(schedule, num_stages=len(sp.stages), num_microbatches=sp.microbatches)
    out = dict(stages=stages, schedule=sched, step_time=sp.step_time, budget=sp.memory_budget, warnings=warnings,
               info={"method": sp.method, "schedule": sp.schedule, "pipelines": sp.pipelines,
                     "batch_size": sp.batch_size, "objective": sp.objective, "search_seconds": sp.search_seconds,
                     "dp_calls": sp.dp_calls, "units": int(sp.stages[-1].blocks[1]), "microbatches": sp.microbatches,
                     "unit": "blocks" if options.get("use_blocks", True) else "atomic components"},
               baseline_name="uniform layer split",
               baseline_reason="it needs at least as many repeated layers as stages, stage counts dividing the "
                               "devices, and must fit the memory budget")
    if uniform is not None:
        out["baseline"] = {"name": "uniform layer split", "stages": len(uniform.stages), "depth": len(uniform.stages),
                           "microbatches": uniform.microbatches, "step_time": uniform.step_time,
                           "max_over_mean": _max_over_mean(list(uniform.predicted_forward),
                                                           list(uniform.predicted_backward)),
                           "hint": "the partitioner searches blocks, not layer boundaries; try more blocks, "
                                   "pipeline_options={'k': ...}"}
    return out


def _graphpipe(pipe_pkg: Any, graph: OpGraph, devices: int, hw: HardwareSpec, memory_budget: float | None,
               options: Mapping[str, Any], profile: str, step: Callable, args: tuple) -> dict:
    measured: list[str] = []
    kw_lg: dict[str, Any] = {}
    if profile == "measured":
        # GraphPipe picks micro-batch sizes from each layer's time at every size, so every op is
        # timed at each size (the step traced again with its data inputs cut to that many samples)
        from ._profile import measured_layer_costs

        op_time, op_curves, measured = measured_layer_costs(step, args, graph, hw)
        kw_lg = {"op_time": op_time, "op_curves": op_curves}
    lg = pipe_pkg.layer_graph(graph, hw, depth=options.get("depth"), **kw_lg)
    kw = {"memory_budget": memory_budget, "max_microbatch_size": options.get("max_microbatch_size"),
          "per_stage_microbatch": options.get("per_stage_microbatch", False)}
    gp = pipe_pkg.graphpipe_partition(lg, devices, hw, **kw)
    try:
        spp = pipe_pkg.spp_partition(lg, devices, hw, **kw)
    except pipe_pkg.PipelineInfeasibleError:
        spp = None
    after = {s.index: tuple(sorted(u for u, v in gp.edges if v == s.index)) for s in gp.stages}
    stages = [dict(units=tuple(sorted(s.nodes)), ops=tuple(sorted({o for n in s.nodes for o in lg.nodes[n].ops})),
                   replicas=s.devices, microbatch_size=-(-s.microbatch_size // s.devices), forward=s.forward,
                   backward=s.backward, memory=s.memory, microbatches=s.num_microbatches, after=after[s.index])
              for s in gp.stages]
    used = sum(s.devices for s in gp.stages)
    warnings = list(measured) if used == devices else [*measured,
        f"graphpipe uses {used} of the {devices} devices: every micro-batch size is a power of two dividing "
        f"the batch of {gp.batch_size}, and a stage gets at most one device per sample of its micro-batch; "
        "a larger batch (or fewer devices) uses them all"]
    out = dict(stages=stages, schedule=gp.schedule, step_time=gp.step_time, budget=memory_budget, warnings=warnings,
               info={"method": gp.method, "schedule": gp.schedule.name, "pipelines": 1, "batch_size": gp.batch_size,
                     "time_per_sample": gp.time_per_sample, "search_seconds": gp.search_seconds, "units": len(lg),
                     "microbatches": max(s.num_microbatches for s in gp.stages), "edges": tuple(gp.edges),
                     "unit": "layer nodes"},
               baseline_name="sequential pipeline (SPP)",
               baseline_reason="no sequential split fits the memory budget")
    if spp is not None:
        out["baseline"] = {"name": "sequential pipeline (SPP)", "stages": len(spp.stages), "depth": spp.depth,
                           "microbatches": max(s.num_microbatches for s in spp.stages), "step_time": spp.step_time,
                           "max_over_mean": _max_over_mean([s.forward for s in spp.stages],
                                                           [s.backward for s in spp.stages]),
                           "hint": "GraphPipe keeps stages to whole series-parallel parts of the graph"}
    return out


def pipeline_plan(step: Callable, *args: Any, mesh: MeshSpec, hw: HardwareSpec, memory_budget: float | None,
                  pipeline: str, schedule: str = "1f1b", profile: str = "model",
                  options: Mapping[str, Any] | None = None) -> Plan:
    import pipeline as pipe_pkg  # pure partitioners; imported here because `pipeline` imports autoshard

    options = dict(options or {})
    if pipeline == "auto":
        return _auto(step, args, mesh, hw, memory_budget, schedule, profile, options)
    _check(pipeline, schedule, profile, options, mesh)
    graph = trace(step, *args, keep_eqns=profile == "measured")
    return _plan_from_graph(pipe_pkg, step, args, graph, mesh, hw, memory_budget, pipeline, schedule, profile,
                            options)


def _auto(step: Callable, args: tuple, mesh: MeshSpec, hw: HardwareSpec, memory_budget: float | None,
          schedule: str, profile: str, options: Mapping[str, Any]) -> Plan:
    """pipeline="auto": every partitioner that applies (GraphPipe needs no "pipe" axis; each has its
    schedules), on one trace; the plan with the shortest simulated step wins (the same event
    simulator times both), and the plan records every candidate's step or why it had none."""
    import pipeline as pipe_pkg

    if profile not in PROFILES:
        _check("rannc", "1f1b", profile, {}, mesh)                  # the same typed error
    unknown = sorted(set(options) - set().union(*PIPELINE_OPTIONS.values()))
    if unknown:
        raise PlanError(f"autoshard.plan: pipeline_options keys {unknown} are unknown for pipeline='auto'; valid: "
                        f"{sorted(set().union(*PIPELINE_OPTIONS.values()))} (each goes to the partitioner it names "
                        f"in {dict((k, sorted(v)) for k, v in PIPELINE_OPTIONS.items())}).")
    skipped: dict[str, str] = {}
    names = []
    for name in PIPELINES:
        if schedule not in SCHEDULES[name]:
            skipped[name] = f"schedule {schedule!r} is not one of its {list(SCHEDULES[name])}"
        elif name == "graphpipe" and "pipe" in mesh.names:
            skipped[name] = "the mesh has a 'pipe' axis (GraphPipe chooses its stage DAG itself)"
        else:
            names.append(name)
    if not names:
        raise PlanError(f"autoshard.plan: pipeline='auto' has no partitioner for schedule={schedule!r} on mesh "
                        f"{mesh}: {'; '.join(f'{k}: {v}' for k, v in skipped.items())}. Fix: schedule='1f1b'.")
    mine = {name: {k: v for k, v in options.items() if k in PIPELINE_OPTIONS[name]} for name in names}
    for name in names:
        _check(name, schedule, profile, mine[name], mesh)
    graph = trace(step, *args, keep_eqns=profile == "measured")
    plans: dict[str, Plan] = {}
    first_error: Exception | None = None
    for name in names:
        try:
            plans[name] = _plan_from_graph(pipe_pkg, step, args, graph, mesh, hw, memory_budget, name, schedule,
                                           profile, mine[name])
        except (pipe_pkg.PipelineError, pipe_pkg.PipelineInfeasibleError) as e:   # recorded: the other may fit
            skipped[name] = str(e).splitlines()[0]
            first_error = first_error or e
    if not plans:
        raise first_error   # every candidate failed: the first one's typed error, whole
    steps = {name: p.predicted["pipeline"]["simulated_step_time"] for name, p in plans.items()}
    best = min(steps, key=lambda n: (steps[n], n))
    chosen = plans[best]
    auto = {"chosen": best, "simulated_step_time": steps, "skipped": skipped}
    predicted = {**chosen.predicted, "pipeline": {**chosen.predicted["pipeline"], "auto": auto}}
    provenance = {**chosen.provenance, "options": {**chosen.provenance["options"], "pipeline": "auto"}}
    return dataclasses.replace(chosen, predicted=predicted, provenance=provenance)


def _plan_from_graph(pipe_pkg: Any, step: Callable, args: tuple, graph: OpGraph, mesh: MeshSpec,
                     hw: HardwareSpec, memory_budget: float | None, pipeline: str, schedule: str, profile: str,
                     options: Mapping[str, Any]) -> Plan:
    from . import __version__
    from ._planner import fingerprint

    devices = math.prod(s for _, s in mesh.axes)
    if pipeline == "rannc":
        stage_counts = [mesh.axis_size("pipe")] if "pipe" in mesh.names else None
        res = _rannc(pipe_pkg, graph, devices, hw, memory_budget, schedule, profile, options, stage_counts)
    else:
        res = _graphpipe(pipe_pkg, graph, devices, hw, memory_budget, options, profile, step, args)
    info = res["info"]
    stages = tuple(PipelineStage(
        index=i, units=st["units"], ops=st["ops"], modules=_modules(graph, st["ops"]), params=_params(graph, st["ops"]),
        replicas=st["replicas"], microbatch_size=st["microbatch_size"], predicted_forward=st["forward"],
        predicted_backward=st["backward"], memory=st["memory"], microbatches=st["microbatches"], after=st["after"])
        for i, st in enumerate(res["stages"]))
    fwd, bwd = [s.predicted_forward for s in stages], [s.predicted_backward for s in stages]
    # the stages through the event simulator: RaNNC's DP optimises a formula (max forward + max
    # backward per extra micro-batch); the simulator runs the schedule's actual order
    sim = pipe_pkg.simulate(res["schedule"], forward=fwd, backward=bwd)
    budget = res["budget"]
    if budget is None:
        from pipeline._blocks import DEFAULT_MEMORY_FRACTION

        budget = DEFAULT_MEMORY_FRACTION * hw.memory_bytes
    depth = stage_depth(stages)
    pp = {**info, "profile": profile, "devices": devices, "devices_used": sum(s.replicas for s in stages),
          "depth": depth, "max_over_mean": _max_over_mean(fwd, bwd),
          "simulated_step_time": sim.makespan, "bubble_fraction": sim.bubble_fraction,
          "peak_inflight": tuple(sim.peak_inflight), "baseline_name": res["baseline_name"],
          "baseline_reason": res["baseline_reason"]}
    if "baseline" in res:
        pp["baseline"] = res["baseline"]
    reports = []
    for v in graph.inputs:
        val = graph.values[v]
        if val.role != "parameter":
            continue
        holders = [s for s in stages if (val.keypath or "") in s.params]
        n = sum(s.replicas for s in holders)
        sync = (f"all-reduce over the {n} devices of stage(s) {','.join(str(s.index) for s in holders)}"
                if n > 1 else "none")
        reports.append(ParamReport(val.keypath or "", val.shape, val.dtype, tuple(() for _ in val.shape),
                                   val.nbytes if holders else 0, sync))
    predicted = {"step_time": res["step_time"], "memory": {"total": max(s.memory for s in stages)},
                 "memory_budget": budget, "feasible": True, "search_seconds": info["search_seconds"], "pipeline": pp}
    provenance = {"autoshard": __version__, "fingerprint": fingerprint(graph), "step": graph.name,
                  "options": {"pipeline": pipeline, "schedule": schedule, "profile": profile, **options},
                  "hardware": {f.name: (dict(getattr(hw, f.name)) if isinstance(getattr(hw, f.name), Mapping)
                                        else getattr(hw, f.name)) for f in dataclasses.fields(hw)}}
    out = Plan(mesh=tuple(mesh.axes), hardware=hw.name,
               input_keypaths=tuple(graph.values[v].keypath or "" for v in graph.inputs),
               input_specs_flat=tuple(tuple(() for _ in graph.values[v].shape) for v in graph.inputs),
               output_keypaths=tuple(graph.output_keypaths),
               output_specs_flat=tuple(tuple(() for _ in graph.values[v].shape) for v in graph.outputs),
               activation_constraints=(), factors=(), storage="replicated", predicted=predicted,
               params=tuple(reports), warnings=tuple(res["warnings"]), provenance=provenance, stages=stages,
               microbatches=info["microbatches"])
    return out.bind(*args)


def stage_depth(stages: tuple[PipelineStage, ...]) -> int:
    """Stages on the longest path of the stage DAG."""
    after = {s.index: s.after for s in stages}
    depth: dict[int, int] = {}

    def d(i: int) -> int:
        if i not in depth:
            depth[i] = 1 + max((d(a) for a in after[i]), default=0)
        return depth[i]

    return max((d(i) for i in after), default=0)
