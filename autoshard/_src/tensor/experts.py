"""Expert reference plans: the shardings people write by hand, as points of the search space
(pure: no jax import).

Each expert is an assignment of mesh axes to factors (logical dims), so the planner's own cost and
memory model prices it, and the audit checks it, exactly like the automatic plan. Which factors
Megatron splits is read from the program's structure (`tensor_parallel_factors`: the inner dim of
each column-parallel / row-parallel matmul pair), so it applies whatever the modules are called;
only the vocabulary is still recognised by the embedding's keypath.

* data-parallel: the batch on every mesh axis, parameters and optimizer state replicated.
* fsdp: the batch on every axis, parameters and optimizer state sharded (ZeRO-3).
* megatron: tensor parallelism on every axis: attention heads and the FFN hidden dim split
  (column-parallel q/k/v/fc1, row-parallel o/fc2), the vocabulary of the embedding and an untied
  head split; a chain of dense layers alternates column and row.
* data-megatron: 2-D: the batch on every axis but the last, Megatron's splits on the last
  (tensor parallelism on the innermost, fastest axis, as Megatron-LM places it).
* megatron-sp: Megatron-LM's tensor parallelism with sequence parallelism (Korthikanti et al.
  2022) on the last axis, the batch on the others (a 1-D mesh: tensor parallelism alone): the
  residual stream between the tensor-parallel regions (norms, residual adds, dropout) split along
  the sequence over the tensor-parallel axis; all-gather into the column-parallel matmuls,
  reduce-scatter out of the row-parallel ones. Priced in the space whose stream is cut from the
  regions (regions.py).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

from ..core.graph import OpGraph
from ..core.mesh import MeshSpec
from .factors import FactorGraph, weight_values

EXPERTS = ("data-parallel", "fsdp", "megatron", "data-megatron", "megatron-sp")

# (pattern over "a/b/c" keypaths, dim to split); the pattern is searched, so a prefix may precede it
VOCAB_RULES: tuple[tuple[str, int], ...] = (
    (r"(^|/)(wte|embed|embedding|embeddings|token_embed|token_embedding|tok_embeddings|shared)/embedding$", 0),
    (r"(^|/)(lm_head|head)/kernel$", -1),
)
# position tables (T5's relative attention bias, learned positions) look like embeddings but
# Megatron-LM keeps them whole: their rows are buckets or positions, not the vocabulary
NOT_VOCAB = re.compile(r"(^|/)(relative_attention_bias|rel_pos\w*|pos_emb\w*|position\w*|wpe)(/|$)")


@functools.lru_cache(maxsize=16384)   # the planner asks per parameter and per submesh shape
def keypath_path(keypath: str) -> str:
    """"[0]['block_0']['attn']['q']['kernel']" -> "block_0/attn/q/kernel" (argument index dropped)."""
    parts = re.findall(r"\['([^']*)'\]|\.([A-Za-z_]\w*)|\[(\d+)\]", keypath)
    comps = [a or b or c for a, b, c in parts]
    while comps and comps[-1] in ("value", "raw_value"):  # nnx Variable wrappers
        comps = comps[:-1]
    return "/".join(comps[1:]) if comps and keypath.startswith("[") else "/".join(comps)


def batch_factors(graph: OpGraph, fg: FactorGraph) -> list[int]:
    """The leading dim of every data input: the batch."""
    out: list[int] = []
    for v in graph.inputs:
        val = graph.values[v]
        if val.role == "data" and val.shape:
            f = fg.value_factors(v)[0]
            if f is not None and f not in out:
                out.append(f)
    return out


def region_twins(fg: FactorGraph, factors: list[int]) -> list[int]:
    """`factors` and their twins across region boundaries (`FactorGraph.cuts`: the group dim of an MoE
    layer's tokens as the experts see it): an expert splitting the batch splits it there too."""
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


def tensor_parallel_factors(graph: OpGraph, fg: FactorGraph, in_map: dict[int, int]) -> list[int]:
    """`_tensor_parallel_factors`, once per factor graph and input map (the 3-D search asks per submesh)."""
    hit = fg.builds.get(("tensor-parallel factors", id(in_map)))
    if hit is not None and hit[0] is in_map and fg.graph is graph:
        return list(hit[1])
    out = _tensor_parallel_factors(graph, fg, in_map)
    fg.builds[("tensor-parallel factors", id(in_map))] = (in_map, tuple(out))
    return out


def _tensor_parallel_factors(graph: OpGraph, fg: FactorGraph, in_map: dict[int, int]) -> list[int]:
    """Factors Megatron splits, found from the program's structure, not from names: the inner dim of a
    column-parallel / row-parallel matmul pair. A factor qualifies when a forward matmul of activations
    by weights produces it (a weight dim the activation lacks: the FFN hidden dim, the attention heads),
    a later such matmul contracts it, it is in no data input, and nothing between reduces over it (a
    norm's mean over the model dim, attention's scores contracting head_dim, a loss over the vocabulary).
    Along a chain of dense layers the pairs alternate: a factor sharing a weight with one already taken
    is left whole (column, row, column, ...). Works on Flax default names (`Dense_0`), on
    `nn.MultiHeadDotProductAttention` (heads, not head_dim), nnx modules and flat dicts of weights."""
    weights = weight_values(graph, sorted(fg.op_factors))
    data = {f for v in graph.inputs if graph.values[v].role == "data" for f in fg.value_factors(v) if f is not None}
    produced: dict[int, int] = {}          # factor -> first op producing it (program order)
    contracted: set[int] = set()
    reduced_elsewhere: set[int] = set()
    for i in sorted(fg.op_factors):
        op, of = graph.ops[i], fg.op_factors[i]
        if op.phase != "forward":
            continue
        w = [v in weights for v in op.inputs]
        if op.primitive == "dot_general" and len(w) == 2 and w.count(True) == 1:
            act = fg.value_factors(op.inputs[w.index(False)])
            for f in of.out_factors:
                if f is not None and f not in act:
                    produced.setdefault(f, i)
            contracted |= of.reduced
        else:
            reduced_elsewhere |= of.reduced
    param_factors = set()
    for v in graph.inputs:
        val = graph.values[v]
        if val.role == "parameter" and len(val.shape) >= 2:
            param_factors |= {f for f in fg.value_factors(in_map.get(v, v)) if f is not None}
    # a weight's reshape counts too: a fused q/k/v kernel's heads are a dim of its exposed view only
    # (bridge/trace/fused.py)
    for i in fg.op_factors:
        op = graph.ops[i]
        if op.primitive == "reshape" and op.inputs and op.inputs[0] in weights and len(op.out_shapes[0]) >= 2:
            param_factors |= {f for f in fg.value_factors(op.outputs[0]) if f is not None}
    candidates = [f for f in sorted(produced, key=produced.get)
                  if f in contracted and f in param_factors and f not in data and f not in reduced_elsewhere
                  and f not in fg.repeated]
    chosen: list[int] = []
    for f in candidates:        # alternate along chains: never two split dims in one tensor
        if not any(h in fg.cooccur.get(f, ()) for h in chosen):
            chosen.append(f)
    # the vocabulary (embedding rows, an untied head's columns): Megatron-LM's vocab-parallel split
    return chosen + [f for f in vocab_factors(graph, fg, in_map) if f not in chosen]


def _fits(fg: FactorGraph, factors: Sequence[int], mesh: MeshSpec, axes: Sequence[str]) -> bool:
    n = 1
    for a in axes:
        n *= mesh.axis_size(a)
    return all(fg.divides(f, n) for f in factors)


def expert_assignments(graph: OpGraph, fg: FactorGraph, in_map: dict[int, int], mesh: MeshSpec
                       ) -> dict[str, tuple[dict[int, tuple[str, ...]], str] | str]:
    """name -> (factor -> mesh axes, storage mode), or a string saying why the expert does not
    apply (a dim that does not divide its axes, no tensor-parallel parameters, a 1-D mesh)."""
    names = tuple(mesh.names)
    batch = region_twins(fg, batch_factors(graph, fg))
    tp = [f for f in tensor_parallel_factors(graph, fg, in_map) if f not in batch]
    out: dict[str, tuple[dict[int, tuple[str, ...]], str] | str] = {}
    why_batch = (f"the batch does not divide the {mesh.size} devices of mesh {mesh}"
                 if not _fits(fg, batch, mesh, names) else "")
    for name, storage in (("data-parallel", "replicated"), ("fsdp", "zero3")):
        out[name] = why_batch or ({f: names for f in batch}, storage)
    if not tp:
        out["megatron"] = out["data-megatron"] = out["megatron-sp"] = "no parameter matches the tensor-parallel rules"
        return out
    # a vocabulary that does not divide the tensor-parallel axes stays replicated (Megatron-LM
    # pads it instead, which changes the model); heads or FFN that do not divide: not applicable
    vocab = set(vocab_factors(graph, fg, in_map))

    def split(axes: Sequence[str]) -> list[int] | str:
        bad = [f for f in tp if not _fits(fg, [f], mesh, axes) and f not in vocab]
        if bad:
            return f"tensor-parallel dims {', '.join(_not_dividing(fg, f, mesh, axes) for f in bad)} do not divide " \
                   f"axes {tuple(axes)}"
        return [f for f in tp if _fits(fg, [f], mesh, axes)]

    tp_all = split(names)
    out["megatron"] = tp_all if isinstance(tp_all, str) else ({f: names for f in tp_all}, "replicated")
    if len(names) < 2:
        out["data-megatron"] = "needs a mesh with at least two axes"
    else:
        data_axes, model_axes = names[:-1], names[-1:]
        tp_model = split(model_axes)
        if isinstance(tp_model, str):
            out["data-megatron"] = tp_model
        elif not _fits(fg, batch, mesh, data_axes):
            out["data-megatron"] = f"the batch does not divide axes {data_axes}"
        else:
            fa = {f: data_axes for f in batch}
            fa.update({f: model_axes for f in tp_model})
            out["data-megatron"] = (fa, "replicated")
    out["megatron-sp"] = _sequence_parallel(fg, out["megatron"] if len(names) < 2 else out["data-megatron"], mesh)
    for name, a in out.items():
        if not isinstance(a, str):
            clash = _clash(fg, a[0])
            if clash:
                out[name] = clash
    return out


def _sequence_parallel(fg: FactorGraph, megatron, mesh: MeshSpec):
    """Megatron's assignment (tensor parallelism on the last axis) plus the residual stream's sequence
    dims on that axis (those sharing no tensor with a dim split on it), or why not."""
    if isinstance(megatron, str):
        return megatron
    if not fg.sequence and fg.expert_cuts:
        return "sequence parallelism is not searched with mixture-of-experts regions"
    if not fg.sequence:
        return ("the values between tensor-parallel regions have no dim besides the batch and the model dims "
                "(no sequence to split)")
    fa = dict(megatron[0])
    tp_axes = tuple(mesh.names[-1:])
    busy = [f for f, axes in fa.items() if set(axes) & set(tp_axes)]
    seq: list[int] = []
    for f in sorted(fg.sequence):     # never two split dims of one tensor on the axis
        if f not in fa and not any(h in fg.cooccur.get(f, ()) for h in busy + seq):
            seq.append(f)
    fits = [f for f in seq if _fits(fg, [f], mesh, tp_axes)]     # others (an MoE's capacity) stay whole
    if not fits:
        return f"sequence dims {', '.join(_not_dividing(fg, f, mesh, tp_axes) for f in seq)} do not divide " \
               f"axes {tp_axes}"
    fa.update({f: tp_axes for f in fits})
    return fa, megatron[1]


def _not_dividing(fg: FactorGraph, f: int, mesh: MeshSpec, axes: Sequence[str]) -> str:
    """The sizes of one logical dim that a split over `axes` does not divide: a dim is also seen as its
    parts (768 = 12 heads x 64), and the parts must divide too ("of size 12 (heads of 768)")."""
    n = 1
    for a in axes:
        n *= mesh.axis_size(a)
    sizes = sorted(set(fg.factor_sizes.get(f, ())))
    failing = [s for s in sizes if s % n]
    whole = [s for s in sizes if s not in failing]
    return f"of size {failing}" + (f" (parts of the dim of size {max(whole)})" if whole else "")


def _clash(fg: FactorGraph, fa: dict[int, tuple[str, ...]]) -> str:
    """Two factors of one tensor on the same axis cannot be expressed as a sharding."""
    for f, axes in fa.items():
        for h in fg.cooccur.get(f, ()):
            if h != f and h in fa and set(axes) & set(fa[h]):
                return (f"dims of sizes {fg.factor_size(f)} and {fg.factor_size(h)} of one tensor would share "
                        f"mesh axes {sorted(set(axes) & set(fa[h]))}")
    return ""


def vocab_factors(graph: OpGraph, fg: FactorGraph, in_map: dict[int, int]) -> list[int]:
    out = []
    for v in graph.inputs:
        val = graph.values[v]
        if val.role == "parameter" and len(val.shape) >= 2:
            dims = _rule_dims(keypath_path(val.keypath or ""), vocab_only=True)
            fs = fg.value_factors(in_map.get(v, v)) if dims else ()
            for d in dims:
                if len(fs) == len(val.shape) and fs[d] is not None:
                    out.append(fs[d])
    return out


@functools.lru_cache(maxsize=16384)
def _rule_dims(path: str, vocab_only: bool) -> tuple[int, ...]:
    """The dims the column, row and vocabulary rules split in the parameter at `path` (only the
    vocabulary rules' with `vocab_only`), in rule order."""
    vocab = () if NOT_VOCAB.search(path) else VOCAB_RULES
    return tuple(d for pat, d in vocab if re.search(pat, path))
