"""The 3-D parts of `autoshard.pipelined`: stage specs from a 3-D plan's stage tensor plans, the
runtime check on this machine, and the batched-gather guard (imports jax)."""

from __future__ import annotations

import warnings
from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ...core.errors import PipelineError
from ...core.graph import keys_in_order
from ...core.mesh import MeshSpec
from ...plan.planner import add_storage_axes
from ...plan.validate import check_constraints_matched
from .cut_place import in_argument
from .layouts import fitting_spec, partition_spec


def runnable_here(program: Any, keys: tuple[str, ...], holders: list[set[int]], p_leaves: list, batch: Any) -> None:
    """A 3-D program XLA would make hang on this machine's CPU runtime runs its stages data parallel
    instead (same results), with a warning naming the collective that forced it."""
    per_stage: list[dict[str, Any]] = [{} for _ in range(program.num_stages)]
    for key, held_by, leaf in zip(keys, holders, p_leaves, strict=True):
        for s in held_by:
            per_stage[s][key] = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
    bad = program.cpu_deadlocks(per_stage, batch)
    if not bad:
        return
    program.drop_tensor_plans()
    warnings.warn(
        "autoshard: the 3-D plan's stage tensor plans compile, for this CPU runtime, to "
        f"{len(bad)} collective-permute(s) inside the per-stage branches (e.g. {bad[0][:100]}...), which "
        "jaxlib's CPU collectives cannot run when other pipe ranks run another stage (the step would hang). "
        "The stages run data parallel here instead (same results; the plan and its predictions are unchanged, "
        "GPU/TPU runtimes run the plan as planned).", stacklevel=3)
    if program.cpu_deadlocks(per_stage, batch):
        raise PipelineError("autoshard.pipelined: even data-parallel stages compile to collective-permutes inside "
                            "the per-stage branches on this CPU runtime; run this plan on GPU/TPU or without "
                            "a model axis.")


def plan_batch_axes(plan: Any, mesh: Mesh, pipe_axis: str) -> tuple[str, ...]:
    """The axes splitting every stage's micro-batch in a 3-D plan (the runtime runs one batch layout)."""
    common = [a for a in mesh.axis_names if a != pipe_axis and all(a in st.batch_axes for st in plan.stages)]
    return tuple(common)


def stage_specs(stages: tuple, keys: tuple[str, ...], holders: list[set[int]], owner: list[int],
                p_leaves: list, mesh: Mesh) -> tuple[list[dict], list[dict]]:
    """(stored, compute) spec of every parameter copy per stage, from the 3-D plan's stage tensor plans:
    a leaf's spec is its owner stage's (tied copies must match to sum their gradients); ZeRO-3 stages
    store their leaves split further over the axes their plan leaves free."""
    S = len(stages)
    by_suffix = [{kp: spec for kp, spec in st.param_specs} for st in stages]
    sub = MeshSpec(tuple((a, mesh.shape[a]) for a in mesh.axis_names if a != "pipe") or (("data", 1),))
    stored: list[dict] = [{} for _ in range(S)]
    compute: list[dict] = [{} for _ in range(S)]
    for i, key in enumerate(keys):
        o = owner[i]
        spec = next((sp for kp, sp in by_suffix[o].items() if in_argument(kp, key)), None)
        if spec is None:
            continue        # replicated
        shape = tuple(p_leaves[i].shape)
        keep = list(spec)
        if stages[o].storage == "zero3":
            keep = add_storage_axes(keep, shape, sub)
        for h in holders[i]:
            stored[h][dict_path(key)] = tuple(tuple(a) for a in keep)
            compute[h][dict_path(key)] = tuple(tuple(a) for a in spec)
    return stored, compute


class ActivationSpecs:
    """A 3-D plan's activation constraints on the loss's eqns: the plan keys ops of the traced step as
    "<module>/<primitive>:<k>" (`core.graph.op_keys`); the loss's forward eqns come first in the step,
    in the same order, so the k-th eqn of a primitive in a module is the same op in both. Matched
    outputs are constrained to the stage plan's spec inside the runtime's shard_map (the automatic
    data/model axes); `enabled` is cleared when the stages run data parallel instead."""

    def __init__(self, prog: Any, modules: list[str], plan: Any, mesh: Mesh):
        wanted: dict[str, list] = {}     # several for one op: its layout, then its consumers' (region cuts)
        for st in plan.stages:
            for key, spec in st.activation_constraints:
                wanted.setdefault(key, []).append(spec)
        keys = keys_in_order((modules[e], fe.eqn.primitive.name) for e, fe in enumerate(prog.eqns))
        if plan.is_pipeline:    # a 3-D plan's stage constraints all name loss ops; a remat tensor plan's also
            # name the backward's and the optimizer's, placed by the step's own constraints (`emit.constrained`)
            check_constraints_matched(list(wanted), set(wanted) & set(keys), "autoshard (3-D stages)")
        self.specs: dict[int, list] = {}
        sizes = dict(mesh.shape)
        for e, fe in enumerate(prog.eqns):
            out = fe.eqn.outvars[0].aval if fe.eqn.outvars else None
            for spec in wanted.get(keys[e], ()):
                if out is None or len(spec) != len(out.shape):
                    continue
                # axes the runtime's mesh lacks (size 1) or that do not divide this micro-batch shape drop out
                spec = tuple(tuple(a for a in ax if a in sizes and a != "pipe") for ax in spec)
                self.specs.setdefault(e, []).append(fitting_spec(tuple(out.shape), spec, sizes))
        self.wanted = len(wanted)
        self.enabled = True

    def after(self, e: int, outs: list) -> list:
        specs = self.specs.get(e) if self.enabled else None
        if not specs or not jax.sharding.get_abstract_mesh().axis_names:
            return outs         # outside the runtime's shard_map (a shape pass): nothing to place
        for spec in specs:
            outs = [jax.lax.with_sharding_constraint(outs[0], partition_spec(spec)), *outs[1:]]
        return outs


def dict_path(key: str) -> str:
    return jax.tree_util.keystr((jax.tree_util.DictKey(key),))


def guard_gathers(eqn: Any, ins: list) -> list:
    if eqn.primitive.name == "gather":
        ins = [batched_gather_operand(eqn, ins[0]), *ins[1:]]
    return ins


def batched_gather_operand(eqn: Any, operand: Any) -> Any:
    """A batched gather (`take_along_axis`: labels' log-probabilities) whose operand is split over an
    automatic axis on a batching dim *and* on an indexed dim aborts XLA's SPMD partitioner inside a
    shard_map that is manual over `pipe` only (jaxlib 0.10.2: spmd_partitioner_util.cc "Check failed:
    partition_group_list..."). The indexed dims are made whole first (the vocabulary of the logits,
    an all-gather over the model axis); the other dims keep whatever split XLA chose."""
    dn = eqn.params["dimension_numbers"]
    context = jax.sharding.get_abstract_mesh()
    if not dn.operand_batching_dims or jax.sharding.AxisType.Auto not in context.axis_types:
        return operand        # nothing to guard (a shape pass, or no automatic axis: a pipe-only mesh)
    indexed = set(dn.start_index_map)
    spec = P(*[None if d in indexed else P.UNCONSTRAINED for d in range(operand.ndim)])
    return jax.lax.with_sharding_constraint(operand, spec)
