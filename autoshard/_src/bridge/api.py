"""`autoshard.plan`, `autoshard.expert_plan` and `autoshard.bind`: trace once, then the pure planners."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from ..core.errors import PlanError
from ..core.graph import OpGraph
from ..core.hardware import HardwareSpec, get_hardware
from ..core.mesh import mesh_spec
from ..plan.pipeline_planner import check_pipeline_request, pipeline_plan
from ..plan.plan import Plan
from ..plan.planner import expert_tensor_plan, tensor_plan
from ..tensor.search import SearchOptions
from .emit import JaxArgs
from .profile import StepProfiler
from .trace import trace


def bind(plan: Plan, *args: Any) -> Plan:
    """`plan` bound to the structure of `args` (arrays or ShapeDtypeStructs), so `plan.input_specs`
    and emission know the pytree; raises PlanError if the plan was made for other arguments."""
    return plan.with_args(JaxArgs.of(args))


def plan(step: Callable, *args: Any, mesh: Any, hardware: str | HardwareSpec | Mapping = "cpu-sim",
         memory_budget: float | None = None, devices: int | None = None,
         options: SearchOptions | None = None, pipeline: str | None = None, schedule: str = "1f1b",
         profile: str = "model", pipeline_options: Mapping[str, Any] | None = None) -> Plan:
    """Plan `step(*args)` on `mesh` (dict, jax Mesh, or "auto" with `devices`).

    `pipeline="rannc"` partitions the step into pipeline stages instead (RaNNC: stages, replicas
    per stage and micro-batch count over all the mesh's devices; a "pipe" axis fixes the stage
    count), with `schedule` "1f1b" or "gpipe", `profile` "model" (roofline on the hardware spec) or
    "measured" (ops timed on the local device), and `pipeline_options` k (blocks, default 32),
    recompute, use_blocks, search ("all" | "node" | "stage"), prune. `pipeline="graphpipe"` chooses
    a DAG of stages over the model's branches (GraphPipe; schedule "1f1b"/"graph-1f1b", options
    max_microbatch_size, depth, per_stage_microbatch); its measured profile times every op at each
    micro-batch size. `pipeline="auto"` plans with every registered partitioner that applies and
    keeps the shorter simulated step. Any registered partitioner's name works (`pipeline.register_partitioner`).
    """
    return bind(plan_graph(step, args, None, mesh=mesh, hw=get_hardware(hardware), memory_budget=memory_budget,
                           devices=devices, options=options, pipeline=pipeline, schedule=schedule, profile=profile,
                           pipeline_options=pipeline_options), *args)


def plan_graph(step: Callable, args: tuple, graph: OpGraph | None, *, mesh: Any, hw: HardwareSpec,
               memory_budget: float | None, devices: int | None, options: SearchOptions | None,
               pipeline: str | None, schedule: str, profile: str, pipeline_options: Mapping[str, Any] | None) -> Plan:
    """The plan of `step(*args)`, reusing `graph` when the caller has traced it already (unbound)."""
    if pipeline is not None:
        if isinstance(mesh, str) and mesh == "auto":
            if devices is None:
                raise PlanError("autoshard.plan: mesh='auto' needs devices=<count>.")
            mesh = {"data": int(devices)}
        m = mesh_spec(mesh)
        check_pipeline_request(pipeline, schedule, profile, dict(pipeline_options or {}), m)
        if graph is None or (profile == "measured" and graph.eqns is None):
            graph = trace(step, *args, keep_eqns=profile == "measured")
        return pipeline_plan(graph, mesh=m, hw=hw, memory_budget=memory_budget, pipeline=pipeline,
                             schedule=schedule, profile=profile, options=pipeline_options,
                             profiler=StepProfiler(step, args))
    if pipeline_options is not None or profile != "model":
        raise PlanError("autoshard.plan: pipeline_options and profile apply to pipeline plans only; "
                        "pass pipeline='rannc' as well, or drop them.")
    opts = options or SearchOptions()
    if memory_budget is not None:
        opts = dataclasses.replace(opts, memory_budget=float(memory_budget))
    graph = graph if graph is not None else trace(step, *args)
    return tensor_plan(graph, mesh=mesh, hw=hw, options=opts, devices=devices)


def expert_plan(name: str, step: Callable, *args: Any, mesh: Any, hardware: str | HardwareSpec | Mapping = "cpu-sim",
                memory_budget: float | None = None, options: SearchOptions | None = None) -> Plan:
    """The hand-written reference plan `name` (one of autoshard's EXPERTS: data-parallel, fsdp,
    megatron, data-megatron) for `step` on `mesh`, priced by the same model as automatic plans."""
    opts = options or SearchOptions()
    if memory_budget is not None:
        opts = dataclasses.replace(opts, memory_budget=float(memory_budget))
    graph = trace(step, *args)
    return bind(expert_tensor_plan(name, graph, mesh=mesh, hw=get_hardware(hardware), options=opts), *args)
