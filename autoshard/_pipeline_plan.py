"""autoshard.plan(..., pipeline="rannc"): pipeline stages as a Plan (RaNNC partitioner in `pipeline/`).

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

PIPELINES = ("rannc",)
PROFILES = ("model", "measured")
PIPELINE_OPTIONS = frozenset({"k", "recompute", "use_blocks", "exhaustive", "prune"})


def _check(pipeline: str, schedule: str, profile: str, options: Mapping[str, Any]) -> None:
    if pipeline not in PIPELINES:
        raise PlanError(f"autoshard.plan: pipeline={pipeline!r} is unknown; valid: {list(PIPELINES)} "
                        "(or None for tensor sharding only).")
    if schedule not in ("1f1b", "gpipe"):
        raise PlanError(f"autoshard.plan: schedule={schedule!r} is not supported by the {pipeline} partitioner; "
                        "valid: ['1f1b', 'gpipe'].")
    if profile not in PROFILES:
        raise PlanError(f"autoshard.plan: profile={profile!r} is unknown; valid: {list(PROFILES)} ('model' "
                        "prices ops with the hardware spec's roofline, 'measured' times them on the local device).")
    unknown = sorted(set(options) - PIPELINE_OPTIONS)
    if unknown:
        raise PlanError(f"autoshard.plan: pipeline_options keys {unknown} are unknown; valid: "
                        f"{sorted(PIPELINE_OPTIONS)}.")


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


def _max_over_mean(sp: Any) -> float:
    t = [s.predicted_forward + s.predicted_backward for s in sp.stages]
    return max(t) / (sum(t) / len(t)) if t and sum(t) > 0 else 1.0


def pipeline_plan(step: Callable, *args: Any, mesh: MeshSpec, hw: HardwareSpec, memory_budget: float | None,
                  pipeline: str, schedule: str = "1f1b", profile: str = "model",
                  options: Mapping[str, Any] | None = None) -> Plan:
    import pipeline as pipe_pkg  # pure partitioners; imported here because `pipeline` imports autoshard

    from . import __version__
    from ._planner import fingerprint

    options = dict(options or {})
    _check(pipeline, schedule, profile, options)
    devices = math.prod(s for _, s in mesh.axes)
    stage_counts = [mesh.axis_size("pipe")] if "pipe" in mesh.names else None
    graph = trace(step, *args, keep_eqns=profile == "measured")
    grouping = group(graph)
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
                              exhaustive=bool(options.get("exhaustive", False)),
                              prune=bool(options.get("prune", False)),
                              costs=costs, stage_counts=stage_counts, **kw)
    uniform = pipe_pkg.best_uniform(costs, devices, grouping=grouping, schedule=schedule,
                                    memory_budget=sp.memory_budget, stage_counts=stage_counts, **kw)
    stages = tuple(PipelineStage(
        index=s.index, blocks=s.blocks, ops=s.ops, modules=_modules(graph, s.ops), params=_params(graph, s.ops),
        replicas=s.replicas, microbatch_size=s.microbatch_size, predicted_forward=s.predicted_forward,
        predicted_backward=s.predicted_backward, memory=s.memory) for s in sp.stages)
    stage_of_param = {kp: s.index for s in stages for kp in s.params}
    reports = []
    for v in graph.inputs:
        val = graph.values[v]
        if val.role != "parameter":
            continue
        st = stage_of_param.get(val.keypath or "")
        holders = [s for s in stages if (val.keypath or "") in s.params]
        sync = (f"all-reduce over the {sum(s.replicas for s in holders)} devices of stage(s) "
                f"{','.join(str(s.index) for s in holders)}" if holders and sum(s.replicas for s in holders) > 1
                else "none")
        reports.append(ParamReport(val.keypath or "", val.shape, val.dtype, tuple(() for _ in val.shape),
                                   val.nbytes if st is not None else 0, sync))
    specs = tuple(tuple(() for _ in graph.values[v].shape) for v in graph.inputs)
    out_specs = tuple(tuple(() for _ in graph.values[v].shape) for v in graph.outputs)
    pp = {"method": sp.method, "schedule": sp.schedule, "profile": profile, "devices": sp.devices,
          "pipelines": sp.pipelines, "batch_size": sp.batch_size, "objective": sp.objective,
          "search_seconds": sp.search_seconds, "dp_calls": sp.dp_calls, "units": int(sp.stages[-1].blocks[1]),
          "max_over_mean": _max_over_mean(sp)}
    # the same stages through the event simulator: the formula above is what the DP optimises
    # (max forward + max backward per micro-batch); the simulator runs the schedule's actual order
    sched = pipe_pkg.schedule(schedule, num_stages=len(sp.stages), num_microbatches=sp.microbatches)
    sim = pipe_pkg.simulate(sched, forward=list(sp.predicted_forward), backward=list(sp.predicted_backward))
    pp.update(simulated_step_time=sim.makespan, bubble_fraction=sim.bubble_fraction,
              peak_inflight=tuple(sim.peak_inflight))
    if uniform is not None:
        pp["uniform"] = {"stages": len(uniform.stages), "replicas": uniform.stages[0].replicas,
                         "microbatches": uniform.microbatches, "step_time": uniform.step_time,
                         "max_over_mean": _max_over_mean(uniform)}
    predicted = {"step_time": sp.step_time, "memory": {"total": max(sp.memory)}, "memory_budget": sp.memory_budget,
                 "feasible": True, "search_seconds": sp.search_seconds, "pipeline": pp}
    provenance = {"autoshard": __version__, "fingerprint": fingerprint(graph), "step": graph.name,
                  "options": {"pipeline": pipeline, "schedule": schedule, "profile": profile, **options},
                  "hardware": {f.name: (dict(getattr(hw, f.name)) if isinstance(getattr(hw, f.name), Mapping)
                                        else getattr(hw, f.name)) for f in dataclasses.fields(hw)}}
    out = Plan(mesh=tuple(mesh.axes), hardware=hw.name,
               input_keypaths=tuple(graph.values[v].keypath or "" for v in graph.inputs),
               input_specs_flat=specs, output_keypaths=tuple(graph.output_keypaths), output_specs_flat=out_specs,
               activation_constraints=(), factors=(), storage="replicated", predicted=predicted,
               params=tuple(reports), warnings=tuple(warnings), provenance=provenance, stages=stages,
               microbatches=sp.microbatches)
    return out.bind(*args)
