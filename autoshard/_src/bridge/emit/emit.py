"""Emission: a Plan → NamedSharding pytrees, a sharding-constrained step, and `jax.jit` with
in/out shardings and donated state. Plain jax objects, inspectable and editable."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from ...core.errors import MeshError, PlanError, TraceFailedError
from ...core.graph import op_keys
from ...core.mesh import check_distinct_devices
from ...plan.plan import Plan
from ...plan.specs import Spec
from ...plan.validate import check_constraints_matched
from .. import compat as jc
from ..trace.trace import Traced
from .remat_jaxpr import eval_with_replays, replays


@dataclasses.dataclass(frozen=True)
class JaxArgs:
    """A step's argument structure (`plan.ArgStructure`): leaf keypaths and the pytree definition."""

    keypaths: tuple[str, ...]
    treedef: Any

    @classmethod
    def of(cls, args: tuple) -> JaxArgs:
        leaves, treedef = jax.tree_util.tree_flatten_with_path(args)
        return cls(tuple(jc.keystr(p) for p, _ in leaves), treedef)

    def unflatten(self, leaves: list) -> Any:
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def partition_specs(self, specs: tuple[Spec, ...]) -> Any:
        return self.unflatten([partition_spec(s) for s in specs])


def partition_spec(spec: Spec) -> PartitionSpec:
    """A plan's per-dimension axes tuple as a PartitionSpec (one axis by name, several as a tuple)."""
    return PartitionSpec(*[(axes[0] if len(axes) == 1 else axes) if axes else None for axes in spec])


def make_mesh(plan_or_axes: Plan | tuple, devices: list | None = None) -> Mesh:
    """A concrete `jax.sharding.Mesh` (Auto axis types) for the plan's axes on the local devices."""
    axes = plan_or_axes.mesh if isinstance(plan_or_axes, Plan) else tuple(plan_or_axes)
    devices = list(devices if devices is not None else jax.devices())
    names = tuple(n for n, _ in axes)
    sizes = tuple(s for _, s in axes)
    need = 1
    for s in sizes:
        need *= s
    if need < len(devices):      # a smaller mesh runs on the first devices, as jax.make_mesh does
        devices = devices[:need]
    if need != len(devices):
        raise MeshError(
            f"autoshard: mesh {dict(axes)} needs {need} devices, but {len(devices)} are available "
            f"({devices[0].platform if devices else 'none'}). Fix: choose axis sizes whose product is "
            f"at most {len(devices)}, or run with more devices (on CPU: "
            f"jax.config.update('jax_num_cpu_devices', {need}) before jax starts).")
    return jax.make_mesh(sizes, names, axis_types=(AxisType.Auto,) * len(names), devices=devices)


def auto_axes(mesh: Mesh) -> Mesh:
    """`mesh` (same devices, names and sizes) with every axis Auto: autoshard emits NamedShardings and
    sharding constraints for XLA to propagate, which jax accepts on Auto axes only, while jax.make_mesh
    makes Explicit axes by default. Every mesh a user passes (audit, pipelined, inference) comes through
    here: one listing a device twice is a MeshError, not jax's bare assertion later."""
    check_distinct_devices(mesh)
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def own_mesh_context() -> contextlib.AbstractContextManager:
    """The step (an @autoshard step, audit's compile, a pipelined loss, an inference program) runs on its
    own mesh: under a caller's `with jax.set_mesh(m)` (even of the same devices, whose axes jax.make_mesh
    makes Explicit) jax would check every op of the step against m ("context mesh ... should match the
    aval mesh", and arrays it makes, such as a pipeline's schedule tables, would be typed on m). Tracing
    and running with no context mesh is what jax.jit of a step with explicit in/out shardings does; the
    caller's context is restored on exit. Inside a caller's trace (where jax.set_mesh is refused) only
    the abstract mesh is cleared."""
    abstract = jax.sharding.get_abstract_mesh()
    if jc.tracing():
        if abstract.empty:
            return contextlib.nullcontext()
        return _cleared(abstract, jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())))
    concrete = jax.sharding.get_mesh()
    if abstract.empty and concrete.empty:
        return contextlib.nullcontext()       # the usual case costs two checks per call
    return _cleared(abstract if concrete.empty else concrete, jax.set_mesh(None))


def mesh_text(mesh: Any) -> str:
    """A mesh for messages: its axes, sizes and axis types."""
    types = ", ".join(t.name for t in mesh.axis_types)
    return f"{dict(mesh.shape)} (axis types {types})"


@contextlib.contextmanager
def _cleared(caller: Any, clear: contextlib.AbstractContextManager) -> Any:
    """`clear` (the caller's mesh context removed); a step whose trace then fails on a sharding call that
    needs that context (jax.sharding.reshard, a PartitionSpec out_sharding) is a MeshError saying so."""
    with clear:
        try:
            yield
        except TraceFailedError as err:
            cause = str(err.__cause__ or "")
            if "mesh" not in cause.lower():
                raise
            first = cause.strip().splitlines()[0] if cause.strip() else ""
            raise MeshError(
                f"autoshard: the step's trace failed under the caller's mesh context, jax.set_mesh with mesh "
                f"{mesh_text(caller)}: autoshard runs the step on its own mesh with Auto axes (the plan's "
                f"shardings), without the caller's context, so a sharding call in the step that needs it fails "
                f"({type(err.__cause__).__name__}: {first}). Fix: drop explicit-sharding calls (jax.sharding.reshard, "
                "out_sharding=P(...)) from the step and let the plan shard it, or constrain with "
                "jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec)) on a mesh with Auto axes, "
                "jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * n).") from err


def on_own_mesh(fn: Callable) -> Callable:
    """`fn` run under `own_mesh_context()`: an entry that traces or runs a step ignores a caller's mesh context."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with own_mesh_context():
            return fn(*args, **kwargs)

    return wrapped


def auto_placed(args: Any) -> Any:
    """`args` with each array placed on an Explicit mesh moved to the same layout on its mesh's Auto twin
    (`auto_axes`): values and devices unchanged, its sharding no longer part of its type."""
    def one(x: Any) -> Any:
        if isinstance(x, jax.Array) and jc.typed_sharding(getattr(x, "sharding", None)):
            return jax.device_put(x, NamedSharding(auto_axes(x.sharding.mesh), x.sharding.spec))
        return x

    return jax.tree.map(one, args)


def shardings(plan: Plan, mesh: Mesh) -> tuple[Any, Any]:
    """(in_shardings, out_shardings) pytrees of NamedSharding for the plan's step."""
    if plan._args is None:
        raise PlanError("autoshard: the plan is not bound to the step's arguments; call autoshard.bind(plan, *args).")
    ins = plan._args.unflatten([NamedSharding(mesh, partition_spec(s)) for s in plan.input_specs_flat])
    outs = [NamedSharding(mesh, partition_spec(s)) for s in plan.output_specs_flat]
    return ins, outs


def constrained(traced: Traced, plan: Plan, mesh: Mesh, remat: bool = False) -> Callable:
    """The traced step re-evaluated from its jaxpr with `with_sharding_constraint` on the planned
    activations (graph rewriting without touching the user's code). Constraints name ops by their
    stable key (`op_keys`); this trace's keys map them to its top-level eqns. `remat`: the plan's
    rematerialisation replayed in the traced backward pass (`remat_jaxpr`)."""
    graph = traced.graph
    index = {k: i for i, k in enumerate(op_keys(graph))}
    by_eqn: dict[int, list[tuple[tuple[int, ...] | None, NamedSharding]]] = {}
    # ops of a remat call's body (a user's nn.remat block, recomputed in the backward pass): the call is
    # bound again with its body's eqns pinned, else XLA partitions the recomputation unguided
    in_remat: dict[int, dict[int, list[tuple[tuple[int, ...] | None, NamedSharding]]]] = {}
    wanted = [key for key, _ in plan.activation_constraints]
    check_constraints_matched(wanted, set(wanted) & set(index), "autoshard")
    for key, spec in plan.activation_constraints:      # two for one op: its layout, then its consumers'
        i = index.get(key)
        if i is not None:
            op = graph.ops[i]
            sharding = NamedSharding(mesh, partition_spec(spec))
            if op.remat_eqn >= 0:
                in_remat.setdefault(op.top_eqn, {}).setdefault(op.remat_eqn, []).append((None, sharding))
                continue
            # a nested op (a gather inside jnp.take's jit) is the call's output of its shape
            shape = tuple(op.out_shapes[0]) if op.nested else None
            by_eqn.setdefault(op.top_eqn, []).append((shape, sharding))

    def after(k: int, outs: list, pins: dict | None = None) -> list:
        for shape, s in (pins if pins is not None else by_eqn).get(k, ()):
            if shape is None:
                at = 0 if getattr(outs[0], "ndim", 0) == len(s.spec) else None
            else:
                hits = [j for j, o in enumerate(outs) if tuple(getattr(o, "shape", ())) == shape]
                at = hits[0] if len(hits) == 1 else None
            if at is not None:
                outs = [*outs[:at], jax.lax.with_sharding_constraint(outs[at], s), *outs[at + 1:]]
        return outs

    schedule = replays(traced.closed, graph, plan.remat_labels, plan.stages[0].remat) if remat else None
    if remat and not schedule:
        warnings.warn(f"autoshard: the plan rematerialises ({plan.stages[0].remat!r}) blocks "
                      f"{list(plan.remat_labels)[:3]}, but nothing of them is replayed in the traced backward pass "
                      "(memory as without remat): the blocks run as one loop (nn.scan; rematerialise inside it with "
                      "nn.remat), or no module of the traced step matches their paths. Fix: plan the step as it is "
                      "traced, or plan with remat 'none'.",
                      stacklevel=4)

    def rebind(k: int, eqn, invals: list) -> list | None:
        pins = in_remat.get(k)
        if pins is None or isinstance(eqn.params.get("jaxpr"), jc.ClosedJaxpr):
            return None      # (a jax whose remat carries a closed body: bound as traced, XLA places it)
        inner = jc.ClosedJaxpr(eqn.params["jaxpr"], [])
        return jc.rebind_with_body(eqn, invals, lambda *a: jc.eval_jaxpr_with(
            inner, list(a), lambda j, outs: after(j, outs, pins)))

    def run(*call_args):
        flat = jax.tree_util.tree_leaves(call_args)
        outs = (jc.eval_jaxpr_with(traced.closed, flat, after, rebind if in_remat else None) if not schedule
                else eval_with_replays(traced.closed, flat, after, schedule))
        return jax.tree_util.tree_unflatten(traced.out_tree, outs)

    run.__name__ = graph.name.rpartition(".")[2] or "step"
    return run


def donated_argnums(plan: Plan, nargs: int) -> tuple[int, ...]:
    """Arguments made only of state the step returns (params, optimizer state): donated."""
    outs = set(plan.output_keypaths)
    by_arg: dict[int, list[str]] = {}
    for kp in plan.input_keypaths:
        by_arg.setdefault(int(kp[1:kp.index("]")]), []).append(kp)
    return tuple(i for i in range(nargs) if by_arg.get(i) and all(k in outs for k in by_arg[i]))


class ShapesChanged(PlanError):
    """Raised while jax traces a planned step for arguments of another structure, shape or dtype
    than the plan's: jax re-traces only then, so the check costs nothing per call. The decorated step
    catches it and plans the new arguments; it reaches the user only from the plain program
    (`step.jitted`) called with other arguments, so it is a PlanError that says so."""

    def __init__(self, planned: tuple, given: tuple):
        super().__init__(
            f"autoshard: the compiled step was planned for arguments {_describe(planned)} and is now traced for "
            f"{_describe(given)}; its shardings fit only the planned ones. Fix: call the decorated step itself "
            "(it plans each new structure, shape or dtype once), not its step.jitted program.")


def signature(args: tuple) -> tuple:
    """(structure, (shape, dtype) per leaf) as jax traces them: Python scalars as 0-d arrays, dtypes
    canonical (with 64-bit types disabled a numpy float64 / int64 leaf is traced as float32 / int32, as
    jax.jit does); a typed PRNG key's extended dtype (`key<fry>`) as it is."""
    leaves, treedef = jax.tree_util.tree_flatten(args)
    return treedef, tuple(_leaf_signature(x) for x in leaves)


def _leaf_signature(x: Any) -> tuple:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return tuple(x.shape), _canonical(x.dtype)
    if isinstance(x, bool | int | float | complex):
        return (), jax.numpy.result_type(x)
    return type(x), None       # no array: tracing it raises the typed error that names it


def _canonical(dtype: Any) -> Any:
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return dtype
    try:
        return jax.dtypes.canonicalize_dtype(dtype)
    except TypeError:        # no jax dtype (strings, objects): tracing it raises the typed error
        return dtype


def _describe(sig: tuple) -> str:
    treedef, leaves = sig
    shown = ", ".join(f"{d}{list(s)}" if isinstance(s, tuple) else getattr(s, "__name__", str(s))
                      for s, d in leaves[:4])
    return f"[{shown}{', ...' if len(leaves) > 4 else ''}] ({len(leaves)} leaves)"


def shape_guarded(fn: Callable, args: tuple) -> Callable:
    """`fn` that raises ShapesChanged when traced for arguments unlike `args`."""
    planned = signature(args)

    def guarded(*call_args):
        given = signature(call_args)
        if given != planned:
            raise ShapesChanged(planned, given)
        return fn(*call_args)

    guarded.__name__ = getattr(fn, "__name__", "step")
    return guarded


def jit_step(traced: Traced, plan: Plan, mesh: Mesh, args: tuple, donate: bool = True,
             guard: bool = False, remat: bool = False) -> Callable:
    """`jax.jit` of the traced step under the plan's constraints and shardings; with `guard`,
    tracing it for arguments unlike `args` raises ShapesChanged (before anything runs or is donated);
    with `remat`, the plan's rematerialisation replayed in the traced backward pass."""
    if plan.is_pipeline:
        raise PlanError(f"autoshard: a pipeline plan ({len(plan.stages)} stages) cannot be run as one jit "
                        "program: that would silently drop its stages. Fix: run the step with "
                        "@autoshard(..., plan=plan) computing its gradients with autoshard.value_and_grad, or the "
                        "loss with autoshard.pipelined(loss_fn, params, batch, mesh=..., num_microbatches=..., "
                        "plan=plan), or use a tensor sharding plan (no pipeline=...).")
    ins, outs = shardings(plan, mesh)
    fn = constrained(traced, plan, mesh, remat)
    if guard:
        fn = shape_guarded(fn, args)
    outs = jax.tree_util.tree_unflatten(traced.out_tree, outs)
    return jax.jit(fn, in_shardings=ins, out_shardings=outs,
                   donate_argnums=donated_argnums(plan, len(args)) if donate else ())
