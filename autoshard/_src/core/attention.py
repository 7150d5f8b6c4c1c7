"""Attention cores recognised from structure, and priced as FlashAttention runs them (pure: no jax import).

A traced attention is whatever code wrote it: `jax.nn.dot_product_attention` on a CPU (jax traces
its XLA path: einsum + softmax; `implementation="cudnn"` cannot be traced without a GPU), flax's
`MultiHeadDotProductAttention`, or a hand-written einsum + `jax.nn.softmax`. All share one shape,
which is what is matched here, never names:

  scores = dot_general(q, k)   batch dims (batch, heads), contracting the head dim of both
  [scale, mask by select_n / additive bias]     elementwise, on the scores' [.., Sq, Skv] grid
  softmax                      reduce_max, sub, exp, reduce_sum, div (and converts)
  out = dot_general(p, v)      contracting the kv-sequence dim of the probabilities

and, under `value_and_grad`, its backward: the matmuls reading v / the probabilities (dP, dV), the
softmax's backward on the [Sq, Skv] grid, and the matmuls reading q and k (dq, dk).

`flash_fusion` re-prices each core as FlashAttention-2 runs it (Dao 2023, "FlashAttention-2: Faster
Attention with Better Parallelism and Work Partitioning", arXiv:2307.08691): the forward is one
kernel (Algorithm 1) that reads Q, K, V and writes O and the row log-sum-exp L (B x H x Sq floats),
the backward (Algorithm 2) reads Q, K, V, O, dO, L, writes dQ, dK, dV, and a pre-pass computes
D = rowsum(dO o O) (two kernels). No [B, H, Sq, Skv] tensor is read, written or saved: activation
memory keeps Q, K, V, O and L. Flops: the forward's two matmuls (4 B H Sq Skv D), halved when
causal (tiles above the diagonal are skipped); the backward 2.5x the forward's (five matmuls: the
four of the gradient and the recompute of the scores, §3.2 / the paper's flop count).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import numpy as np

from .fusion import Fusion, fusion
from .graph import Op, OpGraph
from .liveness import live_ops

# ops a value passes through unchanged in content (views and casts): q seen by the forward matmul and
# by the backward's dk matmul may differ by these
VIEW_OPS = frozenset({"reshape", "squeeze", "expand_dims", "stop_gradient", "bitcast", "transpose",
                      "convert_element_type", "copy", "copy_p"})
COMPARE_OPS = frozenset({"ge", "gt", "le", "lt"})
SOFTMAX_NEEDS = frozenset({"exp"})          # plus a row reduction (checked apart)
ROW_REDUCTIONS = frozenset({"reduce_max", "reduce_sum"})
# the backward is 2.5x the forward's matmul flops: five Sq x Skv x D matmuls against two (FlashAttention-2 §3.2)
BACKWARD_MATMULS = 2.5


@dataclasses.dataclass(frozen=True)
class AttentionCore:
    """One recognised attention. `forward` / `backward`: its op indices (the scores and values
    matmuls, the mask and softmax between them; their gradient); `q`, `k`, `v`, `out`: value ids
    as the matmuls read and write them; `dims`: (batch, heads, q_seq, kv_seq, head_dim); `lse`:
    the softmax's row statistic (a [.., Sq] forward value standing for the log-sum-exp FlashAttention
    keeps); `extra`: values the kernel reads besides q, k, v (an additive bias or a data mask)."""

    scores: int
    values: int
    forward: tuple[int, ...]
    backward: tuple[int, ...]
    q: int
    k: int
    v: int
    out: int
    dims: tuple[int, int, int, int, int]
    causal: bool
    lse: int
    extra: tuple[int, ...] = ()


def attention_cores(graph: OpGraph) -> tuple[AttentionCore, ...]:
    """Every attention core of `graph` (cached on it: a traced graph does not change)."""
    hit = graph.cache.get("attention")
    if hit is None:
        hit = graph.cache["attention"] = _Finder(graph).run()
    return hit


class _Finder:
    def __init__(self, graph: OpGraph) -> None:
        self.g = graph
        self.live = live_ops(graph)
        self.const_memo: dict[int, bool] = {}

    # --- small graph helpers ---------------------------------------------------------------------
    def root(self, v: int) -> int:
        """The value `v` is a view or cast of."""
        while True:
            p = self.g.values[v].producer
            if p is None or self.g.ops[p].primitive not in VIEW_OPS or len(self.g.ops[p].inputs) != 1:
                return v
            v = self.g.ops[p].inputs[0]

    def readers(self, v: int) -> list[int]:
        return [c for c in self.g.values[v].consumers if self.live[c]]

    def constant(self, v: int) -> bool:
        """Does `v` depend on no program input (iotas, literals, constants: a mask built in place)?"""
        hit = self.const_memo.get(v)
        if hit is not None:
            return hit
        stack, order = [v], []
        while stack:                  # iterative: mask chains can be long
            w = stack.pop()
            if w in self.const_memo:
                continue
            val = self.g.values[w]
            if val.producer is None:
                self.const_memo[w] = val.kind in ("literal", "const")
                continue
            pending = [u for u in self.g.ops[val.producer].inputs if u not in self.const_memo]
            if pending:
                stack.append(w)
                stack.extend(pending)
                order.append(w)
            else:
                self.const_memo[w] = all(self.const_memo[u] for u in self.g.ops[val.producer].inputs)
        return self.const_memo[v]

    def count(self, v: int) -> int:
        return math.prod(self.g.values[v].shape)

    # --- the forward core ------------------------------------------------------------------------
    def run(self) -> tuple[AttentionCore, ...]:
        out = []
        taken: set[int] = set()
        for op in self.g.ops:
            if op.index in taken or not self._scores_shape(op):
                continue
            core = self._core(op)
            if core is not None:
                out.append(core)
                taken.update(core.forward)
                taken.update(core.backward)
        return tuple(out)

    def _scores_shape(self, op: Op) -> bool:
        """A live forward matmul with batch dims and free dims on both sides (q-seq, kv-seq)."""
        if op.primitive != "dot_general" or op.phase != "forward" or not self.live[op.index]:
            return False
        (lc, rc), (lb, rb) = op.params.get("contracting", ((), ())), op.params.get("batch", ((), ()))
        if not lb or not lc:
            return False
        lfree = [d for d in range(len(op.in_shapes[0])) if d not in lc and d not in lb]
        rfree = [d for d in range(len(op.in_shapes[1])) if d not in rc and d not in rb]
        return bool(lfree) and bool(rfree) and math.prod(op.in_shapes[1][d] for d in rfree) > 1

    def _grid(self, v: int, n: int, rows: int) -> bool:
        """Is `v` on the scores' grid (n elements) or its rows (`rows` elements)?"""
        c = self.count(v)
        return c in (n, rows)

    def _spread(self, starts: Iterable[int], n: int, rows: int, phase: str) -> tuple[set[int], set[int]]:
        """(non-matmul ops reached from the values `starts` through live `phase` ops on the grid,
        matmuls reached): the softmax and mask region a scores tensor flows through."""
        region, matmuls = set(), set()
        stack = list(starts)
        seen: set[int] = set()
        while stack:
            v = stack.pop()
            for c in self.readers(v):
                op = self.g.ops[c]
                if c in seen or op.phase != phase:
                    continue
                seen.add(c)
                if op.primitive == "dot_general":
                    matmuls.add(c)
                elif op.outputs and all(self._grid(w, n, rows) for w in op.outputs):
                    region.add(c)
                    stack.extend(op.outputs)
        return region, matmuls

    def _ancestors_within(self, ends: Iterable[int], allowed: set[int]) -> set[int]:
        """Ops of `allowed` that the ops `ends` depend on."""
        out: set[int] = set()
        stack = list(ends)
        while stack:
            for v in self.g.ops[stack.pop()].inputs:
                p = self.g.values[v].producer
                if p is not None and p in allowed and p not in out:
                    out.add(p)
                    stack.append(p)
        return out

    def _core(self, s: Op) -> AttentionCore | None:
        n = self.count(s.outputs[0])
        (_, rc), (_, rb) = s.params["contracting"], s.params["batch"]
        rfree = [d for d in range(len(s.in_shapes[1])) if d not in rc and d not in rb]
        skv = math.prod(s.in_shapes[1][d] for d in rfree)
        rows = n // skv
        region, matmuls = self._spread(s.outputs, n, rows, "forward")
        for m in sorted(matmuls):
            values = self.g.ops[m]
            p_side = [i for i, w in enumerate(values.inputs) if self._from(w, region | {s.index})]
            if len(p_side) != 1 or not self._contracts_kv(values, p_side[0], n, skv):
                continue
            path = self._ancestors_within([m], region) | {s.index, m}
            if not self._softmax(path, n, rows):
                continue
            return self._finish(s, values, p_side[0], path, region, n, rows, skv)
        return None

    def _from(self, v: int, ops: set[int]) -> bool:
        p = self.g.values[v].producer
        return p is not None and p in ops

    def _contracts_kv(self, m: Op, p_idx: int, n: int, skv: int) -> bool:
        """The values matmul contracts the probabilities over the kv sequence (their Skv-sized dims)."""
        if self.count(m.inputs[p_idx]) != n:
            return False
        contracting = m.params["contracting"][p_idx]
        return math.prod(m.in_shapes[p_idx][d] for d in contracting) == skv

    def _softmax(self, path: set[int], n: int, rows: int) -> bool:
        """An exp on the grid and a row reduction of it: a softmax, not any batched matmul chain."""
        prims = {self.g.ops[i].primitive for i in path}
        reduces = any(self.g.ops[i].primitive in ROW_REDUCTIONS and self.count(self.g.ops[i].outputs[0]) == rows
                      for i in path)
        return SOFTMAX_NEEDS <= prims and reduces

    def _side_chain(self, v: int, core: set[int]) -> set[int]:
        """The ops building a constant value (a mask from iotas) that only this core reads: they run
        inside the kernel. Shared masks (built once for every layer) stay outside."""
        chain: set[int] = set()
        stack = [v]
        while stack:
            p = self.g.values[stack.pop()].producer
            if p is None or p in chain or p in core or not self.live[p]:
                continue
            if any(c not in core and c not in chain for w in self.g.ops[p].outputs for c in self.readers(w)):
                continue
            chain.add(p)
            stack.extend(self.g.ops[p].inputs)
        return chain

    def _finish(self, s: Op, m: Op, p_idx: int, path: set[int], region: set[int], n: int, rows: int,
                skv: int) -> AttentionCore:
        q, k = s.inputs
        v = m.inputs[1 - p_idx]
        extra, causal, masks = [], False, []
        for i in sorted(path):
            for w in self.g.ops[i].inputs:
                if self._from(w, path) or w in (q, k, v) or self.g.values[w].kind == "literal":
                    continue
                if self.constant(w):
                    causal |= self._masks(w)
                    masks.append(w)
                elif self.count(w) > 1:
                    extra.append(w)
                    causal |= self._masked_bias(w)
        for i in sorted(path):        # a mask applied by select_n inside the core (jnp.where on the scores)
            causal |= self._causal_select(self.g.ops[i])
        stats = [i for i in sorted(path) if self.g.ops[i].primitive in ROW_REDUCTIONS
                 and self.count(self.g.ops[i].outputs[0]) == rows]
        lse = self.g.ops[stats[-1]].outputs[0]
        core = AttentionCore(s.index, m.index, tuple(sorted(path)), (), q, k, v, m.outputs[0],
                             self._dims(s, rows, skv), causal, lse, tuple(dict.fromkeys(extra)))
        bwd = self._backward(core, n, rows)
        # forward ops on the grid that only the core reads (the softmax's residuals for its backward:
        # 1 / sum^2) and constant masks only the core reads are computed inside its kernels
        ops = path | bwd | self._residuals(region - path, path | bwd)
        for i in sorted(bwd):
            masks += [w for w in self.g.ops[i].inputs if not self._from(w, ops) and self.constant(w)]
        for w in masks:
            ops |= self._side_chain(w, ops)
        fwd = {i for i in ops if self.g.ops[i].phase == "forward"}
        return dataclasses.replace(core, forward=tuple(sorted(fwd)), backward=tuple(sorted(ops - fwd)))

    def _residuals(self, candidates: set[int], core: set[int]) -> set[int]:
        """Ops of `candidates` all of whose live readers are in the core (or such ops), last first."""
        out: set[int] = set()
        for i in sorted(candidates, reverse=True):
            readers = [c for w in self.g.ops[i].outputs for c in self.readers(w)]
            if readers and all(c in core or c in out for c in readers):
                out.add(i)
        return out

    def _masks(self, v: int) -> bool:
        """A constant value built by comparing positions (an iota-made causal mask or bias)."""
        return any(self.g.ops[i].primitive in COMPARE_OPS for i in self._producers(v))

    def _producers(self, v: int) -> set[int]:
        out: set[int] = set()
        stack = [v]
        while stack:
            p = self.g.values[stack.pop()].producer
            if p is not None and p not in out:
                out.add(p)
                stack.extend(self.g.ops[p].inputs)
        return out

    def _causal_select(self, op: Op) -> bool:
        """select_n(constant compare mask, ..) with one case constant (the fill) and one not (the
        scores or a bias): masking, as jnp.where(mask, x, -inf) traces. Both cases constant is a
        computation of positions (T5's relative buckets), not a mask."""
        if op.primitive != "select_n" or len(op.inputs) != 3:
            return False
        pred, *cases = op.inputs
        consts = [self.constant(c) for c in cases]
        return self.constant(pred) and self._masks(pred) and any(consts) and not all(consts)

    def _masked_bias(self, v: int) -> bool:
        """A data bias (T5's relative positions) masked causally on its way to the scores."""
        return any(self._causal_select(self.g.ops[i]) for i in self._producers_on_grid(v))

    def _producers_on_grid(self, v: int) -> set[int]:
        """Producers of `v` back through elementwise / broadcast ops (not through matmuls or gathers)."""
        out: set[int] = set()
        stack = [v]
        while stack:
            p = self.g.values[stack.pop()].producer
            if p is None or p in out or self.g.ops[p].primitive in ("dot_general", "gather"):
                continue
            out.add(p)
            stack.extend(self.g.ops[p].inputs)
        return out

    def _dims(self, s: Op, rows: int, skv: int) -> tuple[int, int, int, int, int]:
        """(batch, heads, q_seq, kv_seq, head_dim): the first batch dim is the batch when there are
        several; the q sequence is the largest free dim of q (a grouped-query group dim is heads)."""
        (lc, _), (lb, _) = s.params["contracting"], s.params["batch"]
        shape = s.in_shapes[0]
        batch = shape[lb[0]] if len(lb) > 1 else 1
        lfree = [shape[d] for d in range(len(shape)) if d not in lc and d not in lb]
        sq = max(lfree)
        head_dim = math.prod(shape[d] for d in lc)
        heads = rows // (batch * sq)
        return batch, heads, sq, skv, head_dim

    # --- the backward core -----------------------------------------------------------------------
    def _backward(self, core: AttentionCore, n: int, rows: int) -> set[int]:
        """The core's gradient: backward ops reading the forward core's inner values (probabilities,
        exps, mask), the matmul reading v on the grid (dP), what lies between them and the matmuls
        reading q or k (dq, dk)."""
        inner = {w for i in core.forward for w in self.g.ops[i].outputs} - {core.out}
        starts = {c for w in inner for c in self.readers(w) if self.g.ops[c].phase == "backward"}
        vroot = self.root(core.v)
        for c in self._readers_of_root(vroot):
            op = self.g.ops[c]
            if op.phase == "backward" and op.primitive == "dot_general" and self.count(op.outputs[0]) == n:
                starts.add(c)                                   # dP = dO v^T
        if not starts:
            return set()
        grid_starts = [w for c in starts for w in self.g.ops[c].outputs if self._grid(w, n, rows)]
        region, matmuls = self._spread(grid_starts, n, rows, "backward")
        qk = {self.root(core.q), self.root(core.k)}
        ends = {m for m in matmuls - starts if any(self.root(w) in qk for w in self.g.ops[m].inputs)}
        between = self._ancestors_within(ends, region | starts)
        return starts | ends | between

    def _readers_of_root(self, r: int) -> set[int]:
        """Live readers of `r` or of any view of it."""
        out: set[int] = set()
        stack = [r]
        while stack:
            for c in self.readers(stack.pop()):
                op = self.g.ops[c]
                if op.primitive in VIEW_OPS and len(op.inputs) == 1:
                    stack.extend(op.outputs)
                else:
                    out.add(c)
        return out


def recomputed_ops(graph: OpGraph, core: AttentionCore) -> frozenset[int]:
    """The forward ops selective recompute re-runs in the backward pass (Korthikanti et al. 2022,
    arXiv:2205.05198 §4): the scores matmul, scale / mask / bias, softmax and dropout of `core`, all
    but the values matmul, whose output the backward keeps. Dropout's random bits (drawn on the grid
    from a key, not from the scores) join when only the core reads them: regenerated, not saved."""
    out = set(core.forward) - {core.values}
    n = math.prod(graph.values[graph.ops[core.scores].outputs[0]].shape)
    stack = [w for i in out for w in graph.ops[i].inputs]
    while stack:
        p = graph.values[stack.pop()].producer
        if p is None or p in out or graph.ops[p].phase != "forward" or graph.ops[p].primitive == "dot_general":
            continue
        op = graph.ops[p]
        grid = all(math.prod(graph.values[w].shape) == n for w in op.outputs)
        readers = {c for w in op.outputs for c in graph.values[w].consumers if graph.ops[c].phase == "forward"}
        if grid and readers <= out:
            out.add(p)
            stack.extend(op.inputs)
    return frozenset(out)


def selective_ops(graph: OpGraph) -> frozenset[int]:
    """`recomputed_ops` of every attention core of `graph` (cached: empty without attention)."""
    hit = graph.cache.get("selective")
    if hit is None:
        hit = graph.cache["selective"] = frozenset().union(*(recomputed_ops(graph, c) for c in attention_cores(graph)))
    return hit


# --- pricing ---------------------------------------------------------------------------------------
LSE_ITEMSIZE = 4          # FlashAttention keeps the log-sum-exp in float32


def flash_fusion(graph: OpGraph, fused: Fusion, cores: Iterable[AttentionCore] | None = None) -> Fusion:
    """`fused` with every attention core priced as FlashAttention-2 runs it (module docstring):
    each core's forward bytes and kernel on its values matmul, its backward's on its last op, 0 on
    its other ops; per-op compute scaled (causal halves, the backward's recompute), the grid values
    no longer materialised (`unsaved`) and the log-sum-exp / output the backward reads (`kept`)."""
    cores = tuple(attention_cores(graph) if cores is None else cores)
    n = len(graph.ops)
    nbytes, launches = fused.bytes.copy(), fused.launches.copy()
    scale = np.ones(n) if fused.scale is None else fused.scale.copy()
    over, unsaved, kept = set(fused.overridden), set(fused.unsaved), list(fused.kept)
    live = live_ops(graph)
    for c in cores:
        ops = set(c.forward) | set(c.backward)
        made = {w for i in ops for w in graph.ops[i].outputs}
        written = _written(graph, live, ops, made)
        inner = made - written
        lse = _lse_bytes(graph, c)
        fwd_written = sum(graph.values[w].nbytes for w in written if graph.values[w].producer in c.forward)
        bwd_written = sum(graph.values[w].nbytes for w in written if graph.values[w].producer in c.backward)
        read_qkv = sum(graph.values[w].nbytes for w in (c.q, c.k, c.v)) + sum(_source_bytes(graph, w) for w in c.extra)
        out_b = graph.values[c.out].nbytes
        for i in ops:
            nbytes[i], launches[i] = 0.0, 0.0
            scale[i] = 0.0 if graph.ops[i].primitive != "dot_general" else scale[i]
        # forward (Algorithm 1): read Q, K, V (and a bias), write O and L
        nbytes[c.values] = read_qkv + fwd_written + lse
        launches[c.values] = 1.0
        half = 0.5 if c.causal else 1.0
        fwd_mm = [c.scores, c.values]
        for i in fwd_mm:
            scale[i] *= half
        if c.backward:
            # pre-pass D = rowsum(dO o O): read dO, O, write D; main (Algorithm 2): read Q, K, V, O, dO, L,
            # D (and a bias), write dQ, dK, dV (and whatever else leaves the core: a bias's gradient)
            last = max(c.backward)
            nbytes[last] = 2 * out_b + lse + read_qkv + 2 * out_b + 2 * lse + bwd_written
            launches[last] = 2.0
            bwd_mm = [i for i in c.backward if graph.ops[i].primitive == "dot_general"]
            traced = sum(graph.ops[i].flops for i in bwd_mm)
            target = BACKWARD_MATMULS * sum(graph.ops[i].flops for i in fwd_mm)
            for i in bwd_mm:
                scale[i] *= half * (target / traced if traced > 0 else 1.0)
            reader = last
        else:
            reader = c.values
        over |= ops
        unsaved |= inner - {c.lse, c.out}
        unsaved.discard(c.lse)
        kept.append((c.lse, reader))
        if c.backward and not _saved_view(graph, c.out):
            kept.append((c.out, reader))        # the traced backward needs no O; FlashAttention's does
    return dataclasses.replace(fused, bytes=nbytes, launches=launches, scale=scale,
                               overridden=frozenset(over), unsaved=frozenset(unsaved), kept=tuple(kept))


def _written(graph: OpGraph, live: np.ndarray, ops: set[int], made: set[int]) -> set[int]:
    """Values of the core that something outside it reads (or the step returns): the kernel writes them."""
    outputs = set(graph.outputs)
    out = set()
    for w in made:
        stack = [w]
        while stack:
            u = stack.pop()
            if u in outputs:
                out.add(w)
                break
            readers = [r for r in graph.values[u].consumers if live[r] and r not in ops]
            views = [r for r in readers if graph.ops[r].primitive in ("reshape", "squeeze", "expand_dims")]
            if len(views) < len(readers):
                out.add(w)
                break
            stack.extend(o for r in views for o in graph.ops[r].outputs)
    return out


def _source_bytes(graph: OpGraph, v: int) -> float:
    """Bytes a kernel reads for `v`: what a broadcast broadcasts (a [1, H, S, S] bias read once)."""
    while True:
        p = graph.values[v].producer
        if p is None or graph.ops[p].primitive not in ("broadcast_in_dim", *VIEW_OPS) or not graph.ops[p].inputs:
            return float(graph.values[v].nbytes)
        v = graph.ops[p].inputs[0]


def _lse_bytes(graph: OpGraph, c: AttentionCore) -> float:
    return float(math.prod(graph.values[c.lse].shape) * LSE_ITEMSIZE)


def _saved_view(graph: OpGraph, v: int) -> bool:
    """Does a backward op read `v` or a view of it (so the traced program keeps it already)?"""
    stack = [v]
    while stack:
        for r in graph.values[stack.pop()].consumers:
            op = graph.ops[r]
            if op.phase == "backward":
                return True
            if op.primitive in VIEW_OPS and len(op.inputs) == 1:
                stack.extend(op.outputs)
    return False


ATTENTION_MODES = ("as_traced", "flash")


def priced_fusion(graph: OpGraph, gpu: bool, attention: str = "as_traced") -> Fusion:
    """The fusion every pricer uses: XLA's (core.fusion), with attention re-priced as FlashAttention
    when `attention="flash"` (SearchOptions.attention). Cached on the graph."""
    if attention == "as_traced":
        return fusion(graph, gpu=gpu)
    if attention != "flash":
        raise ValueError(f"attention={attention!r} must be one of {list(ATTENTION_MODES)}")
    key = ("fusion", gpu, attention)
    hit = graph.cache.get(key)
    if hit is None:
        hit = graph.cache[key] = flash_fusion(graph, fusion(graph, gpu=gpu))
    return hit
