"""The vocabulary of a step, found from the program's structure (pure: no jax import).

Megatron-LM splits the vocabulary: the rows of the token embedding (VocabParallelEmbedding) and the
columns of the LM head with the cross-entropy over them (vocab-parallel cross entropy). Which dims
those are is read from what the program does with its parameters, whatever the modules are called
(`wte`, `embed_tokens`, `word_embeddings`, an `nnx.Embed`, a flat `{"tok": ...}` read by `jnp.take`):

* a *lookup table* is a parameter (or a cast of one) that a forward `gather` indexes (`jnp.take`,
  `table[ids]`, `nn.Embed`), or that a forward matmul contracts against a one-hot of integers
  (`jax.nn.one_hot(ids, V) @ table`); its indexed dims are its rows. The table is *data-indexed*
  when its indices are computed from a data input (token ids), not from `iota`/constants alone
  (learned positions, T5's relative-attention buckets: computed from `arange`);
* the *logits* are a dim a forward matmul of activations by weights produces (a weight dim the
  activation lacks) and a forward max-reduction reduces (the loss's log-softmax, a softmax, an
  argmax), except the experts of a mixture-of-experts layer (a batch dim of a weight matmul, and
  that dim's twin across the layer's regions: the router's logits);
* the vocabulary: the data-indexed tables *linked* to the logits (the same dim: a tied head; or the
  same size: an untied head, as Llama's `embed_tokens` and `lm_head`), and the logits linked to
  them. Other data-indexed tables (token types, positions passed in as data) are then not the
  vocabulary. With no logits linked to a table (an encoder without an LM head, a recommender's
  tables) structure cannot tell a word table from a position table passed in as data: only then
  does a keypath pattern (`NOT_VOCAB`) decide, as a last resort; every logit dim of such a step
  counts (a classifier's head: vocab-parallel cross entropy over its classes).
"""

from __future__ import annotations

import dataclasses
import functools
import re

from ..core.graph import OpGraph
from .factors import FactorGraph, weight_values
from .link_rules import _dn5
from .regions import region_twins

# last resort only (see the module docstring): position tables passed in as data look like
# embeddings of the data, and Megatron-LM keeps them whole
NOT_VOCAB = re.compile(r"(^|/)(relative_attention_bias|rel_pos\w*|pos_emb\w*|position\w*|wpe)(/|$)")
_MAX_REDUCTIONS = frozenset({"reduce_max", "argmax", "reduce_min", "argmin"})
# ops a one-hot passes through between its comparison and the matmul
_ONE_HOT_PATH = frozenset({"convert_element_type", "reshape", "broadcast_in_dim", "transpose", "copy",
                           "squeeze", "expand_dims"})
_WALK_LIMIT = 4096          # values visited when finding where indices come from


@dataclasses.dataclass(frozen=True)
class Table:
    """A lookup: op `op` reads rows `dims` (factor `factor`, `size` rows) of the table value `value`."""

    op: int
    value: int
    dims: tuple[int, ...]
    factor: int
    size: int
    data_indexed: bool


@functools.lru_cache(maxsize=16384)
def keypath_path(keypath: str) -> str:
    """"[0]['block_0']['attn']['q']['kernel']" -> "block_0/attn/q/kernel" (argument index dropped)."""
    parts = re.findall(r"\['([^']*)'\]|\.([A-Za-z_]\w*)|\[(\d+)\]", keypath)
    comps = [a or b or c for a, b, c in parts]
    while comps and comps[-1] in ("value", "raw_value"):  # nnx Variable wrappers
        comps = comps[:-1]
    return "/".join(comps[1:]) if comps and keypath.startswith("[") else "/".join(comps)


def origins(graph: OpGraph, v: int) -> frozenset[str]:
    """Where value `v` comes from: the roles of the program inputs it is computed from ("data",
    "parameter", ...) plus "iota" when an iota feeds it (constants and literals add nothing)."""
    seen, todo, out = {v}, [v], set()
    while todo and len(seen) < _WALK_LIMIT:
        val = graph.values[todo.pop()]
        if val.producer is None:
            if val.role:
                out.add(val.role)
            continue
        op = graph.ops[val.producer]
        if op.primitive == "iota":
            out.add("iota")
        for u in op.inputs:
            if u not in seen:
                seen.add(u)
                todo.append(u)
    return frozenset(out)


def lookup_tables(graph: OpGraph, fg: FactorGraph) -> list[Table]:
    """Every forward lookup of a parameter-derived table among `fg`'s ops (program order)."""
    hit = fg.builds.get(("lookup tables",))
    if hit is not None:
        return hit
    weights = weight_values(graph, sorted(fg.op_factors))
    out: list[Table] = []
    for i in sorted(fg.op_factors):
        op = graph.ops[i]
        if op.phase != "forward" or len(op.inputs) < 2:
            continue
        if op.primitive == "gather" and op.inputs[0] in weights and "dimension_numbers" in op.params:
            rows = tuple(_dn5(op.params["dimension_numbers"])[2])
            out.extend(_table(graph, fg, i, 0, rows, op.inputs[1]))
        elif op.primitive == "dot_general" and "contracting" in op.params:
            w = [v in weights for v in op.inputs]
            if w.count(True) != 1:
                continue
            k = w.index(True)
            hot = _one_hot_indices(graph, op.inputs[1 - k])
            if hot is not None:
                out.extend(_table(graph, fg, i, k, tuple(op.params["contracting"][k]), hot))
    fg.builds[("lookup tables",)] = out
    return out


def _table(graph: OpGraph, fg: FactorGraph, i: int, k: int, rows: tuple[int, ...], indices: int) -> list[Table]:
    """The lookup of op `i`'s operand `k` along `rows` (one Table per row dim that has a factor)."""
    op = graph.ops[i]
    shape = op.in_shapes[k]
    fs = fg.value_factors(op.inputs[k], len(shape))
    data = "data" in origins(graph, indices)
    return [Table(i, op.inputs[k], rows, fs[d], shape[d], data) for d in rows if fs[d] is not None]


def _one_hot_indices(graph: OpGraph, v: int) -> int | None:
    """The integer value `v` is a one-hot of (`eq` of it with an iota, through casts and layout
    ops), or None when `v` is no one-hot."""
    for _ in range(8):
        p = graph.values[v].producer
        if p is None:
            return None
        op = graph.ops[p]
        if op.primitive == "eq" and len(op.inputs) == 2:
            kinds = [origins(graph, u) for u in op.inputs]
            for a, b in ((0, 1), (1, 0)):
                if kinds[a] == {"iota"} and "iota" not in kinds[b] and kinds[b]:
                    return op.inputs[b]
            return None
        if op.primitive not in _ONE_HOT_PATH:
            return None
        v = op.inputs[0]
    return None


def activation_operand(op, weights: set[int]) -> int | None:
    """The activation operand's position in a matmul of one activation by one weight, else None."""
    w = [v in weights for v in op.inputs]
    if op.primitive == "dot_general" and len(w) == 2 and w.count(True) == 1:
        return w.index(False)
    return None


def forward_ops(graph: OpGraph, fg: FactorGraph):
    """(index, op, its factors, the activation operand's position when it is a matmul by a weight, else None)
    of the analysed forward ops, in program order."""
    weights = weight_values(graph, sorted(fg.op_factors))
    for i in sorted(fg.op_factors):
        op = graph.ops[i]
        if op.phase == "forward":
            yield i, op, fg.op_factors[i], activation_operand(op, weights)


def logit_factors(graph: OpGraph, fg: FactorGraph, experts: frozenset[int] = frozenset()) -> list[int]:
    """Dims a forward matmul of activations by weights produces and a forward max-reduction reduces
    (the log-softmax of a loss), except `experts` (a mixture-of-experts router's logits); program order."""
    produced: dict[int, int] = {}
    maxed: set[int] = set()
    for i, op, of, k in forward_ops(graph, fg):
        if k is not None:
            act = fg.value_factors(op.inputs[k], len(op.in_shapes[k]))
            for f in of.out_factors:
                if f is not None and f not in act:
                    produced.setdefault(f, i)
        elif op.primitive in _MAX_REDUCTIONS:
            maxed |= of.reduced
    return [f for f in sorted(produced, key=produced.get) if f in maxed and f not in experts
            and f not in fg.repeated]


def expert_factors(graph: OpGraph, fg: FactorGraph) -> frozenset[int]:
    """The batch dims of forward weight matmuls (a mixture-of-experts layer's experts: E x D x F)."""
    weights = weight_values(graph, sorted(fg.op_factors))
    out: set[int] = set()
    for i in sorted(fg.op_factors):
        op = graph.ops[i]
        if op.phase != "forward" or op.primitive != "dot_general" or "batch" not in op.params:
            continue
        for k, v in enumerate(op.inputs[:2]):
            if v in weights and op.inputs[1 - k] not in weights:
                fs = fg.value_factors(v, len(op.in_shapes[k]))
                out.update(fs[d] for d in op.params["batch"][k] if fs[d] is not None)
    return frozenset(out)


def table_keypath(graph: OpGraph, v: int) -> str:
    """The keypath of the parameter a table value is read from ("" when none)."""
    seen, todo = {v}, [v]
    while todo and len(seen) < _WALK_LIMIT:
        val = graph.values[todo.pop(0)]
        if val.producer is None:
            if val.role == "parameter":
                return val.keypath or ""
            continue
        for u in graph.ops[val.producer].inputs:
            if u not in seen:
                seen.add(u)
                todo.append(u)
    return ""


def vocab_factors(graph: OpGraph, fg: FactorGraph) -> list[int]:
    """The vocabulary's factors (see the module docstring): table rows first, then logits, each once."""
    hit = fg.builds.get(("vocab factors",))
    if hit is not None:
        return list(hit)
    experts = frozenset(region_twins(fg, sorted(expert_factors(graph, fg))))
    tables = [t for t in lookup_tables(graph, fg) if t.data_indexed]
    logits = logit_factors(graph, fg, experts)
    sizes = {fg.factor_size(f) for f in logits}
    linked = [t for t in tables if t.factor in logits or t.size in sizes]
    if linked:
        rows = [t.factor for t in linked]
        heads = [f for f in logits if f in rows or fg.factor_size(f) in {t.size for t in linked}]
    else:
        # structure cannot decide between a word table and a position table passed in as data:
        # the keypath decides, the only name-based rule left (module docstring)
        rows = [t.factor for t in tables if not NOT_VOCAB.search(keypath_path(table_keypath(graph, t.value)))]
        heads = logits
    out = tuple(dict.fromkeys(f for f in rows + heads if f not in experts))
    fg.builds[("vocab factors",)] = out
    return list(out)
