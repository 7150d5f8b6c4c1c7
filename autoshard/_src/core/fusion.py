"""Which ops XLA fuses into one GPU kernel, and the HBM bytes each op is priced for (pure: no jax import).

Pricing every jaxpr equation as a full read of its operands and a write of its result makes a
LayerNorm, a softmax or an Adam update 10-30 HBM passes; XLA runs each as one to three kernels
(XLA's GPU fusion passes: `GpuInstructionFusion` fuses producers into consumers, reductions take
their producers as an input fusion (also producers others read: multi-output), `FusionMerger`
and `GpuMultiOutputFusion` merge what is left;
the cuBLAS rewriter folds a bias add and an output convert into the GEMM's epilogue). The model
here follows those rules closely enough to count bytes and kernels:

* *alias* ops (reshape, squeeze, expand_dims, stop_gradient) are bitcasts: no kernel, no bytes;
  their consumers read the aliased value itself;
* *kernel* ops (matmuls, convolutions, gathers, scatters, sorts, scans, windows) are kernels of
  their own; a matmul also takes a single-consumer bias add or output convert as its epilogue;
* every other op is fusible: it joins the fusion of a consumer that is its only reader (in the
  same phase and loop), so a chain of elementwise ops, and the elementwise ops feeding a reduction,
  become one kernel; a reduction's result ends its fusion (its readers start a new one);
* broadcasts and iotas are recomputed inside each fusion that reads them, and so is an elementwise
  op whose inputs cost its readers fewer bytes than writing and re-reading its result (a convert
  read twice, a row's mean / n): XLA duplicates such producers into every consumer. A GEMM's
  epilogue is settled first (cuBLAS's rewriter runs before fusion); on a GPU the bytes a copy reads
  are counted through cheap producers to their sources (priority fusion's cost model); XLA:CPU's
  InstructionFusion copies only ops that are not expensive (exp, tanh, rsqrt, float division) and
  whose operands (broadcasts at full size) are no larger than their result.

A fusion reads each value produced outside it once and writes each of its results that something
outside it reads (or the program returns): those bytes are priced on the member op that reads or
writes them, so a plan that splits an op divides its bytes with it. Each fusion starts one kernel,
counted on its last op.

The decision rules (placement, duplication, GEMM epilogues) are in `core.fusion_rules`; this module
drives the passes.

What GPU fusion does beyond this (documented, not modelled): sibling multi-output fusion of two
reductions of one input (a LayerNorm backward's two sums read their input once on a GPU, twice
here), Triton softmax / GEMM fusions of newer XLA, and fusions XLA splits because they would be too
large. XLA:CPU fuses loops the same way but keeps some reductions unfused; the tests compare the
bytes with XLA:CPU's `cost_analysis()`.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Iterable

import numpy as np

from .fusion_rules import EPILOGUE_OPS, EXPENSIVE_OPS, GEMM_OPS, _Rules  # noqa: F401  (EXPENSIVE_OPS: re-exported)
from .graph import Op, OpGraph
from .liveness import is_live, live_ops

ALIAS_OPS = frozenset({"reshape", "squeeze", "expand_dims", "stop_gradient", "bitcast"})
_MAY_ALIAS = (ALIAS_OPS | {"transpose"}).__contains__      # find_inline takes a transpose into a matmul for a view
KERNEL_OPS = frozenset({
    "dot_general", "conv_general_dilated", "gather", "scatter", "scatter-add", "scatter_add",
    "scatter-mul", "scatter-min", "scatter-max", "sort", "argsort", "top_k", "cumsum", "cumprod",
    "cummax", "cummin", "cumlogsumexp", "reduce_window_sum", "reduce_window_max", "reduce_window_min",
    "reduce_window", "select_and_scatter_add", "select_and_gather_add", "dynamic_update_slice",
    "rng_bit_generator", "fft", "triangular_solve", "cholesky", "lu", "qr", "eigh", "svd",
    "custom_call", "psum", "all_gather", "all_to_all", "reduce_scatter", "ppermute", "pmax", "pmin",
})
REDUCE_OPS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
                        "reduce_xor", "argmax", "argmin"})
RECOMPUTED_OPS = frozenset({"broadcast_in_dim", "iota"})


@dataclasses.dataclass(frozen=True)
class Fusion:
    """Per op: `group` (the fusion it belongs to: the index of its last op; -1 for alias ops, dead
    ops and recomputed broadcasts, which run inside their readers), `bytes` (HBM bytes priced on it) and
    `launches` (kernels it starts: 1 on the last op of each fusion)."""

    group: np.ndarray
    bytes: np.ndarray
    launches: np.ndarray
    moved: tuple[tuple[int, ...], ...]      # per op: the values whose bytes it is priced for
    # attention re-priced as FlashAttention runs it (core.attention.flash_fusion); XLA's fusion leaves
    # them empty: per op a multiplier of its compute (None: 1), the ops whose bytes were replaced, the
    # values no longer materialised, and (value, backward op reading it) kept for the backward that the
    # traced program does not keep (the log-sum-exp)
    scale: np.ndarray | None = None
    overridden: frozenset[int] = frozenset()
    unsaved: frozenset[int] = frozenset()
    kept: tuple[tuple[int, int], ...] = ()

    def kernels(self) -> int:
        return int(self.launches.sum())

    def compute_scale(self, i: int) -> float:
        """The multiplier of op `i`'s compute (1 unless attention was re-priced as FlashAttention)."""
        return 1.0 if self.scale is None else float(self.scale[i])


def fusion(graph: OpGraph, gpu: bool = True) -> Fusion:
    """The fusion of `graph`'s ops (cached on the graph: graphs are not changed after tracing).
    `gpu`: XLA:GPU's normalisation fusion too (a row's reductions and the elementwise ops that use
    them in one kernel: softmax, LayerNorm), which XLA:CPU does not do."""
    key = ("fusion", gpu)
    hit = graph.cache.get(key)
    if hit is None:
        hit = graph.cache[key] = _Fuser(graph, gpu).run()
    return hit


def window_fusion(graph: OpGraph, gpu: bool, scope: tuple[int, ...], core: tuple[int, ...]) -> Fusion:
    """The fusion of the ops in `core` (sorted indices) for callers that read no other op's: that of
    the window `scope` (sorted, holding `core`) fused as a whole graph is, the ops outside it kept as
    they are traced (never fused, recomputed or viewed through). An op's fusion follows from its
    producers and readers and from theirs within one fusion, so a core padded by the neighbouring
    layers gets the whole graph's results (`tests/core/test_fusion_window.py` checks every zoo model
    op by op), unless a fusion of a core op, or one it reads from or writes to, reaches the window's
    edge (a gradient summed over every layer): then, and when it is cached already, the whole graph's
    fusion is returned. Ops outside `core`: no bytes, no group, or those of the whole graph."""
    full = graph.cache.get(("fusion", gpu))
    if full is not None:
        return full
    key = ("fusion", gpu, "window", scope, core)
    hit = graph.cache.get(key)
    if hit is None:
        fz = _Fuser(graph, gpu, scope)
        hit = fz.run()
        if not fz.settled(core):
            hit = fusion(graph, gpu)
        graph.cache[key] = hit
    return hit


class _Lazy(dict):
    """A per-op table computed on first use (a window touches few of a deep graph's ops)."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def __missing__(self, i: int):
        out = self[i] = self.fn(i)
        return out


def op_class(op: Op) -> str:
    """"alias", "kernel", "reduce", "recomputed" or "loop" (fusible elementwise / data movement)."""
    p = op.primitive
    if p in ALIAS_OPS and len(op.inputs) == 1 and len(op.outputs) == 1:
        return "alias"
    if p in KERNEL_OPS or p.startswith(("custom", "all_", "reduce_scatter")):
        return "kernel"
    if p in REDUCE_OPS:
        return "reduce"
    if p in RECOMPUTED_OPS:
        return "recomputed"
    return "loop"


class _Fuser(_Rules):
    """The fusion passes over a graph (or a window of it); the decision rules are `_Rules`'
    (`core.fusion_rules`)."""

    def __init__(self, graph: OpGraph, gpu: bool, scope: tuple[int, ...] | None = None) -> None:
        self.g, self.gpu = graph, gpu
        ops = graph.ops
        n = len(ops)
        # the ops fused (all, or a window: window_fusion); tables are lazy for a window
        self.scope = range(n) if scope is None else scope
        self.inside = self.scope if scope is None else frozenset(scope)
        # dead ops (XLA deletes them) read nothing and start nothing
        if scope is None:
            live = live_ops(graph)
            self.cls = [op_class(op) if live[op.index] else "dead" for op in ops]
            self.has_gemm = [op.primitive in GEMM_OPS for op in ops]
        else:
            alive, inside, values = is_live(graph), self.inside, graph.values
            # outside the window only an op with no reader is taken for dead (not one whose readers all
            # are): a value read across the step (an optimizer's bias correction, by every update) would
            # walk each reader's chain to its root
            self.cls = _Lazy(lambda i: op_class(ops[i]) if (alive(i) if i in inside else (
                any(values[v].consumers for v in ops[i].outputs) or alive(i))) else "dead")
            self.has_gemm = _Lazy(lambda i: ops[i].primitive in GEMM_OPS)
        self.parent = list(range(n)) if scope is None else _Lazy(lambda i: i)
        self.outputs = set(graph.outputs)
        self.reader_cache: dict[int, frozenset[int]] = {}
        self.producer_cache: dict[int, frozenset[int]] = {}
        self.reads_cache: dict[int, tuple[int, ...]] = {}
        self.sources_cache: dict[tuple[int, int], frozenset[int]] = {}
        self.epilogue_cache: dict[int, int | None] = {}
        self.bytes_cache: dict[int, int] = {}

    # --- aliases -----------------------------------------------------------------------------
    def source(self, v: int) -> int:
        """The value `v` is a view of (through alias ops)."""
        while True:
            p = self.g.values[v].producer
            if p is None or self.cls[p] != "alias":
                return v
            v = self.g.ops[p].inputs[0]

    def producers(self, v: int) -> frozenset[int]:
        """The ops whose results a read of `v` touches: its producer, or, through a broadcast that
        runs inside its reader, that broadcast's producers. Cached: asked only after `find_inline`
        (kinds and `inline` settled); a broadcast chain is walked once, not once per reader."""
        hit = self.producer_cache.get(v)
        if hit is None:
            p = self.g.values[self.source(v)].producer
            if p is None:
                hit = frozenset()
            elif self.inline[p]:
                hit = frozenset().union(*(self.producers(w) for w in self.g.ops[p].inputs))
            else:
                hit = frozenset((p,))
            self.producer_cache[v] = hit
        return hit

    def readers(self, v: int) -> frozenset[int]:
        """Ops reading `v`, looking through alias ops and through the broadcasts and iotas that run
        inside their readers (`inline`). Cached: asked only once every reader's kind is settled
        (`find_inline` decides from the last op back)."""
        hit = self.reader_cache.get(v)
        if hit is None:
            hit = self.reader_cache[v] = frozenset(self._readers(v))
        return hit

    def _readers(self, v: int) -> set[int]:
        # through a view or an inlined broadcast: its results' readers, cached too (their readers come
        # later in program order, so their kinds are settled whenever `v`'s are)
        out: set[int] = set()
        cls, inline = self.cls, self.inline
        for c in self.g.values[v].consumers:
            if cls[c] == "alias" or inline[c]:
                for w in self.g.ops[c].outputs:
                    out |= self.readers(w)
            elif cls[c] != "dead":
                out.add(c)
        return out

    def returned(self, v: int) -> bool:
        """Is `v` (or a view of it) a program output?"""
        stack = [v]
        ops = self.g.ops
        while stack:
            w = stack.pop()
            if w in self.outputs:
                return True
            # a view is an alias op or a transpose read as one: the others' kinds are not asked (a value read by
            # every layer would classify each reader)
            stack.extend(o for c in self.g.values[w].consumers
                         if _MAY_ALIAS(ops[c].primitive) and self.cls[c] == "alias" for o in ops[c].outputs)
        return False

    def find_inline(self) -> list[bool]:
        """Broadcasts and iotas every reader of which is a fusion in their place (or another such
        broadcast): they run inside their readers. Decided last op first, so chains resolve."""
        ops = self.g.ops
        self.inline = [False] * len(ops)
        for i in reversed(self.scope):
            op = ops[i]
            kind = self.cls[i]
            if kind not in ("recomputed", "loop") or any(self.returned(v) for v in op.outputs):
                continue
            readers = set().union(*(self.readers(v) for v in op.outputs))
            if op.primitive == "transpose" and readers and all(ops[r].primitive in GEMM_OPS for r in readers):
                self.cls[op.index] = "alias"       # a matmul reads its operand in either layout
                continue
            if kind == "loop" and (self._epilogue_of(op) is not None or not self._duplicable(op)
                                   or not self._cheaper_to_recompute(op, readers)):
                continue              # cuBLAS's rewriter folds an epilogue into its GEMM before fusion runs
            self.inline[op.index] = bool(readers) and all(
                self.cls[r] in ("loop", "reduce") and self.same_place(ops[r], op) for r in readers)
        self.epilogue_cache.clear()        # asked again once every kind is settled (views found above)
        return self.inline

    # --- grouping ----------------------------------------------------------------------------
    def find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def union_into(self, producer: int, consumer: int) -> None:
        a, b = self.find(producer), self.find(consumer)
        if a != b:
            self.parent[a] = b
            self.has_gemm[b] = self.has_gemm[b] or self.has_gemm[a]

    def sole_reader(self, p: int) -> int | None:
        """The one op reading all of `p`'s outputs, if there is one (a returned output is also
        written by the fusion, as a second result)."""
        outs = self.g.ops[p].outputs
        readers = self.readers(outs[0]) if len(outs) == 1 else frozenset().union(*map(self.readers, outs))
        return next(iter(readers)) if len(readers) == 1 else None

    def group(self) -> None:
        ops = self.g.ops
        scope = [ops[i] for i in self.scope]
        for op in scope:
            c = op.index
            kind = self.cls[c]
            if kind in ("loop", "reduce", "recomputed"):
                # an epilogue: a GEMM's single-consumer bias add or output convert
                if op.primitive in EPILOGUE_OPS:
                    self._epilogue(op)
                continue
        for op in scope:
            c = op.index
            if self.cls[c] not in ("loop", "reduce"):
                continue
            for p in set().union(*(self.producers(v) for v in op.inputs)):
                if self.cls[p] != "loop" or not self.same_place(ops[p], op):
                    continue
                if self.has_gemm[self.find(p)] and self.find(p) != self.find(c):
                    continue          # a GEMM's epilogue ends with the GEMM's kernel
                if self.sole_reader(p) == c:
                    self.union_into(p, c)
        for op in scope:
            if self.cls[op.index] == "reduce":
                self._multi_output(op)

    def _multi_output(self, r: Op) -> None:
        """A reduction takes in a producer that others read too (XLA's multi-output fusion: the
        softmax's exp feeds its sum and its division): the producer's result is written once, for
        the others, and not read back by the reduction. Not when another reader of the producer
        leads to the reduction (the fusion would wait on itself)."""
        for p in set().union(*(self.producers(v) for v in r.inputs)):
            if self.cls[p] != "loop" or self.find(p) != p or self.find(p) == self.find(r.index) \
                    or self.has_gemm[p] or not self.same_place(self.g.ops[p], r):
                continue
            others = set().union(*(self.readers(w) for w in self.g.ops[p].outputs)) - {r.index}
            if not self.depends(r.index, others):
                self.union_into(p, r.index)

    def depends(self, r: int, targets: set[int]) -> bool:
        """Does op `r` depend on any op in `targets`? Ops come in program order, so only ancestors
        after the first target can lead to one; the lowest index is expanded first, which reaches a
        forward op read again in the backward pass without walking every later layer (those pairs
        made the whole-set walk quadratic in depth)."""
        if not targets:
            return False
        floor = min(targets)
        seen: set[int] = set()
        heap = [r]
        while heap:
            for v in self.g.ops[heapq.heappop(heap)].inputs:
                q = self.g.values[v].producer
                if q is not None and q >= floor and q not in seen:
                    if q in targets:
                        return True
                    seen.add(q)
                    heapq.heappush(heap, q)
        return False

    def _epilogue(self, op: Op) -> None:
        p = self._epilogue_of(op)
        if p is not None:
            self.union_into(p, op.index)

    # --- bytes -------------------------------------------------------------------------------
    def reads(self, v: int) -> tuple[int, ...]:
        """The materialised values a read of `v` touches (a broadcast run in place reads its input;
        literals are immediates). Cached, as `producers`."""
        hit = self.reads_cache.get(v)
        if hit is None:
            hit = self.reads_cache[v] = tuple(self._reads(v))
        return hit

    def _reads(self, v: int) -> Iterable[int]:
        v = self.source(v)
        p = self.g.values[v].producer
        if p is not None and self.inline[p]:
            for w in self.g.ops[p].inputs:
                yield from self.reads(w)
        elif self.g.values[v].kind != "literal":
            yield v

    def normalisation_diamonds(self) -> None:
        """XLA:GPU's normalisation fusion (Triton softmax rewriter): a reduction of a row and the
        fusion that combines its result with the same row again (softmax's max, sum and divide;
        LayerNorm's mean, variance and scaling) run as one kernel that reads the row once. Not when
        the reduction's result also feeds, through other ops, the fusion itself."""
        ops = self.g.ops
        self.member_lists: dict[int, list[int]] = {}
        for i in self.scope:
            self.member_lists.setdefault(self.find(i), []).append(i)
        for r in self.scope:
            op = ops[r]
            if self.cls[r] != "reduce" or self.find(r) != r or not self.row_reduction(op):
                continue
            # the row: what the reduction's fusion reads, or makes and reduces (a masked score row)
            reads_r = self.group_reads(r) | {v for i in self.members(r) for v in self.g.ops[i].outputs}
            for c in sorted(set().union(*(self.readers(v) for v in op.outputs))):
                if c not in self.inside:
                    continue                  # a window's edge (window_fusion)
                root = self.find(c)
                if self.cls[c] not in ("loop", "reduce") or root == r or self.has_gemm[root] \
                        or not self.same_place(ops[c], op) or not reads_r & self.group_reads(root):
                    continue
                others = set().union(*(self.readers(v) for v in op.outputs)) - set(self.members(root))
                if not self.depends(root, others):
                    self.union_into(r, root)
                    self.member_lists[root] += self.member_lists.pop(r)
                    break

    def members(self, root: int) -> list[int]:
        return self.member_lists[root]

    def group_reads(self, root: int) -> set[int]:
        """The materialised values the fusion rooted at `root` reads from outside."""
        mine = set(self.members(root))
        out: set[int] = set()
        for i in mine:
            for v in self.g.ops[i].inputs:
                for w in self.reads(v):
                    if self.g.values[w].producer not in mine and self.g.values[w].nbytes > 64:
                        out.add(w)
        return out

    def settled(self, core: Iterable[int]) -> bool:
        """After a window's `run`: does no fusion holding a `core` op hold one that could fuse with an
        op outside the window too (a fusion that may reach past the window's edge)?"""
        g, gl = self.g, self.gl
        edge: set[int] = set()
        for i in self.scope:
            if not self._crosses(i):
                continue
            if gl[i] >= 0:
                edge.add(gl[i])
            else:       # a view or an op run inside its readers: the fusions reading it and read by it
                edge.update(gl[j] for v in g.ops[i].outputs for j in self.readers(v))
                edge.update(gl[j] for v in g.ops[i].inputs for j in self.producers(v))
        return not any(gl[i] in edge for i in core)

    def _crosses(self, i: int) -> bool:
        """Could op `i` (in the window) fuse with an op outside it: a fusible or GEMM producer that
        only `i` reads (into `i`, or as its epilogue), a fusible reader that reads it alone, a
        reduction either way (multi-output and normalisation fusions), a view, a broadcast?"""
        g, inside, cls = self.g, self.inside, self.cls
        op = g.ops[i]
        for v in op.inputs:
            p = g.values[v].producer
            if p is None or p in inside or cls[p] == "dead" or (cls[p] == "kernel" and not self.has_gemm[p]):
                continue
            only = all(c == i for w in g.ops[p].outputs for c in g.values[w].consumers)
            if cls[p] in ("alias", "recomputed", "reduce") or cls[i] == "reduce" or only:
                return True
        outside = [c for v in op.outputs for c in g.values[v].consumers if c not in inside and cls[c] != "dead"]
        if not outside:
            return False
        sole = len(set().union(*(self.readers(v) for v in op.outputs))) == 1
        return any(cls[c] == "alias" or cls[c] == "reduce" or cls[i] == "reduce"
                   or (sole and cls[c] in ("loop", "recomputed")) for c in outside)

    def run(self) -> Fusion:
        inline = self.find_inline()
        self.group()
        if self.gpu:
            self.normalisation_diamonds()
        ops, n, scope = self.g.ops, len(self.g.ops), self.scope

        def gid(i: int) -> int:
            return -1 if self.cls[i] in ("alias", "dead") or inline[i] else self.find(i)
        # plain ints: indexing the array per read is slow (a window's: lazily, with the ops around it)
        gl = self.gl = [gid(i) for i in range(n)] if isinstance(scope, range) else _Lazy(gid)
        values = self.g.values
        moved: dict[int, list[int]] = {}
        seen: set[tuple[int, int]] = set()        # (fusion, value) reads already priced
        for i in scope:
            gi = gl[i]
            if gi < 0:
                continue
            mine = moved[i] = []
            op = ops[i]
            for v in op.inputs:
                for w in self.reads(v):
                    p = values[w].producer
                    if (p is None or gl[p] != gi) and (gi, w) not in seen:
                        seen.add((gi, w))
                        mine.append(w)
            for v in op.outputs:
                if self.returned(v) or any(gl[r] != gi for r in self.readers(v)):
                    mine.append(v)
        nbytes, launches = np.zeros(n), np.zeros(n)
        if isinstance(gl, list):
            group = np.array(gl)
        else:
            group = np.full(n, -1)
            group[list(scope)] = [gl[i] for i in scope]
        last: dict[int, int] = {}
        for i in scope:
            if gl[i] >= 0:
                last[gl[i]] = i
        for i, vs in moved.items():
            nbytes[i] = float(sum(values[v].nbytes for v in vs))
        launches[list(last.values())] = 1.0
        moved_t: list[tuple[int, ...]] = [()] * n
        for i, vs in moved.items():
            moved_t[i] = tuple(vs)
        return Fusion(group, nbytes, launches, tuple(moved_t))
