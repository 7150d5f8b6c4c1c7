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

from ...core.errors import PipelineError
from ...pipeline.schedules.schedule import Schedule, tick_table

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
    """Static tables the SPMD loop indexes with (tick, rank). A rank holds the rows of its stages
    (`Schedule.stages_on`), `rows` of them; transfers go in groups of rank pairs (one ppermute per
    group and direction per tick), and what a rank receives in a tick and where it stores it is
    static too, so the traced loop only looks it up."""

    kind: np.ndarray          # [T, R] IDLE / FORWARD / BACKWARD
    microbatch: np.ndarray    # [T, R]
    stage: np.ndarray         # [T, R] stage run (0 when idle)
    local: np.ndarray         # [T, R] that stage's row among its rank's parameter rows
    in_slot: np.ndarray       # [stages, max in-degree, M]: slot of an incoming activation
    out_slot: np.ndarray      # [stages, max out-degree, M]: slot of an incoming gradient
    num_in_slots: int
    num_out_slots: int
    rows: int                 # stages per rank
    pairs: tuple[tuple[tuple[int, int], ...], ...]   # per group: (sender rank, receiver rank) forward
    recv: np.ndarray          # [2, groups, 3, T, R]: (forward, backward) x (store?, buffer row, slot)
    send_row: np.ndarray      # [groups, T, R]: the input-gradient row a backward sends in the group


def _rows_per_rank(sched: Schedule) -> int:
    per_rank = [len(sched.stages_on(r)) for r in range(len(sched.ranks))]
    if len(set(per_rank)) != 1:
        raise PipelineError(
            f"pipeline runtime: schedule {sched.name!r} places {per_rank} stages on its ranks; the runtime needs "
            "the same number on every rank (one parameter row each). Fix: balance the placement.")
    return per_rank[0]


def static_plan(sched: Schedule) -> TickPlan:
    n, M, R = sched.num_stages, sched.num_microbatches[0], len(sched.ranks)
    rows, table = _rows_per_rank(sched), tick_table(sched)
    T = len(table[0]) if table else 0
    kind, mb, stage, local = (np.zeros((T, R), np.int32) for _ in range(4))
    loc = {s: sched.stages_on(sched.rank_of[s]).index(s) for s in range(n)}
    when: dict[tuple[int, int, str], int] = {}
    for r, row in enumerate(table):
        for t, task in enumerate(row):
            if task is not None:
                kind[t, r] = FORWARD if task.kind == "F" else BACKWARD
                mb[t, r], stage[t, r], local[t, r] = task.microbatch, task.stage, loc[task.stage]
                when[(task.stage, task.microbatch, task.kind)] = t
    preds = [sched.predecessors(s) for s in range(n)]
    succs = [sched.successors(s) for s in range(n)]
    in_slot, n_in = _slot_table(sched, preds, M, lambda s, u, m: (when[(u, m, "F")], when[(s, m, "B")]))
    out_slot, n_out = _slot_table(sched, succs, M, lambda s, v, m: (when[(v, m, "B")], when[(s, m, "B")]))
    pairs, recv, send_row = _transfers(sched, table, preds, succs, in_slot, out_slot)
    return TickPlan(kind, mb, stage, local, in_slot, out_slot, n_in, n_out, rows, pairs, recv, send_row)


def _slot_table(sched: Schedule, nbrs: list, M: int, interval: Callable) -> tuple[np.ndarray, int]:
    """Slots of one buffer (stage inputs: `nbrs` = predecessors, held from the producer's forward to
    our backward; incoming gradients: successors, from the consumer's backward to ours). The stages
    of one rank share its buffer, so they are coloured together, per neighbour index."""
    n = sched.num_stages
    slots = np.zeros((n, max(1, max(map(len, nbrs))), M), np.int32)
    used_max = 1
    for r in range(len(sched.ranks)):
        for k in range(slots.shape[1]):
            spans = {(s, m): interval(s, nbrs[s][k], m)
                     for s in sched.stages_on(r) if k < len(nbrs[s]) for m in range(M)}
            slot, used = _slots(spans)
            for (s, m), x in slot.items():
                slots[s, k, m] = x
            used_max = max(used_max, used)
    return slots, used_max


def _transfers(sched: Schedule, table: Any, preds: list, succs: list, in_slot: np.ndarray,
               out_slot: np.ndarray) -> tuple[tuple, np.ndarray, np.ndarray]:
    """Rank-pair groups and, per tick, what each rank receives and stores: a forward sends its
    output to every successor stage's rank, a backward its input gradients to every predecessor's."""
    rank_of, R = sched.rank_of, len(sched.ranks)
    groups = _matchings(sorted({(rank_of[u], rank_of[v]) for u, v in sched.edges}))
    group_of = {pair: g for g, pairs in enumerate(groups) for pair in pairs}
    T = len(table[0]) if table else 0
    recv = np.zeros((2, max(1, len(groups)), 3, T, R), np.int32)
    send_row = np.zeros((max(1, len(groups)), T, R), np.int32)
    for r, row in enumerate(table):
        for t, task in enumerate(row):
            if task is None:
                continue
            s, m = task.stage, task.microbatch
            moves = []          # (direction, group, receiving rank, its buffer row, slot)
            if task.kind == "F":
                for v in succs[s]:
                    k = preds[v].index(s)
                    moves.append((0, group_of[(r, rank_of[v])], rank_of[v], k, in_slot[v, k, m]))
            else:
                for i, u in enumerate(preds[s]):
                    j, g = succs[u].index(s), group_of[(rank_of[u], r)]
                    moves.append((1, g, rank_of[u], j, out_slot[u, j, m]))
                    send_row[g, t, r] = i
            for d, g, q, k, slot in moves:
                if recv[d, g, 0, t, q]:
                    raise PipelineError(
                        f"pipeline runtime: schedule {sched.name!r} sends rank {q} two messages in one tick over one "
                        f"rank pair (stage {s} has two neighbours on rank {q}); place them on different ranks.")
                recv[d, g, :, t, q] = (1, k, slot)
    return tuple(tuple(p) for p in groups), recv, send_row


@dataclasses.dataclass(frozen=True)
class Buffers:
    """What the traced tick loop closes over: the stage DAG, the row codecs of parameters (`pc`) and
    stage outputs (`ac`), the slot tables and each stage's row among its rank's parameter rows."""

    M: int
    preds: list
    succs: list
    pc: Any                          # FlatCodec | ShardedCodec
    ac: Any
    n_in_max: int
    n_out_max: int
    in_slot: jax.Array               # TickPlan.in_slot
    out_slot: jax.Array              # TickPlan.out_slot
    local: tuple[int, ...] = ()      # stage -> parameter row on its rank; () = one row per rank


def _at(buf: Any, *idx: Any) -> Any:
    return jax.tree.map(lambda b: b[idx], buf)


def _tree_sum(rows: list[Any]) -> Any:
    return jax.tree.map(lambda *xs: sum(xs[1:], xs[0]), *rows)


def branches(bufs: Buffers, fns: Sequence[Callable]) -> list[Callable]:
    """`lax.switch`'s branches, one signature for all: stage s's forward at s, its backward at S + s,
    idle at 2S. Each returns (activation row, input-gradient rows, parameter gradient, loss). With
    several stages per rank the parameters come in as the rank's rows and a branch picks its own."""
    S, M, pc, ac = len(fns), bufs.M, bufs.pc, bufs.ac
    preds, succs = bufs.preds, bufs.succs

    def zeros():
        act = ac.zero()
        return act, jax.tree.map(lambda a: jnp.zeros((bufs.n_in_max, *a.shape), a.dtype), act), pc.zero(), \
            jnp.zeros((), jnp.float32)

    def stage_call(s, params, act_buf, m):
        p = pc.unpack(s, _at(params, bufs.local[s]) if bufs.local else params)
        xs = [ac.unpack(u, _at(act_buf, k, bufs.in_slot[s, k, m])) for k, u in enumerate(preds[s])]
        return p, xs

    def forward(s):
        def run(params, act_buf, grad_buf, batch_m, m):
            p, xs = stage_call(s, params, act_buf, m)
            y = fns[s](p, batch_m, *xs)
            z = zeros()
            if not succs[s]:
                return z[0], z[1], z[2], y.astype(jnp.float32) / M
            return ac.pack(s, y), z[1], z[2], z[3]
        return run

    def backward(s):
        def run(params, act_buf, grad_buf, batch_m, m):
            p, xs = stage_call(s, params, act_buf, m)
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

    def idle(params, act_buf, grad_buf, batch_m, m):
        return zeros()

    return [forward(s) for s in range(S)] + [backward(s) for s in range(S)] + [idle]


def spmd_body(bufs: Buffers, st: TickPlan, branches: list[Callable], ties: list, pipe: str,
               data_axes: tuple[str, ...]) -> Callable:
    """The per-device program: the tick loop, then tied copies' gradient sums and the loss/gradient
    reductions over pipe and (manual) data axes. Parameters and gradients are the rank's rows."""
    S = len(bufs.preds)
    kind_t, mb_t, stage_t, local_t = (jnp.asarray(a) for a in (st.kind, st.microbatch, st.stage, st.local))
    recv_t, send_t = jnp.asarray(st.recv), jnp.asarray(st.send_row)

    def body(flat, batch_mb):
        r = lax.axis_index(pipe)
        params = flat if bufs.local else jax.tree.map(lambda b: b[0], flat)

        def store(buf, x, d, g, t):
            ok, row, slot = recv_t[d, g, 0, t, r], recv_t[d, g, 1, t, r], recv_t[d, g, 2, t, r]
            return jax.tree.map(lambda b, v: b.at[row, slot].set(jnp.where(ok > 0, v, b[row, slot])), buf, x)

        def tick(t, carry):
            act_buf, grad_buf, gacc, loss = carry
            k, m, s = kind_t[t, r], mb_t[t, r], stage_t[t, r]
            idx = jnp.where(k == FORWARD, s, jnp.where(k == BACKWARD, S + s, 2 * S))
            batch_m = jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, m, 0, keepdims=False), batch_mb)
            act_out, grads_out, dparam, dloss = lax.switch(idx, branches, params, act_buf, grad_buf, batch_m, m)
            for g, pairs in enumerate(st.pairs):
                act_buf = store(act_buf, lax.ppermute(act_out, pipe, perm=pairs), 0, g, t)
                back = lax.ppermute(_at(grads_out, send_t[g, t, r]), pipe, perm=[(b, a) for a, b in pairs])
                grad_buf = store(grad_buf, back, 1, g, t)
            if bufs.local:
                gacc = jax.tree.map(lambda a, d: a.at[local_t[t, r]].add(d), gacc, dparam)
            else:
                gacc = jax.tree.map(jnp.add, gacc, dparam)
            return act_buf, grad_buf, gacc, loss + dloss

        act = bufs.ac.zero()
        zero = bufs.pc.zero()
        carry = (jax.tree.map(lambda a: jnp.zeros((bufs.n_in_max, st.num_in_slots, *a.shape), a.dtype), act),
                 jax.tree.map(lambda a: jnp.zeros((bufs.n_out_max, st.num_out_slots, *a.shape), a.dtype), act),
                 jax.tree.map(lambda z: jnp.stack([z] * st.rows), zero) if bufs.local else zero,
                 jnp.zeros((), jnp.float32))
        _, _, gacc, loss = lax.fori_loop(0, st.kind.shape[0], tick, carry)
        if not bufs.local:
            gacc = jax.tree.map(lambda g: g[None], gacc)
        gacc = _sum_tied(gacc, r, ties, pipe)
        loss = lax.psum(loss, pipe)
        if data_axes:
            loss, gacc = lax.pmean(loss, data_axes), lax.pmean(gacc, data_axes)
        return loss, gacc

    return body


def _sum_tied(gacc: Any, r: jax.Array, ties: list, pipe: str) -> Any:
    """Copies of one parameter (tied embeddings): every copy's gradient becomes the group's sum. A
    copy is a slice of the last axis of one of the rank's rows: of the flat buffer, or of one group
    buffer (sharded). A rank may hold several copies (`here[r, k]`, at `rows[r, k]`/`offsets[r, k]`):
    they are summed locally, then across the member ranks."""
    for members, group, offsets, rows, here, n in ties:
        buf = gacc if group is None else gacc[group]
        off, row, ok = jnp.asarray(offsets)[r], jnp.asarray(rows)[r], jnp.asarray(here)[r] > 0
        copies = [lax.dynamic_slice_in_dim(buf[row[k]], off[k], n, axis=-1) for k in range(offsets.shape[1])]
        mine = sum((jnp.where(ok[k], c, 0) for k, c in enumerate(copies[1:], 1)), copies[0])
        total = mine
        for j in range(1, len(members)):
            perm = [(members[i], members[(i + j) % len(members)]) for i in range(len(members))]
            total = total + lax.ppermute(mine, pipe, perm=perm)
        for k in range(offsets.shape[1]):
            new = lax.dynamic_update_slice_in_dim(buf[row[k]], total, off[k], axis=-1)
            buf = buf.at[row[k]].set(jnp.where(ok[k], new, buf[row[k]]))
        gacc = buf if group is None else tuple(buf if g == group else b for g, b in enumerate(gacc))
    return gacc
