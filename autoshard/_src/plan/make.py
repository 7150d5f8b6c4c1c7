"""One entry from a traced step and a Config to a Plan: tensor or pipeline (pure: no jax import)."""

from __future__ import annotations

import dataclasses
import math
import time

from ..core.errors import ConfigError, InfeasiblePlanError, PipelineError
from ..core.graph import OpGraph, collector_paused, inputs_with_role
from ..core.grouping import group
from ..core.hardware import HardwareSpec
from ..core.mesh import MeshSpec
from ..pipeline.costs import traced_batch
from ..pipeline.partition import Profiler, microbatch_split_error
from .config import Config
from .joint_planner import auto_mesh_options, fixed_shape_options, joint_plan
from .pipeline_planner import pipeline_plan
from .plan import Plan
from .planner import tensor_plan


def make_plan(graph: OpGraph, config: Config, hardware: HardwareSpec, *, profiler: Profiler | None = None,
              trace_seconds: float = 0.0, three_d: bool = True) -> Plan:
    """The plan of the traced step `graph` under `config` on `hardware` (the config's, or the local
    device's when it names none: the bridge resolves that). `profiler` serves profile="measured".
    mesh="auto" without `pipeline` searches the whole 3-D space (stages x data x model x remat);
    `three_d=False` keeps it to tensor plans (what the decorator runs today).
    The plan's `predicted["timing"]` holds the seconds spent tracing, grouping and searching."""
    if config.mesh is None:
        raise ConfigError("autoshard: no mesh given; pass mesh={'data': 2, 'model': 4} (axis name -> size), a jax "
                          "Mesh, or 'auto' with devices=<count>, or a config file with [mesh].")
    _check_batch_split(graph, config)
    with collector_paused():      # the grouping and every planner (3-D, pipeline) too: see collector_paused
        return _make_plan(graph, config, hardware, profiler, trace_seconds, three_d)


def _make_plan(graph: OpGraph, config: Config, hardware: HardwareSpec, profiler: Profiler | None,
               trace_seconds: float, three_d: bool) -> Plan:
    t0 = time.perf_counter()
    if config.pipeline is None and config.mesh == "auto" and three_d:
        grouping = group(graph)
        group_seconds = time.perf_counter() - t0
        # sequence parallelism is a per-stage choice of the 3-D tables: no tensor search beside it
        plan = joint_plan(graph, devices=config.devices, hw=hardware, options=config.search, grouping=grouping,
                          joint=auto_mesh_options(config.pipeline_options))
    elif config.pipeline == "auto" and isinstance(config.mesh, MeshSpec) and "pipe" in config.mesh.names:
        # a "pipe" mesh fixes the 3-D shape: stages x data x model, searched jointly
        grouping = group(graph)
        group_seconds = time.perf_counter() - t0
        joint = fixed_shape_options(config.mesh, config.schedule, config.num_microbatches, config.pipeline_options)
        plan = joint_plan(graph, devices=config.mesh.size, hw=hardware, options=config.search, joint=joint,
                          grouping=grouping, expert=config.pipeline_options.get("expert"))
    elif config.pipeline is None:
        grouping = group(graph)
        group_seconds = time.perf_counter() - t0
        try:
            plan = tensor_plan(graph, mesh=config.mesh, hw=hardware, options=config.search, devices=config.devices,
                               grouping=grouping)
        except InfeasiblePlanError as err:
            plan = _with_remat(graph, config, hardware, grouping, err)
    else:
        group_seconds = 0.0
        mesh = MeshSpec((("data", config.devices),)) if config.mesh == "auto" else config.mesh
        plan = pipeline_plan(graph, mesh=mesh, hw=hardware, memory_budget=config.memory_budget,
                             pipeline=config.pipeline, schedule=config.schedule, profile=config.profile,
                             options=config.pipeline_options, profiler=profiler,
                             num_microbatches=config.num_microbatches)
    timing = {"trace_seconds": trace_seconds, "group_seconds": group_seconds,
              "search_seconds": plan.predicted["search_seconds"],
              "total_seconds": trace_seconds + time.perf_counter() - t0}
    return dataclasses.replace(plan, predicted={**plan.predicted, "timing": timing})


def _with_remat(graph: OpGraph, config: Config, hardware: HardwareSpec, grouping, err: InfeasiblePlanError) -> Plan:
    """A tensor plan that does not fit without rematerialisation, planned with it: the 3-D search on the
    same mesh as one stage (pipe 1, one micro-batch) chooses the remat policy with the sharding, under the
    same budget (every block instance none / selective / dots / full). Only for meshes whose axes are named
    'data' and/or 'model' (the 3-D tables' axes);
    otherwise, or when nothing fits even then, the tensor search's InfeasiblePlanError stands."""
    mesh = config.mesh
    if not isinstance(mesh, MeshSpec) or not set(mesh.names) <= {"data", "model"}:
        raise err
    staged = MeshSpec((("pipe", 1), *mesh.axes))
    try:
        joint = fixed_shape_options(staged, "1f1b", 1, config.pipeline_options)
        plan = joint_plan(graph, devices=mesh.size, hw=hardware, options=config.search, joint=joint,
                          grouping=grouping)
    except (InfeasiblePlanError, PipelineError, ConfigError):
        raise err from None
    if plan.is_pipeline or not plan.predicted.get("feasible", True):
        raise err
    return plan


def _check_batch_split(graph: OpGraph, config: Config) -> None:
    """A pipeline plan on a mesh with a 'pipe' axis runs every micro-batch on the data-parallel devices
    (all non-pipe axes; in 3-D, the 'data' axis, the model axis splitting tensors): refused up front
    when the traced batch cannot be cut that way, instead of a search that finds no plan and blames memory."""
    mesh = config.mesh
    if config.pipeline is None or not isinstance(mesh, MeshSpec) or "pipe" not in mesh.names:
        return
    if not any(graph.values[v].shape for v in inputs_with_role(graph, "data")):
        return          # no batch argument: nothing to cut
    if config.pipeline == "auto":       # 3-D: the stages split the batch over 'data' (at least)
        axes = [n for n in mesh.names if n == "data"]
    else:
        axes = [n for n in mesh.names if n != "pipe"]
    replicas = math.prod(mesh.axis_size(n) for n in axes)
    why = microbatch_split_error(f"autoshard (pipeline={config.pipeline!r})", traced_batch(graph), replicas,
                                 config.num_microbatches, str(mesh), " x ".join(axes) or "no data axis")
    if why:
        raise PipelineError(why)
