"""OpGraph: the traced program as plain data (pure: no jax import).

An OpGraph holds *values* (tensors: program inputs, constants, op outputs) and *ops* (one per
primitive application, nested jaxprs expanded inline). Ops are stored in program order, which is a
topological order. Loop bodies (scan/while) appear once, annotated with their trip counts, so a
96-layer `nn.scan` model stays small while `Op.repeat` says how often each op runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import itertools
import math
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from typing import Literal

import numpy as np

from .optable import OpTable, build_table

Phase = Literal["forward", "backward", "optimizer", "other"]
PHASES: tuple[Phase, ...] = ("forward", "backward", "optimizer", "other")

_ITEMSIZE = {
    "bool": 1, "int4": 1, "uint4": 1, "int8": 1, "uint8": 1, "float8_e4m3fn": 1,
    "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "int16": 2, "uint16": 2,
    "float16": 2, "bfloat16": 2, "int32": 4, "uint32": 4, "float32": 4, "int64": 8,
    "uint64": 8, "float64": 8, "complex64": 8, "complex128": 16,
}


def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype given by name (PRNG keys: two uint32 words; unknown: 4)."""
    if dtype.startswith("key<"):
        return 8
    return _ITEMSIZE.get(dtype, 4)


def nbytes(shape: Sequence[int], dtype: str) -> int:
    return math.prod(shape) * itemsize(dtype)  # math.prod: exact ints, and ~20x faster than np.prod


@dataclasses.dataclass(frozen=True, slots=True)
class Loop:
    """A loop an op sits in: the container op kind and its trip count (None: unknown, a while)."""

    uid: int
    kind: str
    trip_count: int | None


@dataclasses.dataclass(slots=True)
class Value:
    """A tensor. `keypath` is set for program inputs/outputs (e.g. "[0]['params']['fc1']['kernel']")."""

    id: int
    shape: tuple[int, ...]
    dtype: str
    producer: int | None = None          # op index, None for program inputs and constants
    kind: str = "intermediate"           # "input" | "const" | "literal" | "intermediate"
    keypath: str | None = None
    keypath_parts: tuple[str | int, ...] = ()
    consumers: list[int] = dataclasses.field(default_factory=list)
    # for program inputs: "parameter" (read by the forward pass, updated by the optimizer), "buffer"
    # (model state only the forward reads: BatchNorm statistics), "state" (per-parameter state such
    # as Adam moments, matched to its parameter by keypath), "rng" (a PRNG key: never split, never the
    # batch; core.attribution.is_prng_key) or "data"; module of parameters/state
    role: str = ""
    module: str = ""

    @property
    def nbytes(self) -> int:
        return nbytes(self.shape, self.dtype)


@dataclasses.dataclass(slots=True)
class Op:
    """One primitive application.

    `scope` is the raw name stack joined across nested jaxprs (e.g. "transpose(jvp(GPT))/block_3/fc1");
    `module` is the module path the op is attributed to ("GPT/block_3/fc1"), from name scopes where
    present and from parameter data flow otherwise; `phase` is forward/backward/optimizer/other.
    """

    index: int
    primitive: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    in_shapes: tuple[tuple[int, ...], ...]
    in_dtypes: tuple[str, ...]
    out_shapes: tuple[tuple[int, ...], ...]
    out_dtypes: tuple[str, ...]
    flops: float
    bytes: int
    scope: str
    scope_module: str
    transforms: tuple[str, ...]
    loops: tuple[Loop, ...] = ()
    params: dict = dataclasses.field(default_factory=dict)
    top_eqn: int = -1                    # index of the top-level jaxpr eqn the op comes from
    nested: bool = False                 # inside a nested jaxpr (jit/remat/scan/cond body)
    remat_eqn: int = -1                  # its eqn's index in the body of a top-level remat call it is read from
    module: str = ""
    phase: Phase = "other"

    @property
    def repeat(self) -> int:
        """How many times the op runs per step (product of known enclosing trip counts)."""
        r = 1
        for loop in self.loops:
            if loop.trip_count:
                r *= loop.trip_count
        return r


@dataclasses.dataclass(slots=True)
class OpGraph:
    """The traced step. Contract: `ops`, `values`, `inputs`, `outputs` (value ids in flat pytree
    order), `to_networkx()`; plus summaries used by grouping, planning and benchmarks."""

    ops: list[Op]
    values: dict[int, Value]
    inputs: list[int]
    outputs: list[int]
    output_keypaths: list[str]
    output_keypath_parts: list[tuple[str | int, ...]]
    name: str = ""
    eqns: dict | None = None             # op index -> jaxpr eqn, with trace(keep_eqns=True) only
    # analyses derived from the ops (fusion, liveness), computed once: a traced graph is not changed
    cache: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)
    # loop bodies appear once, so the back edge of a loop is not an edge here: value id -> the uids
    # of the loops that carry it into their next iteration (a scan's carry-out, a while body's
    # results and its condition); liveness.live_ops keeps them while their loop runs
    carried: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    # what the trace recorded as it added the ops: (value ids each op reads, their count per op, value ids
    # each op writes, their count per op, the ops it marked effectful), flat; the table's edges come from it
    # (or from the ops without it)
    recorded_edges: tuple[list[int], ...] | None = dataclasses.field(default=None, repr=False, compare=False)
    _table: OpTable | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def table(self) -> OpTable:
        """The ops as columns (`core.optable`): built when the trace finishes, or on first use for a
        graph made otherwise."""
        if self._table is None or len(self._table.phase) != len(self.ops):
            edges = self.recorded_edges
            self._table = build_table(self.ops, edges if edges is not None and len(edges[1]) == len(self.ops) else None)
            self.recorded_edges = None      # the table holds them now
        return self._table

    def __len__(self) -> int:
        return len(self.ops)

    def __iter__(self) -> Iterator[Op]:
        return iter(self.ops)

    @property
    def total_flops(self) -> float:
        return float(sum(op.flops * op.repeat for op in self.ops))

    def flops_by_phase(self) -> dict[str, float]:
        # bincount adds the weights in index order: the same sums as a loop over the ops
        t = self.table()
        sums = np.bincount(t.phase, weights=t.flops, minlength=len(PHASES))
        return {p: float(sums[k]) for k, p in enumerate(PHASES)}

    def ops_by_phase(self) -> dict[str, int]:
        out = dict.fromkeys(PHASES, 0)
        for op in self.ops:
            out[op.phase] += 1
        return out

    def input_values(self) -> list[Value]:
        return [self.values[v] for v in self.inputs]

    def input_bytes(self) -> int:
        return sum(self.values[v].nbytes for v in self.inputs)

    def find(self, *, primitive: str | None = None, module: str | None = None,
             phase: str | None = None) -> list[Op]:
        """Ops matching all given filters; `module` matches the path or any sub-module of it."""
        out = []
        for op in self.ops:
            if primitive is not None and op.primitive != primitive:
                continue
            if phase is not None and op.phase != phase:
                continue
            if module is not None and not (op.module == module or op.module.startswith(module + "/")):
                continue
            out.append(op)
        return out

    def predecessors(self, op: Op) -> list[int]:
        """Indices of the ops producing this op's inputs."""
        return sorted({p for v in op.inputs if (p := self.values[v].producer) is not None})

    def successors(self, op: Op) -> list[int]:
        return sorted({c for v in op.outputs for c in self.values[v].consumers})

    def to_networkx(self):
        """A networkx.DiGraph: one node per op index (attributes: the Op fields), one edge per
        producer→consumer value (attributes: value id, bytes)."""
        import networkx as nx

        g = nx.DiGraph()
        for op in self.ops:
            g.add_node(op.index, primitive=op.primitive, module=op.module, phase=op.phase,
                       flops=op.flops, bytes=op.bytes, repeat=op.repeat)
        for op in self.ops:
            for v in op.outputs:
                val = self.values[v]
                for c in val.consumers:
                    g.add_edge(op.index, c, value=v, bytes=val.nbytes)
        return g

    def summary(self) -> str:
        by_phase = self.ops_by_phase()
        phases = ", ".join(f"{k} {v}" for k, v in by_phase.items() if v)
        return (f"OpGraph {self.name or ''}: {len(self.ops)} ops ({phases}), "
                f"{len(self.inputs)} inputs ({self.input_bytes() / 2**20:.1f} MiB), "
                f"{self.total_flops / 1e9:.3g} GFLOP per step")

    def __repr__(self) -> str:
        return f"<{self.summary()}>"


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off while a planner runs: a traced step of 50k ops is ~500k
    tracked objects, and every full collection the planner's allocations trigger walks them all (a
    third of a 96-layer tensor plan's time). What a planner allocates is freed by reference counting;
    a collection runs as usual once the outermost pause ends."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def inputs_with_role(graph: OpGraph, role: str) -> list[int]:
    """The program inputs with `role` ("parameter", "state", "buffer", "rng" or "data"), in input order (do
    not modify).
    The inputs are sorted by role once per graph: a deep step has thousands of parameters and optimizer
    moments, and the passes asking for its data inputs or its parameters should not visit them all."""
    hit = graph.cache.get("inputs by role")
    if hit is None or hit[0] != len(graph.inputs):
        by_role: dict[str, list[int]] = {}
        for v in graph.inputs:
            by_role.setdefault(graph.values[v].role, []).append(v)
        hit = graph.cache["inputs by role"] = (len(graph.inputs), by_role)
    return hit[1].get(role, [])


def traced_batch(graph: OpGraph) -> int:
    """The batch the step was traced with: the most common leading dim of its data inputs (1 without any)."""
    dims = Counter(graph.values[v].shape[0] for v in inputs_with_role(graph, "data") if graph.values[v].shape)
    return int(dims.most_common(1)[0][0]) if dims else 1


def fingerprint(graph: OpGraph) -> str:
    """Identity of a traced step, covering everything a plan is bound to: its inputs and outputs
    (keypaths, shapes, dtypes: the plan's in/out shardings) and the op sequence (shapes, dtypes and
    the modules that name its activation constraints). Two steps alike in inputs and ops but not in
    what they return (one also returns the gradients) must not share a plan."""
    h = hashlib.sha1()
    _hash_values(h, [str(graph.values[v].keypath) for v in graph.inputs], graph, graph.inputs)
    h.update(b"->")
    _hash_values(h, graph.output_keypaths, graph, graph.outputs)
    h.update(b"|")
    # the op sequence as the table's columns: module and signature (primitive, shapes, dtypes) ids per op,
    # and what each id stands for (ids number items in order of first appearance: the same program, the
    # same ids, on every host)
    t = graph.table()
    h.update(t.module.astype("<i4").tobytes())
    h.update("\n".join(t.modules).encode())
    h.update(b"|")
    h.update(t.sig.astype("<i4").tobytes())
    h.update(";".join(f"{p}{a}{b}{c}{d}" for p, a, b, c, d in t.sigs).encode())
    return h.hexdigest()[:16]


def _hash_values(h, names: Sequence[str], graph: OpGraph, vids: Sequence[int]) -> None:
    """Feed values' names, shapes and dtypes to the hash `h`, each field as one string or array."""
    vals = [graph.values[v] for v in vids]
    shapes = [val.shape for val in vals]
    h.update("\n".join(names).encode())
    h.update(np.fromiter(map(len, shapes), dtype="<i8", count=len(shapes)).tobytes())
    h.update(np.fromiter(itertools.chain.from_iterable(shapes), dtype="<i8").tobytes())
    h.update("\n".join([val.dtype for val in vals]).encode())


def op_keys(graph: OpGraph) -> list[str]:
    """A stable name per op: "<module>/<primitive>:<k>", the k-th op of that primitive attributed to
    that module in program order ("<root>" outside every module). Unlike op indices, keys survive
    unrelated changes elsewhere in the program and read well in a plan file."""
    return keys_in_order((op.module, op.primitive) for op in graph.ops)


def op_keys_of(graph: OpGraph, ops: Iterable[int]) -> dict[int, str]:
    """`op_keys(graph)[i]` for the ops `ops` only: each op's rank among the earlier ops of its (module,
    primitive) pair, from the table's columns (a stable sort by pair)."""
    mine = np.unique(ops if isinstance(ops, np.ndarray) else np.fromiter(ops, dtype=np.int64))
    if not len(mine):
        return {}
    t = graph.table()
    n = int(mine[-1]) + 1                # a key counts the ops before it only
    pair = t.module[:n].astype(np.int64) * len(t.primitives) + t.primitive[:n]
    order = np.argsort(pair, kind="stable")
    sorted_pair = pair[order]
    starts = np.flatnonzero(np.r_[True, sorted_pair[1:] != sorted_pair[:-1]])
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n) - np.repeat(starts, np.diff(np.r_[starts, n]))
    names = [m or "<root>" for m in t.modules]
    pairs = pair[mine].tolist()
    n_prims = len(t.primitives)
    pre = {p: f"{names[p // n_prims]}/{t.primitives[p % n_prims]}:" for p in set(pairs)}   # once per pair
    return {i: pre[p] + str(k) for i, p, k in zip(mine.tolist(), pairs, rank[mine].tolist(), strict=True)}


def keys_in_order(ops: Iterable[tuple[str, str]]) -> list[str]:
    """`op_keys` of any (module, primitive) sequence in program order (a loss jaxpr's eqns, say)."""
    seen: dict[tuple[str, str], int] = {}
    out = []
    for module, primitive in ops:
        key = (module or "<root>", primitive)
        k = seen.get(key, 0)
        seen[key] = k + 1
        out.append(f"{key[0]}/{key[1]}:{k}")
    return out
