"""Logical dimensions ("factors") of a traced step (pure: no jax import).

Every dimension of every tensor belongs to a factor: a class of dimensions that must be split the
same way for the program to run without resharding. Ops link dimensions: elementwise ops link equal
dimensions of operands and result, a matmul links batch dims, free dims to the result and the two
contracting dims to each other, a reshape links the major dims of each merged/split group (sharding
heads*head_dim on n devices = sharding heads), and so on. The factors of a transformer are few —
batch, sequence, model dim, heads, ffn, vocab — and a sharding plan is an assignment of mesh axes
to factors (MaxText's "logical axis rules", found instead of written).

Each op is then described by the factors that split its iteration space (`loop`) and those it sums
or maxes over (`reduced`): splitting a reduced factor leaves a partial result that needs an
all-reduce. That one rule covers the forward partial sums of row-parallel matmuls, the backward
all-reduce of activation gradients in Megatron's column-parallel layers and the data-parallel
gradient all-reduce (the weight-gradient matmul contracts over the batch).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from ..core.graph import PHASES, Op, OpGraph, nbytes
from ..core.optable import PHASE_CODES, OpTable
from .link_rules import _KNOWN, _LOOKUPS, _WINDOWED, REDUCTIONS, _dn5, _key, _link_op, _reshape_groups, _UnionFind


@dataclasses.dataclass(frozen=True, slots=True)
class OpFactors:
    """How an op's work divides when factors are split."""

    op: int
    loop: frozenset[int]          # factors that split the iteration space
    reduced: frozenset[int]       # split → partial result → all-reduce of the output
    out_factors: tuple            # factor (or None) per output dim
    out_bytes: int                # full size of the first output
    gathered: tuple               # operands an unknown op needs whole: ((bytes, factors), ...)
    known: bool
    in_factors: tuple = ()        # factor (or None) per dim of each input, as this op reads it (after cuts)
    # a reshape merging dims: (input bytes, factors of the merged-away minor dims, factors of the rest).
    # No sharding of the merged dim keeps a minor dim's split ((H, hd) split on hd is not a contiguous
    # block of H*hd), so XLA all-gathers the input over a minor dim's axes first
    regathered: tuple = ()


def _windowed_factors(op: Op, ins: list[tuple]) -> list[int]:
    """The factors of `op`'s input dims a window wider than one element slides over (see FactorGraph.repeated)."""
    if op.primitive == "conv_general_dilated" and "lhs_spec" in op.params and len(ins) > 1:
        lhs, rhs = op.params["lhs_spec"], op.params["rhs_spec"]
        kernel = op.in_shapes[1]
        return [ins[0][d] for d, k in zip(lhs[2:], rhs[2:], strict=False)
                if kernel[k] > 1 and ins[0][d] is not None]
    window = op.params.get("window_dimensions")
    if op.primitive in _WINDOWED and window and ins:
        return [f for f, w in zip(ins[0], window, strict=False) if w > 1 and f is not None]
    return []


@dataclasses.dataclass
class FactorGraph:
    """Factors of a subgraph: per value dim, the factor id (None for size-1 dims), and per op its
    OpFactors. `factor_sizes[f]` lists the sizes of the dims in factor f."""

    graph: OpGraph
    op_factors: dict[int, OpFactors]
    factor_of: dict[tuple[int, int], int]
    factor_sizes: dict[int, list[int]]
    # never split: factors appearing twice in one tensor, and a window's dims (a convolution's or a
    # pooling's spatial dims under a window wider than one: a split needs halo exchanges between
    # neighbouring devices, which XLA's SPMD partitioner adds as collective-permutes and no cost here prices)
    repeated: frozenset[int]
    cooccur: dict[int, frozenset[int]]
    unknown_ops: list[int]
    # region boundaries (expert parallelism): values whose consumers see them with their own factors,
    # (value, factors as produced, factors as consumed); the plan reshards them when the two differ
    cuts: tuple[tuple[int, tuple, tuple], ...] = ()
    # per cut value, the ops reading it in its consumed layout (the others read it as produced)
    cut_readers: dict[int, frozenset[int]] = dataclasses.field(default_factory=dict)
    # the residual stream's token dims cut from tensor-parallel regions (sequence parallelism splits them)
    sequence: frozenset[int] = frozenset()
    expert_cuts: frozenset[int] = frozenset()     # the values cut at MoE dispatch / combine
    repeat_cuts: frozenset[int] = frozenset()     # the values cut where attention repeats its kv heads
    # evaluator summaries built over this graph, by what they depend on (tensor.evaluator): the 3-D
    # search builds the same ones for every submesh shape whose candidate factors agree
    builds: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def value_factors(self, value: int, rank: int | None = None) -> tuple:
        shape = self.graph.values[value].shape
        rank = len(shape) if rank is None else rank
        lead, get = len(shape) - rank, self.factor_of.get
        # _key inlined: called for every input and op operand
        return tuple([get((value, d - rank)) if shape[lead + d] != 1 else None for d in range(rank)])

    def factored_inputs(self) -> tuple[int, ...]:
        """The program inputs with a factor on some dim, in input order: those the analysed ops read (a
        deep step's other layers' weights have none), so loops over the factors of inputs skip them."""
        key = ("factored inputs", id(self.factor_of))
        hit = self.builds.get(key)
        if hit is None or hit[0] is not self.factor_of:
            have = {v for v, _ in self.factor_of}
            hit = self.builds[key] = (self.factor_of, tuple(v for v in self.graph.inputs if v in have))
        return hit[1]

    def divides(self, factor: int, n: int) -> bool:
        # a factor's sizes repeat once per dim it names (thousands for the residual stream): distinct once
        distinct = self.builds.get(("distinct sizes", factor))
        if distinct is None:
            distinct = self.builds[("distinct sizes", factor)] = frozenset(self.factor_sizes.get(factor, ()))
        return all(s % n == 0 for s in distinct)

    def factor_size(self, factor: int) -> int:
        return max(self.factor_sizes.get(factor, [1]))


def link_factors(graph: OpGraph, ops: list[int], same_ops: Sequence[tuple[int, int]] = (),
                 subs: dict[int, dict[int, tuple[int, int]]] | None = None,
                 kept: dict[int, tuple[int, ...]] | None = None,
                 joined: Sequence[tuple[tuple[int, int], tuple[int, int]]] = ()) -> FactorGraph:
    """The factors of the subgraph made of `ops` (sorted indices). `same_ops` pairs ops of two
    instances of one block type that correspond; their dims are linked so instances share factors.

    Region cuts (see regions.py): some consumers read a value under a cut id of its own (`subs`: op ->
    operand position -> (value, cut id)), so its dims there take factors of their own; `kept`: per cut
    id, the dims (right-aligned, negative) that stay linked with the value as produced; `joined`: pairs
    of (value or cut id, right-aligned dim) linked besides."""
    subs = subs or {}

    def inputs_of(i: int) -> tuple:
        op = graph.ops[i]
        sub = subs.get(i)
        return op.inputs if not sub else tuple(sub[k][1] if k in sub else v for k, v in enumerate(op.inputs))

    uf = _linked_dims(graph, ops, same_ops, subs, kept or {}, joined, inputs_of)
    ids = _FactorIds(uf)
    op_factors: dict[int, OpFactors] = {}
    unknown: list[int] = []
    for i in ops:
        op = graph.ops[i]
        ins = [ids.register(v, s) for v, s in zip(inputs_of(i), op.in_shapes, strict=True)]
        outs = [ids.register(v, s) for v, s in zip(op.outputs, op.out_shapes, strict=True)]
        op_factors[i] = _op_factors(op, ins, outs, ids.cooccur)
        if not op_factors[i].known:
            unknown.append(i)
        ids.repeated.update(_windowed_factors(op, ins))
    return FactorGraph(graph, op_factors, ids.factor_of, ids.sizes, frozenset(ids.repeated),
                       {f: frozenset(c) for f, c in ids.cooccur.items()}, unknown)


def _linked_dims(graph: OpGraph, ops: list[int], same_ops: Sequence[tuple[int, int]], subs: dict, kept: dict,
                 joined: Sequence, inputs_of: Callable[[int], tuple]) -> _UnionFind:
    """Dims linked by the ops' rules, the cuts' kept dims, `joined` and corresponding ops."""
    uf = _UnionFind()
    values = graph.values
    for i in ops:
        op = graph.ops[i]
        _link_op(uf, op if i not in subs else dataclasses.replace(op, inputs=inputs_of(i)), values)
    cut_value = {cid: v for per_op in subs.values() for v, cid in per_op.values()}
    for cid, dims in kept.items():
        for d in dims:
            uf.union((cut_value[cid], d), (cid, d))
    for a, b in joined:
        uf.union(a, b)
    for a, b in same_ops:
        # corresponding ops play the same role: so do their results, their weights and the
        # activations they take from outside the block
        oa, ob = graph.ops[a], graph.ops[b]
        for va, vb, sa, sb in itertools.chain(
                zip(oa.outputs, ob.outputs, oa.out_shapes, ob.out_shapes, strict=False),
                zip(inputs_of(a), inputs_of(b), oa.in_shapes, ob.in_shapes, strict=False)):
            if sa == sb and (va < 0 or values[va].kind != "literal"):
                for d in range(len(sa)):
                    if sa[d] != 1:
                        uf.union(_key(va, d, len(sa)), _key(vb, d, len(sb)))
    return uf


class _FactorIds:
    """Dense factor ids in order of first appearance (deterministic), with each factor's dim sizes,
    the factors repeated within one tensor and those sharing a tensor."""

    def __init__(self, uf: _UnionFind) -> None:
        self.uf = uf
        self.roots: dict[tuple[int, int], int] = {}
        self.factor_of: dict[tuple[int, int], int] = {}
        self.sizes: dict[int, list[int]] = {}
        self.repeated: set[int] = set()
        self.cooccur: dict[int, set[int]] = {}
        self.registered: dict[tuple, tuple] = {}     # a value is read by its producer and every consumer

    def register(self, v: int, shape: tuple[int, ...]) -> tuple:
        hit = self.registered.get((v, shape))
        if hit is None:
            hit = self.registered[(v, shape)] = self._register(v, shape)
        return hit

    def _register(self, v: int, shape: tuple[int, ...]) -> tuple:
        out = []
        for d, size in enumerate(shape):
            if size == 1:
                out.append(None)
                continue
            k = _key(v, d, len(shape))
            f = self.roots.setdefault(self.uf.find(k), len(self.roots))
            self.factor_of[k] = f
            self.sizes.setdefault(f, []).append(size)
            out.append(f)
        present = [f for f in out if f is not None]
        if len(set(present)) < len(present):
            seen: set[int] = set()
            for f in present:
                if f in seen:
                    self.repeated.add(f)
                seen.add(f)
        for f in present:
            self.cooccur.setdefault(f, set()).update(present)
        return tuple(out)


def _op_factors(op: Op, ins: list[tuple], outs: list[tuple], cooccur: dict[int, set[int]]) -> OpFactors:
    known = op.primitive in _KNOWN
    reduced = _reduced_factors(op, ins, outs[0] if outs else ())
    loop = {f for fs in ins + outs for f in fs if f is not None}
    gathered: tuple = ()
    if not known:
        loop, reduced = set(), set()
        gathered = tuple((nbytes(s, d), fs) for s, d, fs in zip(op.in_shapes, op.in_dtypes, ins, strict=True)
                         if any(fs))
    if op.primitive in _LOOKUPS:
        # a lookup's table rows and its indices share no tensor, but one axis cannot split both:
        # each device would find only its own rows for its own indices
        for f in loop:
            cooccur.setdefault(f, set()).update(loop)
    out_shape = op.out_shapes[0] if op.out_shapes else ()
    out_dtype = op.out_dtypes[0] if op.out_dtypes else "float32"
    regathered: tuple = ()
    if op.primitive == "reshape" and ins:
        minor = set(_merged_minor_dims(op.in_shapes[0], out_shape))
        mf = frozenset(f for d, f in enumerate(ins[0]) if d in minor and f is not None)
        if mf:
            rest = frozenset(f for d, f in enumerate(ins[0]) if d not in minor and f is not None)
            regathered = ((nbytes(op.in_shapes[0], op.in_dtypes[0]), mf, rest),)
    return OpFactors(op.index, frozenset(loop), frozenset(reduced), outs[0] if outs else (),
                     nbytes(out_shape, out_dtype), gathered, known, tuple(ins), regathered)


def _merged_minor_dims(a: tuple[int, ...], b: tuple[int, ...]) -> list[int]:
    """Dims of `a` that a reshape to `b` merges into a more major dim: every dim but the first of a
    group of `a`'s dims whose product is one dim of `b` or a group of them (size-1 dims aside)."""
    return [d for dims_a, _ in _reshape_groups(a, b) for d in dims_a[1:] if a[d] != 1]


def weight_values(graph: OpGraph, ops: Iterable[int]) -> frozenset[int]:
    """Values computed from parameters alone (a kernel, its cast or reshape) among `ops` (sorted).
    Cached on the graph per ops: the analyses of one factor graph ask several times."""
    ops = tuple(ops)
    key = ("weight values", ops)
    hit = graph.cache.get(key)
    if hit is None:
        hit = graph.cache[key] = frozenset(_weight_values(graph, ops))
    return hit


def _weight_values(graph: OpGraph, ops: tuple[int, ...]) -> set[int]:
    weights = {v for v in graph.inputs if graph.values[v].role in ("parameter", "buffer")}
    for i in ops:
        op = graph.ops[i]
        if op.inputs and all(v in weights for v in op.inputs):
            weights.update(op.outputs)
    return weights


def _reduced_factors(op: Op, ins: list[tuple], out: tuple = ()) -> set[int]:
    p = op.primitive
    params = op.params
    if p == "dot_general" and "contracting" in params:
        (lc, _), _ = params["contracting"], params["batch"]
        return {ins[0][d] for d in lc if ins[0][d] is not None}
    if p in REDUCTIONS:
        return {ins[0][d] for d in params.get("axes", ()) if ins[0][d] is not None}
    if p == "gather" and "dimension_numbers" in params:
        _, _, start_index_map, _, _ = _dn5(params["dimension_numbers"])
        return {ins[0][d] for d in start_index_map if ins[0][d] is not None}
    if p in ("scatter-add", "scatter_add") and "dimension_numbers" in params:
        # updates are summed over their scatter dims, except those that are batching dims
        window, _, _, _, ibatch = _dn5(params["dimension_numbers"])
        upd = ins[2]
        scatter = [d for d in range(len(upd)) if d not in window]
        return {upd[d] for k, d in enumerate(scatter) if k not in ibatch and upd[d] is not None}
    if p == "conv_general_dilated" and "lhs_spec" in params:
        # a window sums over the input and kernel positions it does not keep (a strided conv's
        # input rows, a weight gradient's image positions), and over the input features
        ls, rs = params["lhs_spec"], params["rhs_spec"]
        summed = {ins[0][d] for d in ls[2:]} | {ins[1][d] for d in rs[2:]}
        if params.get("feature_group_count", 1) == 1:
            summed.add(ins[0][ls[1]])
        return summed - set(out) - {None}
    return set()


def factor_shards(factors: Sequence, axes_of: dict[int, tuple[str, ...]], sizes: dict[str, int]) -> int:
    """How many pieces a tensor with these dim factors is split into under an assignment."""
    n = 1
    for f in factors:
        if f is not None:
            for a in axes_of.get(f, ()):
                n *= sizes[a]
    return n


def size_of(shape: Sequence[int]) -> int:
    return int(np.prod(shape, dtype=np.int64)) if shape else 1


def corresponding_ops(graph: OpGraph, a: Sequence[int], b: Sequence[int],
                      phases: Sequence[str] = PHASES, a_cache: dict | None = None) -> list[tuple[int, int]]:
    """Pairs of ops of two instances of one block that do the same thing, phase by phase, matched
    on (primitive, shapes) in program order; instances that differ slightly (the first block's
    backward has no input gradient) still pair up everywhere else. `phases`: those phases' pairs only
    (each phase is matched on its own). `a_cache`: a dict kept for one `a` (a representative matched
    against every other instance), holding its per-phase ops and signatures."""
    side_a, side_b = corresponding_arrays(graph, a, b, phases, a_cache)
    return list(zip(side_a.tolist(), side_b.tolist(), strict=True))


def corresponding_arrays(graph: OpGraph, a: Sequence[int], b: Sequence[int], phases: Sequence[str] = PHASES,
                         a_cache: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """`corresponding_ops` as two aligned int64 arrays (a deep step's instance maps: no per-op Python)."""
    parts_a: list[np.ndarray] = []
    parts_b: list[np.ndarray] = []
    t = graph.table()
    arr_a = None
    arr_b = np.fromiter(b, dtype=np.int64, count=len(b))
    for phase in phases:
        hit = a_cache.get(phase) if a_cache is not None else None
        if hit is None:
            arr_a = np.fromiter(a, dtype=np.int64, count=len(a)) if arr_a is None else arr_a
            hit = _phase_signature(t, arr_a, phase)
            if a_cache is not None:
                a_cache[phase] = hit
        oa, sa = hit
        ob, sb = _phase_signature(t, arr_b, phase)
        if sa == sb:
            parts_a.append(oa)
            parts_b.append(ob)
            continue
        for ia, ib, size in _matching_blocks(sa, sb):
            parts_a.append(oa[ia:ia + size])
            parts_b.append(ob[ib:ib + size])
    empty = np.zeros(0, dtype=np.int64)
    return (np.concatenate(parts_a) if parts_a else empty), (np.concatenate(parts_b) if parts_b else empty)


def _phase_signature(t: OpTable, arr: np.ndarray, phase: str) -> tuple[np.ndarray, bytes]:
    """The ops of `phase` among the ops `arr` (of the graph whose table is `t`) and their (primitive, in shapes,
    out shapes) ids, in order (as bytes: compared and hashed at C speed; the ids stand for those tuples one to
    one)."""
    mine = arr[t.phase[arr] == PHASE_CODES[phase]] if len(arr) else arr
    return mine, t.kind[mine].tobytes()


@functools.lru_cache(maxsize=256)
def _matching_blocks(sa: bytes, sb: bytes) -> tuple[tuple[int, int, int], ...]:
    """difflib's matching blocks of two op signature sequences. The instances of a block differ from
    their representative in the same way (a 96-layer model asks ~190 times), so each distinct pair
    of sequences is matched once."""
    import difflib

    a, b = np.frombuffer(sa, dtype=np.int32).tolist(), np.frombuffer(sb, dtype=np.int32).tolist()
    return tuple(tuple(m) for m in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_matching_blocks())
