"""Which instance of a block type stands for which (pure: no jax import).

The planner analyses representative instances only (`instance_roles`). An op of an instance it did not
analyse takes the factors of the instance standing for it (the first middle instance of its residue class
mod the type's period); an input takes those of instance k mod p (the instances' weights are linked).
These maps carry that over to every op and every input.
"""

from __future__ import annotations

import math

import numpy as np

from ..core.graph import PHASES, OpGraph
from ..core.grouping import Grouping
from ..core.optable import PHASE_CODES
from .factors import corresponding_arrays


def instance_maps(graph: OpGraph, grouping: Grouping, periods: tuple[int, ...],
                  phases: tuple[str, ...] = PHASES) -> dict[int, int]:
    """Op index → the corresponding op of its representative instance (an instance the search did not
    analyse: the one standing for it; another: instance k mod p of a type with period p), for the ops of
    `phases`. Computed once per grouping: do not modify."""
    def build() -> dict[int, int]:
        ops, reps = instance_map_arrays(graph, grouping, periods, phases)
        return dict(zip(ops.tolist(), reps.tolist(), strict=True))
    if graph is not grouping.graph:
        return build()
    return grouping.memo(("instance_maps", tuple(periods), phases), build)


def instance_map_arrays(graph: OpGraph, grouping: Grouping, periods: tuple[int, ...],
                        phases: tuple[str, ...] = PHASES) -> tuple[np.ndarray, np.ndarray]:
    """`instance_maps` as two aligned arrays (the ops, the representative op of each). Computed once per
    grouping: do not modify."""
    if graph is not grouping.graph:
        return _instance_map_arrays(graph, grouping, periods, phases)
    return grouping.memo(("instance_map_arrays", tuple(periods), phases),
                         lambda: _instance_map_arrays(graph, grouping, periods, phases))


def _instance_map_arrays(graph: OpGraph, grouping: Grouping, periods: tuple[int, ...],
                         phases: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    ops: list[np.ndarray] = []
    reps: list[np.ndarray] = []
    for bt, period in zip(grouping.block_types, periods, strict=True):
        rep_sigs: dict[int, dict] = {}        # each representative's signature, once
        stands = {} if bt.scanned else instance_roles(graph, grouping, bt, period)[1]
        mapped = []
        for k, inst in enumerate(bt.instances):
            # an instance the search did not analyse takes the factors of the one standing for it (not of
            # the first, which differs at its edge: its input comes from the remainder)
            r = stands.get(k)
            r = k % period if r is None or r == k else r
            if k >= period and inst.ops != bt.instances[r].ops:
                mapped.append((k, r))
        same = _same_sequences(graph, grouping, bt, mapped, phases)
        for (k, r), pair in zip(mapped, same, strict=True):
            if pair is None:
                pair = corresponding_arrays(graph, bt.instances[r].ops, bt.instances[k].ops, phases,
                                            rep_sigs.setdefault(r, {}))
            reps.append(pair[0])
            ops.append(pair[1])
    empty = np.zeros(0, dtype=np.int64)
    return (np.concatenate(ops) if ops else empty), (np.concatenate(reps) if reps else empty)


def _same_sequences(graph: OpGraph, grouping: Grouping, bt, mapped: list[tuple[int, int]], phases: tuple[str, ...]
                    ) -> list[tuple[np.ndarray, np.ndarray] | None]:
    """For each (instance, representative) of `mapped`: the pairs `corresponding_arrays` gives when the two run
    the same op kinds in the same phases in the same order (most layers of a deep step: one array operation
    for all of them), else None. Pairs phase by phase, as it does."""
    if not mapped:
        return []
    rows, row_of = grouping.op_rows(next(j for j, b in enumerate(grouping.block_types) if b is bt))
    t = graph.table()
    kinds, phase = t.kind[rows], t.phase[rows]
    ks = row_of[np.fromiter((k for k, _ in mapped), dtype=np.int64, count=len(mapped))]
    rs = row_of[np.fromiter((r for _, r in mapped), dtype=np.int64, count=len(mapped))]
    both = (ks >= 0) & (rs >= 0)             # instances of the common op count: compared as rows
    ks, rs = np.where(both, ks, 0), np.where(both, rs, 0)
    same = both & (kinds[ks] == kinds[rs]).all(axis=1) & (phase[ks] == phase[rs]).all(axis=1)
    out: list[tuple[np.ndarray, np.ndarray] | None] = []
    columns: dict[int, np.ndarray] = {}      # per representative: its ops' positions, phase by phase
    for k, r, ok in zip(ks.tolist(), rs.tolist(), same.tolist(), strict=True):
        if not ok:
            out.append(None)
            continue
        cols = columns.get(r)
        if cols is None:
            cols = columns[r] = np.concatenate([np.flatnonzero(phase[r] == PHASE_CODES[p]) for p in phases])
        out.append((rows[r, cols], rows[k, cols]))
    return out


def instance_roles(graph: OpGraph, grouping: Grouping, bt, period: int) -> tuple[set[int], dict[int, int]]:
    """Which instances of block type `bt` (repeating with `period`) the search analyses: (those counting for
    themselves, {every other instance from `period` on: the one standing for it}). The first `period`
    instances, the last and those bordering the remainder count for themselves: they differ from the
    middle ones (the first layer computes no input gradient when its input is the data; the last feeds
    the remainder). The first other instance of each residue class stands for its class (itself too)."""
    n = bt.count
    if graph is grouping.graph:       # asked by the analysis and by every instance map: once per type
        t = next(j for j, b in enumerate(grouping.block_types) if b is bt)
        border = grouping.memo(("bordering remainder", t), lambda: bordering_remainder(graph, grouping, bt))
    else:
        border = bordering_remainder(graph, grouping, bt)
    exact = set(range(min(period, n))) | {n - 1} | border
    first: dict[int, int] = {}
    stands = {}
    for j in range(period, n):
        if j not in exact:
            stands[j] = first.setdefault(j % period, j)
    return exact, stands


def input_maps(graph: OpGraph, grouping: Grouping, periods: tuple[int, ...]) -> dict[int, int]:
    """Input value → the corresponding input of its block type's first instance, matched by role,
    shape, dtype and keypath with the instance's own path components removed. Computed once per
    grouping: do not modify."""
    if graph is not grouping.graph:
        return _input_maps(graph, grouping, periods)
    return grouping.memo(("input_maps", tuple(periods)), lambda: _input_maps(graph, grouping, periods))


def _input_maps(graph: OpGraph, grouping: Grouping, periods: tuple[int, ...]) -> dict[int, int]:
    tails_of: dict[str, list[tuple[str, ...]]] = {}

    def strip(parts: tuple, path: str) -> tuple:
        # remove the instance's own path components ("block_3", or "blocks", "3" in nnx); the
        # keypath may lack leading scope names (linen's "GPT"), so try the path's suffixes, longest first
        tails = tails_of.get(path)
        if tails is None:
            comps = path.split("/")
            tails = tails_of[path] = [tuple(comps[s:]) for s in range(len(comps))]
        out = tuple([str(p).lstrip(".") for p in parts[1:]])
        for tail in tails:
            k = -1
            while tail[0] in out[k + 1:]:
                k = out.index(tail[0], k + 1)
                if out[k:k + len(tail)] == tail:
                    return (parts[0], *out[:k], *out[k + len(tail):])
        return (parts[0], *out)

    # inputs by the instance whose subtree holds their module (each distinct module looked up once)
    paths = {inst.path for bt in grouping.block_types for inst in bt.instances}
    path_of: dict[str, str | None] = {}
    under: dict[str, list[int]] = {}
    for v in graph.inputs:
        module = graph.values[v].module
        if module not in path_of:
            comps = module.split("/")
            path_of[module] = next((p for d in range(len(comps), 0, -1) if (p := "/".join(comps[:d])) in paths), None)
        if (path := path_of[module]) is not None:
            under.setdefault(path, []).append(v)

    def inputs_under(path: str) -> list[int]:
        return under.get(path, [])

    def key(v: int, path: str) -> tuple:
        val = graph.values[v]
        return (val.role, val.shape, val.dtype, strip(val.keypath_parts, path))

    out: dict[int, int] = {}
    for bt, period in zip(grouping.block_types, periods, strict=True):
        reps: list[dict | None] = [None] * period      # by stripped key: only for instances not matched in order
        for k, inst in enumerate(bt.instances):
            if k < period:
                continue
            rep, mine = bt.instances[k % period], inputs_under(inst.path)
            theirs = inputs_under(rep.path)
            if _same_but_instance(graph, mine, theirs, inst.path, rep.path):
                out.update(zip(mine, theirs, strict=True))        # the common case: the same leaves in the same order
                continue
            if reps[k % period] is None:
                reps[k % period] = {key(v, rep.path): v for v in theirs}
            by_key = reps[k % period]
            for v in mine:
                hit = by_key.get(key(v, inst.path))
                if hit is not None:
                    out[v] = hit
    return out


def _same_but_instance(graph: OpGraph, mine: list[int], theirs: list[int], path: str, rep_path: str) -> bool:
    """Are `mine` (an instance's inputs) `theirs` (its representative's) one by one: the same role, shape and
    dtype, and keypaths that differ only where the two instances' own path components do ("block_3" against
    "block_0", or 3 against 0 in nnx)? What stripping those components and matching by key would find."""
    comps, rep_comps = path.split("/"), rep_path.split("/")
    if len(mine) != len(theirs) or len(comps) != len(rep_comps):
        return False
    subs = set()
    for a, b in zip(comps, rep_comps, strict=True):
        if a != b:
            subs |= {(a, b), ("." + a, "." + b)} | ({(int(a), int(b))} if a.isdigit() and b.isdigit() else set())
    values = graph.values
    for v, w in zip(mine, theirs, strict=True):
        x, y = values[v], values[w]
        if x.role != y.role or x.shape != y.shape or x.dtype != y.dtype:
            return False
        px, py = x.keypath_parts, y.keypath_parts
        if len(px) != len(py):
            return False
        for a, b in zip(px, py, strict=True):
            if a != b and (a, b) not in subs:
                return False
    return True


def bordering_remainder(graph: OpGraph, grouping: Grouping, bt) -> set[int]:
    """The instances of block type `bt` whose forward pass exchanges a value with the remainder that no other
    instance of the type reads (the residual stream entering or leaving it). Instances need not come in
    program order and a type's instances may sit between remainder ops (T5's FFN sublayers between its
    unrepeated attention sublayers): one that another instance stands for has no factors of its own, so the
    stream would not link through it and a plan could lay the stream out differently on its two sides
    without the reshard being priced. They count for themselves."""
    values, ops, block_of = graph.values, graph.ops, grouping.block_of
    t = next(j for j, b in enumerate(grouping.block_types) if b is bt)
    out: set[int] = set()
    for i in grouping.remainder:        # walked from the remainder's side: it is small beside the blocks
        op = ops[i]
        if op.phase != "forward":
            continue
        for v in op.inputs:             # a value an instance's forward pass hands to the remainder
            p = values[v].producer
            if p is not None and ops[p].phase == "forward" and (b := block_of(p)) is not None and b[0] == t \
                    and _not_scalar(values[v].shape):       # not a layer's auxiliary loss (MoE load balancing)
                out.add(b[1])
        for v in op.outputs:            # one the remainder hands to one instance alone (not a shared mask)
            if _not_scalar(values[v].shape) and (k := _sole_reader(values[v].consumers, ops, block_of, t)) >= 0:
                out.add(k)
    return out


def _sole_reader(consumers: list[int], ops, block_of, t: int) -> int:
    """The instance of type t reading a value in its forward pass when it is the only instance of the type
    reading it (-1 otherwise). Stops at a second instance: a value every layer reads (a mask, positions)
    has consumers in all of them."""
    only, forward = -1, False
    for c in consumers:
        b = block_of(c)
        if b is None or b[0] != t:
            continue
        if only >= 0 and b[1] != only:
            return -1
        only, forward = b[1], forward or ops[c].phase == "forward"
    return only if forward else -1


def _not_scalar(shape: tuple[int, ...]) -> bool:
    return math.prod(shape) > 1
