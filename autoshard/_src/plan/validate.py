"""Checks of a plan at its boundaries (pure): a plan read from JSON against its own mesh, a plan bound to
a step against the step's argument shapes, and a plan's activation constraints against the ops they name.

A plan file is data a user may edit; everything autoshard later does with it (NamedShardings, shard_map
stages, sharding constraints) trusts these fields, and a bad one surfaces there as a raw jax error, a
crash (a mesh naming one axis twice segfaults jax.make_mesh) or a silently different program. So every
field is checked once, here, with a PlanError naming the field, the leaf's keypath, the spec, the mesh
and the fix.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..core.errors import MeshError, PlanError
from ..core.mesh import MeshSpec
from .specs import Spec, spec_str

STORAGE_MODES = ("replicated", "zero1", "zero3")
REMAT_POLICIES = ("none", "selective", "dots", "full")
_FIX = "Fix: re-plan with autoshard.plan(step, *args, ...) and save plan.to_json(), or correct the file"


def _fail(where: str, what: str, fix: str = _FIX) -> PlanError:
    return PlanError(f"{where}: {what}. {fix}.")


def checked_mesh(axes: Any, where: str, field: str = "mesh") -> dict[str, int]:
    """The plan's (or a stage's) mesh as {axis: size}, or PlanError: unique names, sizes >= 1."""
    try:
        return dict(MeshSpec(tuple(tuple(a) if isinstance(a, (list, tuple)) else a for a in axes)).axes)
    except (MeshError, TypeError) as err:
        why = str(err).removeprefix("autoshard: ").rstrip(".")
        raise _fail(where, f"{field}={axes!r} is not a valid mesh ({why})") from err


def spec_problem(spec: Spec, axes: Mapping[str, int]) -> str | None:
    """Why `spec` cannot split an array on a mesh with `axes`, or None."""
    used = [a for dim in spec for a in dim]
    unknown = sorted(set(used) - set(axes))
    if unknown:
        return f"names axes {unknown} that its mesh {dict(axes)} does not have"
    twice = sorted({a for a in used if used.count(a) > 1})
    if twice:
        return f"uses mesh axes {twice} more than once (an axis splits at most one dimension, once)"
    return None


def _check_specs(where: str, field: str, pairs: Iterable[tuple[str, Spec]], axes: Mapping[str, int]) -> None:
    for name, spec in pairs:
        problem = spec_problem(spec, axes)
        if problem:
            raise _fail(where, f"{field} {name}: spec {spec_str(spec)} {problem}")


def check_plan(plan: Any, where: str = "Plan.from_json") -> None:
    """Every field of a plan read back from JSON, against its own mesh (PlanError naming the first bad one)."""
    axes = checked_mesh(plan.mesh, where)
    for field, keys, specs in (("input_specs_flat", plan.input_keypaths, plan.input_specs_flat),
                               ("output_specs_flat", plan.output_keypaths, plan.output_specs_flat)):
        if len(keys) != len(specs):
            raise _fail(where, f"{field} holds {len(specs)} specs for {len(keys)} keypaths (one spec per leaf)")
        if len(set(keys)) != len(keys):
            raise _fail(where, f"{field}: keypaths appear twice ({sorted({k for k in keys if keys.count(k) > 1})[:3]})")
        _check_specs(where, f"{field} leaf", zip(keys, specs, strict=True), axes)
    _check_specs(where, "params leaf", ((p.keypath, p.spec) for p in plan.params), axes)
    if not isinstance(plan.microbatches, int) or plan.microbatches < 1:
        raise _fail(where, f"microbatches={plan.microbatches!r} must be an int >= 1")
    if plan.schedule is not None and not isinstance(plan.schedule, str):
        raise _fail(where, f"schedule={plan.schedule!r} must be null (a tensor plan) or a schedule name")
    _check_stages(plan, axes, where)
    check_interleaved(plan, axes, where)


def check_interleaved(plan: Any, axes: Mapping[str, int], where: str) -> None:
    """A plan with schedule "interleaved-1f1b" runs v stages on each pipe rank (stage k on rank k % pipe):
    its stages are a chain of v x pipe, and its micro-batches go in groups of pipe."""
    if plan.schedule != "interleaved-1f1b":
        return
    n, pipe = len(plan.stages), axes.get("pipe")
    name = "schedule='interleaved-1f1b'"
    if pipe is None:
        raise _fail(where, f"{name} places stage k on pipe rank k % pipe, but the mesh {dict(axes)} has no 'pipe' "
                    "axis", "Fix: add a 'pipe' axis to the mesh, or use schedule '1f1b'")
    if n % pipe:
        raise _fail(where, f"{name} runs v stages on each of the {pipe} pipe ranks (stage k on rank k % {pipe}); "
                    f"the plan has {n} stages, not a multiple of {pipe}",
                    f"Fix: give the plan v x {pipe} stages, or a 'pipe' axis dividing {n}")
    if plan.microbatches % pipe:
        raise _fail(where, f"{name} runs micro-batches in groups of the {pipe} pipe ranks; microbatches="
                    f"{plan.microbatches} is not a multiple of {pipe}",
                    f"Fix: microbatches={-(-plan.microbatches // pipe) * pipe}")
    off_chain = [st.index for st in plan.stages if tuple(st.after) != ((st.index - 1,) if st.index else ())]
    if off_chain:
        raise _fail(where, f"{name} runs a chain of stages, but stages {off_chain} do not run right after the one "
                    "before them (after=(i-1,))", "Fix: a chain plan, or schedule 'graph-1f1b' for a DAG")


def _check_stages(plan: Any, axes: Mapping[str, int], where: str) -> None:
    stages = plan.stages
    if not stages:
        raise _fail(where, "the plan has no stages (a tensor plan has one over the whole mesh, a pipeline plan "
                    "one per pipeline stage)")
    if plan.schedule is None and len(stages) != 1:
        raise _fail(where, f"a tensor plan (schedule null) has {len(stages)} stages; it runs one over the whole "
                    "mesh (set the pipeline schedule, or keep one stage)")
    for i, st in enumerate(stages):
        at = f"stage {i}"
        if st.index != i:
            raise _fail(where, f"{at} has index {st.index}; stages are listed in order, index 0, 1, ...")
        stage_axes = {**axes, **checked_mesh(st.mesh, where, f"{at} mesh")}
        for name, value, valid in (("storage", st.storage, STORAGE_MODES), ("remat", st.remat, REMAT_POLICIES)):
            if value not in valid:
                raise _fail(where, f"{at} {name}={value!r} is not one of {list(valid)}")
        for name in ("replicas", "microbatches"):
            if getattr(st, name) < 1:
                raise _fail(where, f"{at} {name}={getattr(st, name)} must be >= 1")
        bad_after = [s for s in st.after if not 0 <= s < len(stages) or s == i]
        if bad_after:
            raise _fail(where, f"{at} runs after stages {bad_after}, which are not other stages of this plan "
                        f"(0..{len(stages) - 1})")
        if plan.schedule is not None and not (st.units or st.ops or st.params or st.modules):
            raise _fail(where, f"pipeline {at} is empty (no units, ops, modules or parameters): every stage "
                        "of a pipeline runs part of the step")
        _check_specs(where, f"{at} param_specs leaf", st.param_specs, stage_axes)
        _check_specs(where, f"{at} activation_constraints op", st.activation_constraints, stage_axes)
        unknown = sorted(set(st.batch_axes) - set(stage_axes))
        if unknown:
            raise _fail(where, f"{at} batch_axes names axes {unknown} that its mesh {dict(stage_axes)} does not have")


def check_fits(plan: Any, keypaths: Sequence[str], shapes: Sequence[tuple[int, ...]], where: str) -> None:
    """Each argument leaf's planned spec fits the leaf: no more dims than it has, each split dim divisible
    by the product of its mesh axes (jax.jit rejects, or pads, anything else)."""
    sizes = dict(plan.mesh)
    for kp, shape, spec in zip(keypaths, shapes, plan.input_specs_flat, strict=True):
        if len(spec) > len(shape):
            raise _fail(where, f"argument {kp} of shape {tuple(shape)} has the spec {spec_str(spec)} of "
                        f"{len(spec)} dimensions on mesh {sizes}", "Fix: re-plan for these arguments "
                        "(autoshard.plan(step, *args, ...)), or give the leaf at most as many dims in the plan file")
        for d, (dim, axes) in enumerate(zip(shape, spec, strict=False)):
            parts = math.prod(sizes.get(a, 1) for a in axes)
            if dim % parts:
                raise _fail(where, f"argument {kp} of shape {tuple(shape)}: spec {spec_str(spec)} splits dim {d} "
                            f"(size {dim}) into {parts} parts over {list(axes)} of mesh {sizes}, which does not "
                            "divide it", "Fix: re-plan for these arguments (autoshard.plan(step, *args, ...)), or "
                            "split that dim over axes whose sizes divide it in the plan file")


def check_constraints_matched(wanted: Sequence[str], matched: set[str], where: str) -> None:
    """A plan's activation constraints name ops by key; one naming no op of the step is not applied. None
    applied: the plan is not what would run (PlanError). Some not applied: a warning naming how many."""
    wanted_keys = list(dict.fromkeys(wanted))
    missing = [k for k in wanted_keys if k not in matched]
    if not missing:
        return
    what = (f"{len(missing)} of the plan's {len(wanted_keys)} activation constraints name ops the step does not "
            f"have (e.g. {missing[:3]})")
    if len(missing) == len(wanted_keys):
        raise _fail(where, f"{what}: none would be applied, so the step would not run as planned (an edited plan "
                    "whose op keys, '<module>/<primitive>:<k>', match nothing, or a plan of another step)",
                    "Fix: re-plan with autoshard.plan(step, *args, ...), or use the op keys of "
                    "autoshard.trace(step, *args) in the plan file")
    warnings.warn(f"{where}: {what}; those are not applied (the rest are). Re-plan, or correct their op keys.",
                  stacklevel=4)
