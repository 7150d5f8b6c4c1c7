"""Pipeline plans under the decorator: `autoshard.value_and_grad` inside a pipelined `@autoshard`.

    @autoshard.autoshard(mesh={"pipe": 4, "data": 2}, pipeline="rannc")
    def train_step(params, opt_state, batch):
        loss, grads = autoshard.value_and_grad(loss_fn)(params, batch)   # runs as pipeline stages
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

Outside such a step `autoshard.value_and_grad` is `jax.value_and_grad`. Inside one, the decorator
first runs the step eagerly up to that call on the concrete arguments (capture): it learns the loss
function and the (params, batch) it is applied to, cuts the loss with `autoshard.pipelined` (the
plan's parameter placement, the loss's form over the batch checked on real values), then jits the
whole step with the call replaced by the pipeline program: stack the parameters into the stage rows, run the
schedule, hand back gradients shaped like the parameters. Everything else in the step (optimizer,
metrics) runs as ordinary jitted code around it.
"""

from __future__ import annotations

import contextvars
import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from ...core.errors import PlanError
from ...pipeline.costs import traced_batch
from ...plan.plan import Plan
from ..trace.loss_call import LossCall
from ..trace.trace import Traced
from .cut import pipelined
from .repack import storage_sharding


@dataclasses.dataclass
class _Capture:
    batch_size: int
    call: LossCall | None = None


@dataclasses.dataclass
class _Running:
    call: LossCall                 # what the capture saw
    make: Callable                 # (loss_fn, params, batch) -> autoshard.Pipelined
    calls: int = 0


class _Substitute:
    """The post-gradient trace of an MPMD step (`mpmd_step.py`): value_and_grad returns these values."""

    def __init__(self, loss: Any, grads: Any):
        self.loss, self.grads = loss, grads


class _Captured(BaseException):
    """Raised by value_and_grad in capture mode to stop the eager run of the step there (a
    BaseException, so a step's own `except Exception` does not swallow it)."""


_ACTIVE: contextvars.ContextVar[_Capture | _Running | _Substitute | None] = contextvars.ContextVar("autoshard_pipeline",
                                                                          default=None)


def value_and_grad(fun: Callable, argnums: int = 0, has_aux: bool = False, **kwargs: Any) -> Callable:
    """`jax.value_and_grad(fun, argnums, has_aux, ...)`; inside a step decorated with
    `@autoshard(..., pipeline=...)` the loss runs as the plan's pipeline stages (micro-batched,
    parameters stage-sharded) and returns the same (loss, grads) up to float rounding."""
    plain = jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux, **kwargs)

    def wrapped(*args: Any) -> Any:
        ctx = _ACTIVE.get()
        if ctx is None:
            return plain(*args)
        if isinstance(ctx, _Substitute):
            return ((ctx.loss, None), ctx.grads) if has_aux else (ctx.loss, ctx.grads)
        if kwargs:
            raise PlanError(
                f"autoshard.value_and_grad: inside a pipelined @autoshard step the options {sorted(kwargs)} are not "
                "supported (argnums and has_aux are). Fix: drop them, or use a tensor sharding plan (no pipeline=).")
        size = ctx.batch_size if isinstance(ctx, _Capture) else ctx.call.batch_size
        call = LossCall(fun, args, argnums, has_aux, size)
        if isinstance(ctx, _Capture):
            ctx.call = call
            raise _Captured()
        ctx.calls += 1
        if not call.same_as(ctx.call) or ctx.calls > 1:
            raise PlanError(
                "autoshard.value_and_grad: a pipelined @autoshard step pipelines one loss, once per step; this "
                f"step calls value_and_grad {'again' if ctx.calls > 1 else 'with another function'} "
                f"({getattr(fun, '__name__', fun)!r}). Fix: compute one loss per step, or use "
                "jax.value_and_grad for the others (they then run unpipelined).")
        # cut again from the traced function (the capture's cut is the same; this one cannot hold
        # values the capture's closure had baked in); the capture already checked the loss's form
        run = ctx.make(call.loss_fn, call.params, call.batch)
        repack = run.repacker(call.params)          # storage <-> stage rows, one all-to-all each way
        loss, grads = run(repack.stack(call.params), call.batch)
        grads = repack.unstack(grads)
        return ((loss, call.aux()), grads) if has_aux else (loss, grads)

    return wrapped


def capture(fn: Callable, args: tuple, batch_size: int) -> _Capture:
    """Run `fn(*args)` eagerly until its autoshard.value_and_grad call; what that call received."""
    cap = _Capture(batch_size)
    token = _ACTIVE.set(cap)
    try:
        fn(*args)
    except _Captured:
        return cap
    finally:
        _ACTIVE.reset(token)
    raise PlanError(
        f"autoshard: the step {getattr(fn, '__name__', fn)!r} has a pipeline plan but never calls "
        "autoshard.value_and_grad, so there is no loss to cut into stages. Fix: compute the gradients with "
        "`loss, grads = autoshard.value_and_grad(loss_fn)(params, batch)` (it is jax.value_and_grad elsewhere).")


def batch_sharding(mesh: Any, shape: tuple[int, ...]) -> Any:
    """The batch: split on its leading dimension over the non-pipe axes when it divides, else whole."""
    data = tuple(a for a in mesh.axis_names if a != "pipe")
    n = mesh.size // mesh.shape["pipe"]
    if shape and data and shape[0] % n == 0:
        return NamedSharding(mesh, PartitionSpec(data))
    return NamedSharding(mesh, PartitionSpec())


def _graph_mesh(plan: Plan, mesh: Any) -> Any:
    """A GraphPipe plan has no 'pipe' axis: its DAG's S stages run on a (pipe=S, data=r) mesh of
    the first S*r devices, r the plan's replicas per stage (the runtime needs one count for all)."""
    from jax.sharding import AxisType

    S = len(plan.stages)
    counts = sorted({s.replicas for s in plan.stages})
    r = counts[0]
    if len({s.microbatches for s in plan.stages}) > 1:
        raise PlanError(
            f"autoshard: the GraphPipe plan gives its stages different micro-batch counts "
            f"{[s.microbatches for s in plan.stages]}; the runtime runs one count for every stage. Fix: plan with "
            "pipeline_options={'per_stage_microbatch': False} (the default).")
    if S * r > mesh.size:
        raise PlanError(f"autoshard: the GraphPipe plan's {S} stages x {r} replicas need {S * r} devices; the mesh "
                        f"{dict(mesh.shape)} has {mesh.size}.")
    if S * r < mesh.size:
        warnings.warn(f"autoshard: the GraphPipe plan's {S} stages x {r} replica(s) use {S * r} of the mesh's "
                      f"{mesh.size} devices (see the plan's warnings); the step runs on those", stacklevel=4)
    devices = list(mesh.devices.flat)[:S * r]
    return jax.make_mesh((S, r), ("pipe", "data"), axis_types=(AxisType.Auto,) * 2, devices=devices)


def pipelined_step(fn: Callable, plan: Plan, mesh: Any, args: tuple, *, num_microbatches: int | None,
                   hardware: Any, traced: Traced) -> tuple[Callable, Any, Any, Any]:
    """(step, the Pipelined it runs, in_shardings, out_shardings) for a pipeline `plan` on `mesh`:
    the step's arguments and results are stored ZeRO-style (`repack.storage_sharding`), except the leaves the
    loss receives as its batch, split over the data axes (`batch_sharding`). `traced`: the step's
    one trace (its output shapes give the out shardings)."""
    replicas = [s.replicas for s in plan.stages]
    if "pipe" not in mesh.axis_names:
        mesh = _graph_mesh(plan, mesh)
    dp = mesh.size // mesh.shape["pipe"]
    if "3d" not in plan.predicted and any(r != dp for r in replicas):     # 3-D stages run their own plans
        warnings.warn(f"autoshard: the plan gives its stages {replicas} replicas; the runtime runs every stage on "
                      f"the {dp} devices of the non-pipe axes (same results; step time differs from the plan's "
                      "prediction)", stacklevel=3)
    abstract = [x for x in jax.tree.leaves(args) if isinstance(x, jax.ShapeDtypeStruct)]
    if abstract:
        raise PlanError(
            f"autoshard: a pipeline plan's step needs concrete example arguments on its first call or lower() "
            f"(it runs the step up to autoshard.value_and_grad and checks the loss on the real batch); got "
            f"abstract {abstract[0]}. Fix: call or lower with arrays, or plan abstractly with autoshard.plan.")
    cap = capture(fn, args, traced_batch(traced.graph))
    call = cap.call
    M = num_microbatches if num_microbatches is not None else plan.microbatches
    schedule = plan.provenance.get("options", {}).get("schedule", "1f1b")
    if plan.schedule == "interleaved-1f1b":       # v stages per pipe rank: the plan's own schedule
        schedule = plan.schedule
    kw = dict(mesh=mesh, num_microbatches=M, schedule=schedule, plan=plan, hardware=hardware)
    run = pipelined(call.loss_fn, call.params, call.batch, **kw)     # checks the loss on real values
    if run.program.auto:      # the runtime check ran once: the step's own cut keeps its outcome
        kw["tensor_in_stages"] = run.program.tensor_in_stages

    def make(loss_fn: Callable, params: Any, batch: Any) -> Any:
        return pipelined(loss_fn, params, batch, check_loss=False, **kw)

    def step(*call_args: Any) -> Any:
        token = _ACTIVE.set(_Running(call, make))
        try:
            return fn(*call_args)
        finally:
            _ACTIVE.reset(token)

    step.__name__ = getattr(fn, "__name__", "step")
    batch_ids = {id(x) for x in call.batch}
    ins = jax.tree.map(lambda x: batch_sharding(mesh, tuple(x.shape)) if id(x) in batch_ids
                       else storage_sharding(mesh, tuple(x.shape)), args)
    outs = jax.tree.unflatten(traced.out_tree, [storage_sharding(mesh, tuple(a.shape))
                                                for a in traced.closed.out_avals])
    return step, run, ins, outs
