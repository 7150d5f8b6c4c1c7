"""Pipeline plans: a registered partitioner's `StagePartition` as a Plan (pure: no jax import).

The partitioner works over all devices of the mesh: it chooses the stages, the devices (replicas,
data parallel) of each stage and the micro-batch count. A mesh axis named "pipe" fixes the stage
count to its size. Tensor specs inside a stage are replicated (each replica holds its stage's
parameters whole); the plan's `stages` say which parameters and ops each stage holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..core.errors import InfeasiblePlanError, PipelineError, PlanError
from ..core.graph import OpGraph, fingerprint
from ..core.hardware import HardwareSpec, hardware_dict
from ..core.mesh import MeshSpec
from ..core.version import VERSION
from ..pipeline.partition import PartitionProblem, Profiler, StagePartition, max_over_mean
from ..pipeline.registry import AUTO, get_partitioner, partitioner_names
from ..pipeline.schedules.simulate import simulate
from .plan import ParamReport, Plan, Stage


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


def pipeline_plan(graph: OpGraph, *, mesh: MeshSpec, hw: HardwareSpec, memory_budget: float | None,
                  pipeline: str, schedule: str = "1f1b", profile: str = "model",
                  options: Mapping[str, Any] | None = None, profiler: Profiler | None = None,
                  num_microbatches: int | None = None) -> Plan:
    """The pipeline plan of the traced step `graph` by the registered partitioner `pipeline` (or
    "auto": the best of all that apply). `profiler` times ops on the local device for profile="measured";
    `num_microbatches`, when given, is the plan's micro-batch count (the count the runtime will run).
    The arguments are validated by `Config`."""
    options = dict(options or {})
    if profile == "measured" and profiler is None:
        raise PlanError("autoshard.plan: profile='measured' needs the step itself to time its ops; plan with "
                        "autoshard.plan(step, *args, ...), not from a graph alone.")
    if pipeline == AUTO:
        return _auto(graph, mesh, hw, memory_budget, schedule, profile, options, profiler, num_microbatches)
    problem = PartitionProblem(graph, mesh, hw, memory_budget, schedule, options, profile,
                               profiler if profile == "measured" else None, num_microbatches)
    return _plan_from_partition(graph, _partition(get_partitioner(pipeline), problem), problem, pipeline)


def _partition(partitioner: Any, problem: PartitionProblem) -> StagePartition:
    """The partitioner's result, refused when it ignores the micro-batch count asked for (the runtime
    would run that count while the plan was priced for its own)."""
    want = problem.num_microbatches
    try:
        part = partitioner.partition(problem)
    except InfeasiblePlanError as err:
        if want is None:
            raise
        raise InfeasiblePlanError(f"{err} (planned for num_microbatches={want}: each micro-batch must give every "
                                  "replica of a stage a sample; fewer micro-batches, or none given, may fit)",
                                  min_memory=err.min_memory, budget=err.budget) from err
    got = sorted({s.microbatches for s in part.stages})
    if want is not None and got != [want]:
        raise PipelineError(f"autoshard.plan: num_microbatches={want}, but the {partitioner.name} partitioner "
                            f"chooses its own micro-batch count ({', '.join(map(str, got))}) and cannot plan for "
                            f"{want}. Fix: drop num_microbatches (the plan's count is then run), or use "
                            "pipeline='rannc', which plans for the given count.")
    return part


def _auto(graph: OpGraph, mesh: MeshSpec, hw: HardwareSpec, memory_budget: float | None, schedule: str,
          profile: str, options: Mapping[str, Any], profiler: Profiler | None, num_microbatches: int | None) -> Plan:
    """pipeline="auto": every registered partitioner that applies (its schedules, the mesh), on one
    trace; the plan with the shortest simulated step wins (the same event simulator times all), and
    the plan records every candidate's step or why it had none."""
    parts = [get_partitioner(n) for n in partitioner_names()]
    skipped: dict[str, str] = {}
    chosen_parts = []
    for p in parts:
        mine = {k: v for k, v in options.items() if k in p.options}
        why = (f"schedule {schedule!r} is not one of its {list(p.schedules)}" if schedule not in p.schedules
               else p.unsupported(mesh, mine))
        if why:
            skipped[p.name] = why
        else:
            chosen_parts.append((p, mine))
    if not chosen_parts:
        raise PlanError(f"autoshard.plan: pipeline='auto' has no partitioner for schedule={schedule!r} on mesh "
                        f"{mesh}: {'; '.join(f'{k}: {v}' for k, v in skipped.items())}. Fix: schedule='1f1b'.")
    plans: dict[str, Plan] = {}
    first_error: Exception | None = None
    for p, mine in chosen_parts:
        problem = PartitionProblem(graph, mesh, hw, memory_budget, schedule, mine, profile,
                                   profiler if profile == "measured" else None, num_microbatches)
        try:
            plans[p.name] = _plan_from_partition(graph, _partition(p, problem), problem, p.name)
        except (PipelineError, InfeasiblePlanError) as e:   # recorded: another may fit
            skipped[p.name] = str(e).splitlines()[0]
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


def _plan_from_partition(graph: OpGraph, part: StagePartition, problem: PartitionProblem, pipeline: str) -> Plan:
    hw, mesh = problem.hardware, problem.mesh
    # each stage is data parallel over its replicas (its tensor part: the batch split over "data")
    stages = tuple(Stage(
        index=i, mesh=(("data", st.replicas),), replicas=st.replicas, microbatch_size=st.microbatch_size,
        predicted_forward=st.forward, predicted_backward=st.backward, memory=st.memory,
        microbatches=st.microbatches, after=st.after, units=st.units, ops=st.ops, modules=_modules(graph, st.ops),
        params=_params(graph, st.ops)) for i, st in enumerate(part.stages))
    fwd, bwd = [s.predicted_forward for s in stages], [s.predicted_backward for s in stages]
    # the stages through the event simulator: RaNNC's DP optimises a formula (max forward + max
    # backward per extra micro-batch); the simulator runs the schedule's actual order
    sim = simulate(part.schedule, forward=fwd, backward=bwd)
    microbatches = max(s.microbatches for s in stages)
    pp = {"method": part.method, "schedule": part.schedule.name, "pipelines": part.pipelines,
          "batch_size": part.batch_size, **part.info, "search_seconds": part.search_seconds, "units": part.units,
          "microbatches": microbatches, "unit": part.unit, "profile": problem.profile, "devices": problem.devices,
          "devices_used": sum(s.replicas for s in stages), "depth": stage_depth(stages),
          "max_over_mean": max_over_mean(fwd, bwd), "simulated_step_time": sim.makespan,
          "bubble_fraction": sim.bubble_fraction, "peak_inflight": tuple(sim.peak_inflight),
          "baseline_name": part.baseline_name, "baseline_reason": part.baseline_reason}
    if part.baseline is not None:
        pp["baseline"] = dataclasses.asdict(part.baseline)
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
    predicted = {"step_time": part.step_time, "memory": {"total": max(s.memory for s in stages)},
                 "memory_budget": part.memory_budget, "feasible": True, "search_seconds": part.search_seconds,
                 "pipeline": pp}
    provenance = {"autoshard": VERSION, "fingerprint": fingerprint(graph), "step": graph.name,
                  "options": {"pipeline": pipeline, "schedule": problem.schedule, "profile": problem.profile,
                              **problem.options},
                  "hardware": hardware_dict(hw)}
    return Plan(mesh=tuple(mesh.axes), hardware=hw.name,
                input_keypaths=tuple(graph.values[v].keypath or "" for v in graph.inputs),
                input_specs_flat=tuple(tuple(() for _ in graph.values[v].shape) for v in graph.inputs),
                output_keypaths=tuple(graph.output_keypaths),
                output_specs_flat=tuple(tuple(() for _ in graph.values[v].shape) for v in graph.outputs),
                stages=stages, predicted=predicted, params=tuple(reports), warnings=part.warnings,
                provenance=provenance, schedule=part.schedule.name, microbatches=microbatches)


def stage_depth(stages: tuple[Stage, ...]) -> int:
    """Stages on the longest path of the stage DAG."""
    after = {s.index: s.after for s in stages}
    depth: dict[int, int] = {}

    def d(i: int) -> int:
        if i not in depth:
            depth[i] = 1 + max((d(a) for a in after[i]), default=0)
        return depth[i]

    return max((d(i) for i in after), default=0)
