"""A 3-D plan run by the MPMD runtime: its chosen stages' submeshes, micro-batches, schedule and stage tensor
plans (`plan.predicted["3d"]["chosen"]`, `plan.stages`), equal or unequal submeshes alike."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ...core.errors import PlanError
from .cut_place import in_argument
from .layouts import fitting_spec, partition_spec
from .mpmd import MpmdPipeline, mpmd_pipelined


def plan_submeshes(plan: Any) -> tuple[tuple[int, int], ...]:
    """The (data, model) submesh of every pipeline rank of a 3-D plan."""
    j = getattr(plan, "predicted", {}).get("3d")
    if not getattr(plan, "is_pipeline", False) or not j or not j.get("chosen"):
        raise PlanError("autoshard MPMD pipeline: the plan is not a 3-D pipeline plan (no predicted['3d']['chosen']); "
                        "plan with autoshard.plan(..., mesh='auto') or a mesh with a 'pipe' axis and pipeline='auto'.")
    chosen = j["chosen"]
    subs = chosen.get("submeshes")
    if subs is None:       # an equal-submesh point: every stage data x model
        subs = ((chosen["data"], chosen["model"]),) * chosen["stages"]
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
    """`mpmd_pipelined` with everything taken from a 3-D plan (`num_microbatches` overrides the plan's)."""
    chosen = plan_submeshes(plan) and plan.predicted["3d"]["chosen"]
    if chosen.get("virtual_stages", 1) > 1:
        raise PlanError("autoshard MPMD pipeline: interleaved 3-D plans (virtual_stages > 1) are not run by the MPMD "
                        "runtime yet; plan with pipeline_options={'virtual_stages': 1}.")
    M = num_microbatches if num_microbatches is not None else int(chosen["microbatches"])
    return mpmd_pipelined(loss_fn, params, batch, submeshes=plan_submeshes(plan), num_microbatches=M,
                          schedule=chosen.get("schedule", "1f1b"), devices=devices,
                          param_specs=stage_param_specs(plan), check_loss=check_loss, plan=plan,
                          batch_axes=[tuple(a for a in st.batch_axes if a in ("data", "model")) or ("data",)
                                      for st in plan.stages])
