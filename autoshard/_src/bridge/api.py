"""`autoshard.plan`, `autoshard.expert_plan` and `autoshard.bind`: one trace, then the pure planners."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ..core.errors import ConfigError, PlanError
from ..core.graph import OpGraph
from ..core.hardware import HardwareSpec
from ..plan.config import Config
from ..plan.make import make_plan
from ..plan.plan import Plan
from ..plan.planner import expert_tensor_plan
from ..plan.validate import check_fits
from .audit.profile import StepProfiler
from .devices import local_hardware
from .emit.emit import JaxArgs, on_own_mesh
from .inference.api import plan_inference
from .trace.trace import trace


def bind(plan: Plan, *args: Any) -> Plan:
    """`plan` bound to the structure of `args` (arrays or ShapeDtypeStructs), so `plan.input_specs`
    and emission know the pytree; raises PlanError if the plan was made for other arguments, or one of
    its specs does not fit its leaf (more dims than the leaf, or a split that does not divide)."""
    if not isinstance(plan, Plan):
        raise PlanError(f"autoshard.bind: plan={type(plan).__name__} is not a training autoshard.Plan"
                        + (" (an inference plan runs through autoshard.autoshard(fn, mode='inference', mesh=...))"
                           if type(plan).__name__ == "InferencePlan" else "")
                        + ". Fix: pass the result of autoshard.plan(step, *args, ...) or Plan.from_json(text).")
    structure = JaxArgs.of(args)
    bound = plan.with_args(structure)
    shapes = [tuple(np.shape(x)) for x in jax.tree.leaves(args)]
    check_fits(plan, structure.keypaths, shapes, "autoshard.bind")
    return bound


def local_config(config: Config) -> Config:
    """`config` with the local device count where mesh="auto" leaves `devices` open."""
    if config.mesh == "auto" and config.devices is None:
        return config.replace(devices=len(jax.devices()))
    return config


def hardware_of(config: Config) -> HardwareSpec:
    return config.hardware if config.hardware is not None else local_hardware()


@on_own_mesh
def plan(step: Callable, *args: Any, config: Any = None, mode: str = "train", **kwargs: Any) -> Plan:
    """Plan `step(*args)` (arrays or ShapeDtypeStructs): keywords are `Config` fields (mesh, devices,
    hardware, memory_budget, search or options, pipeline, schedule, profile, pipeline_options, ...),
    `config` a TOML path, mapping or Config they override.

    Tensor plans by default. `pipeline="rannc"` partitions the step into pipeline stages instead
    (stages, replicas per stage and micro-batch count over all the mesh's devices; a "pipe" axis
    fixes the stage count; schedules "1f1b" / "gpipe"; options k, recompute, use_blocks, search,
    prune); `pipeline="graphpipe"` chooses a DAG of stages over the model's branches (schedules
    "1f1b" / "graph-1f1b"; options max_microbatch_size, depth, per_stage_microbatch); "auto" plans
    with every registered partitioner that applies and keeps the shorter simulated step.
    `profile="measured"` times the ops on the local device instead of the hardware roofline.

    `mode="inference"` partitions an inference function `step(params, images)` instead (BBGraP: a split
    direction per layer over a one-axis mesh) and returns an `InferencePlan`; options are those of
    `inference.plan.InferenceConfig` (speeds, direction, max_fuse, data_argnums, emission).
    """
    if mode != "train":
        if mode != "inference":
            raise ConfigError(f"autoshard.plan: mode={mode!r} must be 'train' or 'inference'.")
        if config is not None:
            raise ConfigError("autoshard.plan: mode='inference' takes its options as keywords (mesh, hardware, "
                              "speeds, direction, max_fuse, data_argnums, emission), not config=.")
        return plan_inference(step, *args, **kwargs)  # type: ignore[return-value]
    cfg = local_config(Config.make(config, **kwargs))
    t0 = time.perf_counter()
    graph = trace(step, *args, keep_eqns=cfg.profile == "measured")
    return bind(plan_traced(step, args, graph, cfg, time.perf_counter() - t0), *args)


def plan_traced(step: Callable, args: tuple, graph: OpGraph, config: Config, trace_seconds: float = 0.0,
                three_d: bool = True) -> Plan:
    """The (unbound) plan of `step(*args)` already traced as `graph` (with keep_eqns=True when the
    config asks for a measured profile). `three_d=False`: mesh="auto" plans tensor sharding only."""
    return make_plan(graph, config, hardware_of(config), profiler=StepProfiler(step, args),
                     trace_seconds=trace_seconds, three_d=three_d)


@on_own_mesh
def expert_plan(name: str, step: Callable, *args: Any, config: Any = None, **kwargs: Any) -> Plan:
    """The hand-written reference plan `name` (one of autoshard's EXPERTS: data-parallel, fsdp,
    megatron, data-megatron, megatron-sp) for `step` on the config's mesh, priced by the same model as
    automatic plans."""
    cfg = Config.make(config, **kwargs)
    ignored = {k: getattr(cfg, k) for k in ("pipeline", "num_microbatches") if getattr(cfg, k) is not None}
    if ignored or cfg.pipeline_options or cfg.mesh == "auto":
        given = {**ignored, **({"pipeline_options": dict(cfg.pipeline_options)} if cfg.pipeline_options else {}),
                 **({"mesh": "auto"} if cfg.mesh == "auto" else {})}
        raise ConfigError(f"autoshard.expert_plan({name!r}): {given} would be ignored: expert plans are tensor plans "
                          "on a fixed mesh. Fix: drop those options, or call autoshard.plan(step, *args, ...) for "
                          "pipeline and 3-D plans (pipeline_options={'expert': 'megatron'} picks Megatron-LM's grid).")
    graph = trace(step, *args)
    return bind(expert_tensor_plan(name, graph, mesh=cfg.mesh, hw=hardware_of(cfg), options=cfg.search), *args)
