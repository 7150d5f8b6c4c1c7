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
one stage's parameters (P = the largest stage's size); stage inputs and incoming gradients sit in
slots reused as soon as their backward has run, so 1F1B holds its in-flight count, not every
micro-batch. Mesh axes other than `pipe` split each micro-batch (data parallelism inside stages).

This module imports jax; the schedules, validator and simulator it executes are pure.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import networkx as nx
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..core.errors import PipelineError
from ..pipeline.schedules.registry import schedule as build_schedule
from ..pipeline.schedules.schedule import Schedule, chain_edges, tick_table

IDLE, FORWARD, BACKWARD = 0, 1, 2


# --- flat layouts ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the leaves of one pytree sit in a flat 1-D buffer (leaves keep their own dtypes)."""

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    offsets: tuple[int, ...]
    size: int
    paths: tuple[str, ...] = ()     # jax.tree_util.keystr of every leaf

    def pack(self, tree: Any, width: int, dtype: Any) -> jax.Array:
        leaves = jax.tree.leaves(tree)
        parts = [jnp.ravel(x).astype(dtype) for x in leaves]
        if width > self.size:
            parts.append(jnp.zeros((width - self.size,), dtype))
        return jnp.concatenate(parts) if parts else jnp.zeros((width,), dtype)

    def unpack(self, flat: jax.Array) -> Any:
        leaves = [lax.slice_in_dim(flat, o, o + math.prod(s)).reshape(s).astype(d)
                  for o, s, d in zip(self.offsets, self.shapes, self.dtypes, strict=True)]
        return jax.tree.unflatten(self.treedef, leaves)


def _layout(tree: Any, what: str) -> Layout:
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = [x for _, x in with_paths]
    bad = [(i, x) for i, x in enumerate(leaves) if not jnp.issubdtype(x.dtype, jnp.floating)]
    if bad:
        i, x = bad[0]
        raise PipelineError(
            f"pipeline runtime: {what} has a {x.dtype} leaf (leaf {i}, shape {tuple(x.shape)}); the runtime "
            f"moves only floating-point parameters and activations between stages. Pass integer data "
            f"through the batch (every stage sees its micro-batch) or cast it to float.")
    shapes = tuple(tuple(int(d) for d in x.shape) for x in leaves)
    sizes = [math.prod(s) for s in shapes]
    offsets = tuple(int(o) for o in np.cumsum([0, *sizes[:-1]])) if sizes else ()
    return Layout(treedef, shapes, tuple(str(x.dtype) for x in leaves), offsets, int(sum(sizes)),
                  tuple(jax.tree_util.keystr(kp) for kp, _ in with_paths))


def _buffer_dtype(layouts: Sequence[Layout]) -> Any:
    dtypes = [d for lay in layouts for d in lay.dtypes]
    return jnp.result_type(*dtypes) if dtypes else jnp.float32


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class StackedParams:
    """All stages' parameters as one [stages, P] buffer sharded over the pipe axis: row s holds stage
    s's leaves, flattened and zero-padded. A pytree with one leaf, so elementwise optax transforms
    (sgd, momentum, adam, adamw without masks) update it exactly as they would the per-stage trees;
    transforms that look at whole tensors (per-layer norms, masks) need `unstack` first."""

    flat: jax.Array
    layouts: tuple[Layout, ...]

    def tree_flatten(self):
        return (self.flat,), self.layouts

    @classmethod
    def tree_unflatten(cls, layouts, children):
        return cls(children[0], layouts)


# --- edges, ticks and slots -------------------------------------------------------------------------


def _matchings(edges: Sequence[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Split edges into groups where each stage sends at most once and receives at most once: one
    ppermute per group and direction per tick (a chain is one group)."""
    groups: list[list[tuple[int, int]]] = []
    for a, b in edges:
        for g in groups:
            if all(a != u and b != v for u, v in g):
                g.append((a, b))
                break
        else:
            groups.append([(a, b)])
    return groups


def _slots(intervals: dict[int, tuple[int, int]]) -> tuple[dict[int, int], int]:
    """Greedy interval colouring (optimal for intervals): micro-batch -> slot, slots used. Values are
    stored at the end of a tick, after its task read its inputs, so a slot last read at tick t can
    take a value stored at tick t."""
    free_at: list[int] = []
    slot = {}
    for m, (start, end) in sorted(intervals.items(), key=lambda kv: kv[1]):
        for k, t in enumerate(free_at):
            if t <= start:   # read during tick t, overwritten at its end
                slot[m], free_at[k] = k, end
                break
        else:
            slot[m] = len(free_at)
            free_at.append(end)
    return slot, len(free_at)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static tables the SPMD loop indexes with (tick, rank)."""

    kind: np.ndarray          # [T, S] IDLE / FORWARD / BACKWARD
    microbatch: np.ndarray    # [T, S]
    in_slot: np.ndarray       # [S, max in-degree, M]: slot of an incoming activation
    out_slot: np.ndarray      # [S, max out-degree, M]: slot of an incoming gradient
    num_in_slots: int
    num_out_slots: int


def _static_plan(sched: Schedule) -> _Plan:
    S, M = sched.num_stages, sched.num_microbatches[0]
    table = tick_table(sched)
    T = len(table[0]) if table else 0
    kind = np.zeros((T, S), np.int32)
    mb = np.zeros((T, S), np.int32)
    when: dict[tuple[int, int, str], int] = {}
    for r, row in enumerate(table):
        for t, task in enumerate(row):
            if task is not None:
                kind[t, r] = FORWARD if task.kind == "F" else BACKWARD
                mb[t, r] = task.microbatch
                when[(task.stage, task.microbatch, task.kind)] = t
    preds = [sched.predecessors(s) for s in range(S)]
    succs = [sched.successors(s) for s in range(S)]
    in_slot = np.zeros((S, max(1, max(map(len, preds))), M), np.int32)
    out_slot = np.zeros((S, max(1, max(map(len, succs))), M), np.int32)
    n_in = n_out = 1
    for s in range(S):
        for k, u in enumerate(preds[s]):   # held from the producer's forward to our backward
            slot, used = _slots({m: (when[(u, m, "F")], when[(s, m, "B")]) for m in range(M)})
            in_slot[s, k] = [slot[m] for m in range(M)]
            n_in = max(n_in, used)
        for j, v in enumerate(succs[s]):   # held from the consumer's backward to our backward
            slot, used = _slots({m: (when[(v, m, "B")], when[(s, m, "B")]) for m in range(M)})
            out_slot[s, j] = [slot[m] for m in range(M)]
            n_out = max(n_out, used)
    return _Plan(kind, mb, in_slot, out_slot, n_in, n_out)


# --- the program --------------------------------------------------------------------------------


class PipelineProgram:
    """`prog(stacked_params, batch) -> (loss, grads)`: one jitted SPMD program per batch shape."""

    def __init__(self, stage_fns: Sequence[Callable], mesh: Mesh, sched: Schedule, pipe_axis: str,
                 data_axes: tuple[str, ...], tied: tuple[tuple[tuple[int, str], ...], ...] = ()):
        self.stage_fns = tuple(stage_fns)
        self.tied = tied
        self.mesh = mesh
        self.schedule = sched
        self.pipe_axis = pipe_axis
        self.data_axes = data_axes
        self.num_stages = sched.num_stages
        self.num_microbatches = sched.num_microbatches[0]
        self._static = _static_plan(sched)
        self._compiled: dict[Any, Callable] = {}

    @property
    def data_parallel(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.data_axes)

    @property
    def ticks(self) -> int:
        """Lock-step ticks per step: the length of the schedule's tick table."""
        return int(self._static.kind.shape[0])

    @property
    def slots(self) -> tuple[int, int]:
        """(stage-input slots, incoming-gradient slots) every device holds per edge."""
        return self._static.num_in_slots, self._static.num_out_slots

    # parameters

    def stack(self, params: Sequence[Any]) -> StackedParams:
        if not isinstance(params, (list, tuple)) or len(params) != self.num_stages:
            got = type(params).__name__
            if isinstance(params, (list, tuple)):
                got += f" of {len(params)}"
            raise PipelineError(
                f"pipeline runtime: stack(params) takes one parameter pytree per stage ({self.num_stages}), got {got}.")
        layouts = tuple(_layout(p, f"stage {s}'s parameters") for s, p in enumerate(params))
        width = max(1, max(lay.size for lay in layouts))
        dtype = _buffer_dtype(layouts)
        rows = jnp.stack([lay.pack(p, width, dtype) for lay, p in zip(layouts, params, strict=True)])
        return StackedParams(jax.device_put(rows, NamedSharding(self.mesh, P(self.pipe_axis))), layouts)

    def unstack(self, stacked: StackedParams) -> list[Any]:
        self._check_stacked(stacked, "unstack")
        return [lay.unpack(stacked.flat[s]) for s, lay in enumerate(stacked.layouts)]

    def _check_stacked(self, stacked: Any, where: str) -> None:
        if not isinstance(stacked, StackedParams):
            raise PipelineError(
                f"pipeline runtime: {where} takes the StackedParams from prog.stack(...), "
                f"got {type(stacked).__name__}.")
        if len(stacked.layouts) != self.num_stages or stacked.flat.shape[0] != self.num_stages:
            raise PipelineError(
                f"pipeline runtime: {where}: StackedParams holds {len(stacked.layouts)} stages, the program has "
                f"{self.num_stages}; stack the parameters with this program's stack().")

    # running

    def __call__(self, params: StackedParams, batch: Any) -> tuple[jax.Array, StackedParams]:
        loss, grads = self._jitted(params, batch, "prog(params, batch)")(params.flat, batch)
        return loss, StackedParams(grads, params.layouts)

    def lower(self, params: StackedParams, batch: Any) -> Any:
        """The jitted program lowered for these arguments (`.compile().as_text()`, `memory_analysis()`)."""
        return self._jitted(params, batch, "prog.lower(params, batch)").lower(params.flat, batch)

    def _jitted(self, params: StackedParams, batch: Any, where: str) -> Callable:
        self._check_stacked(params, where)
        B = self._batch_size(batch)
        key = (params.layouts, str(params.flat.dtype), params.flat.shape,
               jax.tree.structure(batch), tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(batch)))
        if key not in self._compiled:
            self._compiled[key] = self._build(params, batch, B)
        return self._compiled[key]

    def value_and_grad(self, params: Sequence[Any], batch: Any) -> tuple[jax.Array, list[Any]]:
        """Per-stage parameter trees in, per-stage gradient trees out (stacks and unstacks)."""
        loss, grads = self(self.stack(params), batch)
        return loss, self.unstack(grads)

    def _tie_offsets(self, group: tuple[tuple[int, str], ...], layouts: tuple[Layout, ...]):
        """(member stages, flat offset per rank (0 off the group), leaf size) of one tied parameter."""
        offsets = np.zeros(self.num_stages, np.int32)
        shapes = set()
        for s, path in group:
            lay = layouts[s]
            if path not in lay.paths:
                raise PipelineError(
                    f"pipeline runtime: tied parameter {path} is not in stage {s}'s parameters "
                    f"(it has {list(lay.paths)[:6]}{' ...' if len(lay.paths) > 6 else ''}).")
            i = lay.paths.index(path)
            offsets[s] = lay.offsets[i]
            shapes.add((lay.shapes[i], lay.dtypes[i]))
        if len(shapes) != 1:
            raise PipelineError(
                f"pipeline runtime: tied copies {list(group)} differ in shape or dtype: {sorted(shapes)}.")
        (shape, _), = shapes
        return tuple(s for s, _ in group), offsets, math.prod(shape)

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

    def _build(self, params: StackedParams, batch: Any, B: int) -> Callable:
        """The jitted step for one batch shape: a shape pass over the stages, then the SPMD tick loop."""
        S, M, dp = self.num_stages, self.num_microbatches, self.data_parallel
        sched, st = self.schedule, self._static
        preds = [sched.predecessors(s) for s in range(S)]
        succs = [sched.successors(s) for s in range(S)]
        local_mb = B // (M * dp)
        out_lay = _output_layouts(self.stage_fns, params.layouts, batch, local_mb, sched.edges, preds, succs)
        bufs = _buffers(st, M, preds, succs, params, out_lay)
        branches = _branches(bufs, self.stage_fns)
        kind_t, mb_t = jnp.asarray(st.kind), jnp.asarray(st.microbatch)
        tables = _edge_tables(sched.edges, preds, succs, S)
        pipe, data_axes = self.pipe_axis, self.data_axes
        ties = [self._tie_offsets(group, params.layouts) for group in self.tied]
        body = _spmd_body(bufs, st, branches, tables, kind_t, mb_t, ties, pipe, data_axes)

        data_spec = data_axes if len(data_axes) != 1 else data_axes[0]
        batch_spec = jax.tree.map(lambda x: P(None, data_spec or None), batch)
        mapped = jax.shard_map(body, mesh=self.mesh, in_specs=(P(pipe), batch_spec),
                               out_specs=(P(), P(pipe)), check_vma=False)

        def step(flat, batch):
            batch_mb = jax.tree.map(lambda x: x.reshape(M, B // M, *x.shape[1:]), batch)
            return mapped(flat, batch_mb)

        return jax.jit(step)


def _output_layouts(fns: Sequence[Callable], layouts: tuple[Layout, ...], batch: Any, local_mb: int,
                    edges: Sequence[tuple[int, int]], preds: list, succs: list) -> dict[int, Layout]:
    """The flat layout of every non-sink stage's output on one local micro-batch, from shapes evaluated in
    topological order; a sink must return the scalar float loss."""
    mb_struct = jax.tree.map(lambda x: jax.ShapeDtypeStruct((local_mb, *x.shape[1:]), x.dtype), batch)
    p_structs = [jax.tree.unflatten(lay.treedef, [jax.ShapeDtypeStruct(s, d)
                                                  for s, d in zip(lay.shapes, lay.dtypes, strict=True)])
                 for lay in layouts]
    S = len(fns)
    outs: dict[int, Any] = {}
    for s in _topological(S, edges):
        try:
            outs[s] = jax.eval_shape(fns[s], p_structs[s], mb_struct, *[outs[u] for u in preds[s]])
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
    return {s: _layout(outs[s], f"stage {s}'s output") for s in range(S) if succs[s]}


@dataclasses.dataclass(frozen=True)
class _Buffers:
    """What the traced tick loop closes over: the stage DAG, flat layouts, buffer shapes and the slot
    tables and zero rows (device arrays made once, outside the trace)."""

    M: int
    preds: list
    succs: list
    layouts: tuple[Layout, ...]      # stage parameters
    out_lay: dict[int, Layout]       # stage outputs (stages with successors)
    A: int                           # activation row width
    act_dtype: Any
    P_width: int                     # parameter row width
    p_dtype: Any
    n_in_max: int
    n_out_max: int
    in_slot: jax.Array               # _Plan.in_slot
    out_slot: jax.Array              # _Plan.out_slot
    zeros: tuple[jax.Array, ...]     # a branch's four results, all zero


def _buffers(st: _Plan, M: int, preds: list, succs: list, params: StackedParams,
             out_lay: dict[int, Layout]) -> _Buffers:
    A = max([1, *(lay.size for lay in out_lay.values())])
    act_dtype = _buffer_dtype(list(out_lay.values()))
    P_width = params.flat.shape[1]
    p_dtype = params.flat.dtype
    n_in_max, n_out_max = st.in_slot.shape[1], st.out_slot.shape[1]
    st_in_slot, st_out_slot = jnp.asarray(st.in_slot), jnp.asarray(st.out_slot)
    zeros = (jnp.zeros((A,), act_dtype), jnp.zeros((n_in_max, A), act_dtype),
             jnp.zeros((P_width,), p_dtype), jnp.zeros((), jnp.float32))
    return _Buffers(M, preds, succs, params.layouts, out_lay, A, act_dtype, P_width, p_dtype, n_in_max, n_out_max,
                    st_in_slot, st_out_slot, zeros)


def _branches(bufs: _Buffers, fns: Sequence[Callable]) -> list[Callable]:
    """`lax.switch`'s branches, one signature for all: stage s's forward at s, its backward at S + s,
    idle at 2S. Each returns (activation row, input-gradient rows, parameter gradient, loss)."""
    S, M, A, act_dtype, zeros = len(fns), bufs.M, bufs.A, bufs.act_dtype, bufs.zeros
    preds, succs, out_lay = bufs.preds, bufs.succs, bufs.out_lay

    def stage_call(s, flat_p, act_buf, grad_buf, batch_m, m):
        p = bufs.layouts[s].unpack(flat_p)
        xs = [out_lay[u].unpack(act_buf[k, bufs.in_slot[s, k, m]]) for k, u in enumerate(preds[s])]
        return p, xs

    def forward(s):
        def run(flat_p, act_buf, grad_buf, batch_m, m):
            p, xs = stage_call(s, flat_p, act_buf, grad_buf, batch_m, m)
            y = fns[s](p, batch_m, *xs)
            if not succs[s]:
                return zeros[0], zeros[1], zeros[2], y.astype(jnp.float32) / M
            return out_lay[s].pack(y, A, act_dtype), zeros[1], zeros[2], zeros[3]
        return run

    def backward(s):
        def run(flat_p, act_buf, grad_buf, batch_m, m):
            p, xs = stage_call(s, flat_p, act_buf, grad_buf, batch_m, m)
            y, vjp = jax.vjp(lambda p_, *xs_: fns[s](p_, batch_m, *xs_), p, *xs)
            if succs[s]:
                g = sum(grad_buf[j, bufs.out_slot[s, j, m]] for j in range(len(succs[s])))
                ct = out_lay[s].unpack(g)
            else:
                ct = jnp.asarray(1.0 / M, y.dtype)
            dp_, *dxs = vjp(ct)
            rows = [out_lay[u].pack(dx, A, act_dtype) for u, dx in zip(preds[s], dxs, strict=True)]
            rows += [zeros[0]] * (bufs.n_in_max - len(rows))
            return zeros[0], jnp.stack(rows), bufs.layouts[s].pack(dp_, bufs.P_width, bufs.p_dtype), zeros[3]
        return run

    def idle(flat_p, act_buf, grad_buf, batch_m, m):
        return zeros

    return [forward(s) for s in range(S)] + [backward(s) for s in range(S)] + [idle]


def _edge_tables(edges: Sequence[tuple[int, int]], preds: list, succs: list, S: int) -> list:
    """Per matching (one ppermute per direction and tick): its pairs and, for each direction, per
    receiving rank the sender (or -1) and the edge index at each end."""

    def lookup(pairs, key):
        src = np.full(S, -1, np.int32)
        k_in = np.zeros(S, np.int32)
        k_out = np.zeros(S, np.int32)
        for a, b in pairs:
            if key == "fwd":
                src[b], k_in[b] = a, preds[b].index(a)
            else:
                src[a], k_out[a] = b, succs[a].index(b)
                k_in[b] = preds[b].index(a)      # which input-gradient row rank b sends
        return jnp.asarray(src), jnp.asarray(k_in), jnp.asarray(k_out)

    return [(pairs, lookup(pairs, "fwd"), lookup(pairs, "bwd")) for pairs in _matchings(edges)]


def _spmd_body(bufs: _Buffers, st: _Plan, branches: list[Callable], tables: list, kind_t: jax.Array,
               mb_t: jax.Array, ties: list, pipe: str, data_axes: tuple[str, ...]) -> Callable:
    """The per-device program: the tick loop, then tied copies' gradient sums and the loss/gradient
    reductions over pipe and data axes."""
    S = len(bufs.preds)

    def body(flat, batch_mb):
        r = lax.axis_index(pipe)
        flat_p = flat[0]

        def tick(t, carry):
            act_buf, grad_buf, gacc, loss = carry
            k, m = kind_t[t, r], mb_t[t, r]
            idx = jnp.where(k == FORWARD, r, jnp.where(k == BACKWARD, S + r, 2 * S))
            batch_m = jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, m, 0, keepdims=False), batch_mb)
            act_out, grads_out, dparam, dloss = lax.switch(idx, branches, flat_p, act_buf, grad_buf, batch_m, m)
            def deliver(buf, recv, src, row, slots, kind):
                # keep what arrived only if the sender ran that kind of task this tick
                valid = (src >= 0) & (kind_t[t, jnp.maximum(src, 0)] == kind)
                slot = slots[r, row, mb_t[t, jnp.maximum(src, 0)]]
                return buf.at[row, slot].set(jnp.where(valid, recv, buf[row, slot]))

            for pairs, (f_src, f_kin, _), (b_src, b_kin, b_kout) in tables:
                recv = lax.ppermute(act_out, pipe, perm=pairs)
                act_buf = deliver(act_buf, recv, f_src[r], f_kin[r], bufs.in_slot, FORWARD)
                recv = lax.ppermute(grads_out[b_kin[r]], pipe, perm=[(b, a) for a, b in pairs])
                grad_buf = deliver(grad_buf, recv, b_src[r], b_kout[r], bufs.out_slot, BACKWARD)
            return act_buf, grad_buf, gacc + dparam, loss + dloss

        carry = (jnp.zeros((bufs.n_in_max, st.num_in_slots, bufs.A), bufs.act_dtype),
                 jnp.zeros((bufs.n_out_max, st.num_out_slots, bufs.A), bufs.act_dtype),
                 jnp.zeros((bufs.P_width,), bufs.p_dtype), jnp.zeros((), jnp.float32))
        _, _, gacc, loss = lax.fori_loop(0, st.kind.shape[0], tick, carry)
        gacc = _sum_tied(gacc, r, ties, pipe)
        loss = lax.psum(loss, pipe)
        if data_axes:
            loss, gacc = lax.pmean(loss, data_axes), lax.pmean(gacc, data_axes)
        return loss, gacc[None]

    return body


def _sum_tied(gacc: jax.Array, r: jax.Array, ties: list, pipe: str) -> jax.Array:
    for members, offsets, n in ties:    # copies of one parameter: every copy gets the sum
        off = jnp.asarray(offsets)[r]
        mine = lax.dynamic_slice_in_dim(gacc, off, n)
        total = mine
        for j in range(1, len(members)):
            perm = [(members[i], members[(i + j) % len(members)]) for i in range(len(members))]
            total = total + lax.ppermute(mine, pipe, perm=perm)
        member = jnp.isin(r, jnp.asarray(members))
        gacc = lax.dynamic_update_slice_in_dim(gacc, jnp.where(member, total, mine), off, 0)
    return gacc


def _topological(n: int, edges: Sequence[tuple[int, int]]) -> list[int]:
    g = nx.DiGraph(list(edges))
    g.add_nodes_from(range(n))
    return list(nx.lexicographical_topological_sort(g))


def pipeline_value_and_grad(stage_fns: Sequence[Callable], mesh: Mesh, *, num_microbatches: int | None = None,
                            schedule: str | Schedule = "1f1b", edges: Sequence[tuple[int, int]] | None = None,
                            pipe_axis: str = "pipe", data_axes: Sequence[str] | None = None,
                            tied: Sequence[Sequence[tuple[int, str]]] = ()) -> PipelineProgram:
    """Build the SPMD pipeline program for `stage_fns` on `mesh` (see the module docstring).

    `schedule`: a registered name ("gpipe", "1f1b", "graph-1f1b") built with `num_microbatches` and
    `edges` (default: a chain), or a `pipeline.Schedule` (then its own stage DAG and counts are used).
    `data_axes`: mesh axes splitting each micro-batch; default every axis but `pipe_axis`.
    `tied`: groups of (stage, keystr path in that stage's parameters) holding copies of one parameter
    (tied embeddings): each copy's gradient becomes the group's sum once per step, so copies updated
    by an elementwise optimizer stay equal, and the weight never travels with the micro-batches."""
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
    S = len(fns)
    if mesh.shape[pipe_axis] != S:
        raise PipelineError(
            f"pipeline runtime: {S} stages need a '{pipe_axis}' axis of size {S}; the mesh {dict(mesh.shape)} has "
            f"{mesh.shape[pipe_axis]}. Each pipe rank runs one stage.")
    axes = tuple(a for a in mesh.axis_names if a != pipe_axis) if data_axes is None else tuple(data_axes)
    unknown = [a for a in axes if a not in mesh.axis_names or a == pipe_axis]
    if unknown:
        raise PipelineError(
            f"pipeline runtime: data_axes {unknown} are not non-pipe axes of the mesh {dict(mesh.shape)}.")
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
    groups = tuple(tuple((int(st), str(path)) for st, path in group) for group in tied)
    for group in groups:
        stages = [st for st, _ in group]
        if len(group) < 2 or len(set(stages)) != len(stages) or not all(0 <= st < S for st in stages):
            raise PipelineError(
                f"pipeline runtime: tied group {list(group)} must name two or more distinct stages 0..{S - 1}.")
    return PipelineProgram(fns, mesh, sched, pipe_axis, axes, groups)
