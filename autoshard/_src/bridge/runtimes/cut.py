"""autoshard.pipelined: cut a loss function into pipeline stages and run them with `pipeline.runtime`.

    run = autoshard.pipelined(m.loss, params, batch, mesh={"pipe": 4, "data": 2}, num_microbatches=8)
    loss, grads = run.value_and_grad(params, batch)      # == jax.value_and_grad(m.loss)(params, batch)
    state = run.stack(params); loss, g = run(state, batch)   # keep parameters stage-sharded

The loss is traced at the micro-batch shape and its jaxpr flattened (jit wrappers inlined; control
flow, custom derivatives and remat kept whole). Every eqn that depends on a parameter gets a stage:
by default the eqn sequence is cut into S pieces minimising an estimated pipeline tick (the
largest stage's flops and the largest boundary's bytes on `hardware`); with `plan=` (a pipeline
Plan) each eqn starts at the stage owning the parameters it reads and each cut takes the cheapest
boundary between them. An eqn
never runs before the stages of its inputs, so the cut is always a valid chain. Eqns that only
read the batch (labels, masks, position ids) are recomputed by every stage that needs them instead
of being sent. Values computed in stage s and used in a later stage travel down the chain. A
parameter read by several stages (tied embeddings) has a copy on each; the runtime sums the copies'
gradients once per step, so an elementwise optimizer keeps them equal and the weight never
travels with the micro-batches.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh

from ...core.attribution import parse_scope
from ...core.errors import PipelineError
from ...core.hardware import get_hardware
from ...pipeline.partition import microbatch_split_error
from ...plan.explain import stage_submeshes
from .. import compat as jc
from ..devices import local_hardware
from ..emit.emit import auto_axes, on_own_mesh
from ..emit.remat import eqn_blocks, run_eqns
from ..trace.loss_form import LossForm, loss_form, value_avals
from ..trace.trace import eqn_flops
from .cut_3d import ActivationSpecs, dict_path, guard_gathers, plan_batch_axes, runnable_here, stage_specs
from .cut_dag import assign as dag_assign
from .cut_dag import plan_edges
from .cut_place import anchors, live_bytes, plan_anchors, plan_stages, stage_count
from .layouts import on_one_place
from .repack import Repacker
from .runtime import pipeline_value_and_grad


@dataclasses.dataclass(frozen=True)
class StageInfo:
    """What one stage of a `Pipelined` loss runs and holds."""

    index: int
    eqns: int                        # eqns it runs (recomputed batch-only eqns not counted)
    flops: float                     # per micro-batch, forward
    modules: tuple[str, ...]         # module paths of its eqns, in order of first appearance
    params: tuple[str, ...]          # keypaths of the parameters it owns
    receives: int                    # values it gets from the previous stage
    receive_bytes: int               # their bytes per micro-batch (per data-parallel replica)
    borrows: tuple[str, ...] = ()    # copies of earlier stages' parameters it reads (tied weights)
    receive_shapes: tuple[tuple[int, ...], ...] = ()   # shapes of the values it receives
    after: tuple[int, ...] = ()      # the stages it receives from


def _mesh(mesh: Any) -> Mesh:
    if isinstance(mesh, jax.sharding.AbstractMesh):
        mesh = dict(mesh.shape)       # axes without devices (jax.sharding.get_abstract_mesh()): the local ones
    if isinstance(mesh, Mesh):
        return auto_axes(mesh)        # jax.make_mesh's Explicit axes: same devices, Auto (the runtime's constraints)
    if isinstance(mesh, Mapping) and mesh and all(isinstance(v, int) and v > 0 for v in mesh.values()):
        n = math.prod(mesh.values())
        if n > len(jax.devices()):
            raise PipelineError(
                f"autoshard.pipelined: mesh {dict(mesh)} needs {n} devices, {len(jax.devices())} are available.")
        return jax.make_mesh(tuple(mesh.values()), tuple(mesh), axis_types=(AxisType.Auto,) * len(mesh),
                             devices=jax.devices()[:n])
    raise PipelineError(f"autoshard.pipelined: mesh must be a jax Mesh or a dict axis -> size, got {mesh!r}. Fix: "
                        "mesh={'pipe': 2, 'data': 4} or jax.make_mesh(sizes, names) with a 'pipe' axis.")


class Pipelined:
    """A loss function cut into stages: `value_and_grad` on parameter trees, or `stack` once and call
    with the stage-sharded `StackedParams` (what a training loop keeps between steps)."""

    def __init__(self, program: Any, stages: tuple[StageInfo, ...], treedef: Any, keys: tuple[str, ...],
                 owner: tuple[int, ...], holders: tuple[tuple[int, ...], ...]):
        self.program = program
        self.stages = stages
        self._treedef, self._keys, self._owner, self._holders = treedef, keys, owner, holders

    @property
    def mesh(self) -> Mesh:
        return self.program.mesh

    @on_own_mesh
    def stack(self, params: Any) -> Any:
        return self.program.stack(self._per_stage(params))

    def _per_stage(self, params: Any) -> list[dict[str, Any]]:
        """Each stage's parameters as {key: leaf} (a tied leaf in every stage that reads it)."""
        leaves, treedef = jax.tree.flatten(params)
        if treedef != self._treedef:
            raise PipelineError(
                f"autoshard.pipelined: the parameters' structure differs from the one the loss was cut for "
                f"({treedef.num_leaves} vs {self._treedef.num_leaves} leaves); pass the same parameter tree.")
        per_stage: list[dict[str, Any]] = [{} for _ in self.stages]
        for key, held_by, leaf in zip(self._keys, self._holders, leaves, strict=True):
            for s in held_by:
                per_stage[s][key] = leaf
        return per_stage

    def repacker(self, params: Any) -> Repacker:
        """Moves parameters stored ZeRO-style (`repack.storage_spec`) into the stage rows and gradients
        back, one all-to-all each way (what the decorated pipeline step runs every step)."""
        structs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in jax.tree.leaves(params)]
        stacked = self.program.abstract_stack(self._per_stage(jax.tree.unflatten(self._treedef, structs)))
        return Repacker(self, structs, stacked)

    @on_own_mesh
    def unstack(self, stacked: Any) -> Any:
        per_stage = self.program.unstack(stacked)
        return jax.tree.unflatten(self._treedef, [per_stage[s][k] for k, s in zip(self._keys, self._owner,
                                                                                   strict=True)])

    @on_own_mesh
    def __call__(self, stacked: Any, batch: Any) -> tuple[jax.Array, Any]:
        return self.program(stacked, batch)

    @on_own_mesh
    def value_and_grad(self, params: Any, batch: Any) -> tuple[jax.Array, Any]:
        loss, grads = self.program(self.stack(params), batch)
        return loss, self.unstack(grads)

    def describe(self) -> str:
        rows = [f"{len(self.stages)} stages, {self.program.num_microbatches} micro-batches, schedule "
                f"{self.program.schedule.name!r}, mesh {dict(self.mesh.shape)}",
                "| stage | eqns | GFLOP/micro-batch | params | receives (MiB) | modules |", "|---|---|---|---|---|---|"]
        for st in self.stages:
            mods = ", ".join(st.modules[:4]) + (" ..." if len(st.modules) > 4 else "")
            rows.append(f"| {st.index} | {st.eqns} | {st.flops / 1e9:.3g} | {len(st.params)} | "
                        f"{st.receives} ({st.receive_bytes / 2**20:.3g}) | {mods} |")
        return "\n".join(rows)


@on_own_mesh
def pipelined(loss_fn: Callable, params: Any, batch: Any, *, mesh: Any, num_microbatches: int,
              schedule: str = "1f1b", plan: Any = None, pipe_axis: str = "pipe",
              data_axes: tuple[str, ...] | None = None, check_loss: bool = True,
              hardware: Any = None, tensor_in_stages: bool | None = None,
              virtual_stages: int | None = None) -> Pipelined:
    """Cut `loss_fn(params, batch) -> scalar loss` into one stage per `pipe_axis` rank and build
    the shard_map pipeline program (see the module docstring). `plan`: a pipeline Plan from
    `autoshard.plan(..., pipeline="rannc")` whose stage count matches; its parameter placement
    guides the cut. `data_axes`: mesh axes splitting each micro-batch (default: all but pipe).
    `hardware` (a preset name, HardwareSpec or dict, as in `autoshard.plan`; None: the local device's
    preset, as everywhere): its flop rate and link
    bandwidth weigh stage flops against boundary bytes when there is no plan.

    Each replica runs `loss_fn` per micro-batch (B / (num_microbatches x replicas) consecutive
    samples) and the pipeline averages these chunks. `loss_form` makes that the one-device loss and
    gradient on every batch when the loss is affine in sums over samples (means, sums, and ratios
    such as sum(ce * mask) / sum(mask) whose denominator comes from the batch: computed on the whole
    batch before the pipeline). `check_loss` refuses other losses (a max over samples, a
    parameter-dependent denominator) and compares the two on the example batch (concrete arguments);
    pass False to train on the mean of the per-chunk losses instead.

    A 3-D `plan` (stages with tensor plans) runs each stage's tensor plan on the automatic axes;
    `tensor_in_stages=None` first checks that this machine's runtime can run the compiled program
    (`PipelineProgram.cpu_deadlocks`) and otherwise runs the stages data parallel, with a warning;
    True / False skip the check (keep the stage plans / run data parallel).

    `autoshard.pipelined` (`runtimes.choose`) runs a plan whose `runtime` is "mpmd" (stages on unequal
    submeshes, unequal replicas or micro-batch counts) on the MPMD runtime instead, over the mesh's devices
    (`runtimes.mpmd.MpmdPipeline`, this surface).

    `schedule="interleaved-1f1b"` cuts v stages per pipe rank (stage k on rank k % pipe): v is the
    plan's stage count / pipe, else `virtual_stages` (default 2)."""
    if not callable(loss_fn):
        raise PipelineError(f"autoshard.pipelined: loss_fn must be callable, got {type(loss_fn).__name__}.")
    mesh = _mesh(mesh)
    if getattr(plan, "runtime", "spmd") == "mpmd" and "3d" in plan.predicted:
        raise PipelineError("autoshard.pipelined: the 3-D plan's stages sit on unequal submeshes "
                            f"({stage_submeshes(plan.stages)}): one SPMD program cannot run them. Fix: call "
                            "autoshard.pipelined(...) or @autoshard(plan=plan), which run it MPMD.")
    three_d = plan is not None and bool(getattr(plan, "is_pipeline", False)) and "3d" in plan.predicted
    if three_d and data_axes is None:
        data_axes = plan_batch_axes(plan, mesh, pipe_axis)
    S, axes, B, mb = _split_batch(mesh, batch, num_microbatches, pipe_axis, data_axes)
    S = stage_count(plan, schedule, S, virtual_stages)      # stages to cut (pipe ranks x chunks)
    if three_d:      # stages see the whole micro-batch, split over the data axes by XLA
        mb *= math.prod(mesh.shape[a] for a in axes)
    c = cut_stages(loss_fn, params, batch, S=S, mb=mb, B=B, plan=plan, schedule=schedule, check_loss=check_loss,
                   hardware=hardware, mesh_shape=dict(mesh.shape), three_d=three_d,
                   acts=(lambda prog, modules: ActivationSpecs(prog, modules, plan, mesh)) if three_d else None)
    specs = stage_specs(plan_stages(plan, S), c.keys, c.holders, c.owner, c.p_leaves, mesh) if three_d else (None, None)
    form = c.form
    program = pipeline_value_and_grad(c.fns, mesh, num_microbatches=num_microbatches, schedule=c.schedule,
                                      edges=c.edges, pipe_axis=pipe_axis, data_axes=axes, tied=c.tied,
                                      stage_specs=specs[0], compute_specs=specs[1],
                                      batch_globals=form.globals if form is not None and form.stats else None)
    if three_d and tensor_in_stages is None:
        runnable_here(program, c.keys, c.holders, c.p_leaves, batch)
    elif three_d and not tensor_in_stages:
        program.drop_tensor_plans()
    if c.acts is not None:      # data-parallel stages place no activations either
        c.acts.enabled = program.tensor_in_stages
        program.activation_specs = c.acts
    return Pipelined(program, c.infos, c.treedef, c.keys, tuple(c.owner), tuple(map(tuple, c.holders)))


@dataclasses.dataclass(frozen=True)
class StageCut:
    """A loss cut into stage functions (`_stage_fn`): what any runtime needs to run them."""

    fns: list[Callable]                    # stage s: fn(params {key: leaf}, batch, *inputs per predecessor)
    edges: list[tuple[int, int]] | None    # the stage DAG (None: a chain)
    schedule: str                          # the schedule to run ("graph-1f1b" for a DAG cut with "1f1b")
    keys: tuple[str, ...]                  # parameter leaves' keypaths
    treedef: Any
    p_leaves: list
    holders: list[set[int]]                # the stages holding each leaf (tied: several)
    owner: list[int]
    tied: list                             # per tied leaf: [(stage, dict path)] of its copies
    form: LossForm | None
    infos: tuple[StageInfo, ...]
    acts: Any = None                       # a 3-D cut's `ActivationSpecs`


def cut_stages(loss_fn: Callable, params: Any, batch: Any, *, S: int, mb: int, B: int, plan: Any = None,
               schedule: str = "1f1b", check_loss: bool = True, hardware: Any = None,
               mesh_shape: dict | None = None, three_d: bool = False, acts: Callable | None = None) -> StageCut:
    """Trace `loss_fn` at micro-batch size `mb` (batch `B`) and cut it into S stage functions (the module
    docstring); `acts(prog, modules)`: a 3-D cut's activation constraints. Runtime-independent: the SPMD
    runtime (`pipelined`) and the MPMD one (`runtimes.mpmd`) both run the result."""
    mesh_shape = mesh_shape or {}
    closed, prog, treedef, keys, p_leaves = _trace(loss_fn, params, batch, mb)
    form = loss_form(loss_fn, params, batch, prog, closed, mb, B, strict=check_loss)
    if form is not None:
        prog = form.prog          # batch-size literals at their full-batch values
        if check_loss and form.inexact:
            raise _inexact_error(form, mb, mesh_shape)
    if check_loss:
        _check_chunk_mean(loss_fn, params, batch, form, mb, mesh_shape)
    g = _analyse(prog, closed, keys)
    rate, bandwidth = _rates(hardware, p_leaves)
    dag = plan_edges(plan_stages(plan, S)) if plan is not None else None
    if dag is None:     # a chain: stage s sends s+1 everything made so far that is used later
        cut = _chain_cut(g, plan, S, rate, bandwidth)
    else:               # a DAG (GraphPipe): each value goes straight to the stages using it
        cut = _dag_cut(g, plan, S, dag)
        if schedule == "1f1b":
            schedule = "graph-1f1b"     # 1F1B generalised to a DAG of stages
    _check_sends(g, cut.sends)
    holders, owner = _holders(g, cut.stage)
    needs_batch_only = _batch_only_needs(g, cut, S)
    blocks = eqn_blocks(prog, plan.predicted["3d"]["unit_labels"]) if three_d else []
    act = acts(prog, g.modules) if acts is not None else None
    fns = [_stage_fn(s, prog, cut.stage, needs_batch_only[s], [cut.sends[u] for u in cut.preds[s]],
                     None if s == cut.sink else cut.sends[s], keys, holders, g.loss_key, act,
                     (blocks, plan.stages[s].remat if three_d else "none"), form) for s in range(S)]
    tied = [[(h, dict_path(keys[i])) for h in sorted(holders[i])] for i in range(len(keys)) if len(holders[i]) > 1]
    infos = _stage_infos(g, cut, S, holders, owner)
    return StageCut(fns, cut.edges, schedule, keys, treedef, p_leaves, holders, owner, tied, form, infos, act)


@dataclasses.dataclass(frozen=True)
class _Eqns:
    """The traced loss, flattened, and what the cut reads of it (lists are indexed by eqn)."""

    prog: Any
    keys: tuple[str, ...]            # the parameter leaves' keypaths
    param_key: dict[Any, int]        # value key -> parameter leaf index
    producer: dict[int, int]         # value key -> the eqn making it
    key_ins: list[list[Any]]         # each eqn's non-literal inputs
    batch_only: list[bool]           # no parameter upstream
    flops: list[float]               # per micro-batch, forward
    modules: list[str]
    avals: dict[int, Any]
    nbytes: dict[int, int]
    loss_key: Any


@dataclasses.dataclass(frozen=True)
class _Cut:
    """Which stage runs each eqn and which values travel between stages."""

    stage: list[int]                       # per eqn (-1: batch-only, recomputed where needed)
    edges: list[tuple[int, int]] | None    # the stage DAG (None: a chain)
    sends: dict[int, list[Any]]            # stage -> the values it sends each successor
    sink: int                              # the stage returning the loss
    preds: list[list[int]]                 # per stage: the stages it receives from


def _split_batch(mesh: Mesh, batch: Any, num_microbatches: Any, pipe_axis: str,
                 data_axes: tuple[str, ...] | None) -> tuple[int, tuple[str, ...], int, int]:
    """(stages, data axes, batch size, micro-batch size per replica), or a PipelineError."""
    if pipe_axis not in mesh.axis_names:
        raise PipelineError(
            f"autoshard.pipelined: the mesh {dict(mesh.shape)} has no {pipe_axis!r} axis; its size is the stage count.")
    S = mesh.shape[pipe_axis]
    if S < 2:
        raise PipelineError(
            f"autoshard.pipelined: the mesh {dict(mesh.shape)} has {pipe_axis}={S}: one stage, nothing to pipeline. "
            f"Fix: a {pipe_axis!r} axis of 2 or more, or run the loss without stages (jax.value_and_grad; "
            "@autoshard.autoshard plans tensor sharding over the other axes).")
    axes = tuple(a for a in mesh.axis_names if a != pipe_axis) if data_axes is None else tuple(data_axes)
    dp = math.prod(mesh.shape[a] for a in axes if a in mesh.shape)
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise PipelineError(
            f"autoshard.pipelined: num_microbatches must be a positive int, got {num_microbatches!r}.")
    sizes = {x.shape[0] for x in jax.tree.leaves(batch) if getattr(x, "shape", ())}
    if len(sizes) != 1:
        raise PipelineError(
            f"autoshard.pipelined: every batch leaf needs the same leading (batch) dimension; got {sorted(sizes)}.")
    B = sizes.pop()
    why = microbatch_split_error("autoshard.pipelined", B, dp, num_microbatches, str(dict(mesh.shape)),
                                 " x ".join(a for a in axes if a in mesh.shape) or "no data axis")
    if why:
        raise PipelineError(why)
    return S, axes, B, B // (num_microbatches * dp)


def _trace(loss_fn: Callable, params: Any, batch: Any, mb: int) -> tuple[Any, Any, Any, tuple[str, ...], list]:
    """(closed jaxpr, flattened program, params treedef, leaf keypaths, leaves) of the loss traced at
    the micro-batch shape."""
    p_leaves_kp, treedef = jax.tree_util.tree_flatten_with_path(params)
    keys = tuple(jc.keystr(kp) for kp, _ in p_leaves_kp)
    p_struct = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    b_struct = jax.tree.map(lambda x: jax.ShapeDtypeStruct((mb, *x.shape[1:]), x.dtype), batch)
    try:
        closed = jax.make_jaxpr(loss_fn)(p_struct, b_struct)
    except Exception as e:
        raise PipelineError(
            f"autoshard.pipelined: tracing loss_fn at the micro-batch size {mb} failed: {type(e).__name__}: {e}") from e
    prog = jc.flatten_calls(closed)
    if len(prog.outputs) != 1 or closed.out_avals[0].shape != () or \
            not jnp.issubdtype(closed.out_avals[0].dtype, jnp.floating):
        raise PipelineError(
            f"autoshard.pipelined: loss_fn must return one scalar float loss (the micro-batch mean); it returns "
            f"{[(a.shape, str(a.dtype)) for a in closed.out_avals]}.")
    return closed, prog, treedef, keys, [x for _, x in p_leaves_kp]


def _analyse(prog: Any, closed: Any, keys: tuple[str, ...]) -> _Eqns:
    n_params = len(keys)
    param_key = {k: i for i, k in enumerate(prog.inputs[:n_params])}   # value key -> leaf index
    batch_keys = set(prog.inputs[n_params:])

    eqns = prog.eqns
    producer: dict[int, int] = {k: e for e, fe in enumerate(eqns) for k in fe.outputs}
    key_ins = [[a for a in fe.inputs if not jc.is_literal(a)] for fe in eqns]
    # batch-only eqns (no parameter upstream) are recomputed where needed, never sent
    batch_only = [False] * len(eqns)
    for e, ins in enumerate(key_ins):
        batch_only[e] = all(k in batch_keys or k in prog.consts or (k in producer and batch_only[producer[k]])
                            for k in ins)
    flops = [eqn_flops(fe.eqn) for fe in eqns]      # the planner's lowering: remat/scan bodies counted

    modules = [parse_scope(fe.scope)[0] for fe in eqns]
    avals = value_avals(prog, closed)
    nbytes = {k: int(np.prod(a.shape)) * a.dtype.itemsize for k, a in avals.items()}   # PRNG keys too
    return _Eqns(prog, keys, param_key, producer, key_ins, batch_only, flops, modules, avals, nbytes,
                 prog.outputs[0])


def _rates(hardware: Any, p_leaves: list) -> tuple[float, float]:
    """(flop rate for the parameters' dtype, link bandwidth) of `hardware` (None: the local device)."""
    hw = get_hardware(hardware) if hardware is not None else local_hardware()
    biggest = max(p_leaves, key=lambda x: x.size) if p_leaves else None
    rate = hw.peak_flops(biggest.dtype if biggest is not None else jnp.float32) * hw.compute_efficiency
    return rate, hw.intra_node_bandwidth


def _chain_cut(g: _Eqns, plan: Any, S: int, flop_rate: float, link_bandwidth: float) -> _Cut:
    """A chain: every eqn at the latest of its anchor and its inputs' stages; stage s sends s+1
    everything made so far that is used later."""
    n = len(g.key_ins)
    live = live_bytes(g.key_ins, g.producer, g.batch_only, g.nbytes, g.loss_key)
    anchor = anchors(plan, S, g.keys, g.key_ins, g.param_key, g.batch_only, g.flops, g.modules, live, flop_rate,
                      link_bandwidth)
    stage = [-1] * n
    for e in range(n):
        if g.batch_only[e]:
            continue
        ins = [stage[g.producer[k]] for k in g.key_ins[e] if k in g.producer and not g.batch_only[g.producer[k]]]
        stage[e] = max([anchor[e], *ins])
    made_at = {k: stage[g.producer[k]] for k in g.producer if not g.batch_only[g.producer[k]]}
    last_use: dict[int, int] = {}
    for e, ins in enumerate(g.key_ins):
        if not g.batch_only[e]:
            for k in ins:
                if k in made_at:
                    last_use[k] = max(last_use.get(k, -1), stage[e])
    if not jc.is_literal(g.loss_key) and g.loss_key in made_at:
        last_use[g.loss_key] = S - 1
    sends = {s: [k for k in sorted(made_at) if made_at[k] <= s < last_use.get(k, -1)] for s in range(S - 1)}
    return _Cut(stage, None, sends, S - 1, [[s - 1] if s else [] for s in range(S)])


def _dag_cut(g: _Eqns, plan: Any, S: int, dag: list[tuple[int, int]]) -> _Cut:
    """A DAG (GraphPipe): `cut_dag.assign` places the eqns; each value goes straight to the stages using it."""
    plan_anchor = plan_anchors(plan, S, g.keys, g.key_ins, g.param_key, g.batch_only, g.modules)
    stage, edges, sends, sink = dag_assign(S, dag, plan_anchor, g.key_ins, [fe.outputs for fe in g.prog.eqns],
                                           g.batch_only, None if jc.is_literal(g.loss_key) else g.loss_key)
    return _Cut(stage, edges, sends, sink, [[u for u, v in edges if v == s] for s in range(S)])


def _check_sends(g: _Eqns, sends: dict[int, list[Any]]) -> None:
    """Stages exchange only floating-point values: name the first other value that would travel."""
    eqns = g.prog.eqns
    for a, ks in sends.items():
        bad = [k for k in ks if not jnp.issubdtype(g.avals[k].dtype, jnp.floating)]
        if bad:
            k = bad[0]
            where = f"eqn '{eqns[g.producer[k]].eqn.primitive.name}' in {eqns[g.producer[k]].scope or 'the top level'}"
            raise PipelineError(
                f"autoshard.pipelined: a {g.avals[k].dtype}{list(g.avals[k].shape)} value made by {where} in stage {a} "
                f"is used in a later stage; stages exchange only floating-point values. Compute it from the batch "
                f"alone (then every stage recomputes it) or keep its producer and users together.")


def _holders(g: _Eqns, stage: list[int]) -> tuple[list[set[int]], list[int]]:
    """(the stages holding each parameter leaf, its owner: the first of them)."""
    # holders: every stage reading a parameter keeps a copy (tied embeddings: the first and the last
    # stage), the runtime sums the copies' gradients once per step; unread ones live on stage 0
    holders: list[set[int]] = [set() for _ in range(len(g.keys))]
    for e, ins in enumerate(g.key_ins):
        for k in ins:
            if k in g.param_key and not g.batch_only[e]:
                holders[g.param_key[k]].add(stage[e])
    holders = [h or {0} for h in holders]
    return holders, [min(h) for h in holders]


def _batch_only_needs(g: _Eqns, cut: _Cut, S: int) -> list[list[int]]:
    """Per stage: the batch-only eqns it must recompute (it then runs them and its own eqns in program order)."""
    eqns = g.prog.eqns
    needs_batch_only: list[list[int]] = []
    for s in range(S):
        want = {k for e in range(len(eqns)) if cut.stage[e] == s for k in g.key_ins[e]}
        if s == cut.sink and not jc.is_literal(g.loss_key):
            want.add(g.loss_key)
        chosen: set[int] = set()
        for e in range(len(eqns) - 1, -1, -1):
            if g.batch_only[e] and (any(k in want for k in eqns[e].outputs)):
                chosen.add(e)
                want.update(g.key_ins[e])
        needs_batch_only.append(sorted(chosen))
    return needs_batch_only


def _stage_infos(g: _Eqns, cut: _Cut, S: int, holders: list[set[int]], owner: list[int]) -> tuple[StageInfo, ...]:
    """What each stage runs, holds and receives (`Pipelined.stages`)."""
    keys = g.keys
    recv = [[k for u in cut.preds[s] for k in cut.sends[u]] for s in range(S)]
    infos = []
    for s in range(S):
        mine = [e for e in range(len(g.prog.eqns)) if cut.stage[e] == s]
        mods = list(dict.fromkeys(g.modules[e] for e in mine))
        infos.append(StageInfo(s, len(mine), float(sum(g.flops[e] for e in mine)), tuple(m for m in mods if m),
                               tuple(k for k, o in zip(keys, owner, strict=True) if o == s), len(recv[s]),
                               int(sum(g.nbytes[k] for k in recv[s])),
                               tuple(k for k, h, o in zip(keys, holders, owner, strict=True) if s in h and o != s),
                               tuple(tuple(int(d) for d in g.avals[k].shape) for k in recv[s]), tuple(cut.preds[s])))
    return tuple(infos)


def _inexact_error(form: LossForm, mb: int, mesh_shape: dict) -> PipelineError:
    return PipelineError(
        f"autoshard.pipelined: the loss cannot be computed exactly from {form.chunks} chunks of {mb} samples "
        f"(micro-batches x data-parallel replicas, mesh {mesh_shape}): {form.inexact}. A pipelined loss must "
        "be affine in sums over the samples: a mean or sum of per-sample terms, or a ratio such as "
        "sum(ce * mask) / sum(mask) whose denominator comes from the batch alone (the pipeline computes it on "
        "the whole batch). Fix: write the loss in that form (e.g. no max over samples, no parameter-dependent "
        "denominator), or, with autoshard.pipelined, pass check_loss=False to train on the mean of the per-chunk "
        "losses instead of the one-device loss.")


def _check_chunk_mean(loss_fn: Callable, params: Any, batch: Any, form: LossForm | None, mb: int,
                      mesh_shape: dict) -> None:
    """The loss's structure makes the pipeline exact on every batch; this compares the two on the example
    batch once, for mixing the structure cannot see (a cumsum or sort over the batch axis)."""
    leaves = jax.tree.leaves((params, batch))
    if form is None or not all(isinstance(x, jax.Array | np.ndarray) for x in leaves):
        return   # one chunk, or abstract example arguments: nothing to compare
    params, batch = on_one_place((params, batch))
    full = float(jax.jit(loss_fn)(params, batch))
    rows = jax.tree.map(lambda x: x[0], form.globals(batch))
    f = jax.jit(form.chunk_loss)
    p_leaves, b_leaves = jax.tree.leaves(params), jax.tree.leaves(batch)
    parts = [float(f(p_leaves, [x[i * mb:(i + 1) * mb] for x in b_leaves], rows)) for i in range(form.chunks)]
    mean = float(np.mean(parts))
    if not math.isclose(full, mean, rel_tol=1e-4, abs_tol=1e-6):
        raise PipelineError(
            f"autoshard.pipelined: on the example batch, loss_fn over all {form.chunks * mb} samples is {full:.6g} but "
            f"the mean over the {form.chunks} chunks of {mb} samples the pipeline computes (micro-batches x "
            f"data-parallel replicas, mesh {mesh_shape}) is {mean:.6g}: the loss mixes samples in a way other "
            "than sums over them (e.g. a cumsum, sort or normalisation across the batch axis), so pipelining would "
            "change it. Fix: compute per-sample terms and reduce them with a mean, a sum or sum(l * mask) / "
            "sum(mask), or pass check_loss=False to train on the mean of the per-chunk losses.")


def _stage_fn(s: int, prog: Any, stage: list[int], batch_only_eqns: list[int], recv: list[list],
              send: list | None, keys: tuple[str, ...], holders: list[set[int]], loss_key: Any,
              acts: ActivationSpecs | None = None, remat: tuple[list, str] = ([], "none"),
              form: LossForm | None = None) -> Callable:
    """Stage s: receives one tuple of values per predecessor (`recv`, in the runtime's order), runs
    its eqns and sends `send` (None: the last stage, returns the loss). `acts`: a 3-D stage runs with
    automatic data/model axes, its plan's activation constraints placed (and
    `cut_3d.batched_gather_operand` guarding gathers); `remat`: (block of every eqn, policy), its
    blocks run checkpointed (`remat.run_eqns`); `form`: the loss's sums over samples scaled to the whole
    batch and its batch statistics taken from the whole batch (the runtime's batch is then (batch,
    `LossForm.globals`))."""
    own = sorted(set(batch_only_eqns) | {e for e, st in enumerate(stage) if st == s})
    n_params = len(keys)
    my_params = [(prog.inputs[i], keys[i]) for i in range(n_params) if s in holders[i]]
    batch_in = prog.inputs[n_params:]
    blocks, policy = remat
    keep = set(send or ()) | ({loss_key} if send is None and not jc.is_literal(loss_key) else set())
    guard = guard_gathers if acts is not None else None
    after = acts.after if acts is not None else None

    def fn(params: dict, batch: Any, *inputs: Any) -> Any:
        rows: tuple = ()
        if form is not None and form.stats:
            batch, whole = batch
            rows = tuple(x[0] for x in whole)     # each row holds the whole batch's value
        hook = _then(form.after(rows), after) if form is not None else after
        env: dict = dict(prog.consts)
        env.update(zip(batch_in, jax.tree.leaves(batch), strict=True))
        env.update({k: params[name] for k, name in my_params})
        for ks, values in zip(recv, inputs, strict=True):
            env.update(zip(ks, values, strict=True))
        run_eqns(prog, own, env, blocks or [None] * len(prog.eqns), policy, keep, guard, hook)
        if send is None:
            return loss_key.val if jc.is_literal(loss_key) else env[loss_key]
        return tuple(env[k] for k in send)

    return fn


def _then(first: Callable, second: Callable | None) -> Callable:
    return first if second is None else (lambda e, outs: second(e, first(e, outs)))
