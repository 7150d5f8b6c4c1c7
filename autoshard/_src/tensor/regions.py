"""Regions of a step whose tensors change layout (pure: no jax import).

A factor (logical dim, factors.py) takes one mesh axis for the whole program, unless a value is *cut*:
its consumers on the far side of a region boundary read it under factors of their own, so a plan may
lay it out differently there and pays for the move (an all-to-all, an all-gather, a reduce-scatter in
place of an all-reduce; evaluator.py prices them, emission pins both layouts). Two kinds of regions
are found from the program's structure, never from names:

* mixture-of-experts layers (`_expert_cuts`): tokens dispatched to the experts and the experts'
  outputs returning to the tokens (GShard's expert parallelism: groups split for attention, experts
  for the expert FFNs, an all-to-all between);
* grouped-query attention (`_repeat_cuts`): the key/value heads repeated for the query heads they
  serve; the query heads may split where the fewer kv heads cannot (Megatron-LM then keeps k/v whole:
  a local slice into the repeat, an all-gather of its cotangent out of it);
* tensor-parallel regions (`_sequence_cuts`): the ops that touch a Megatron factor (heads, FFN hidden,
  vocabulary) against the residual stream between them (norms, residual adds, dropout). Cutting the
  stream's token dims where it enters and leaves them lets the plan split the sequence over the
  tensor-parallel axis outside them (Megatron-SP: all-gather before the column-parallel matmul,
  reduce-scatter after the row-parallel one), which divides the stream's activation memory by the
  tensor-parallel degree for the bytes Megatron's all-reduces already move.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from ..core.graph import OpGraph, inputs_with_role
from .factors import FactorGraph, link_factors, weight_values
from .link_rules import _key

Subs = dict[int, dict[int, tuple[int, int]]]
# producers whose partial sums XLA reduce-scatters straight into a split layout; a gather's partial
# lookup (a vocabulary-parallel embedding) is all-reduced first: split, XLA gathers the table instead
REDUCE_SCATTERED = frozenset({"dot_general", "conv_general_dilated"})


def analyze(graph: OpGraph, ops: Iterable[int], same_ops: Sequence[tuple[int, int]] = (),
            tensor_parallel: tuple[FactorGraph, Collection[int]] | None = None,
            linked: FactorGraph | None = None) -> FactorGraph:
    """Factors of the subgraph made of `ops` (indices), with its mixture-of-experts layers cut into
    regions; `same_ops` pairs corresponding ops of two instances of one block type.

    `tensor_parallel`: (this subgraph's uncut factor graph, the factors Megatron splits in it): cut the
    residual stream from the tensor-parallel regions too, so sequence parallelism is in the space.
    `linked`: `link_factors(graph, ops, same_ops)` when the caller has it (read, not modified)."""
    ops = sorted(set(ops))
    fg = linked if linked is not None else link_factors(graph, ops, same_ops)
    subs = _expert_cuts(graph, ops, fg)
    expert_values = frozenset(v for per_op in subs.values() for v, _ in per_op.values())
    repeat_subs, kept = _repeat_cuts(graph, ops, fg)
    for i, per_op in repeat_subs.items():
        for k, cut in per_op.items():
            subs.setdefault(i, {}).setdefault(k, cut)
    repeat_values = frozenset(v for per_op in repeat_subs.values() for v, _ in per_op.values())
    sequence: set[int] = set()
    inside: set[int | None] = set()
    seq_kept: dict[int, tuple[int, ...]] = {}
    if tensor_parallel is not None:
        seq_subs, seq_kept, stream_dims, joined = _sequence_cuts(graph, ops, *tensor_parallel)
        for i, per_op in seq_subs.items():
            for k, cut in per_op.items():
                if cut[0] not in repeat_values:       # a value is cut once (one layout per side)
                    subs.setdefault(i, {}).setdefault(k, cut)
                    kept.setdefault(cut[1], seq_kept[cut[1]])
    if not subs:
        return fg
    fg = link_factors(graph, ops, same_ops, subs, kept, joined if tensor_parallel is not None else ())
    cut_values = sorted({(v, cid) for per_op in subs.values() for v, cid in per_op.values()})
    cuts = []
    for v, cid in cut_values:
        shape = graph.values[v].shape
        after = tuple(fg.factor_of.get(_key(cid, d, len(shape))) if shape[d] != 1 else None
                      for d in range(len(shape)))
        before = fg.value_factors(v)
        cuts.append((v, before, after))
        if tensor_parallel is not None and cid in seq_kept and v not in repeat_values:
            stream, region = (before, after) if v in stream_dims[0] else (after, before)
            cut_dims = [d for d in range(len(shape)) if d - len(shape) not in kept[cid]]
            sequence.update(stream[d] for d in cut_dims if stream[d] is not None)
            inside.update(region[d] for d in cut_dims)
    fg.cuts = tuple(cuts)
    readers: dict[int, set[int]] = {}
    for i, per_op in subs.items():
        for v, _ in per_op.values():
            readers.setdefault(v, set()).add(i)
    fg.cut_readers = {v: frozenset(ops_) for v, ops_ in readers.items()}
    fg.sequence = frozenset(sequence - inside)
    fg.expert_cuts = expert_values
    fg.repeat_cuts = repeat_values
    return fg


def region_twins(fg: FactorGraph, factors: list[int]) -> list[int]:
    """`factors` and their twins across region boundaries (`FactorGraph.cuts`: the group dim of an MoE
    layer's tokens as the experts see it): an expert plan splitting the batch splits it there too."""
    out = list(factors)
    changed = True
    while changed:
        changed = False
        for _, before, after in fg.cuts:
            for b, a in zip(before, after, strict=True):
                for x, y in ((b, a), (a, b)):
                    if x in out and y is not None and y not in out:
                        out.append(y)
                        changed = True
    return out


def constant_values(graph: OpGraph, ops: Sequence[int]) -> set[int]:
    """Values computed from no input at all (an iota, a causal mask, positions): cheap to compute in
    any layout, never worth a collective."""
    const: set[int] = set()
    for i in ops:
        op = graph.ops[i]
        if all(graph.values[v].kind == "literal" or v in const for v in op.inputs):
            const.update(op.outputs)
    return const


def _is_index(dtype: str) -> bool:
    """Integer and boolean values (token ids, labels, masks) follow the lookups that read them: a
    vocabulary-parallel embedding gathers with its own indices, never the stream's."""
    return dtype.startswith(("int", "uint", "bool"))


def _sequence_cuts(graph: OpGraph, ops: list[int], fg: FactorGraph, tensor_parallel: Collection[int]
                   ) -> tuple[Subs, dict[int, tuple[int, ...]], tuple[set[int]], list]:
    """Cuts between the tensor-parallel regions (ops iterating over a factor in `tensor_parallel`) and
    the rest of the step (the residual stream): a value produced on one side and read on the other is
    read there under its own token dims -- the dims whose factor is neither the batch, nor a
    dim of a matmul's weight, nor tensor-parallel (the sequence: where Megatron-SP splits). Parameters,
    constants and indices are never cut. Returns (subs, per cut id the dims kept linked, ({values entering a
    region from the stream},), dims of different regions' cuts linked)."""
    tp = set(tensor_parallel)
    weights = weight_values(graph, ops)
    const = constant_values(graph, ops)
    batch = {fg.value_factors(v)[0] for v in inputs_with_role(graph, "data") if graph.values[v].shape}
    matmul_dims: set[int] = set()
    for i in ops:
        op = graph.ops[i]
        if op.primitive in ("dot_general", "conv_general_dilated"):
            for v, s in zip(op.inputs, op.in_shapes, strict=True):
                if v in weights:
                    matmul_dims.update(f for f in fg.value_factors(v, len(s)) if f is not None)
    in_region = {i: bool(fg.op_factors[i].loop & tp) for i in ops}
    subs: Subs = {}
    kept: dict[int, tuple[int, ...]] = {}
    entering: set[int] = set()
    joined: list[tuple[tuple[int, int], tuple[int, int]]] = []
    first: dict[int, tuple[int, int]] = {}
    for i in ops:
        op = graph.ops[i]
        for k, (v, s) in enumerate(zip(op.inputs, op.in_shapes, strict=True)):
            if graph.values[v].kind == "literal" or v in weights or v in const or _is_index(graph.values[v].dtype):
                continue
            # a value from outside the analysed ops (an input, a block that is not analysed: the next
            # layer's cotangent) crosses between blocks: it is the stream
            p = graph.values[v].producer
            if in_region.get(p, False) == in_region[i]:
                continue
            fs = fg.value_factors(v, len(s))
            cut = [d for d, f in enumerate(fs) if f is not None and f not in batch | matmul_dims | tp]
            if not cut:
                continue
            subs.setdefault(i, {})[k] = (v, -1 - v)
            kept[-1 - v] = tuple(d - len(s) for d in range(len(s)) if d not in cut)
            if in_region[i]:
                entering.add(v)
                # every region reads the stream's sequence as one factor: the space grows by one
                # factor per stream dim, not one per region
                for d in cut:
                    key = (-1 - v, d - len(s))
                    if first.setdefault(fs[d], key) != key:
                        joined.append((first[fs[d]], key))
    return subs, kept, (entering,), joined


def _repeat_cuts(graph: OpGraph, ops: list[int], fg: FactorGraph) -> tuple[Subs, dict[int, tuple[int, ...]]]:
    """Where grouped-query attention repeats its key/value heads for the query heads (`jnp.repeat`),
    found from structure, never from names: a broadcast inserting a dim right after a weight's dim (the
    kv heads of k_proj's output), merged into it by a reshape; in the backward pass its transpose, a
    reshape splitting a weight's dim summed over the split-off part. The repeated value is cut (its
    consumers read the query heads under a factor of their own; the backward's reshape reads the
    cotangent under the kv heads'), the other dims kept linked. Without the cut the reshape would tie
    the kv heads to the query heads, and a query-heads split would need the kv heads to divide too.
    Returns (op -> operand position -> (value, cut id), per cut id the dims kept linked)."""
    opset = set(ops)
    wdims = {f for v in fg.factored_inputs() if graph.values[v].role in ("parameter", "buffer")
             for f in fg.value_factors(v) if f is not None}
    subs: Subs = {}
    kept: dict[int, tuple[int, ...]] = {}
    for i in ops:
        op = graph.ops[i]
        if op.primitive != "reshape" or not op.outputs:
            continue
        merged = _repeat_merge(graph, op, opset, fg, wdims)
        if merged is not None:      # the repeated value: every consumer reads the query heads
            v, rank = op.outputs[0], len(op.out_shapes[0])
            for c in graph.values[v].consumers:
                if c in opset:
                    for k, u in enumerate(graph.ops[c].inputs):
                        if u == v:
                            subs.setdefault(c, {})[k] = (v, -1 - v)
            kept[-1 - v] = tuple(d - rank for d in range(rank) if d != merged)
            continue
        split = _repeat_split(graph, op, opset, fg, wdims)
        if split is not None:       # its cotangent, read as the kv heads by the sum over the repeats
            v, rank = op.inputs[0], len(op.in_shapes[0])
            subs.setdefault(i, {})[0] = (v, -1 - v)
            kept[-1 - v] = tuple(d - rank for d in range(rank) if d != split)
    return subs, kept


def _repeat_merge(graph: OpGraph, op, opset: set[int], fg: FactorGraph, wdims: set[int]) -> int | None:
    """The dim of reshape `op`'s result that merges a weight's dim with a dim a broadcast inserted right
    after it (a repeat), or None."""
    p = graph.values[op.inputs[0]].producer
    if p is None or p not in opset or graph.ops[p].primitive != "broadcast_in_dim":
        return None
    b = graph.ops[p]
    sb, sin, out = b.out_shapes[0], b.in_shapes[0], op.out_shapes[0]
    bd = tuple(b.params.get("broadcast_dimensions", ()))
    fs = fg.value_factors(b.inputs[0], len(sin))
    for n in range(1, len(sb)):
        if n in bd or sb[n] == 1 or (n - 1) not in bd or sb[n - 1] == 1:
            continue
        f = fs[bd.index(n - 1)]
        if f in wdims and out == (*sb[:n - 1], sb[n - 1] * sb[n], *sb[n + 1:]):
            return n - 1
    return None


def _repeat_split(graph: OpGraph, op, opset: set[int], fg: FactorGraph, wdims: set[int]) -> int | None:
    """The dim of reshape `op`'s operand that it splits into (a weight's dim, a part) that a reduce_sum
    then sums away (the transpose of a repeat), or None."""
    s, out = op.in_shapes[0], op.out_shapes[0]
    if len(out) != len(s) + 1:
        return None
    fs = fg.value_factors(op.inputs[0], len(s))
    for m in range(len(s)):
        a, r = out[m], out[m + 1]
        if a == 1 or r == 1 or fs[m] not in wdims or out != (*s[:m], a, r, *s[m + 1:]):
            continue
        if any(c in opset and graph.ops[c].primitive == "reduce_sum"
               and tuple(graph.ops[c].params.get("axes", ())) == (m + 1,)
               for c in graph.values[op.outputs[0]].consumers):
            return m
    return None


_LAYOUT_OPS = frozenset({"transpose", "reshape", "convert_element_type", "copy"})


def _expert_cuts(graph: OpGraph, ops: list[int], fg: FactorGraph) -> Subs:
    """Where a mixture-of-experts layer changes layout, found from structure (no names):

    - an *expert matmul* multiplies activations by weights batched over a dim (the experts: E x D x F);
      that dim's factor is an expert factor;
    - a *combine* is a matmul of two activations reading an operand that comes (through layout ops)
      from an expert matmul: that operand is cut (the combine, the gradient of its routing weights);
    - a *dispatch* is any other matmul of two activations whose result has an expert factor while it
      contracts something else (the tokens): its result is cut.

    The backward pass has the same shapes (transposed dispatch and combine), so it is cut the same
    way. Returns op -> operand position -> (value, cut id); cut ids are negative."""
    opset = set(ops)
    weights = weight_values(graph, ops)
    expert: set[int] = set()
    batched: set[int] = set()
    for i in ops:
        op = graph.ops[i]
        if op.primitive != "dot_general" or "batch" not in op.params or len(op.inputs) != 2:
            continue
        w = [v in weights for v in op.inputs]
        if w.count(True) != 1:
            continue
        k = w.index(True)
        dims = op.params["batch"][k]
        if dims:
            fs = fg.value_factors(op.inputs[k], len(op.in_shapes[k]))
            expert.update(fs[d] for d in dims if fs[d] is not None)
            batched.update(op.outputs)
    if not expert:
        return {}

    def from_experts(v: int) -> bool:
        for _ in range(8):                   # a short chain of layout ops at most
            if v in batched:
                return True
            p = graph.values[v].producer
            if p is None or p not in opset or graph.ops[p].primitive not in _LAYOUT_OPS:
                return False
            v = graph.ops[p].inputs[0]
        return False

    subs: Subs = {}
    for i in ops:
        op = graph.ops[i]
        if op.primitive != "dot_general" or "contracting" not in op.params or len(op.inputs) != 2 \
                or any(v in weights for v in op.inputs):
            continue
        of = fg.op_factors[i]
        cut_in = [k for k, v in enumerate(op.inputs) if from_experts(v)]
        if cut_in:
            for k in cut_in:
                subs.setdefault(i, {})[k] = (op.inputs[k], -1 - op.inputs[k])
        elif not cut_in and set(of.out_factors) & expert and of.reduced - expert:
            v = op.outputs[0]
            for c in graph.values[v].consumers:
                if c in opset:
                    for k, u in enumerate(graph.ops[c].inputs):
                        if u == v:
                            subs.setdefault(c, {})[k] = (v, -1 - v)
    return subs


