"""Pipeline runtime: stage functions run as one SPMD program over the `pipe` axis of a mesh.

    prog = pipeline.runtime.pipeline_value_and_grad(
        [stage0, stage1, stage2, stage3], mesh, num_microbatches=8, schedule="1f1b")
    params = prog.stack([p0, p1, p2, p3])      # each stage's parameters only on its pipe rank
    loss, grads = prog(params, batch)          # grads: same StackedParams layout as params
    prog.unstack(grads)                        # list of per-stage pytrees

A stage is `f(params, batch, *inputs) -> output`: `batch` is the stage's micro-batch (every
leaf's leading dim cut to micro-batch size), `inputs` the outputs of its predecessor stages in
the order of the schedule's edges (none for a source stage). A sink stage (no successors) returns
the scalar mean loss of its micro-batch; the step's loss is the mean over micro-batches (and the
sum over sinks), which equals the full-batch loss for mean losses.

How it runs: the validated schedule becomes a static tick table (`pipeline.tick_table`); a loop
over ticks runs, on every rank at once, its stage's forward, its backward (the forward recomputed
from the stored stage input, then `jax.vjp`) or nothing, chosen by `lax.switch`; after each tick
activations move forward and input gradients backward along the stage DAG's edges by `ppermute`.
Parameters of all stages sit in one flat buffer [stages, P] sharded over `pipe`, so a device holds
its stages' parameters (P = the largest stage's size); stage inputs and incoming gradients sit in
slots reused as soon as their backward has run, so 1F1B holds its in-flight count, not every
micro-batch. Mesh axes other than `pipe` split each micro-batch (data parallelism inside stages).

Stages outnumber ranks when the schedule places several on one rank (`Schedule.placement`;
"interleaved-1f1b": S*v stages on S ranks, stage k on rank k % S): the buffer's rows go rank by rank,
so rank r holds the rows of its v stages and a branch picks its own; the tick table names the stage
each rank runs; an activation goes to the rank of the next stage, which at a chunk boundary is rank
S-1 -> rank 0 (the transfers are a ring ppermute), gradients the other way.

This module imports jax; the schedules, validator and simulator it executes are pure.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import networkx as nx
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ...core.errors import PipelineError
from ...pipeline.schedules.registry import schedule as build_schedule
from ...pipeline.schedules.schedule import Schedule, chain_edges
from .layouts import (
    FlatCodec,
    ShardedCodec,
    Spec,
    StackedParams,
    buffer_dtype,
    check_specs,
    constrain_to,
    layout,
    on_one_place,
)
from .ticks import Buffers, branches, spmd_body, static_plan

INTERLEAVED = "interleaved-1f1b"   # the registered schedule that places several stages per rank

# --- the program --------------------------------------------------------------------------------


class PipelineProgram:
    """`prog(stacked_params, batch) -> (loss, grads)`: one jitted SPMD program per batch shape."""

    def __init__(self, stage_fns: Sequence[Callable], mesh: Mesh, sched: Schedule, pipe_axis: str,
                 data_axes: tuple[str, ...], tied: tuple[tuple[tuple[int, str], ...], ...] = (),
                 stage_specs: tuple[Mapping[str, Spec], ...] | None = None,
                 compute_specs: tuple[Mapping[str, Spec], ...] | None = None,
                 batch_globals: Callable[[Any], Any] | None = None):
        self.stage_fns = tuple(stage_fns)
        self.batch_globals = batch_globals
        self.tied = tied
        self.mesh = mesh
        self.schedule = sched
        self.pipe_axis = pipe_axis
        self.data_axes = data_axes
        self.num_stages = sched.num_stages
        self.num_microbatches = sched.num_microbatches[0]
        # row i of the stacked parameters holds stage _stage_of_row[i]: each rank's stages in a block
        self._stage_of_row = tuple(s for r in range(len(sched.ranks)) for s in sched.stages_on(r))
        self._row_of = tuple(self._stage_of_row.index(s) for s in range(sched.num_stages))
        self.stage_specs = stage_specs
        self.compute_specs = compute_specs
        self._static = static_plan(sched)
        self._compiled: dict[Any, Callable] = {}
        self.checked_hlo = ""             # the compiled program `cpu_deadlocks` inspected (CPU, 3-D)
        self.activation_specs: Any = None  # a 3-D cut's placed activations (`cut_3d.ActivationSpecs`)

    @property
    def auto(self) -> bool:
        """Tensor-sharded stages: only `pipe` is manual, the stages' data/model axes are XLA's."""
        return self.stage_specs is not None

    @property
    def tensor_in_stages(self) -> bool:
        """A 3-D program whose stages split tensors by their plans (False: data parallel inside)."""
        return self.auto and any(self.stage_specs)

    @property
    def data_parallel(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.data_axes)

    @property
    def ticks(self) -> int:
        """Lock-step ticks per step: the length of the schedule's tick table."""
        return int(self._static.kind.shape[0])

    @property
    def slots(self) -> tuple[int, int]:
        """(stage-input slots, incoming-gradient slots) every device holds per in-/out-edge index,
        shared by the stages of its rank."""
        return self._static.num_in_slots, self._static.num_out_slots

    # parameters

    def stack(self, params: Sequence[Any]) -> StackedParams:
        if not isinstance(params, (list, tuple)) or len(params) != self.num_stages:
            got = type(params).__name__
            if isinstance(params, (list, tuple)):
                got += f" of {len(params)}"
            raise PipelineError(
                f"pipeline runtime: stack(params) takes one parameter pytree per stage ({self.num_stages}), got {got}.")
        params = on_one_place(params)
        if self.auto:
            for s, p in enumerate(params):
                layout(p, f"stage {s}'s parameters")          # the same float-only check
            codec = ShardedCodec.build(dict(enumerate(params)), dict(enumerate(self.stage_specs)), self.mesh,
                                       dict(enumerate(self.compute_specs or self.stage_specs)))
            rows = [codec.pack(s, params[s]) for s in self._stage_of_row]
            bufs = tuple(jax.device_put(jnp.stack([r[g] for r in rows]), sh)
                         for g, sh in enumerate(codec.stacked_sharding(self.pipe_axis)))
            return StackedParams(bufs, codec)
        layouts = tuple(layout(p, f"stage {s}'s parameters") for s, p in enumerate(params))
        width = max(1, max(lay.size for lay in layouts))
        dtype = buffer_dtype(layouts)
        rows = jnp.stack([layouts[s].pack(params[s], width, dtype) for s in self._stage_of_row])
        return StackedParams(jax.device_put(rows, NamedSharding(self.mesh, P(self.pipe_axis))), layouts)

    def unstack(self, stacked: StackedParams) -> list[Any]:
        self._check_stacked(stacked, "unstack")
        if self.auto:
            codec = stacked.layouts
            return [codec.unpack(s, tuple(b[self._row_of[s]] for b in stacked.flat), constrain=False)
                    for s in range(self.num_stages)]
        return [lay.unpack(stacked.flat[self._row_of[s]]) for s, lay in enumerate(stacked.layouts)]

    def _check_stacked(self, stacked: Any, where: str) -> None:
        if not isinstance(stacked, StackedParams):
            raise PipelineError(
                f"pipeline runtime: {where} takes the StackedParams from prog.stack(...), "
                f"got {type(stacked).__name__}.")
        n = len(stacked.layouts.layouts if isinstance(stacked.layouts, ShardedCodec) else stacked.layouts)
        rows = {b.shape[0] for b in jax.tree.leaves(stacked.flat)}
        if n != self.num_stages or rows != {self.num_stages} or isinstance(stacked.layouts, ShardedCodec) != self.auto:
            raise PipelineError(
                f"pipeline runtime: {where}: StackedParams holds {n} stages, the program has "
                f"{self.num_stages}; stack the parameters with this program's stack().")

    # running

    def __call__(self, params: StackedParams, batch: Any) -> tuple[jax.Array, StackedParams]:
        loss, grads = self._jitted(params, batch, "prog(params, batch)")(params.flat, batch)
        return loss, StackedParams(grads, params.layouts)

    def lower(self, params: StackedParams, batch: Any) -> Any:
        """The jitted program lowered for these arguments (`.compile().as_text()`, `memory_analysis()`)."""
        return self._jitted(params, batch, "prog.lower(params, batch)").lower(params.flat, batch)

    def abstract_stack(self, params: Sequence[Any]) -> StackedParams:
        """`stack(params)` as ShapeDtypeStructs with the stacked shardings (params may be abstract)."""
        structs = [jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), p) for p in params]
        out = jax.eval_shape(self.stack, structs)
        shard = (out.layouts.stacked_sharding(self.pipe_axis) if self.auto
                 else NamedSharding(self.mesh, P(self.pipe_axis)))
        flat = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), out.flat, shard)
        return StackedParams(flat, out.layouts)

    def cpu_deadlocks(self, params: Sequence[Any], batch: Any) -> list[str]:
        """On the CPU runtime, the collective-permutes XLA placed inside the per-stage branches of a 3-D
        program (empty elsewhere). jaxlib 0.10.2's CPU collectives rendezvous every local device on a
        collective-permute, and devices running another stage's branch never arrive: the step would
        hang, then abort. All-reduces, all-gathers and all-to-alls inside branches are fine."""
        if not self.auto or self.mesh.devices.flat[0].platform != "cpu":
            return []
        batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
        text = self.lower(self.abstract_stack(params), batch).compile().as_text()
        self.checked_hlo = text
        return [line.strip()[:160] for line in text.splitlines()
                if " collective-permute(" in line and "/cond/" in line and "/ppermute" not in line]

    def drop_tensor_plans(self) -> None:
        """Run every stage data parallel (parameters whole on each device of its pipe rank): the
        fallback when the stages' tensor plans cannot run here (`cpu_deadlocks`)."""
        self.stage_specs = tuple({} for _ in range(self.num_stages))
        self.compute_specs = None
        self._compiled.clear()

    def _jitted(self, params: StackedParams, batch: Any, where: str) -> Callable:
        self._check_stacked(params, where)
        B = self._batch_size(batch)
        key = (params.layouts, tuple((b.shape, str(b.dtype)) for b in jax.tree.leaves(params.flat)),
               jax.tree.structure(batch), tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(batch)))
        if key not in self._compiled:
            self._compiled[key] = self._build(params, batch, B)
        return self._compiled[key]

    def value_and_grad(self, params: Sequence[Any], batch: Any) -> tuple[jax.Array, list[Any]]:
        """Per-stage parameter trees in, per-stage gradient trees out (stacks and unstacks)."""
        loss, grads = self(self.stack(params), batch)
        return loss, self.unstack(grads)

    def _tie_offsets(self, group: tuple[tuple[int, str], ...], codec: Any):
        """(member ranks, buffer group, [ranks, K] flat offsets, [ranks, K] parameter rows, [ranks, K]
        copy-here flags, leaf size) of one tied parameter: K copies at most on one rank (several when
        a rank holds several of the tied stages)."""
        rank_of, R = self.schedule.rank_of, len(self.schedule.ranks)
        per_rank: dict[int, list[tuple[int, int]]] = {}      # rank -> [(offset, row)]
        where = set()
        for s, path in group:
            paths = codec.layouts[s].paths
            if path not in paths:
                raise PipelineError(
                    f"pipeline runtime: tied parameter {path} is not in stage {s}'s parameters "
                    f"(it has {list(paths)[:6]}{' ...' if len(paths) > 6 else ''}).")
            g, off, n = codec.tie_slice(s, path)
            r = rank_of[s]
            per_rank.setdefault(r, []).append((off, self.schedule.stages_on(r).index(s)))
            where.add((g, n, codec.tie_kind(s, path)))
        if len(where) != 1:
            raise PipelineError(
                f"pipeline runtime: tied copies {list(group)} differ in shape, dtype or split: "
                f"{sorted(map(str, where))}.")
        K = max(map(len, per_rank.values()))
        offsets, rows, here = (np.zeros((R, K), np.int32) for _ in range(3))
        for r, copies in per_rank.items():
            for k, (off, row) in enumerate(copies):
                offsets[r, k], rows[r, k], here[r, k] = off, row, 1
        (g, n, _), = where
        return tuple(sorted(per_rank)), g, offsets, rows, here, n

    def _batch_size(self, batch: Any) -> int:
        leaves = jax.tree.leaves(batch)
        if not leaves or any(not getattr(x, "shape", ()) for x in leaves):
            raise PipelineError(
                "pipeline runtime: the batch must be a pytree of arrays with a leading batch dimension; got "
                f"leaves with shapes {[getattr(x, 'shape', None) for x in leaves]}.")
        sizes = {x.shape[0] for x in leaves}
        if len(sizes) != 1:
            raise PipelineError(
                f"pipeline runtime: batch leaves disagree on the leading (batch) dimension: {sorted(sizes)}.")
        B = sizes.pop()
        M, dp = self.num_microbatches, self.data_parallel
        if B % (M * dp):
            raise PipelineError(
                f"pipeline runtime: batch size {B} does not split into {M} micro-batches x {dp} data-parallel "
                f"replicas (mesh {dict(self.mesh.shape)}, data axes {list(self.data_axes)}); use a batch that "
                f"is a multiple of {M * dp} or change num_microbatches.")
        return B

    def _codecs(self, params: StackedParams, batch: Any, B: int, preds: list, succs: list) -> tuple[Any, Any]:
        """(parameter codec, activation codec) for one batch shape."""
        M, dp, sched = self.num_microbatches, self.data_parallel, self.schedule
        local_mb = B // M if self.auto else B // (M * dp)
        if self.auto:
            structs = [params.layouts.structs(s) for s in range(self.num_stages)]
        else:
            structs = [lay.structs() for lay in params.layouts]
        outs = _output_structs(self.stage_fns, structs, jax.eval_shape(self._stage_batch, batch), local_mb,
                               sched.edges, preds, succs)
        S = self.num_stages
        if self.auto:
            data = tuple(self.data_axes)
            act_specs = {s: {jax.tree_util.keystr(kp): ((data,) + ((),) * (len(x.shape) - 1)) if x.shape else ()
                             for kp, x in jax.tree_util.tree_flatten_with_path(o)[0]} for s, o in outs.items()}
            return params.layouts, ShardedCodec.build(outs, act_specs, self.mesh, stages=S)
        out_lay = [layout(outs[s], f"stage {s}'s output") if s in outs else None for s in range(S)]
        real = [lay for lay in out_lay if lay is not None]
        flat_p = FlatCodec(params.layouts, params.flat.shape[1], params.flat.dtype)
        return flat_p, FlatCodec(tuple(out_lay), max([1, *(lay.size for lay in real)]), buffer_dtype(real))

    def _build(self, params: StackedParams, batch: Any, B: int) -> Callable:
        """The jitted step for one batch shape: a shape pass over the stages, then the SPMD tick loop."""
        S, M = self.num_stages, self.num_microbatches
        sched, st = self.schedule, self._static
        preds = [sched.predecessors(s) for s in range(S)]
        succs = [sched.successors(s) for s in range(S)]
        pc, ac = self._codecs(params, batch, B, preds, succs)
        local = tuple(sched.stages_on(sched.rank_of[s]).index(s) for s in range(S)) if st.rows > 1 else ()
        bufs = Buffers(M, preds, succs, pc, ac, st.in_slot.shape[1], st.out_slot.shape[1],
                        jnp.asarray(st.in_slot), jnp.asarray(st.out_slot), local)
        fns = branches(bufs, self.stage_fns)
        pipe = self.pipe_axis
        ties = [self._tie_offsets(group, pc) for group in self.tied]
        reduce_axes = () if self.auto else self.data_axes        # auto axes: XLA reduces over them
        body = spmd_body(bufs, st, fns, ties, pipe, reduce_axes)
        data_spec = (self.data_axes if len(self.data_axes) != 1 else self.data_axes[0]) or None
        p_spec = jax.tree.map(lambda _: P(pipe), params.flat)
        stage_batch = jax.eval_shape(self._stage_batch, batch)
        if self.auto:
            mapped = jax.shard_map(body, mesh=self.mesh, in_specs=(p_spec, P()), out_specs=(P(), p_spec),
                                   axis_names=frozenset({pipe}), check_vma=False)
            mb_sharding = P(None, data_spec)
        else:
            batch_spec = jax.tree.map(lambda x: P(None, data_spec), stage_batch)
            mapped = jax.shard_map(body, mesh=self.mesh, in_specs=(p_spec, batch_spec), out_specs=(P(), p_spec),
                                   check_vma=False)
            mb_sharding = None

        def step(flat, batch):
            batch_mb = jax.tree.map(lambda x: x.reshape(M, B // M, *x.shape[1:]), self._stage_batch(batch))
            if mb_sharding is not None:
                batch_mb = jax.tree.map(lambda x: constrain_to(x, mb_sharding, self.mesh), batch_mb)
            return mapped(flat, batch_mb)

        return jax.jit(step)

    def _stage_batch(self, batch: Any) -> Any:
        """What the stages receive, micro-batched: the batch, or (batch, its `batch_globals`)."""
        return batch if self.batch_globals is None else (batch, self.batch_globals(batch))


def _output_structs(fns: Sequence[Callable], structs: list[Any], batch: Any, local_mb: int,
                    edges: Sequence[tuple[int, int]], preds: list, succs: list) -> dict[int, Any]:
    """The output shapes of every non-sink stage on one local micro-batch, evaluated in topological
    order; a sink must return the scalar float loss."""
    mb_struct = jax.tree.map(lambda x: jax.ShapeDtypeStruct((local_mb, *x.shape[1:]), x.dtype), batch)
    S = len(fns)
    outs: dict[int, Any] = {}
    for s in _topological(S, edges):
        try:
            outs[s] = jax.eval_shape(fns[s], structs[s], mb_struct, *[outs[u] for u in preds[s]])
        except Exception as e:  # the user's function failed on these shapes: say which stage
            raise PipelineError(
                f"pipeline runtime: stage {s} failed on a micro-batch of {local_mb} samples with inputs from "
                f"stages {list(preds[s])}: {type(e).__name__}: {e}") from e
        if not succs[s]:
            y = outs[s]
            scalar = isinstance(y, jax.ShapeDtypeStruct) and y.shape == ()
            if not (scalar and jnp.issubdtype(y.dtype, jnp.floating)):
                raise PipelineError(
                    f"pipeline runtime: stage {s} has no successor, so it must return the scalar float loss of "
                    f"its micro-batch; it returned {jax.tree.map(lambda x: (x.shape, str(x.dtype)), y)}.")
    for s in range(S):
        if succs[s]:
            layout(outs[s], f"stage {s}'s output")          # floating point only
    return {s: outs[s] for s in range(S) if succs[s]}


def _topological(n: int, edges: Sequence[tuple[int, int]]) -> list[int]:
    g = nx.DiGraph(list(edges))
    g.add_nodes_from(range(n))
    return list(nx.lexicographical_topological_sort(g))


def pipeline_value_and_grad(stage_fns: Sequence[Callable], mesh: Mesh, *, num_microbatches: int | None = None,
                            schedule: str | Schedule = "1f1b", edges: Sequence[tuple[int, int]] | None = None,
                            pipe_axis: str = "pipe", data_axes: Sequence[str] | None = None,
                            tied: Sequence[Sequence[tuple[int, str]]] = (),
                            stage_specs: Sequence[Mapping[str, Spec]] | None = None,
                            compute_specs: Sequence[Mapping[str, Spec]] | None = None,
                            batch_globals: Callable[[Any], Any] | None = None) -> PipelineProgram:
    """Build the SPMD pipeline program for `stage_fns` on `mesh` (see the module docstring).

    `schedule`: a registered name ("gpipe", "1f1b", "graph-1f1b", "interleaved-1f1b") built with
    `num_microbatches` and `edges` (default: a chain), or a `pipeline.Schedule` (then its own stage
    DAG, counts and placement are used). One stage per pipe rank, except "interleaved-1f1b": there
    the stage functions are S*v chunks on S pipe ranks, stage k on rank k % S, and rank r holds the
    parameters of its v stages.
    `data_axes`: mesh axes splitting each micro-batch; default every axis but `pipe_axis`.
    `tied`: groups of (stage, keystr path in that stage's parameters) holding copies of one parameter
    (tied embeddings): each copy's gradient becomes the group's sum once per step, so copies updated
    by an elementwise optimizer stay equal, and the weight never travels with the micro-batches.
    `batch_globals(batch)`: values of the whole batch (leaves with its leading dimension) the stages
    need, e.g. a loss's normaliser; the stages then receive (micro-batch, its rows of them)."""
    if not isinstance(mesh, Mesh):
        raise PipelineError(f"pipeline runtime: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
    fns = tuple(stage_fns) if isinstance(stage_fns, (list, tuple)) else None
    if not fns or not all(callable(f) for f in fns):
        raise PipelineError(
            f"pipeline runtime: stage_fns must be a non-empty list of callables f(params, batch, *inputs), "
            f"got {stage_fns!r}.")
    if pipe_axis not in mesh.axis_names:
        raise PipelineError(
            f"pipeline runtime: pipe_axis={pipe_axis!r} is not an axis of the mesh {dict(mesh.shape)}; name the "
            f"mesh axis that holds the stages.")
    S, R = len(fns), mesh.shape[pipe_axis]
    if schedule == INTERLEAVED and S % R:
        raise PipelineError(
            f"pipeline runtime: schedule='{INTERLEAVED}' places stage k on pipe rank k % {R}, so the {S} stages must "
            f"be a multiple of the '{pipe_axis}' axis size {R} (mesh {dict(mesh.shape)}). Fix: give "
            f"{-(-S // R) * R} stage functions, or a '{pipe_axis}' axis dividing {S}.")
    if isinstance(schedule, str) and schedule != INTERLEAVED and R != S:
        raise PipelineError(
            f"pipeline runtime: {S} stages need a '{pipe_axis}' axis of size {S}; the mesh {dict(mesh.shape)} has "
            f"{R}. Each pipe rank runs one stage (schedule='{INTERLEAVED}' runs several per rank).")
    axes = tuple(a for a in mesh.axis_names if a != pipe_axis) if data_axes is None else tuple(data_axes)
    unknown = [a for a in axes if a not in mesh.axis_names or a == pipe_axis]
    if unknown:
        raise PipelineError(
            f"pipeline runtime: data_axes {unknown} are not non-pipe axes of the mesh {dict(mesh.shape)}.")
    sched = _schedule_for(schedule, S, num_microbatches, edges, R)
    if len(sched.ranks) != R:
        raise PipelineError(
            f"pipeline runtime: schedule {sched.name!r} runs on {len(sched.ranks)} ranks; the mesh's '{pipe_axis}' "
            f"axis has {R} ({dict(mesh.shape)}). Fix: a schedule with one task list per pipe rank.")
    if stage_specs is not None:
        stage_specs, compute_specs = _checked_specs(stage_specs, compute_specs, mesh, pipe_axis, S)
    groups = tuple(tuple((int(st), str(path)) for st, path in group) for group in tied)
    for group in groups:
        stages = [st for st, _ in group]
        if len(group) < 2 or len(set(stages)) != len(stages) or not all(0 <= st < S for st in stages):
            raise PipelineError(
                f"pipeline runtime: tied group {list(group)} must name two or more distinct stages 0..{S - 1}.")
    if batch_globals is not None and not callable(batch_globals):
        raise PipelineError(f"pipeline runtime: batch_globals must be callable, got {type(batch_globals).__name__}.")
    return PipelineProgram(fns, mesh, sched, pipe_axis, axes, groups, stage_specs, compute_specs, batch_globals)


def _schedule_for(schedule: str | Schedule, S: int, num_microbatches: int | None,
                  edges: Sequence[tuple[int, int]] | None, ranks: int) -> Schedule:
    """The validated schedule for S stage functions on `ranks` pipe ranks: the given one, or a
    registered name built with `num_microbatches` over `edges` (default: a chain); "interleaved-1f1b"
    gets S / ranks virtual stages per rank."""
    if isinstance(schedule, Schedule):
        sched = schedule
        if edges is not None and tuple(map(tuple, edges)) != tuple(sched.edges):
            raise PipelineError(
                f"pipeline runtime: edges={list(edges)} disagree with the given schedule's {list(sched.edges)}; "
                f"pass one of them.")
        if num_microbatches is not None and set(sched.num_microbatches) != {num_microbatches}:
            raise PipelineError(
                f"pipeline runtime: num_microbatches={num_microbatches} disagrees with the given schedule's "
                f"{list(sched.num_microbatches)}.")
    else:
        if num_microbatches is None:
            raise PipelineError(
                f"pipeline runtime: schedule={schedule!r} needs num_microbatches (micro-batches per step).")
        chain = tuple(chain_edges(S))
        dag = chain if edges is None else tuple(tuple(e) for e in edges)
        opts = {"num_stages": S, "num_microbatches": num_microbatches}
        if schedule == INTERLEAVED:
            opts = {"num_stages": ranks, "num_microbatches": num_microbatches, "virtual_stages": S // ranks}
        if dag != chain:
            if schedule != "graph-1f1b":
                raise PipelineError(
                    f"pipeline runtime: schedule {schedule!r} runs a chain of stages; edges={list(dag)} form a "
                    f"DAG, which needs schedule='graph-1f1b'.")
            opts["edges"] = dag
        sched = build_schedule(schedule, **opts)
    if sched.num_stages != S:
        raise PipelineError(
            f"pipeline runtime: the schedule has {sched.num_stages} stages but {S} stage functions were given.")
    if len(set(sched.num_microbatches)) != 1:
        raise PipelineError(
            f"pipeline runtime: per-stage micro-batch counts {list(sched.num_microbatches)} are not supported yet; "
            f"the runtime needs one count for every stage (GraphPipe plans with per_stage_microbatch=False).")
    return sched


def _checked_specs(stage_specs: Sequence[Mapping[str, Spec]], compute_specs: Sequence[Mapping[str, Spec]] | None,
                   mesh: Mesh, pipe_axis: str, S: int) -> tuple[tuple[dict, ...], tuple[dict, ...] | None]:
    """One mapping per stage, naming only non-pipe mesh axes (PipelineError otherwise)."""
    if len(stage_specs) != S or (compute_specs is not None and len(compute_specs) != S):
        raise PipelineError(f"pipeline runtime: stage_specs (and compute_specs) need one mapping per stage "
                            f"({S}), got {len(stage_specs)}.")
    check_specs(dict(enumerate(stage_specs)), mesh, pipe_axis)
    if compute_specs is not None:
        check_specs(dict(enumerate(compute_specs)), mesh, pipe_axis)
    stage_specs = tuple(dict(x) for x in stage_specs)
    compute_specs = None if compute_specs is None else tuple(dict(x) for x in compute_specs)
    return stage_specs, compute_specs
