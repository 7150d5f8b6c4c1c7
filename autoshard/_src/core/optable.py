"""The ops of a traced step as columns (pure: no jax import).

A deep step has tens of thousands of ops but few distinct modules, primitives and shape signatures:
a 96-layer GPT has 53,891 ops, 966 modules and 207 signatures. Each op's phase, module, signature and flops as
small integers and floats in numpy arrays let the planner's whole-graph passes (fingerprint, grouping's
module compositions, matching an instance's ops to its representative's, op keys, flops by phase) run
as array operations instead of visiting 50k Python objects each. Built once per graph, when the trace
finishes (`OpGraph.table`), from the ops' fields; a traced graph is not changed after that. The graph's edges
are columns too (which ops produce what each op reads, in CSR form), recorded by the trace as it adds the ops:
the walks a deep step needs (which forward ops reach the loss) are one breadth-first search.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import breadth_first_order

PHASE_CODES = {"forward": 0, "backward": 1, "optimizer": 2, "other": 3}   # index into graph.PHASES


@dataclasses.dataclass(frozen=True, eq=False)
class OpTable:
    """Per-op columns, row i for op i. Ids number distinct items in order of first appearance."""

    phase: np.ndarray            # int8: PHASE_CODES[op.phase]
    module: np.ndarray           # int32: index into `modules`
    modules: tuple[str, ...]
    sig: np.ndarray              # int32: index into `sigs`, (primitive, in shapes, in dtypes, out shapes, out dtypes)
    sigs: tuple[tuple, ...]
    kind: np.ndarray             # int32: index into `kinds`, (primitive, in shapes, out shapes): what grouping and
    kinds: tuple[tuple, ...]     # instance matching compare (dtypes aside)
    primitive: np.ndarray        # int32: index into `primitives`
    primitives: tuple[str, ...]
    flops: np.ndarray            # float64: flops per step (the op's flops times its loops' trip counts)
    repeat: np.ndarray           # float64: runs per step (op.repeat: the product of its loops' known trip counts)
    nested: np.ndarray           # bool: inside a nested jaxpr (op.nested)
    in_remat: np.ndarray         # bool: read from the body of a top-level remat call (op.remat_eqn >= 0)
    looped: np.ndarray           # bool: inside a loop body (op.loops)
    # the edges, op by op in CSR form: op i reads the values of operand entries operand_ptr[i]:operand_ptr[i + 1],
    # produced by ops operand_src[entry] (-1: a program input, constant or literal)
    operand_ptr: np.ndarray      # int64, one more than ops
    operand_src: np.ndarray      # int32
    producer: np.ndarray         # int32 by value id: the op writing it (-1: a program input, constant or literal)
    effectful: np.ndarray        # bool: marked by the trace as having effects (a callback, I/O: op.params["effectful"])

    def producers_of(self, values: Sequence[int]) -> np.ndarray:
        """The op writing each of `values` (value ids), -1 for a program input, constant or literal (a literal
        the step returns is made after every op: past the end of `producer`)."""
        ids = np.asarray(values, dtype=np.int64)
        out = np.full(len(ids), -1, dtype=np.int64)
        inside = ids < len(self.producer)
        out[inside] = self.producer[ids[inside]]
        return out

    def feeding(self, targets: np.ndarray, within: np.ndarray) -> np.ndarray:
        """Bool per op: it is one of `within` (bool per op) from which one of the `targets` (op indices, all
        within) is reached through ops within only. One breadth-first walk from the targets up the edges."""
        n = len(self.phase)
        readers = np.repeat(np.arange(n, dtype=np.int32), np.diff(self.operand_ptr))
        src = self.operand_src
        known = src >= 0
        keep = known & within[np.where(known, src, 0)] & within[readers]
        targets = np.asarray(targets, dtype=np.int32)
        # reader -> producer, and a root (row n) -> every target
        rows = np.concatenate([readers[keep], np.full(len(targets), n, dtype=np.int32)])
        cols = np.concatenate([src[keep], targets])
        walk = csr_matrix((np.ones(len(rows), dtype=np.int8), (rows, cols)), shape=(n + 1, n + 1))
        reached = breadth_first_order(walk, n, directed=True, return_predecessors=False)
        out = np.zeros(n + 1, dtype=bool)
        out[reached] = True
        return out[:n]


def build_table(ops: Sequence[Any], edges: tuple[list[int], ...] | None = None) -> OpTable:
    """The columns of `ops` (graph.Op objects in index order). `edges`: the trace's record of the edges and
    effectful ops (OpGraph.recorded_edges); read from the ops when None."""
    sig_ids: dict[tuple, int] = {}
    sig = [sig_ids.setdefault((op.primitive, op.in_shapes, op.in_dtypes, op.out_shapes, op.out_dtypes),
                              len(sig_ids)) for op in ops]
    mod_ids: dict[str, int] = {}
    module = [mod_ids.setdefault(op.module, len(mod_ids)) for op in ops]
    codes = PHASE_CODES
    phase = [codes[op.phase] for op in ops]
    looped = [bool(op.loops) for op in ops]
    repeat = [op.repeat if lp else 1 for op, lp in zip(ops, looped, strict=True)]     # 1 outside loops
    flops = [op.flops * r for op, r in zip(ops, repeat, strict=True)]
    # kinds and primitives from the distinct signatures (few), not per op
    kind_ids: dict[tuple, int] = {}
    prim_ids: dict[str, int] = {}
    kind_of_sig = np.asarray([kind_ids.setdefault((p, i, o), len(kind_ids)) for p, i, _, o, _ in sig_ids],
                             dtype=np.int32)
    prim_of_sig = np.asarray([prim_ids.setdefault(s[0], len(prim_ids)) for s in sig_ids], dtype=np.int32)
    sig_arr = np.asarray(sig, dtype=np.int32)
    operand_ptr, operand_src, producer = _edges(ops, edges)
    return OpTable(
        phase=np.asarray(phase, dtype=np.int8), module=np.asarray(module, dtype=np.int32), modules=tuple(mod_ids),
        sig=sig_arr, sigs=tuple(sig_ids), kind=kind_of_sig[sig_arr] if len(sig_arr) else sig_arr,
        kinds=tuple(kind_ids), primitive=prim_of_sig[sig_arr] if len(sig_arr) else sig_arr,
        primitives=tuple(prim_ids), flops=np.asarray(flops, dtype=np.float64),
        repeat=np.asarray(repeat, dtype=np.float64),
        nested=np.asarray([op.nested for op in ops], dtype=bool),
        in_remat=np.asarray([op.remat_eqn >= 0 for op in ops], dtype=bool), looped=np.asarray(looped, dtype=bool),
        operand_ptr=operand_ptr, operand_src=operand_src, producer=producer, effectful=_effectful(ops, edges))


def _effectful(ops: Sequence[Any], edges: tuple | None) -> np.ndarray:
    """Bool per op: op.params["effectful"] (the trace lists those ops as it marks them)."""
    out = np.zeros(len(ops), dtype=bool)
    marked = edges[4] if edges is not None else [i for i, op in enumerate(ops) if op.params.get("effectful")]
    out[np.asarray(marked, dtype=np.int64)] = True
    return out


def _edges(ops: Sequence[Any], edges: tuple | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(operand_ptr, operand_src, producer) from the flat record (read ids and count per op, written ids and count)."""
    if edges is None:
        edges = ([v for op in ops for v in op.inputs], [len(op.inputs) for op in ops],
                 [v for op in ops for v in op.outputs], [len(op.outputs) for op in ops])
    read, n_read, written, n_written = (np.asarray(x, dtype=np.int64) for x in edges[:4])
    by_op = np.arange(len(ops), dtype=np.int32)
    producer = np.full(int(max(read.max(initial=-1), written.max(initial=-1))) + 1, -1, dtype=np.int32)
    producer[written] = np.repeat(by_op, n_written)
    ptr = np.zeros(len(ops) + 1, dtype=np.int64)
    np.cumsum(n_read, out=ptr[1:])
    return ptr, producer[read], producer
