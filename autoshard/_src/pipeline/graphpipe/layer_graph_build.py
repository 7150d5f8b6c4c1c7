"""Build a LayerGraph (GraphPipe's coarse DAG) from a traced training step (pure: no jax import).

    lg = layer_graph(autoshard.trace(model.train_step, *model.abstract_state()), "v100-sxm")

The op-level work is RaNNC's (`_atomic.atomic_partition`, `_costs.PipelineCosts`): one atomic
component per non-constant forward op, with its constant forward ops (cloned where shared) and the
backward / optimizer ops attached to it (a weight gradient and the update of a parameter join the
forward op that reads the parameter; other backward ops join the forward op of their module that
they read). This module only decides which components form one *node*:

1. **Units.** The module tree of the forward ops is cut at a *layer level*. Two or more siblings
   named `<prefix>_<i>` or `<prefix><i>` with a common prefix and i = 0, 1, ..., k-1 (`layer_0`..
   `layer_7`, `fc_0`.., `embedding_0`.., flax's `Dense_0`..) form a *repeated group* (`ln1`/`ln2`
   and `fc1`/`fc2` inside a transformer layer do not: they are not enumerated from 0). Walking
   down from the root, a child whose subtree holds a repeated group is a container (`MMT/branch_2`,
   `DLRM/top`) and is walked into; a member of a repeated group with none below it is a *unit*
   (`MMT/branch_2/layer_5`, `DLRM/embedding_3`, `CandleUno/branch_0/dense_1`); any other child
   (`in_proj`, `ln_f`, `head`) is *outside*.
   `depth=d` overrides this: the units are the module paths cut to their first d components
   (depth=3 on MMT also makes each branch's `in_proj` and `ln_f` a node).
2. **Outside ops** (forward ops whose module is not inside a unit: input projections, final norms,
   activations applied by a container, pooling, concatenation, the interaction, the loss) start as
   one piece per op and are merged along the data flow until no rule applies: a piece with exactly
   one producing piece joins it (epilogues: ReLU after a Dense, `ln_f`, pooling, a bag sum);
   otherwise a piece with exactly one consuming piece joins that (prologues: input projections,
   and joins: DLRM's concatenation joins `top/fc_0`); a piece with neither producer nor consumer
   (e.g. a metric on the labels only) joins the piece holding the last forward op. Pieces left
   with several producers and several or no consumers stay nodes of their own (MMT's concatenation
   + classifier head + loss: the join of the branches). Contracting an edge into a piece's only
   producer or only consumer never creates a cycle.
3. **Nodes** are listed in a topological order (Kahn, ties by program order); an edge (u, v)
   carries values produced by u's forward ops and read by v's.

Costs per node: forward/backward seconds are the roofline times of the node's forward/backward ops
at the traced batch divided by it; the *curves* give the node's seconds per micro-batch of 1, 2, 4,
... samples up to the traced batch (rounded up to a power of two). For them each op's flops and
bytes are split into a part that scales with the batch and a part that does not, by the batch
factor (`autoshard._factors`: the logical dim of the data inputs' leading dim, followed through
every op): an op touching a batch-carrying value has flops linear in the batch; of its bytes, the
values carrying the batch scale and the others (weights read, weight gradients written) are paid
once per micro-batch, so a memory-bound layer costs about the same at b = 1 as at b = 16 on the
roofline. Ops with no batch-carrying value (weight casts) cost the same per micro-batch. This
matches traces at smaller batches op for op (a dead value, which no op links to the batch, scales
when its leading dim is the batch). `update` is the node's optimizer
seconds per step. `param_bytes`/`state_bytes` count each parameter (and its optimizer state) once,
in the first node reading it (a tied embedding is held by its first user); saved constants (weights
read by the backward after a cast) are held once per node and are added to `state_bytes`.
`activation_bytes` per sample = forward values read by the node's backward ops (received inputs
included) + the data inputs its forward reads; `output_bytes` per sample = the largest amount the
node sends to any one consumer node.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import re
from collections import defaultdict, deque
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ...core.cost import CostModel
from ...core.errors import PipelineError
from ...core.fusion import fusion
from ...core.graph import OpGraph
from ...core.hardware import get_hardware
from ...core.kernels import compute_dtype, op_seconds
from ...core.liveness import live_ops
from ...tensor.regions import analyze
from ..atomic import atomic_partition
from ..costs import PipelineCosts
from .layer_graph import LayerGraph, LayerNode

_INDEXED = re.compile(r"^(.*?)_?(\d+)$")
ROOT_NAME = "<root>"     # name of an outside node whose ops have no module (the loss, usually)


# ops that start a kernel of their own after XLA's fusion (elementwise ops fuse into them)
def layer_graph(graph: OpGraph, hardware: Any, *, batch_size: int | None = None,
                depth: int | None = None, cost_model: CostModel | None = None,
                kernel_overhead: float = 0.0, op_time: Sequence[float] | None = None,
                op_curves: Any = None) -> LayerGraph:
    """The LayerGraph of a traced training step (see the module docstring for the rules).

    `hardware`: a preset name, HardwareSpec or override dict (`autoshard.get_hardware`), used by
    the roofline cost model unless `cost_model` (anything with `compute(flops, bytes, dtype)`) is
    given. `batch_size`: the batch the step was traced with (default: the most common leading dim of
    the data inputs). `depth`: cut the module tree at this many path components instead of the
    automatic layer level. `kernel_overhead`: seconds each kernel costs per launch beyond the
    roofline (e.g. ~5e-6 for a CUDA launch), added to the curves once per micro-batch for each op
    that starts a kernel after fusion (`core.fusion`). With the default 0 the curves follow the
    hardware's kernel model when it has one
    (`HardwareSpec.kernels`: tile and wave quantization, launches, achievable bandwidth; GPU presets
    do) and a custom `cost_model` is not given; otherwise the pure roofline
    (`{"base": ..., "kernels": None}` keeps the roofline for comparison).

    Measured costs (autoshard's profile="measured") replace the model: `op_time` gives each op's
    seconds per execution at the traced batch (the nodes' per-sample forward/backward), and
    `op_curves` an [ops, K] array of each op's seconds per execution at micro-batch 1, 2, ...,
    2**(K-1) (K = len(curve_sizes(batch))), which becomes the node curves.
    """
    if not isinstance(graph, OpGraph):
        raise PipelineError(f"pipeline.layer_graph: graph has type {type(graph).__name__}; pass the OpGraph of "
                            "a traced training step, autoshard.trace(step, *args).")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                   or batch_size < 1):
        raise PipelineError(f"pipeline.layer_graph: batch_size={batch_size!r} must be an int >= 1 (the samples "
                            "per step the graph was traced with), or None to read it from the data inputs.")
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 1):
        raise PipelineError(f"pipeline.layer_graph: depth={depth!r} must be an int >= 1 (module path components "
                            "per node, e.g. 3 for 'MMT/branch_0/layer_3'), or None for the automatic level.")
    if isinstance(kernel_overhead, bool) or not isinstance(kernel_overhead, (int, float)) or not (
            0 <= kernel_overhead < 1):
        raise PipelineError(f"pipeline.layer_graph: kernel_overhead={kernel_overhead!r} must be seconds per "
                            "kernel launch, in [0, 1) (e.g. 5e-6), or 0 for the pure roofline.")
    if op_curves is not None and kernel_overhead:
        raise PipelineError(f"pipeline.layer_graph: kernel_overhead={kernel_overhead!r} adds launch costs to the "
                            "roofline curves, but op_curves (measured) are given and hold them already; pass one.")
    atomic = atomic_partition(graph)
    if kernel_overhead:             # the roofline plus a constant per launch, not the kernel model
        hardware = dataclasses.replace(get_hardware(hardware), kernels=None)
    costs = PipelineCosts(atomic, hardware, cost_model=cost_model, batch=batch_size, op_time=op_time)
    modules = [graph.ops[t].module for t in atomic.tasks]
    units = _units(modules, depth)
    node_of, names = _group(atomic, costs, modules, units)
    if op_curves is None:
        curves = _op_curves(graph, costs, kernel_overhead)
    else:
        curves = _measured_curves(graph, costs.batch, op_curves)
    curves = curves * live_ops(graph)[:, None]      # XLA deletes dead code: it costs nothing
    return _build(graph, costs, node_of, names, units, curves)


# --- micro-batch curves --------------------------------------------------------------------------

def curve_sizes(batch: int) -> list[int]:
    """Micro-batch sizes the curves are given at: 1, 2, 4, ..., the first power of two >= batch."""
    return [2 ** k for k in range(max(1, math.ceil(math.log2(batch)) + 1))]


def op_curves(graph: OpGraph, hardware: Any, *, batch_size: int | None = None,
              cost_model: CostModel | None = None, kernel_overhead: float = 0.0) -> np.ndarray:
    """[ops, K] roofline seconds of each op (times its repeat count) at micro-batch `curve_sizes`."""
    costs = PipelineCosts(atomic_partition(graph), hardware, cost_model=cost_model, batch=batch_size)
    return _op_curves(graph, costs, kernel_overhead) * live_ops(graph)[:, None]


def _measured_curves(graph: OpGraph, batch: int, op_curves: Any) -> np.ndarray:
    K = len(curve_sizes(batch))
    try:
        arr = np.asarray(op_curves, dtype=float)
    except (TypeError, ValueError) as e:
        raise PipelineError(f"pipeline.layer_graph: op_curves is not numeric ({e}); give an [ops, K] array of "
                            "seconds per execution.") from None
    if arr.shape != (len(graph.ops), K):
        raise PipelineError(f"pipeline.layer_graph: op_curves has shape {arr.shape}; the graph has {len(graph.ops)} "
                            f"ops and batch {batch}, so give ({len(graph.ops)}, {K}): each op's seconds at "
                            f"micro-batch {curve_sizes(batch)}.")
    if not np.isfinite(arr).all() or (arr < 0).any():
        bad = np.argwhere(~np.isfinite(arr) | (arr < 0))[0]
        raise PipelineError(f"pipeline.layer_graph: op_curves[{bad[0]}, {bad[1]}] = {float(arr[tuple(bad)])!r} "
                            f"(op '{graph.ops[bad[0]].primitive}'); seconds must be finite and >= 0.")
    return arr * np.array([op.repeat for op in graph.ops], dtype=float)[:, None]


def _op_curves(graph: OpGraph, costs: PipelineCosts, kernel_overhead: float = 0.0) -> np.ndarray:
    """[ops, K] seconds of each op (times its repeat count) at micro-batch 1, 2, ..., 2**(K-1) >= batch."""
    B = costs.batch
    sizes = np.array(curve_sizes(B), dtype=float)
    K = len(sizes)
    fg = analyze(graph, range(len(graph.ops)))
    batch_factors = {fg.value_factors(v)[0] for v in graph.inputs
                     if graph.values[v].role == "data" and graph.values[v].shape
                     and graph.values[v].shape[0] == B} - {None}
    carries = {}
    outputs = set(graph.outputs)

    def scales(v: int) -> bool:
        if v not in carries:
            val = graph.values[v]
            if not val.consumers and v not in outputs:   # dead (e.g. an unused broadcast): no op links its
                carries[v] = bool(val.shape) and val.shape[0] == B   # dims, so judge by the leading dim
            else:
                carries[v] = any(f in batch_factors for f in fg.value_factors(v))
        return carries[v]

    km = costs.hardware.kernels
    if km is not None and costs.custom_cost_model is None:
        return _kernel_curves(graph, costs, sizes, lambda v, r: [f in batch_factors for f in fg.value_factors(v, r)],
                              scales)
    cm = costs.cost_model
    fz = fusion(graph, gpu=costs.hardware.kernels is not None)
    out = np.repeat(costs.op_time[:, None], K, axis=1)     # ops without batch-carrying values
    for op in graph.ops:
        fixed, var = _fused_split(graph, fz.moved[op.index], scales)
        if not var:
            continue
        dtype = op.out_dtypes[0] if op.out_dtypes else "float32"
        out[op.index] = [op.repeat * cm.compute(op.flops * s / B, fixed + var * s / B, dtype) for s in sizes]
    if kernel_overhead:
        launches = fz.launches * np.array([op.repeat for op in graph.ops], dtype=float)
        out += kernel_overhead * launches[:, None]
    return out


def _kernel_curves(graph: OpGraph, costs: PipelineCosts, sizes: np.ndarray, batch_dims, scales) -> np.ndarray:
    """`_op_curves` on the hardware's kernel model (core/kernels.py): each op's shapes at each
    micro-batch (its batch-carrying dims scaled), matmuls and convolutions in whole tiles and waves,
    memory at the achievable bandwidth, a launch per kernel after fusion (`core.fusion`)."""
    hw, km, B = costs.hardware, costs.hardware.kernels, costs.batch
    fz = fusion(graph, gpu=costs.hardware.kernels is not None)
    out = np.zeros((len(graph.ops), len(sizes)))
    for op in graph.ops:
        dtype = compute_dtype(op.primitive, op.in_dtypes, op.out_dtypes)
        rate = hw.peak_flops(dtype) * hw.compute_efficiency
        fixed, var = _fused_split(graph, fz.moved[op.index], scales)
        for j, size in enumerate(sizes):
            f = size / B if var else 1.0
            ins = [_at_batch(s, batch_dims(v, len(s)), f) for v, s in zip(op.inputs, op.in_shapes, strict=True)]
            res = _at_batch(op.out_shapes[0], batch_dims(op.outputs[0], len(op.out_shapes[0])), f) \
                if op.outputs else ()
            t = op_seconds(km, op.primitive, op.params, ins, res, op.flops * f, fixed + var * f, rate,
                           hw.memory_bandwidth, peak=hw.peak_flops(dtype), launches=fz.launches[op.index])
            out[op.index, j] = op.repeat * t
    return out


def _at_batch(shape: Sequence[int], is_batch: Sequence[bool], f: float) -> tuple[int, ...]:
    return tuple(max(1, math.ceil(d * f)) if b else d for d, b in zip(shape, is_batch, strict=True))


# --- units ---------------------------------------------------------------------------------------

def _split(module: str) -> tuple[str, ...]:
    return tuple(p for p in module.split("/") if p) if module else ()


def _units(modules: Sequence[str], depth: int | None) -> tuple[tuple[str, ...], ...]:
    """Unit module paths (as component tuples), sorted."""
    paths = {_split(m) for m in modules}
    if depth is not None:
        units = {p[:depth] for p in paths if len(p) >= depth}
        if not units:
            deepest = max((len(p) for p in paths), default=0)
            raise PipelineError(
                f"pipeline.layer_graph: depth={depth} is deeper than every forward op's module path (the deepest "
                f"has {deepest} components); pass depth <= {deepest}, or depth=None for the automatic level.")
        return tuple(sorted(units))
    children: dict[tuple[str, ...], set[str]] = defaultdict(set)
    for p in paths:
        for i in range(len(p)):
            children[p[:i]].add(p[i])

    def repeated(parent: tuple[str, ...]) -> set[str]:
        groups: dict[str, dict[int, str]] = defaultdict(dict)
        for name in children.get(parent, ()):
            m = _INDEXED.match(name)
            if m:
                groups[m.group(1)][int(m.group(2))] = name
        # enumerated from 0 (layer_0, layer_1, ...; flax's Dense_0, Dense_1): 'ln1'/'ln2' or
        # 'fc1'/'fc2' inside one transformer layer are distinct roles, not a list of layers
        return {n for g in groups.values() if len(g) >= 2 and sorted(g) == list(range(len(g))) for n in g.values()}

    has_rep: dict[tuple[str, ...], bool] = {}

    def holds_repeat(node: tuple[str, ...]) -> bool:   # a repeated group anywhere strictly below node
        if node not in has_rep:
            has_rep[node] = bool(repeated(node)) or any(holds_repeat(node + (c,)) for c in children.get(node, ()))
        return has_rep[node]

    units: list[tuple[str, ...]] = []
    stack = [()]
    while stack:
        node = stack.pop()
        rep = repeated(node)
        for c in sorted(children.get(node, ())):
            child = node + (c,)
            if holds_repeat(child):
                stack.append(child)
            elif c in rep:
                units.append(child)
    if not units:
        raise PipelineError(
            "pipeline.layer_graph: no repeated modules (siblings named like 'layer_0', 'layer_1') in the module "
            f"tree of the forward ops ({len(paths)} distinct modules, e.g. {sorted('/'.join(p) for p in paths)[:5]}), "
            "so there is no layer level to cut at; pass depth=<path components per node>.")
    return tuple(sorted(units))


def _unit_of(module: str, units: set[tuple[str, ...]], max_len: int) -> tuple[str, ...] | None:
    p = _split(module)
    for k in range(min(len(p), max_len), 0, -1):
        if p[:k] in units:
            return p[:k]
    return None


# --- grouping components into nodes -------------------------------------------------------------

def _group(atomic, costs: PipelineCosts, modules: Sequence[str],
           units: tuple[tuple[str, ...], ...]) -> tuple[list[int], dict[int, str]]:
    """Node (a union-find root component) of each component, and each root's name."""
    n = len(atomic)
    unit_set, max_len = set(units), max(len(u) for u in units)
    comp_unit = [_unit_of(m, unit_set, max_len) for m in modules]
    parent = list(range(n))

    def find(c: int) -> int:
        while parent[c] != c:
            parent[c] = parent[parent[c]]
            c = parent[c]
        return c

    first: dict[tuple[str, ...], int] = {}
    for c, u in enumerate(comp_unit):
        if u is not None:
            if u in first:
                parent[c] = first[u]
            else:
                first[u] = c
    succ: list[list[int]] = [atomic.successors(c) for c in range(n)]
    pred: list[list[int]] = [atomic.predecessors(c) for c in range(n)]
    members: dict[int, list[int]] = defaultdict(list)
    for c in range(n):
        members[find(c)].append(c)
    outside = {r for r in members if comp_unit[r] is None}

    def neighbours(r: int, adj: list[list[int]]) -> set[int]:
        return {find(x) for c in members[r] for x in adj[c]} - {r}

    def merge(r: int, into: int) -> None:
        parent[r] = into
        members[into].extend(members.pop(r))
        outside.discard(r)

    queue = deque(sorted(outside))
    queued = set(queue)
    isolated: list[int] = []
    while queue:
        r = queue.popleft()
        queued.discard(r)
        if find(r) != r or r not in outside:
            continue
        ps, ss = neighbours(r, pred), neighbours(r, succ)
        if len(ps) == 1:
            target = next(iter(ps))
        elif len(ss) == 1:
            target = next(iter(ss))
        else:
            if not ps and not ss:
                isolated.append(r)
            continue
        merge(r, target)
        # the target and the old neighbours now see one piece fewer: look at them again
        for x in sorted((ps | ss | {target}) & outside):
            if x not in queued:
                queue.append(x)
                queued.add(x)
    last = find(n - 1)
    for r in isolated:                 # no producer, no consumer: with the loss (the last forward op)
        if find(r) == r and r in members and r != last and not neighbours(r, pred) and not neighbours(r, succ):
            merge(r, last)
            last = find(n - 1)
    node_of = [find(c) for c in range(n)]
    names: dict[int, str] = {}
    for r, cs in members.items():
        u = comp_unit[r]
        if u is not None:
            names[r] = "/".join(u)
        else:   # an outside node: named by the module of its most expensive forward op
            fwd = costs.items["fwd"]
            best = max(cs, key=lambda c: (fwd[atomic.tasks[c]][0], -c))
            names[r] = modules[best] or ROOT_NAME
    return node_of, names


# --- costs ---------------------------------------------------------------------------------------

def _topo(roots: Iterable[int], edges: set[tuple[int, int]], names: dict[int, str],
          key: dict[int, int]) -> list[int]:
    """Kahn's algorithm, ties broken by `key` (a node's first component: program order)."""
    roots = list(roots)
    indeg = dict.fromkeys(roots, 0)
    out: dict[int, list[int]] = defaultdict(list)
    for a, b in edges:
        out[a].append(b)
        indeg[b] += 1
    heap = [(key[r], r) for r in roots if indeg[r] == 0]
    heapq.heapify(heap)
    order = []
    while heap:
        _, r = heapq.heappop(heap)
        order.append(r)
        for b in out[r]:
            indeg[b] -= 1
            if indeg[b] == 0:
                heapq.heappush(heap, (key[b], b))
    if len(order) != len(roots):
        stuck = sorted(names[r] for r in roots if indeg[r] > 0)[:6]
        raise PipelineError(
            f"pipeline.layer_graph: the nodes {stuck} form a cycle (a module runs at two points of the step with "
            "other modules between, e.g. weights shared across layers); pass depth= to cut the module tree at "
            "another level so that each node is contiguous in the data flow.")
    return order


def _build(graph: OpGraph, costs: PipelineCosts, node_of: list[int], names: dict[int, str],
           units: tuple[tuple[str, ...], ...], op_curves: np.ndarray) -> LayerGraph:
    roots = sorted(set(node_of))
    # edges and per-consumer bytes between nodes, from the values crossing components
    sent: dict[tuple[int, int], float] = defaultdict(float)
    for c, dsts, nbytes in costs.flows:
        a = node_of[c]
        for b in {node_of[d] for d in dsts} - {a}:
            sent[(a, b)] += nbytes
    first: dict[int, int] = {}
    for c, r in enumerate(node_of):
        first.setdefault(r, c)
    order = _topo(roots, set(sent), names, first)
    index = {r: i for i, r in enumerate(order)}
    tot: dict[str, list[float]] = {cat: [0.0] * len(order) for cat in costs.items}
    K = op_curves.shape[1]
    curve = {"forward": np.zeros((len(order), K)), "backward": np.zeros((len(order), K))}
    for cat, its in costs.items.items():
        acc = tot[cat]
        phase = {"fwd": "forward", "fwd_const": "forward", "bwd": "backward", "bwd_const": "backward"}.get(cat)
        for key, (w, cs) in its.items():
            held = {index[node_of[c]] for c in cs}
            if cat in ("params", "state"):      # once, in the first node reading it
                acc[min(held)] += w
            else:                               # a union: cloned constants count in each node
                for i in held:
                    acc[i] += w
                    if phase:
                        curve[phase][i] += op_curves[key]
    out_bytes = [0.0] * len(order)
    for (a, _), nbytes in sent.items():
        out_bytes[index[a]] = max(out_bytes[index[a]], nbytes)
    node_ops: dict[int, set[int]] = defaultdict(set)
    for c, r in enumerate(node_of):
        node_ops[index[r]].update(costs.atomic.ops(c))
    prefix = _common_prefix(units)
    b = float(costs.batch)
    nodes = []
    for i, r in enumerate(order):
        name = names[r]
        parts = _split(name) if name != ROOT_NAME else ()
        branch = "/".join(parts[:len(prefix) + 1]) if len(parts) > len(prefix) else name
        nodes.append(LayerNode(
            name=name,
            forward=(tot["fwd"][i] + tot["fwd_const"][i]) / b,
            backward=(tot["bwd"][i] + tot["bwd_const"][i]) / b,
            param_bytes=tot["params"][i],
            state_bytes=tot["state"][i] + tot["act_const"][i],
            activation_bytes=(tot["act"][i] + tot["data"][i]) / b,
            output_bytes=out_bytes[i] / b,
            update=tot["step"][i],
            branch=branch,
            # cumulative maxima: rounding can make a sum dip by an ulp where an op turns compute-bound
            forward_curve=tuple(np.maximum.accumulate(curve["forward"][i]).tolist()),
            backward_curve=tuple(np.maximum.accumulate(curve["backward"][i]).tolist()),
            ops=tuple(sorted(node_ops[i]))))
    edges = tuple(sorted((index[a], index[b_]) for a, b_ in sent))
    return LayerGraph(tuple(_unique(nodes)), edges, costs.batch, graph.name)


def _common_prefix(units: Sequence[tuple[str, ...]]) -> tuple[str, ...]:
    first = units[0]
    k = len(first)
    for u in units[1:]:
        k = min(k, len(u))
        while k and u[:k] != first[:k]:
            k -= 1
    return first[:k] if len(units) > 1 else first[:-1]


def _unique(nodes: list[LayerNode]) -> list[LayerNode]:
    """Distinct names: a repeated name (two outside nodes of one module) gets '#2', '#3', ..."""
    seen: dict[str, int] = defaultdict(int)
    out = []
    for nd in nodes:
        seen[nd.name] += 1
        if seen[nd.name] > 1:
            nd = dataclasses.replace(nd, name=f"{nd.name}#{seen[nd.name]}")
        out.append(nd)
    return out


def _fused_split(graph: OpGraph, moved, scales) -> tuple[float, float]:
    """(bytes that stay, bytes that scale with the micro-batch) of the values an op moves to and
    from HBM after fusion (`core.fusion`)."""
    var = sum(graph.values[v].nbytes for v in moved if scales(v))
    return float(sum(graph.values[v].nbytes for v in moved) - var), float(var)
