"""Which forward values stay in memory for the backward pass once XLA has fused the step (pure: no jax).

A jaxpr's residuals (every forward value a backward equation reads) overstate what a compiled step
keeps: XLA fuses an elementwise producer into each of its readers when that moves fewer bytes
(`core.fusion`: priority fusion duplicates it, the older instruction fusion duplicates cheap ops), so
a LayerNorm's float32 centred and scaled rows, or the five intermediates of a tanh-GELU, are
recomputed inside the backward's fusions from the fusion inputs they derive from (the normalised
row's input and its statistics; the MLP's first matmul output). What stays alive from the forward to
the backward pass is the *materialised* values a backward fusion reads: results of kernels (matmuls,
reductions, gathers) and of elementwise fusions written to memory, read by a fusion that runs in the
backward pass. Korthikanti et al. (2022, §4.1) count exactly those for a GPT layer: the layer norms'
inputs, Q, K, V, the attention's probabilities and output, the MLP's input, its first matmul's
output and its activation's output (34 s b h + 5 a s^2 b bytes with dropout masks in 16-bit).

`saved_values(graph, fused, core)` answers, per forward value, whether it is such a value.
`core` (a window fusion's priced ops) marks where `fused` holds groups; a reader outside it is
judged by its phase (a backward reader keeps the value, as the jaxpr says).
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from .fusion import Fusion
from .graph import Op, OpGraph


def saved_values(graph: OpGraph, fused: Fusion, core: Collection[int] | None = None) -> Callable[[int], bool]:
    """A predicate on forward values: does the compiled step keep `v` for the backward pass?"""
    ops, values, group = graph.ops, graph.values, fused.group
    known = (lambda i: True) if core is None else (lambda i: i in core)
    runs_backward: dict[int, bool] = {}

    def fused_in_backward(i: int) -> bool:
        """Does op `i` run inside a backward fusion (a forward op recomputed by the backward)?"""
        root = int(group[i])
        hit = runs_backward.get(root)
        if hit is None:
            hit = runs_backward[root] = ops[root].phase == "backward"
        return hit

    needed: dict[int, bool] = {}

    def read_by_backward(v: int, home: int) -> bool:
        """Is `v` (made by the fusion `home`) read by a fusion run in the backward pass, directly or
        through views and ops recomputed inside their readers?"""
        hit = needed.get(v)
        if hit is not None:
            return hit
        needed[v] = False          # a cycle cannot occur (a DAG); this guards re-entry only
        # outside the window: the jaxpr's answer, through forward ops; in a group: its phase; else a
        # view, an op recomputed in its readers, or dead code: through its outputs
        out = any(_reader_keeps(c, home) for c in values[v].consumers)
        needed[v] = out
        return out

    def saved(v: int, via: Callable[[int], bool] | None = None) -> bool:
        """`via`: only readers `c` with via(c) count at the first hop (a value cut at a region
        boundary is read in two layouts; each layout is kept only for the readers that read it)."""
        p = values[v].producer
        if p is None or ops[p].phase != "forward":
            return False
        readers = [c for c in values[v].consumers if via is None or via(c)]
        if not known(p):
            return any(ops[c].phase == "backward" for c in readers)
        if group[p] < 0 or fused_in_backward(p):
            return False           # a view, recomputed where it is read, dead, or run by the backward
        if via is None:
            return read_by_backward(v, int(group[p]))
        return any(_reader_keeps(c, int(group[p])) for c in readers)

    def _reader_keeps(c: int, home: int) -> bool:
        op = ops[c]
        if not known(c):
            return op.phase == "backward" or (op.phase == "forward" and any(read_by_backward(w, home)
                                                                            for w in op.outputs))
        if group[c] >= 0:
            return int(group[c]) != home and fused_in_backward(c)
        return any(read_by_backward(w, home) for w in op.outputs)
    return saved


# layout-only ops between a parameter and a backward-data convolution's kernel operand
_KERNEL_VIEWS = frozenset({"rev", "transpose", "reshape", "copy", "copy_p"})


def reversed_parameter(graph: OpGraph, op: Op) -> bool:
    """Is `op` the reversal of a parameter (a convolution kernel, read by its backward-data convolution)?
    No working buffer on either backend: cuDNN's backward-data convolution reads the kernel in place, and
    XLA:CPU materialises every spatially reversed one early, which `plan.cpu_buffers` counts."""
    if op.primitive != "rev":
        return False
    v = op.inputs[0]
    while graph.values[v].producer is not None:
        producer = graph.ops[graph.values[v].producer]
        if producer.primitive not in _KERNEL_VIEWS:
            return False
        v = producer.inputs[0]
    return graph.values[v].role == "parameter"
