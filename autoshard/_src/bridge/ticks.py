"""The pipeline runtime's tick loop (imports jax): the static tick and slot tables a validated
schedule becomes, the `lax.switch` branches (each stage's forward, its backward, idle) and the
per-device SPMD body that runs them, moving activations and gradients along the stage DAG's edges
by `ppermute`. `runtime.PipelineProgram` builds and jits it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..pipeline.schedules.schedule import Schedule, tick_table

IDLE, FORWARD, BACKWARD = 0, 1, 2


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
class TickPlan:
    """Static tables the SPMD loop indexes with (tick, rank)."""

    kind: np.ndarray          # [T, S] IDLE / FORWARD / BACKWARD
    microbatch: np.ndarray    # [T, S]
    in_slot: np.ndarray       # [S, max in-degree, M]: slot of an incoming activation
    out_slot: np.ndarray      # [S, max out-degree, M]: slot of an incoming gradient
    num_in_slots: int
    num_out_slots: int


def static_plan(sched: Schedule) -> TickPlan:
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
    return TickPlan(kind, mb, in_slot, out_slot, n_in, n_out)


@dataclasses.dataclass(frozen=True)
class Buffers:
    """What the traced tick loop closes over: the stage DAG, the row codecs of parameters (`pc`) and
    stage outputs (`ac`), and the slot tables."""

    M: int
    preds: list
    succs: list
    pc: Any                          # FlatCodec | ShardedCodec
    ac: Any
    n_in_max: int
    n_out_max: int
    in_slot: jax.Array               # TickPlan.in_slot
    out_slot: jax.Array              # TickPlan.out_slot


def _at(buf: Any, *idx: Any) -> Any:
    return jax.tree.map(lambda b: b[idx], buf)


def _tree_sum(rows: list[Any]) -> Any:
    return jax.tree.map(lambda *xs: sum(xs[1:], xs[0]), *rows)


def branches(bufs: Buffers, fns: Sequence[Callable]) -> list[Callable]:
    """`lax.switch`'s branches, one signature for all: stage s's forward at s, its backward at S + s,
    idle at 2S. Each returns (activation row, input-gradient rows, parameter gradient, loss)."""
    S, M, pc, ac = len(fns), bufs.M, bufs.pc, bufs.ac
    preds, succs = bufs.preds, bufs.succs

    def zeros():
        act = ac.zero()
        return act, jax.tree.map(lambda a: jnp.zeros((bufs.n_in_max, *a.shape), a.dtype), act), pc.zero(), \
            jnp.zeros((), jnp.float32)

    def stage_call(s, row_p, act_buf, m):
        p = pc.unpack(s, row_p)
        xs = [ac.unpack(u, _at(act_buf, k, bufs.in_slot[s, k, m])) for k, u in enumerate(preds[s])]
        return p, xs

    def forward(s):
        def run(row_p, act_buf, grad_buf, batch_m, m):
            p, xs = stage_call(s, row_p, act_buf, m)
            y = fns[s](p, batch_m, *xs)
            z = zeros()
            if not succs[s]:
                return z[0], z[1], z[2], y.astype(jnp.float32) / M
            return ac.pack(s, y), z[1], z[2], z[3]
        return run

    def backward(s):
        def run(row_p, act_buf, grad_buf, batch_m, m):
            p, xs = stage_call(s, row_p, act_buf, m)
            y, vjp = jax.vjp(lambda p_, *xs_: fns[s](p_, batch_m, *xs_), p, *xs)
            if succs[s]:
                g = _tree_sum([_at(grad_buf, j, bufs.out_slot[s, j, m]) for j in range(len(succs[s]))])
                ct = ac.unpack(s, g)
            else:
                ct = jnp.asarray(1.0 / M, y.dtype)
            dp_, *dxs = vjp(ct)
            z = zeros()
            rows = [ac.pack(u, dx) for u, dx in zip(preds[s], dxs, strict=True)]
            rows += [z[0]] * (bufs.n_in_max - len(rows))
            return z[0], jax.tree.map(lambda *r: jnp.stack(r), *rows), pc.pack(s, dp_), z[3]
        return run

    def idle(row_p, act_buf, grad_buf, batch_m, m):
        return zeros()

    return [forward(s) for s in range(S)] + [backward(s) for s in range(S)] + [idle]


def edge_tables(edges: Sequence[tuple[int, int]], preds: list, succs: list, S: int) -> list:
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


def spmd_body(bufs: Buffers, st: TickPlan, branches: list[Callable], tables: list, kind_t: jax.Array,
               mb_t: jax.Array, ties: list, pipe: str, data_axes: tuple[str, ...]) -> Callable:
    """The per-device program: the tick loop, then tied copies' gradient sums and the loss/gradient
    reductions over pipe and (manual) data axes."""
    S = len(bufs.preds)

    def body(flat, batch_mb):
        r = lax.axis_index(pipe)
        row_p = jax.tree.map(lambda b: b[0], flat)

        def tick(t, carry):
            act_buf, grad_buf, gacc, loss = carry
            k, m = kind_t[t, r], mb_t[t, r]
            idx = jnp.where(k == FORWARD, r, jnp.where(k == BACKWARD, S + r, 2 * S))
            batch_m = jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, m, 0, keepdims=False), batch_mb)
            act_out, grads_out, dparam, dloss = lax.switch(idx, branches, row_p, act_buf, grad_buf, batch_m, m)

            def deliver(buf, recv, src, row, slots, kind):
                # keep what arrived only if the sender ran that kind of task this tick
                valid = (src >= 0) & (kind_t[t, jnp.maximum(src, 0)] == kind)
                slot = slots[r, row, mb_t[t, jnp.maximum(src, 0)]]
                return jax.tree.map(lambda b, x: b.at[row, slot].set(jnp.where(valid, x, b[row, slot])), buf, recv)

            for pairs, (f_src, f_kin, _), (b_src, b_kin, b_kout) in tables:
                recv = lax.ppermute(act_out, pipe, perm=pairs)
                act_buf = deliver(act_buf, recv, f_src[r], f_kin[r], bufs.in_slot, FORWARD)
                recv = lax.ppermute(_at(grads_out, b_kin[r]), pipe, perm=[(b, a) for a, b in pairs])
                grad_buf = deliver(grad_buf, recv, b_src[r], b_kout[r], bufs.out_slot, BACKWARD)
            return act_buf, grad_buf, jax.tree.map(jnp.add, gacc, dparam), loss + dloss

        act = bufs.ac.zero()
        carry = (jax.tree.map(lambda a: jnp.zeros((bufs.n_in_max, st.num_in_slots, *a.shape), a.dtype), act),
                 jax.tree.map(lambda a: jnp.zeros((bufs.n_out_max, st.num_out_slots, *a.shape), a.dtype), act),
                 bufs.pc.zero(), jnp.zeros((), jnp.float32))
        _, _, gacc, loss = lax.fori_loop(0, st.kind.shape[0], tick, carry)
        gacc = _sum_tied(gacc, r, ties, pipe)
        loss = lax.psum(loss, pipe)
        if data_axes:
            loss, gacc = lax.pmean(loss, data_axes), lax.pmean(gacc, data_axes)
        return loss, jax.tree.map(lambda g: g[None], gacc)

    return body


def _sum_tied(gacc: Any, r: jax.Array, ties: list, pipe: str) -> Any:
    """Copies of one parameter (tied embeddings): every copy's gradient becomes the group's sum. A
    copy is a slice of the last axis of one row (flat) or of one group buffer (sharded)."""
    for members, group, offsets, n in ties:
        buf = gacc if group is None else gacc[group]
        off = jnp.asarray(offsets)[r]
        mine = lax.dynamic_slice_in_dim(buf, off, n, axis=-1)
        total = mine
        for j in range(1, len(members)):
            perm = [(members[i], members[(i + j) % len(members)]) for i in range(len(members))]
            total = total + lax.ppermute(mine, pipe, perm=perm)
        member = jnp.isin(r, jnp.asarray(members))
        buf = lax.dynamic_update_slice_in_dim(buf, jnp.where(member, total, mine), off, axis=-1)
        gacc = buf if group is None else tuple(buf if g == group else b for g, b in enumerate(gacc))
    return gacc
