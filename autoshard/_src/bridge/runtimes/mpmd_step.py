"""A pipelined `@autoshard` step whose plan runs MPMD (stages on unequal submeshes, unequal replicas or
micro-batch counts): the step's loss runs as the plan's stage programs (`mpmd.MpmdPipeline`), the rest of
the step as per-stage programs (`split_step.py`).

    @autoshard.autoshard(plan=plan)         # e.g. a 3-D plan on stages of 2, 2 and 4 devices
    def train_step(params, opt_state, batch):
        loss, grads = autoshard.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

The first call runs the step eagerly up to `autoshard.value_and_grad` (as the SPMD path does) to learn
the loss and which argument leaves are its parameters and batch, cuts the loss into the plan's stages,
and traces the step once more with that call's results as inputs: the program after the gradients.
Each call then places the parameters on their stages (a no-op from the second step on: the step returns
them there), runs the pipeline, and runs the post-gradient segments. Parameters, gradients and the
optimizer state of a stage never leave its devices; only values an update reads from several stages
(a global gradient norm's per-stage sums) cross between them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ...core.errors import PlanError
from ..compat import bind_eqn, flatten_calls, is_literal
from .from_plan import mpmd_from_plan
from .mpmd import MpmdPipeline
from .pipelined_step import _ACTIVE, _Capture, _Captured, _Substitute, capture
from .split_step import Segment, split


class MpmdStep:
    """The step as a driver over the stage programs (module doc); called like the step."""

    def __init__(self, fn: Callable, plan: Any, args: tuple, *, batch_size: int, devices: list | None,
                 num_microbatches: int | None):
        self.fn = fn
        abstract = [x for x in jax.tree.leaves(args) if isinstance(x, jax.ShapeDtypeStruct)]
        if abstract:
            raise PlanError(
                f"autoshard: a pipeline plan's step needs concrete example arguments on its first call (it runs the "
                f"step up to autoshard.value_and_grad and cuts the loss on real values); got abstract {abstract[0]}. "
                "Fix: call the step with arrays.")
        call = capture(fn, args, batch_size).call
        if call.has_aux:
            raise PlanError("autoshard: a step whose pipeline plan runs MPMD computes its loss with "
                            "autoshard.value_and_grad(..., has_aux=False) so far (the auxiliary output needs a "
                            "forward pass of every stage). Fix: return the auxiliary values from a separate "
                            "jax.jit call, or use a plan with equal stage submeshes (SPMD).")
        leaves, self.treedef = jax.tree.flatten(args)
        pos = {id(x): i for i, x in enumerate(leaves)}
        p_leaves, self.p_tree = jax.tree.flatten(call.params)
        strays = [i for i, x in enumerate(p_leaves) if id(x) not in pos] + \
                 [i for i, x in enumerate(call.batch) if id(x) not in pos]
        if strays:
            raise PlanError("autoshard: a step whose pipeline plan runs MPMD passes its loss the parameters and the "
                            "batch as they come in the step's arguments (params, state.params, batch, ...); this "
                            f"step computes {len(strays)} of them inside the step. Fix: compute them before the "
                            "step, or use a plan with equal stage submeshes (SPMD).")
        _check_fixed(fn, args, batch_size)
        self.param_pos = [pos[id(x)] for x in p_leaves]
        self.batch_pos = [pos[id(x)] for x in call.batch]
        self.run: MpmdPipeline = mpmd_from_plan(call.loss_fn, call.params, call.batch, plan,
                                                num_microbatches=num_microbatches, devices=devices)
        self._trace_post(args, call)
        self._programs: dict[int, Callable] = {}

    def _trace_post(self, args: tuple, call: Any) -> None:
        leaves = jax.tree.leaves(args)
        loss = jax.ShapeDtypeStruct((), jnp.float32)
        grads = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in jax.tree.leaves(call.params)]

        def post(arg_leaves: list, loss: Any, grad_leaves: list) -> Any:
            token = _ACTIVE.set(_Substitute(loss, jax.tree.unflatten(self.p_tree, grad_leaves)))
            try:
                return self.fn(*jax.tree.unflatten(self.treedef, arg_leaves))
            finally:
                _ACTIVE.reset(token)

        closed, shapes = jax.make_jaxpr(post, return_shape=True)(
            [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves], loss, grads)
        self.out_tree = jax.tree.structure(shapes)
        self.prog = prog = flatten_calls(closed)
        n = len(leaves)
        self.arg_keys, self.loss_key, self.grad_keys = prog.inputs[:n], prog.inputs[n], prog.inputs[n + 1:]
        cut = self.run.cut
        owner = dict(zip(cut.keys, cut.owner, strict=True))
        seeds = {self.loss_key: self.run.sink}
        for i, k in enumerate(cut.keys):
            seeds[self.arg_keys[self.param_pos[i]]] = owner[k]
            seeds[self.grad_keys[i]] = owner[k]
        nbytes = {}
        for fe in prog.eqns:
            for k, v in zip(fe.outputs, fe.eqn.outvars, strict=True):
                nbytes[k] = v.aval.size * v.aval.dtype.itemsize
        for k, x in [*zip(self.arg_keys, leaves, strict=True), *zip(self.grad_keys, grads, strict=True)]:
            nbytes[k] = x.size * x.dtype.itemsize
        self.segments: list[Segment] = split(prog, seeds, nbytes, default_stage=self.run.sink)

    # --- running ---------------------------------------------------------------------------
    def __call__(self, *args: Any) -> Any:
        leaves = jax.tree.leaves(args)
        run, cut = self.run, self.run.cut
        by_key = {k: leaves[self.param_pos[i]] for i, k in enumerate(cut.keys)}
        placed = [{k: jax.device_put(by_key[k], sh) for k, sh in run.shardings[s].items()}
                  for s in range(run.num_stages)]
        loss, grads = run(placed, [leaves[i] for i in self.batch_pos])
        vals: dict[Any, Any] = dict(zip(self.arg_keys, leaves, strict=True))
        vals[self.loss_key] = loss
        for i, k in enumerate(cut.keys):
            vals[self.grad_keys[i]] = grads[cut.owner[i]][k]
        for j, seg in enumerate(self.segments):
            outs = self._program(j)(*[self._on(vals[k], seg.stage) for k in seg.inputs])
            vals.update(zip(seg.outputs, outs, strict=True))
        results = [k.val if is_literal(k) else vals[k] if k in vals else self.prog.consts[k] for k in self.prog.outputs]
        return jax.tree.unflatten(self.out_tree, results)

    def _on(self, x: Any, s: int) -> Any:
        """`x` on stage s's devices: as it is when it is there, else replicated there (a cross-stage send)."""
        mesh = self.run.meshes[s]
        if isinstance(x, jax.Array) and x.sharding.device_set == set(mesh.devices.flat):
            return x
        return jax.device_put(x, NamedSharding(mesh, P()))

    def _program(self, j: int) -> Callable:
        if j not in self._programs:
            seg, prog = self.segments[j], self.prog

            def segment(*ins: Any) -> list:
                env = {k: prog.consts[k] for e in seg.eqns for k in prog.eqns[e].inputs
                       if not is_literal(k) and k in prog.consts}
                env.update(zip(seg.inputs, ins, strict=True))
                for e in seg.eqns:
                    fe = prog.eqns[e]
                    outs = bind_eqn(fe.eqn, [a.val if is_literal(a) else env[a] for a in fe.inputs])
                    env.update(zip(fe.outputs, outs, strict=True))
                return [env[k] for k in seg.outputs]

            self._programs[j] = jax.jit(segment)
        return self._programs[j]

    def describe(self) -> str:
        rows = [self.run.describe(), "", f"after the gradients: {len(self.segments)} per-stage program(s)",
                "| level | stage | eqns | reads | writes |", "|---|---|---|---|---|"]
        rows += [f"| {seg.level} | {seg.stage} | {len(seg.eqns)} | {len(seg.inputs)} | {len(seg.outputs)} |"
                 for seg in self.segments]
        return "\n".join(rows)


def _check_fixed(fn: Callable, args: tuple, batch_size: int) -> None:
    """The loss's other inputs (neither parameters nor batch: a dropout key, a scale) are baked into the
    stage programs at the first call; one computed from the step's arguments would go stale."""
    def fixed(*a: Any) -> list:
        cap = _Capture(batch_size)
        token = _ACTIVE.set(cap)
        try:
            fn(*a)
        except _Captured:
            pass
        finally:
            _ACTIVE.reset(token)
        return cap.call.fixed_arrays() if cap.call is not None else []

    closed = jax.make_jaxpr(fixed)(*jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args))
    tainted = set(closed.jaxpr.invars)
    for eqn in closed.jaxpr.eqns:
        if any(not is_literal(v) and v in tainted for v in eqn.invars):
            tainted.update(eqn.outvars)
    bad = [v for v in closed.jaxpr.outvars if not is_literal(v) and v in tainted]
    if bad:
        raise PlanError(
            f"autoshard: the pipelined loss reads {len(bad)} array(s) computed from the step's arguments besides "
            f"its parameters and batch (e.g. a dropout key of shape {tuple(bad[0].aval.shape)}); the MPMD runtime "
            "cuts the loss once, so they would keep their first step's values. Fix: pass them inside the batch "
            "(leading dim = batch size), or use a plan with equal stage submeshes (SPMD).")
