"""A pipeline plan run by the MPMD runtime. A 3-D plan: its chosen stages' submeshes, micro-batches, schedule
(interleaved included) and stage tensor plans (`plan.predicted["3d"]["chosen"]`, `plan.stages`), equal or
unequal submeshes alike. A RaNNC or GraphPipe plan: each stage on its own `replicas` devices (data
parallel within the stage), with its own micro-batch count, over the plan's stage DAG."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ...core.errors import PlanError
from .cut_dag import plan_edges
from .cut_place import in_argument
from .layouts import fitting_spec, partition_spec
from .mpmd import MpmdPipeline, mpmd_pipelined


def plan_submeshes(plan: Any) -> tuple[tuple[int, int], ...]:
    """The (data, model) submesh of every pipeline rank: a 3-D plan's chosen submeshes, a RaNNC or
    GraphPipe plan's (replicas, 1) per stage."""
    if not getattr(plan, "is_pipeline", False):
        raise PlanError("autoshard MPMD pipeline: the plan is not a pipeline plan; plan with autoshard.plan(..., "
                        "mesh='auto'), a mesh with a 'pipe' axis and pipeline='auto', or pipeline='rannc'/'graphpipe'.")
    j = plan.predicted.get("3d")
    if j is None:
        return tuple((int(st.replicas), 1) for st in plan.stages)
    chosen = j.get("chosen")
    if not chosen:
        raise PlanError("autoshard MPMD pipeline: the 3-D plan has no predicted['3d']['chosen'] (edited or truncated); "
                        "plan it again with autoshard.plan(..., mesh='auto').")
    ranks = int(chosen["stages"]) // max(1, int(chosen.get("virtual_stages", 1)))
    subs = chosen.get("submeshes")
    if subs is None:       # an equal-submesh point: every pipe rank data x model
        subs = ((chosen["data"], chosen["model"]),) * ranks
    elif len(subs) != ranks:      # listed per stage: an interleaved plan's stage k runs on rank k % ranks
        if any(tuple(subs[k]) != tuple(subs[k % ranks]) for k in range(len(subs))):
            raise PlanError(f"autoshard MPMD pipeline: the interleaved plan's stages {list(subs)} do not share their "
                            f"rank's submesh (stage k runs on rank k % {ranks}); plan it again.")
        subs = subs[:ranks]
    return tuple((int(d), int(t)) for d, t in subs)


def stage_param_specs(plan: Any) -> Callable[[int, str, tuple[int, ...], Mesh], P]:
    """param_specs(stage, key, shape, mesh) from the plan's stage tensor plans (keypath suffixes; splits that
    do not divide the shape, or name an axis of size 1, drop out: a layout choice, never a result change)."""
    by_stage = [dict(st.param_specs) for st in plan.stages]

    def spec(s: int, key: str, shape: tuple[int, ...], mesh: Mesh) -> P:
        found = next((sp for kp, sp in by_stage[s].items() if in_argument(kp, key)), None)
        if found is None:
            return P()
        sizes = dict(mesh.shape)
        found = tuple(tuple(a for a in ax if sizes.get(a, 1) > 1) for ax in found)
        return partition_spec(fitting_spec(shape, found, sizes))
    return spec


def mpmd_from_plan(loss_fn: Callable, params: Any, batch: Any, plan: Any, *, num_microbatches: int | None = None,
                   devices: Any = None, check_loss: bool = True) -> MpmdPipeline:
    """`mpmd_pipelined` with everything taken from a pipeline plan (`num_microbatches` overrides the plan's
    counts with one for every stage). `devices`: the devices to run on (the first the plan uses)."""
    subs = plan_submeshes(plan)
    j = plan.predicted.get("3d")
    if j is not None:
        chosen = j["chosen"]
        v = int(chosen.get("virtual_stages", 1))
        counts: Any = int(chosen["microbatches"])
        schedule = "interleaved-1f1b" if v > 1 else chosen.get("schedule", "1f1b")
        axes = [tuple(a for a in st.batch_axes if a in ("data", "model")) or ("data",) for st in plan.stages]
    else:
        v, counts = 1, [int(st.microbatches) for st in plan.stages]
        schedule, axes = plan.schedule or "1f1b", None
        if schedule not in ("1f1b", "gpipe", "graph-1f1b"):
            raise PlanError(f"autoshard MPMD pipeline: the plan's schedule {schedule!r} is not run by the MPMD runtime "
                            "('1f1b', 'gpipe', 'graph-1f1b' and 3-D interleaved plans are).")
        if len(set(counts)) > 1 or plan_edges(plan.stages) is not None:
            schedule = "graph-1f1b"
    if num_microbatches is not None:
        counts = num_microbatches
    if j is None:       # a GraphPipe plan may leave devices idle (a warning of its own): the first ones run
        devices = list(jax.devices() if devices is None else devices)[:sum(d * t for d, t in subs)]
    return mpmd_pipelined(loss_fn, params, batch, submeshes=subs, num_microbatches=counts, schedule=schedule,
                          devices=devices, virtual_stages=v, param_specs=stage_param_specs(plan),
                          check_loss=check_loss, plan=plan, batch_axes=axes)
