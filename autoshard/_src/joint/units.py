"""The step as a chain of pipeline units for the 3-D search (pure: no jax import).

A unit is one instance of a repeated block (TAP's grouping: `block_7`, one encoder layer) with the
remainder ops around it attached: forward remainder ops join the unit they run after (those before
the first block join the first unit: embeddings, position ids), other remainder ops join the unit of
their module's last forward op (an embedding's update stays with the embedding; the loss's backward
with the head). Stages are contiguous unit ranges.

Each unit has a *kind*: units of one kind cost the same under any tensor plan, so the search prices
kinds, not units. An instance the tensor search analyses (first, last, one per period in the middle)
with its attachments is its own kind; every other middle instance is the kind of the middle
representative of its residue class, whose ops stand for it with weight 1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from ..core.attention import selective_ops
from ..core.graph import OpGraph
from ..core.grouping import Grouping
from ..core.liveness import live_ops
from ..pipeline.costs import leading_dim, traced_batch
from ..tensor.experts import batch_factors, region_twins
from ..tensor.instances import instance_maps
from ..tensor.search import Analysis

SLICES = ("fwd", "fwd_dots", "fwd_attn", "bwd", "const", "step")


@dataclasses.dataclass(frozen=True)
class UnitKind:
    """Ops that price one unit of this kind (analysed ops: the factor graph knows them), split by
    how their cost scales: per micro-batch with its size (`fwd`, `bwd`; among `fwd`, `fwd_dots` its
    matmuls and `fwd_attn` its attention scores and softmax, what selective remat reruns), per
    micro-batch whatever its size (`const`: weight transposes), once per step (`step`: the optimizer).
    `inputs`: the parameters, state and data the unit reads."""

    key: tuple
    slices: dict[str, dict[int, float]]
    inputs: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Units:
    """The chain: per unit its kind, ops (for the plan's stages) and label; per boundary the bytes
    crossing it at the traced batch (`cut_dep` scale with the batch, `cut_const` do not)."""

    kinds: tuple[UnitKind, ...]
    kind_of: tuple[int, ...]
    ops: tuple[tuple[int, ...], ...]
    labels: tuple[str, ...]
    cut_dep: np.ndarray             # [U + 1]: bytes entering unit j from units < j (0 at both ends)
    cut_const: np.ndarray
    scanned: bool                   # a block type is an nn.scan loop: its iterations are one unit

    def __len__(self) -> int:
        return len(self.kind_of)


def _block_units(graph: OpGraph, grouping: Grouping) -> list[tuple[int, int]]:
    """(block type, instance) of every unit, in forward order (a scanned type is one unit)."""
    first: dict[tuple[int, int], int] = {}
    for t, bt in enumerate(grouping.block_types):
        for k, inst in enumerate(bt.instances[:1] if bt.scanned else bt.instances):
            fwd = [o for o in inst.ops if graph.ops[o].phase == "forward"]
            first[(t, k)] = min(fwd) if fwd else min(inst.ops)
    return sorted(first, key=lambda tk: first[tk])


def _attach(graph: OpGraph, grouping: Grouping, blocks: list[tuple[int, int]]) -> list[list[int]]:
    """Remainder ops per unit (module docstring rules)."""
    starts = []
    for t, k in blocks:
        fwd = [o for o in grouping.block_types[t].instances[k].ops if graph.ops[o].phase == "forward"]
        starts.append(min(fwd) if fwd else min(grouping.block_types[t].instances[k].ops))
    starts_arr = np.array(starts)
    attached: list[list[int]] = [[] for _ in blocks]
    last_fwd_unit: dict[str, int] = {}
    rest = []
    for o in sorted(grouping.remainder):
        op = graph.ops[o]
        if op.phase == "forward":
            u = max(int(np.searchsorted(starts_arr, o, side="right")) - 1, 0)
            attached[u].append(o)
            last_fwd_unit[op.module] = max(last_fwd_unit.get(op.module, 0), u)
        else:
            rest.append(o)
    for o in rest:
        module = graph.ops[o].module
        while module and module not in last_fwd_unit:
            module = module.rpartition("/")[0]
        attached[last_fwd_unit.get(module, len(blocks) - 1)].append(o)
    return attached


def _representatives(grouping: Grouping, periods: Sequence[int]) -> dict[tuple[int, int], int]:
    """Instance -> the analysed instance standing for it (the tensor search's choice of
    first `period`, last, and one middle instance per residue class)."""
    rep = {}
    for t, (bt, p) in enumerate(zip(grouping.block_types, periods, strict=True)):
        n = bt.count
        exact = set(range(min(p, n))) | {n - 1}
        for k in range(n):
            rep[(t, k)] = k if k in exact or bt.scanned else next(
                j for j in range(p, 2 * p) if j % p == k % p and j not in exact)
    return rep


def batch_dependent(graph: OpGraph, grouping: Grouping, analysed: Analysis) -> np.ndarray:
    """Per op: does its work scale with the batch? Yes when it iterates over a batch factor, or
    when an output leads with the traced batch size (a constant broadcast to [batch, heads, q, k]
    for a causal mask: no data flows into it and its new dims are linked to no factor, yet it grows
    with the batch); a weight transpose does not. Ops outside the analysed instances answer as
    their representative."""
    # the batch's twins across MoE region cuts too: the dispatched tokens' group dim is the batch
    batch = set(region_twins(analysed.fg, batch_factors(graph, analysed.fg)))
    size = traced_batch(graph)
    dep = np.zeros(len(graph.ops), dtype=bool)
    for i, of in analysed.fg.op_factors.items():
        op = graph.ops[i]
        dep[i] = bool(batch & of.loop) or (size > 1 and any(leading_dim(s) == size for s in op.out_shapes))
    for op, rep in instance_maps(graph, grouping, analysed.periods).items():
        if rep in analysed.fg.op_factors:
            dep[op] = dep[rep]
    return dep


def build_units(graph: OpGraph, grouping: Grouping, analysed: Analysis) -> Units:
    """The unit chain of `graph` (grouped by `grouping`; `analysed`: the tensor search's analysis)."""
    blocks = _block_units(graph, grouping)
    dep = batch_dependent(graph, grouping, analysed)
    if not blocks:   # nothing repeats: the whole step is one unit
        kinds = (_kind(graph, ("all",), list(range(len(graph.ops))), dep),)
        return Units(kinds, (0,), (tuple(range(len(graph.ops))),), ("(whole step)",), np.zeros(2), np.zeros(2),
                     False)
    attached = _attach(graph, grouping, blocks)
    rep = _representatives(grouping, analysed.periods)
    kinds: list[UnitKind] = []
    index: dict[tuple, int] = {}
    kind_of, unit_ops, labels = [], [], []
    for (t, k), extra in zip(blocks, attached, strict=True):
        bt = grouping.block_types[t]
        r = rep[(t, k)]
        key = (t, r, tuple(extra))
        if key not in index:
            index[key] = len(kinds)
            kinds.append(_kind(graph, key, [*bt.instances[r].ops, *extra], dep))
        kind_of.append(index[key])
        unit_ops.append(tuple(sorted({*bt.instances[k].ops, *extra})))
        labels.append(bt.instances[k].path + (" (scan)" if bt.scanned else ""))
    cut_dep, cut_const = _cuts(graph, unit_ops, dep)
    return Units(tuple(kinds), tuple(kind_of), tuple(unit_ops), tuple(labels), cut_dep, cut_const,
                 any(bt.scanned for bt in grouping.block_types))


def _kind(graph: OpGraph, key: tuple, ops: Sequence[int], dep: np.ndarray) -> UnitKind:
    slices: dict[str, dict[int, float]] = {s: {} for s in SLICES}
    inputs: set[int] = set()
    live = live_ops(graph)
    attn = selective_ops(graph)
    for o in ops:
        if not live[o]:        # XLA deletes it: no slice prices it
            continue
        op = graph.ops[o]
        w = float(op.repeat)
        if op.phase == "forward" and dep[o]:
            slices["fwd"][o] = w
            if op.primitive == "dot_general":
                slices["fwd_dots"][o] = w
            if o in attn:
                slices["fwd_attn"][o] = w
        elif op.phase == "backward" and dep[o]:
            slices["bwd"][o] = w
        elif op.phase in ("forward", "backward"):
            slices["const"][o] = w
        else:
            slices["step"][o] = w
        inputs.update(v for v in op.inputs if graph.values[v].kind == "input")
    return UnitKind(key, slices, tuple(sorted(inputs)))


def _cuts(graph: OpGraph, unit_ops: Sequence[Sequence[int]], dep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Bytes of forward values made in a unit before each boundary and read by a forward op after it."""
    unit_of = {o: u for u, ops in enumerate(unit_ops) for o in ops}
    n = len(unit_ops)
    diff = {True: np.zeros(n + 2), False: np.zeros(n + 2)}
    live = live_ops(graph)
    for op in graph.ops:
        if op.phase != "forward" or op.index not in unit_of or not live[op.index]:
            continue
        p = unit_of[op.index]
        for v, shape_bytes in zip(op.outputs, _out_bytes(graph, op.index), strict=True):
            users = [unit_of[c] for c in graph.values[v].consumers
                     if graph.ops[c].phase == "forward" and c in unit_of and live[c]]
            q = max(users, default=p)
            if q > p:
                d = diff[bool(dep[op.index])]
                d[p + 1] += shape_bytes
                d[q + 1] -= shape_bytes
    cut_dep, cut_const = np.cumsum(diff[True])[: n + 1], np.cumsum(diff[False])[: n + 1]
    for c in (cut_dep, cut_const):
        c[0] = c[n] = 0.0
    return cut_dep, cut_const


def _out_bytes(graph: OpGraph, i: int) -> list[float]:
    return [float(graph.values[v].nbytes) for v in graph.ops[i].outputs]


def kinds_per_range(units: Units) -> np.ndarray:
    """counts[i, j, k]: units of kind k among units i..j-1 (prefix differences)."""
    n, K = len(units), len(units.kinds)
    onehot = np.zeros((n, K))
    onehot[np.arange(n), units.kind_of] = 1
    prefix = np.concatenate([np.zeros((1, K)), np.cumsum(onehot, axis=0)])
    return prefix[None, :, :] - prefix[:, None, :]
