"""MPMD pipeline runtime: every stage its own jitted program on its own submesh.

    run = mpmd_pipelined(m.loss, params, batch, submeshes=[(2, 1), (1, 2), (2, 2)], num_microbatches=4)
    state = run.init(params, optimizer)          # each stage's parameters and optimizer state on its mesh
    state, loss = run.step(state, batch)         # == one device's step up to float rounding
    params = run.gather(state)                   # the parameter tree (each leaf from its owner stage)

The loss is cut into stage functions exactly as for the SPMD runtime (`cut.cut_stages`). Stage s runs on
`meshes[rank_of[s]]`, a ("data", "model") Mesh of Auto axes over its own devices, its parameters placed
with their own NamedShardings; micro-batches split over its "data" axis where they divide. Its forward is
`jax.jit` of `jax.vjp` of the stage function: the VJP (a pytree holding the residuals) stays on the stage's
devices until its backward, a second jitted program that also adds the parameter gradient to the stage's
accumulator. Activations go forward and their gradients back with `jax.device_put` onto the other stage's
mesh (cross-mesh transfers). The driver walks the schedule's per-rank task lists (data from
`pipeline.schedules`) in an order respecting their dependencies and never blocks: jax's asynchronous dispatch
queues each program on its stage's devices, so stages on disjoint devices overlap. Tied copies' gradients
are summed once per step; the optimizer then updates each stage on its own mesh, and parameters and
optimizer state stay there between steps.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ...core.errors import PipelineError
from ...pipeline.schedules.registry import schedule as build_schedule
from ...pipeline.schedules.schedule import Schedule, Task
from ..compat import is_literal
from .cut import StageCut, cut_stages
from .flow import Flow
from .submeshes import stage_meshes


@dataclasses.dataclass
class MpmdState:
    """What stays on the stages between steps: per stage, its parameters {key: leaf} and optimizer state."""

    params: list[dict[str, jax.Array]]
    opt_states: list[Any]


def issue_order(sched: Schedule) -> list[Task]:
    """The schedule's tasks as one host-side sequence: each rank's tasks in its order, a task issued once
    every task it depends on has been (a rank waits, the others go on), so dispatch never deadlocks."""
    pos = [0] * len(sched.ranks)
    done: set[Task] = set()
    order: list[Task] = []
    total = sum(map(len, sched.ranks))
    while len(order) < total:
        moved = False
        for r, tasks in enumerate(sched.ranks):
            while pos[r] < len(tasks) and all(d in done for d in sched.dependencies(tasks[pos[r]])):
                order.append(tasks[pos[r]])
                done.add(tasks[pos[r]])
                pos[r] += 1
                moved = True
        if not moved:
            raise PipelineError(f"autoshard MPMD pipeline: schedule {sched.name!r} cannot progress (every rank waits "
                                f"on another); ranks stopped at {pos}.")
    return order


def batch_spec(x: Any, mesh: Mesh, axes: tuple[str, ...] = ("data",)) -> P:
    """A micro-batch leaf (or activation): split on its leading dim over the stage's batch `axes` where they
    divide it, else over "data", else whole."""
    for ax in (tuple(axes), ("data",)):
        n = math.prod(mesh.shape[a] for a in ax)
        if n > 1 and getattr(x, "ndim", 0) and x.shape[0] % n == 0:
            return P(ax if len(ax) > 1 else ax[0])
    return P()


def model_spec(shape: tuple[int, ...], mesh: Mesh) -> P:
    """The default stage tensor plan: a matrix's last dim split over "model" where it divides."""
    t = mesh.shape["model"]
    if t > 1 and len(shape) >= 2 and shape[-1] % t == 0:
        return P(*([None] * (len(shape) - 1)), "model")
    return P()


def _move(tree: Any, mesh: Mesh, axes: tuple[str, ...] = ("data",)) -> Any:
    """Cross-mesh transfer of activations or their gradients onto `mesh` (asynchronous)."""
    return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, batch_spec(x, mesh, axes))), tree)


class _Forward:
    """A stage's forward: `jax.jit` of `jax.vjp` of the stage function, except that the residuals which are
    the stage's parameters themselves are not returned (jit would return a copy of each, one per micro-batch
    in flight); `_Held.vjp` puts the parameters back for the backward."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self._made: dict[Any, tuple[Callable, Any, dict[int, int]]] = {}

    def _run(self, p: Any, b: Any, *xs: Any) -> Any:
        return jax.vjp(lambda p_, *xs_: self.fn(p_, b, *xs_), p, *xs)

    def __call__(self, p: Any, b: Any, *xs: Any) -> tuple[Any, _Held]:
        leaves, tree = jax.tree.flatten((p, b, xs))
        key = (tree, tuple((x.shape, str(x.dtype)) for x in leaves))
        if key not in self._made:
            self._made[key] = self._make(p, b, xs)
        slim, treedef, where = self._made[key]
        y, kept = slim(p, b, *xs)
        return y, _Held(kept, treedef, where)

    def _make(self, p: Any, b: Any, xs: tuple) -> tuple[Callable, Any, dict[int, int]]:
        closed, (y_shape, vjp_shape) = jax.make_jaxpr(self._run, return_shape=True)(p, b, *xs)
        param_vars = {v: i for i, v in enumerate(closed.jaxpr.invars[:len(jax.tree.leaves(p))])}
        outs = closed.jaxpr.outvars[len(jax.tree.leaves(y_shape)):]
        where = {j: param_vars[v] for j, v in enumerate(outs) if not is_literal(v) and v in param_vars}

        def slim(p: Any, b: Any, *xs: Any) -> Any:
            y, vjp = self._run(p, b, *xs)
            return y, [x for j, x in enumerate(jax.tree.leaves(vjp)) if j not in where]

        return jax.jit(slim), jax.tree.structure(vjp_shape), where


class _Held:
    """A forward's residuals until its backward, without the stage's parameters (`_Forward`)."""

    __slots__ = ("kept", "treedef", "where")

    def __init__(self, kept: list, treedef: Any, where: dict[int, int]):
        self.kept, self.treedef, self.where = kept, treedef, where

    def vjp(self, params: Any) -> Any:
        p_leaves, it = jax.tree.leaves(params), iter(self.kept)
        n = len(self.kept) + len(self.where)
        return jax.tree.unflatten(self.treedef, [p_leaves[self.where[j]] if j in self.where else next(it)
                                                 for j in range(n)])


def _bwd(M: int) -> tuple[Callable, Callable]:
    """(first backward, accumulating backward) of a stage: vjp(ct) -> (parameter gradient (+ acc), input
    gradients); a sink (ct None) seeds 1/M: the step's loss is the mean of the micro-batch losses."""
    def grads(vjp: Any, ct: Any, y: Any) -> Any:
        if ct is None:
            ct = jnp.full_like(y, 1.0 / M)
        dp, *dxs = vjp(ct)
        return dp, dxs

    def first(vjp: Any, ct: Any, y: Any) -> Any:
        return grads(vjp, ct, y)

    def acc(vjp: Any, ct: Any, y: Any, total: Any) -> Any:
        dp, dxs = grads(vjp, ct, y)
        return jax.tree.map(jnp.add, total, dp), dxs

    return jax.jit(first), jax.jit(acc, donate_argnums=3)


class MpmdPipeline:
    """A `StageCut` run as one jitted forward and backward per stage on its own submesh (module doc)."""

    def __init__(self, cut: StageCut, meshes: Sequence[Mesh], sched: Schedule,
                 param_specs: Callable[[int, str, tuple[int, ...], Mesh], P] | None = None,
                 batch_axes: Sequence[tuple[str, ...]] | None = None, stage_fns: Sequence[Callable] | None = None):
        if sched.num_stages != len(cut.fns) or len(sched.ranks) != len(meshes):
            raise PipelineError(f"autoshard MPMD pipeline: the schedule has {sched.num_stages} stages on "
                                f"{len(sched.ranks)} ranks; the cut has {len(cut.fns)} stages and there are "
                                f"{len(meshes)} submeshes.")
        self.cut, self.schedule, self.rank_meshes = cut, sched, list(meshes)
        S = sched.num_stages
        self.meshes = [self.rank_meshes[sched.rank_of[s]] for s in range(S)]
        self.counts = tuple(sched.num_microbatches)           # per stage (GraphPipe: they may differ)
        self.sink = next(s for s in range(S) if not sched.successors(s))
        self.M = self.counts[self.sink]                       # the loss is the mean of the sink's micro-batches
        self.batch_axes = [tuple(a) for a in batch_axes] if batch_axes is not None else [("data",)] * S
        self.order = issue_order(sched)
        spec = param_specs or (lambda s, key, shape, mesh: model_spec(shape, mesh))
        shapes = {k: tuple(x.shape) for k, x in zip(cut.keys, cut.p_leaves, strict=True)}
        self.shardings = [{k: NamedSharding(self.meshes[s], spec(s, k, shapes[k], self.meshes[s]))
                           for k, held in zip(cut.keys, cut.holders, strict=True) if s in held} for s in range(S)]
        # stage s's function traced at its own micro-batch size (`stage_fns`), else the cut's
        self._fwd = [_Forward(fn) for fn in (stage_fns if stage_fns is not None else cut.fns)]
        self._bwd = _bwd(self.M)
        self._updates: dict[int, Callable] = {}

    @property
    def num_stages(self) -> int:
        return self.schedule.num_stages

    # parameters and optimizer state

    def place(self, params: Any) -> list[dict[str, jax.Array]]:
        """Each stage's parameters {key: leaf} on its mesh, as copies (the caller's arrays are never donated)."""
        leaves, treedef = jax.tree.flatten(params)
        if treedef != self.cut.treedef:
            raise PipelineError("autoshard MPMD pipeline: the parameters' structure differs from the one the loss "
                                f"was cut for ({treedef.num_leaves} vs {self.cut.treedef.num_leaves} leaves).")
        by_key = dict(zip(self.cut.keys, leaves, strict=True))
        # device_put may reuse the caller's buffer as one shard (may_alias=False included, jax 0.10) and the
        # update donates the stage's parameters: a jitted copy on the stage's mesh owns fresh buffers
        return [self._copy(s, {k: jax.device_put(by_key[k], sh) for k, sh in self.shardings[s].items()})
                for s in range(self.num_stages)]

    def _copy(self, s: int, tree: dict) -> dict:
        return jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=self.shardings[s])(tree)

    def init(self, params: Any, optimizer: Any) -> MpmdState:
        placed = self.place(params)
        return MpmdState(placed, [self._on_stage(s, jax.jit(optimizer.init)(p)) for s, p in enumerate(placed)])

    def _on_stage(self, s: int, tree: Any) -> Any:
        """Leaves jit left on one device (an optimizer's step count: no input feeds it) replicated on stage s."""
        mesh = self.meshes[s]
        devs = set(mesh.devices.flat)
        return jax.tree.map(lambda x: x if set(x.sharding.device_set) == devs
                            else jax.device_put(x, NamedSharding(mesh, P())), tree)

    def gather(self, state: MpmdState | list) -> Any:
        """The parameter tree, each leaf its owner stage's copy (still on that stage's devices)."""
        placed = state.params if isinstance(state, MpmdState) else state
        return jax.tree.unflatten(self.cut.treedef, [placed[o][k] for k, o in zip(self.cut.keys, self.cut.owner,
                                                                                  strict=True)])

    # one step

    # the `autoshard.Pipelined` surface: stack / __call__ / unstack / value_and_grad / stages

    stack = place
    unstack = gather

    @property
    def stages(self) -> tuple:
        return self.cut.infos

    def value_and_grad(self, params: Any, batch: Any) -> tuple[jax.Array, Any]:
        """(loss, gradient tree) for a parameter tree; each gradient leaf on its owner stage's devices."""
        loss, grads = self(self.place(params), batch)
        return loss, self.gather(grads)

    def describe(self) -> str:
        counts = self.M if len(set(self.counts)) == 1 else list(self.counts)
        rows = [f"MPMD: {self.num_stages} stages, {counts} micro-batches, schedule {self.schedule.name!r}",
                "| stage | devices | mesh | eqns | params |", "|---|---|---|---|---|"]
        for st, mesh in zip(self.cut.infos, self.meshes, strict=True):
            ids = [d.id for d in mesh.devices.flat]
            rows.append(f"| {st.index} | {ids} | {dict(mesh.shape)} | {st.eqns} | {len(st.params)} |")
        return "\n".join(rows)

    def __call__(self, placed: list[dict[str, jax.Array]], batch: Any) -> tuple[jax.Array, list[dict]]:
        """(loss, per-stage gradients {key: leaf} on the stages' meshes): the schedule issued without waiting."""
        S, sched = self.num_stages, self.schedule
        mbs, B = self._microbatches(batch)
        flow = Flow(self.counts, B, [sched.predecessors(s) for s in range(S)], [sched.successors(s) for s in range(S)],
                    lambda tree, v: _move(tree, self.meshes[v], self.batch_axes[v]))
        held: dict[tuple[int, int], Any] = {}     # (stage, micro-batch) -> (output, residuals) until its backward
        grads: list[Any] = [None] * S
        losses = []
        first, acc = self._bwd
        for t in self.order:
            s, m = t.stage, t.microbatch
            if t.kind == "F":
                y, residuals = self._fwd[s](placed[s], mbs[s][m], *flow.inputs(s, m))
                held[(s, m)] = (y, residuals)
                if s == self.sink:
                    losses.append(y)
                flow.send(s, m, y)
                continue
            y, residuals = held.pop((s, m))
            vjp = residuals.vjp(placed[s])
            ct = flow.gradient(s, m) if s != self.sink else None
            if grads[s] is None:
                grads[s], dxs = first(vjp, ct, y)
            else:
                grads[s], dxs = acc(vjp, ct, y, grads[s])
            flow.give_back(s, m, dxs)
        loss = sum(x.astype(jnp.float32) for x in losses) / self.M
        return loss, self._sum_tied(grads)

    def step(self, state: MpmdState, batch: Any, optimizer: Any) -> tuple[MpmdState, jax.Array]:
        """One training step: gradients, then each stage's optimizer update on its own mesh."""
        loss, grads = self(state.params, batch)
        out = [self._update(s, optimizer, state.opt_states[s])(state.params[s], state.opt_states[s], grads[s])
               for s in range(self.num_stages)]
        return MpmdState([p for p, _ in out], [o for _, o in out]), loss

    def _update(self, s: int, optimizer: Any, opt_state: Any) -> Callable:
        if s not in self._updates:
            keep = (self.shardings[s], jax.tree.map(lambda x: x.sharding, opt_state))

            def update(p: Any, o: Any, g: Any) -> Any:
                u, o = optimizer.update(g, o, p)      # an optax GradientTransformation
                return jax.tree.map(lambda x, d: (x + d).astype(x.dtype), p, u), o
            self._updates[s] = jax.jit(update, out_shardings=keep, donate_argnums=(0, 1))
        return self._updates[s]

    def _microbatches(self, batch: Any) -> tuple[list[list[Any]], int]:
        """(per stage, its micro-batches on its mesh ((batch, whole-batch statistics) for a ratio loss); the
        batch size). Each stage splits the batch into its own count."""
        form = self.cut.form
        staged = (batch, form.globals(batch)) if form is not None and form.stats else batch
        sizes = {x.shape[0] for x in jax.tree.leaves(staged)}
        B = sizes.pop() if len(sizes) == 1 else None
        if B is None or any(B % n for n in self.counts):
            raise PipelineError(f"autoshard MPMD pipeline: the batch's leading dims {sorted(sizes)} must be one size "
                                f"that splits into each stage's micro-batch count {list(self.counts)}.")
        chunks: dict[int, list[Any]] = {}
        for n in set(self.counts):
            mb = B // n
            chunks[n] = [jax.tree.map(lambda x, m=m, mb=mb: x[m * mb:(m + 1) * mb], staged) for m in range(n)]
        return [[_move(c, mesh, ax) for c in chunks[n]]
                for mesh, ax, n in zip(self.meshes, self.batch_axes, self.counts, strict=True)], B

    def _sum_tied(self, grads: list[dict]) -> list[dict]:
        """A parameter held by several stages (tied embeddings): every copy's gradient becomes the copies' sum,
        formed on the owner's mesh and sent back, so an elementwise optimizer keeps the copies equal."""
        for k, held, o in zip(self.cut.keys, self.cut.holders, self.cut.owner, strict=True):
            if len(held) < 2:
                continue
            home = self.shardings[o][k]
            total = sum((jax.device_put(grads[h][k], home) for h in sorted(held) if h != o), grads[o][k])
            for h in held:
                grads[h][k] = total if h == o else jax.device_put(total, self.shardings[h][k])
        return grads


def mpmd_pipelined(loss_fn: Callable, params: Any, batch: Any, *, submeshes: Sequence[Any],
                   num_microbatches: int | Sequence[int], schedule: str = "1f1b",
                   devices: Sequence[Any] | None = None, virtual_stages: int = 2,
                   param_specs: Callable | None = None, check_loss: bool = True, hardware: Any = None,
                   plan: Any = None, batch_axes: Sequence[tuple[str, ...]] | None = None) -> MpmdPipeline:
    """Cut `loss_fn(params, batch) -> scalar` into stages and run them MPMD, one rank per entry of `submeshes`
    ((data, model) shapes or {"devices", "shape"}: `submeshes.stage_meshes`, checked before anything runs).
    `num_microbatches`: one count, or one per stage (GraphPipe's per-stage micro-batch sizes: each stage
    runs its own count, activations re-chunked between them, `flow.py`). `schedule`: a registered name
    ("gpipe", "1f1b", "interleaved-1f1b": `virtual_stages` stages per rank; a plan cutting the loss into
    a DAG of stages, or per-stage counts, run "graph-1f1b"); `param_specs(stage, key, shape, mesh) ->
    PartitionSpec`: each stage's parameter shardings (default `model_spec`); `plan`: a pipeline plan with
    as many stages, guiding the cut as in `autoshard.pipelined`; `batch_axes`: per stage, the mesh axes
    splitting its micro-batches (default "data")."""
    meshes = stage_meshes(submeshes, devices)
    R = len(meshes)
    S = R * virtual_stages if schedule == "interleaved-1f1b" else R
    counts = _counts(num_microbatches, S)
    sizes = {x.shape[0] for x in jax.tree.leaves(batch) if getattr(x, "shape", ())}
    if len(sizes) != 1 or any(next(iter(sizes)) % n for n in counts):
        raise PipelineError(f"autoshard MPMD pipeline: every batch leaf needs one leading (batch) dimension that "
                            f"splits into {sorted(set(counts))} micro-batches; got {sorted(sizes)}.")
    B = sizes.pop()
    three_d = "3d" in getattr(plan, "predicted", {})
    mesh_shape = {f"stage{r}": dict(mesh.shape) for r, mesh in enumerate(meshes)}
    cuts = {}
    for n in sorted(set(counts), reverse=True):      # one trace per micro-batch size (the shapes are baked in)
        cuts[n] = cut_stages(loss_fn, params, batch, S=S, mb=B // n, B=B, plan=plan, schedule=schedule,
                             check_loss=check_loss, hardware=hardware, three_d=three_d, mesh_shape=mesh_shape)
    cut = cuts[counts[0]]
    if any(c.edges != cut.edges or c.keys != cut.keys for c in cuts.values()):
        raise PipelineError("autoshard MPMD pipeline: the loss cuts differently at the stages' micro-batch sizes "
                            f"{sorted(B // n for n in cuts)}; give every stage one micro-batch count.")
    if cut.edges is not None or len(set(counts)) > 1:
        if schedule not in ("1f1b", "graph-1f1b"):
            raise PipelineError(f"autoshard MPMD pipeline: schedule={schedule!r} runs a chain of stages with one "
                                "micro-batch count; a DAG of stages or per-stage counts run 'graph-1f1b' (or '1f1b').")
        sched = build_schedule("graph-1f1b", num_stages=S, num_microbatches=list(counts), edges=cut.edges)
    else:
        kw = {"virtual_stages": virtual_stages} if schedule == "interleaved-1f1b" else {}
        sched = build_schedule(schedule, num_stages=R, num_microbatches=counts[0], **kw)
    fns = [cuts[counts[s]].fns[s] for s in range(S)]
    return MpmdPipeline(cut, meshes, sched, param_specs, batch_axes, stage_fns=fns)


def _counts(num_microbatches: Any, S: int) -> tuple[int, ...]:
    """One micro-batch count per stage, checked."""
    many = isinstance(num_microbatches, (list, tuple))
    counts = tuple(num_microbatches) if many else (num_microbatches,) * S
    if len(counts) != S or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in counts):
        raise PipelineError(f"autoshard MPMD pipeline: num_microbatches must be a positive int or one per stage "
                            f"({S}), got {num_microbatches!r}.")
    return counts
