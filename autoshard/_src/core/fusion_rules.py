"""The pure decision rules of `core.fusion`: where XLA fuses, which producers it duplicates into their
readers, and which ops a GEMM takes as its epilogue (pure: no jax import).

`_Rules` is mixed into `core.fusion._Fuser`, which drives the passes (grouping, multi-output and
normalisation fusion, bytes and launches); kept apart so each module stays readable. The rules:

* placement: XLA fuses within one loop body and phase (forward and backward together), and the
  normalisation fusion takes only row reductions;
* duplication: a fusible op is recomputed in each reader when that moves fewer bytes (XLA:GPU's
  priority fusion, counting through cheap producers to their sources) or, on XLA:CPU, when it is
  not expensive (`EXPENSIVE_OPS`) and its operands are no larger than its result;
* epilogue: a GEMM's single-consumer bias add or output convert (cuBLAS's rewriter, before fusion).

The methods read the `_Fuser`'s graph `g`, `gpu`, op kinds `cls`, `source` (alias resolution) and its
caches: `sources_cache`, `epilogue_cache` (cleared by `find_inline` once every kind is settled) and
`bytes_cache`.
"""

from __future__ import annotations

import math

from .graph import Op

# ops XLA's InstructionFusion never duplicates into several readers (`IsExpensive`); XLA:GPU's priority
# fusion weighs them by its cost model instead (duplicating them when that saves memory traffic)
EXPENSIVE_OPS = frozenset({"exp", "exp2", "expm1", "log", "log1p", "tanh", "logistic", "rsqrt", "sqrt", "cbrt",
                           "pow", "atan2", "div", "rem", "erf", "erfc", "erf_inv", "lgamma", "digamma", "tan",
                           "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh"})
GEMM_OPS = frozenset({"dot_general", "conv_general_dilated"})
EPILOGUE_OPS = frozenset({"add", "convert_element_type"})


class _Rules:
    """Fusion's decision rules, as methods of `core.fusion._Fuser` (see the module docstring)."""

    # --- placement ---------------------------------------------------------------------------
    def same_place(self, a: Op, b: Op) -> bool:
        """XLA fuses within one loop body, across the forward and backward passes (a cheap forward
        op is recomputed in the backward's fusion rather than saved), but not into the optimizer
        (a gradient reaches it through a reduction once the batch is split)."""
        return a.loops == b.loops and (a.phase == b.phase or {a.phase, b.phase} <= {"forward", "backward"})

    @staticmethod
    def row_reduction(op: Op) -> bool:
        """A reduction over the last (minor) dim only: the rows the normalisation fusion keeps on chip
        (a bias gradient's sum over the batch rows is a column reduction: not fused so)."""
        axes = tuple(op.params.get("axes", ()))
        rank = len(op.in_shapes[0]) if op.in_shapes else 0
        return rank > 0 and axes == (rank - 1,)

    # --- duplication -------------------------------------------------------------------------
    def _duplicable(self, op: Op) -> bool:
        """May fusion copy `op` into several readers? Not an expensive op on XLA:CPU (`EXPENSIVE_OPS`);
        an integer division is cheap there, and so is one by a constant (XLA's algebraic simplifier
        makes it a multiplication first: a mean's `sum / n`)."""
        if self.gpu or op.primitive not in EXPENSIVE_OPS:
            return True
        if op.primitive not in ("div", "rem"):
            return False
        by_constant = op.primitive == "div" and self.g.values[op.inputs[-1]].kind == "literal"
        return by_constant or not any(d.startswith(("float", "bfloat")) for d in op.out_dtypes)

    def _cheaper_to_recompute(self, op: Op, readers: set[int]) -> bool:
        """Would recomputing `op` inside each of its readers' fusions move fewer bytes than writing
        its result once and reading it back in each? (XLA's priority fusion duplicates a producer
        into all its consumers when that lowers the estimated run time; for memory-bound code, the
        bytes.) A convert feeding two readers, a row's mean / n: yes; a residual add: no."""
        if len(op.outputs) != 1:
            return False
        out = self.g.values[op.outputs[0]].nbytes
        if not self.gpu:
            return self._operand_bytes(op) <= out
        n = len(readers)
        # the operands' bytes bound what recomputing reads (sources replace an operand only when no
        # larger, a broadcast's are smaller): when even they pass, the sources need not be walked
        values = self.g.values
        operands = {self.source(v) for v in op.inputs}
        if n * sum(self._nbytes(w) for w in operands if values[w].kind != "literal") <= (1 + n) * out:
            return True
        return n * self._input_bytes(op) <= (1 + n) * out

    def _operand_bytes(self, op: Op) -> float:
        """XLA:CPU's test (InstructionFusion): copying a producer into several readers cannot add memory
        traffic when its HLO operands (a broadcast at its full size) are no larger than its result; a
        larger one (a row's `x - mean`) is written once (the exception, fusing it along every path,
        is not modelled: a reduction or matmul on one path forbids it, and the estimate errs high).
        An operand the jaxpr broadcasts implicitly (a (B, S, 1) row statistic times a (1, 1, D) scale:
        jax lowers it through a full-size HLO broadcast) counts at the result's size as well."""
        total = 0.0
        out = self.g.values[op.outputs[0]]
        for v in op.inputs:
            val = self.g.values[self.source(v)]
            if val.kind == "literal":
                continue
            if len(val.shape) == len(out.shape) and val.shape != out.shape:
                total += val.nbytes * (math.prod(out.shape) // max(1, math.prod(val.shape)))
            else:
                total += val.nbytes
        return total

    def _input_bytes(self, op: Op) -> float:
        """Bytes recomputing `op` reads: its inputs, a broadcast counted as what it broadcasts (it is
        recomputed in place), and through producers as cheap to recompute (an elementwise op reading
        no more than it writes, not a GEMM's epilogue: decided after `op`, as producers come earlier)
        the values they derive from, each once (a tanh-GELU's terms all read one matmul output)."""
        return float(sum(map(self._nbytes, self._recompute_sources(op, 4))))

    def _nbytes(self, v: int) -> int:
        hit = self.bytes_cache.get(v)
        if hit is None:
            hit = self.bytes_cache[v] = self.g.values[v].nbytes
        return hit

    def _recompute_sources(self, op: Op, depth: int) -> frozenset[int]:
        key = (op.index, depth)       # cached: chains share their producers
        hit = self.sources_cache.get(key)
        if hit is None:
            hit = self.sources_cache[key] = frozenset(self._sources(op, depth))
        return hit

    def _sources(self, op: Op, depth: int) -> set[int]:
        out: set[int] = set()
        for v in op.inputs:
            v = self.source(v)
            val = self.g.values[v]
            p = val.producer
            if val.kind == "literal":
                continue
            if p is not None and self.cls[p] == "recomputed":
                out |= self._recompute_sources(self.g.ops[p], depth)
                continue
            q = self.g.ops[p] if p is not None else None
            if q is not None and depth > 0 and self.cls[p] == "loop" and len(q.outputs) == 1 \
                    and self.same_place(q, op) and self._duplicable(q) and self._epilogue_of(q) is None:
                inner = self._recompute_sources(q, depth - 1)
                if sum(map(self._nbytes, inner)) <= self._nbytes(v):
                    out |= inner
                    continue
            out.add(v)
        return out

    # --- epilogue ----------------------------------------------------------------------------
    def _epilogue_of(self, op: Op) -> int | None:
        """The GEMM whose epilogue `op` is (a single-consumer bias add or output convert), if any."""
        if op.primitive not in EPILOGUE_OPS:
            return None
        if op.index not in self.epilogue_cache:
            self.epilogue_cache[op.index] = self._find_epilogue(op)
        return self.epilogue_cache[op.index]

    def _find_epilogue(self, op: Op) -> int | None:
        for v in op.inputs:
            p = self.g.values[self.source(v)].producer
            if p is None or self.g.ops[p].primitive not in GEMM_OPS or not self.same_place(self.g.ops[p], op):
                continue
            if op.primitive == "add" and not self._bias(op, v):
                continue
            return p if self._only_reader(p, op.index) else None
        return None

    def _only_reader(self, p: int, c: int) -> bool:
        """Is `c` the one live op reading `p`'s results (through views)? Asked while readers' kinds
        are still being settled, so views are followed and nothing is cached."""
        stack = list(self.g.ops[p].outputs)
        while stack:
            v = stack.pop()
            for r in self.g.values[v].consumers:
                if self.cls[r] == "alias":
                    stack.extend(self.g.ops[r].outputs)
                elif self.cls[r] != "dead" and r != c:
                    return False
        return True

    def _bias(self, op: Op, gemm_out: int) -> bool:
        """Is `op`'s other operand a vector broadcast over the GEMM's output (cuBLASLt's BIAS epilogue)?"""
        others = [w for w in op.inputs if w != gemm_out]
        if len(others) != 1:
            return False
        src = self.g.values[self.source(others[0])]
        p = src.producer
        if p is not None and self.g.ops[p].primitive == "broadcast_in_dim":
            src = self.g.values[self.source(self.g.ops[p].inputs[0])]
        return sum(d > 1 for d in src.shape) <= 1
