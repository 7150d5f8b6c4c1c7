"""Expert reference plans: the shardings people write by hand, as points of the search space
(pure: no jax import).

Each expert is an assignment of mesh axes to factors (logical dims), so the planner's own cost and
memory model prices it, and the audit checks it, exactly like the automatic plan. Which factors
Megatron splits is read from the program's structure (`tensor_parallel_factors`: the inner dim of
each column-parallel / row-parallel matmul pair) and the vocabulary from what reads it (`vocab.py`: the
rows of a table the token ids index, the logits of the loss), so it applies whatever the modules are called.

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

from collections.abc import Sequence

from ..core.graph import OpGraph, inputs_with_role
from ..core.mesh import MeshSpec
from .factors import FactorGraph, weight_values
from .regions import region_twins
from .vocab import forward_ops, vocab_factors

EXPERTS = ("data-parallel", "fsdp", "megatron", "data-megatron", "megatron-sp")


def batch_factors(graph: OpGraph, fg: FactorGraph) -> list[int]:
    """The leading dim of every data input: the batch."""
    out: list[int] = []
    for v in inputs_with_role(graph, "data"):
        val = graph.values[v]
        if val.shape:
            f = fg.value_factors(v)[0]
            if f is not None and f not in out:
                out.append(f)
    return out


def tensor_parallel_factors(graph: OpGraph, fg: FactorGraph, in_map: dict[int, int]) -> list[int]:
    """The factors Megatron splits: `tensor_parallel_parts`' three in order, each once."""
    return list(dict.fromkeys(f for part in tensor_parallel_parts(graph, fg, in_map) for f in part))


def tensor_parallel_parts(graph: OpGraph, fg: FactorGraph, in_map: dict[int, int]
                          ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(column/row pairs' inner dims, grouped-query attention's kv heads twinned to query heads among
    them, the vocabulary), once per factor graph and input map (the 3-D search asks per submesh)."""
    hit = fg.builds.get(("tensor-parallel factors", id(in_map)))
    if hit is not None and hit[0] is in_map and fg.graph is graph:
        return hit[1]
    chosen = tuple(_tensor_parallel_factors(graph, fg, in_map))
    out = (chosen, tuple(repeat_twins(fg, chosen)), tuple(vocab_factors(graph, fg)))
    fg.builds[("tensor-parallel factors", id(in_map))] = (in_map, out)
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
    data = {f for v in inputs_with_role(graph, "data") for f in fg.value_factors(v) if f is not None}
    produced: dict[int, int] = {}          # factor -> first op producing it (program order)
    contracted: set[int] = set()
    reduced_elsewhere: set[int] = set()
    for i, op, of, k in forward_ops(graph, fg):
        if k is not None:
            act = fg.value_factors(op.inputs[k])
            for f in of.out_factors:
                if f is not None and f not in act:
                    produced.setdefault(f, i)
            contracted |= of.reduced
        else:
            reduced_elsewhere |= of.reduced
    param_factors = set()
    for src in {in_map.get(v, v) for v in inputs_with_role(graph, "parameter") if len(graph.values[v].shape) >= 2}:
        param_factors |= {f for f in fg.value_factors(src) if f is not None}
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
    return chosen


def repeat_twins(fg: FactorGraph, factors: Sequence[int]) -> list[int]:
    """The kv heads of grouped-query attention whose repeats are the query heads in `factors`
    (`FactorGraph.repeat_cuts`: each repeated value's dims as produced and as its consumers read them)."""
    out: list[int] = []
    for v, before, after in fg.cuts:
        if v in fg.repeat_cuts:
            for b, a in zip(before, after, strict=True):
                for x, y in ((a, b), (b, a)):
                    if x in factors and y is not None and y not in factors and y not in out:
                        out.append(y)
    return out


def optional_factors(graph: OpGraph, fg: FactorGraph, in_map: dict[int, int]) -> set[int]:
    """Tensor-parallel factors Megatron-LM leaves whole when they do not divide its axes: the vocabulary
    (it pads it instead, which changes the model) and kv heads fewer than the tensor-parallel degree (it
    replicates k/v: multi-query attention's one head, grouped-query attention's few)."""
    chosen, twins, vocab = tensor_parallel_parts(graph, fg, in_map)
    return (set(twins) | set(vocab)) - set(chosen)


class NotApplicable(str):
    """Why an expert plan does not apply: a str (as plans record it) with the fix to suggest (`fix`)."""

    fix: str

    def __new__(cls, text: str, fix: str = "") -> NotApplicable:
        self = super().__new__(cls, text)
        self.fix = fix
        return self


_MESH_FIX = "Fix: choose a mesh whose axis sizes divide the split dimensions."


def _devices(mesh: MeshSpec, axes: Sequence[str]) -> int:
    n = 1
    for a in axes:
        n *= mesh.axis_size(a)
    return n


def _fits(fg: FactorGraph, factors: Sequence[int], mesh: MeshSpec, axes: Sequence[str]) -> bool:
    n = _devices(mesh, axes)
    return all(fg.divides(f, n) for f in factors)


def expert_assignments(graph: OpGraph, fg: FactorGraph, in_map: dict[int, int], mesh: MeshSpec
                       ) -> dict[str, tuple[dict[int, tuple[str, ...]], str] | str]:
    """name -> (factor -> mesh axes, storage mode), or a `NotApplicable` saying why the expert does not
    apply, naming the parameter dims that stop it (a dim that does not divide its axes, no
    tensor-parallel parameters, a 1-D mesh)."""
    names = tuple(mesh.names)
    batch = region_twins(fg, batch_factors(graph, fg))
    tp = [f for f in tensor_parallel_factors(graph, fg, in_map) if f not in batch]
    out: dict[str, tuple[dict[int, tuple[str, ...]], str] | str] = {}
    why_batch = _indivisible(graph, fg, in_map, "the batch", batch, mesh, names,
                             f"the {mesh.size} devices of mesh {mesh}")
    for name, storage in (("data-parallel", "replicated"), ("fsdp", "zero3")):
        out[name] = why_batch or ({f: names for f in batch}, storage)
    if not tp:
        out["megatron"] = out["data-megatron"] = out["megatron-sp"] = NotApplicable(
            "no tensor-parallel dim: no forward matmul produces a weight dim that a later one contracts (a "
            "column-parallel / row-parallel pair) and no table is indexed by the data (a vocabulary)",
            "Fix: use the data-parallel or fsdp expert for this step.")
        return out
    # a vocabulary or kv heads that do not divide the tensor-parallel axes stay replicated (Megatron-LM
    # pads the vocabulary, replicates k/v); query heads or FFN that do not divide: not applicable
    optional = optional_factors(graph, fg, in_map)

    def split(axes: Sequence[str]) -> list[int] | str:
        bad = [f for f in tp if f not in optional]
        why = _indivisible(graph, fg, in_map, "tensor-parallel dims", bad, mesh, axes)
        return why or [f for f in tp if _fits(fg, [f], mesh, axes)]

    tp_all = split(names)
    out["megatron"] = tp_all if isinstance(tp_all, str) else ({f: names for f in tp_all}, "replicated")
    out["data-megatron"] = _data_megatron(graph, fg, in_map, mesh, batch, split)
    out["megatron-sp"] = _sequence_parallel(graph, fg, in_map, out["megatron"] if len(names) < 2
                                            else out["data-megatron"], mesh)
    for name, a in out.items():
        if not isinstance(a, str):
            clash = _clash(graph, fg, in_map, a[0])
            if clash:
                out[name] = clash
    return out


def _data_megatron(graph: OpGraph, fg: FactorGraph, in_map: dict[int, int], mesh: MeshSpec, batch: list[int],
                   split) -> tuple[dict[int, tuple[str, ...]], str] | str:
    """The batch on every axis but the last, `split`'s tensor-parallel factors on the last, or why not."""
    names = tuple(mesh.names)
    if len(names) < 2:
        return NotApplicable("needs a mesh with at least two axes",
                             'Fix: give the mesh a data and a model axis, e.g. {"data": 2, "model": 4}.')
    data_axes, model_axes = names[:-1], names[-1:]
    tp_model = split(model_axes)
    if isinstance(tp_model, str):
        return tp_model
    why = _indivisible(graph, fg, in_map, "the batch", batch, mesh, data_axes)
    if why:
        return why
    fa = {f: data_axes for f in batch}
    fa.update({f: model_axes for f in tp_model})
    return fa, "replicated"


def _sequence_parallel(graph: OpGraph, fg: FactorGraph, in_map: dict[int, int], megatron, mesh: MeshSpec):
    """Megatron's assignment (tensor parallelism on the last axis) plus the residual stream's sequence
    dims on that axis (those sharing no tensor with a dim split on it), or why not."""
    if isinstance(megatron, str):
        return megatron
    if not fg.sequence and fg.expert_cuts:
        return NotApplicable("sequence parallelism is not searched with mixture-of-experts regions",
                             "Fix: use the megatron or data-megatron expert.")
    if not fg.sequence:
        return NotApplicable("the values between tensor-parallel regions have no dim besides the batch and the "
                             "model dims (no sequence to split)", "Fix: use the megatron or data-megatron expert.")
    fa = dict(megatron[0])
    tp_axes = tuple(mesh.names[-1:])
    busy = [f for f, axes in fa.items() if set(axes) & set(tp_axes)]
    seq: list[int] = []
    for f in sorted(fg.sequence):     # never two split dims of one tensor on the axis
        if f not in fa and not any(h in fg.cooccur.get(f, ()) for h in busy + seq):
            seq.append(f)
    fits = [f for f in seq if _fits(fg, [f], mesh, tp_axes)]     # others (an MoE's capacity) stay whole
    if not fits:
        sites = "; ".join(factor_site(graph, fg, f, in_map) for f in sorted(fg.sequence))
        return _indivisible(graph, fg, in_map, "sequence dims", seq, mesh, tp_axes) or NotApplicable(
            f"every sequence dim of the residual stream ({sites}) shares a tensor with a dim split on axes "
            f"{tp_axes}", "Fix: use the megatron or data-megatron expert.")
    fa.update({f: tp_axes for f in fits})
    return fa, megatron[1]


def _indivisible(graph: OpGraph, fg: FactorGraph, in_map: dict[int, int], what: str, factors: Sequence[int],
                 mesh: MeshSpec, axes: Sequence[str], over: str = "") -> NotApplicable | str:
    """"" when every factor divides the devices of `axes`, else why not: each failing dim where a
    parameter (or data input) has it, its sizes that do not divide, the axes it would need to divide."""
    n = _devices(mesh, axes)
    bad = [f for f in factors if not fg.divides(f, n)]
    if not bad:
        return ""
    over = over or f"axes {tuple(axes)} ({n} devices)"
    dims = "; ".join(_not_dividing(graph, fg, in_map, f, n) for f in bad)
    verb = "does" if what == "the batch" else "do"
    return NotApplicable(f"{what} {verb} not divide {over}: {dims}", _MESH_FIX)


def _not_dividing(graph: OpGraph, fg: FactorGraph, in_map: dict[int, int], f: int, n: int) -> str:
    """Where one logical dim is and its sizes that `n` devices do not divide: a dim is also seen as its
    parts (768 = 12 heads x 64), and the parts must divide too ("of size [12] (parts of the dim of size
    768)")."""
    sizes = sorted(set(fg.factor_sizes.get(f, ())))
    failing = [s for s in sizes if s % n]
    whole = [s for s in sizes if s not in failing]
    return f"{factor_site(graph, fg, f, in_map, failing)}: of size {failing}" + \
        (f" (parts of the dim of size {max(whole)})" if whole else "")


def factor_site(graph: OpGraph, fg: FactorGraph, f: int, in_map: dict[int, int] | None = None,
                sizes: Sequence[int] = ()) -> str:
    """Where a logical dim shows to a user: "<keypath> dim d" of a parameter holding it (a weight matrix
    before a bias, one whose dim has a size in `sizes` first; "and N more parameters" after), else of a
    data input, else the module of a region boundary where its consumers read it, else "factor f"."""
    in_map = in_map or {}
    sites: dict[str, list[tuple[str, int]]] = {"parameter": [], "data": []}
    factors_of: dict[int, tuple] = {}      # the layers' parameters share their representatives'
    for role, site in sites.items():
        for v in inputs_with_role(graph, role):
            val = graph.values[v]
            src = in_map.get(v, v) if role == "parameter" else v
            fs = factors_of.get(src)
            if fs is None:
                fs = factors_of[src] = fg.value_factors(src)
            if f in fs:
                site.extend((f"{val.keypath} dim {d}", val.shape[d], len(val.shape) < 2)
                            for d, g in enumerate(fs) if g == f)
    params = sorted(sites["parameter"], key=lambda s: (s[2], s[1] not in sizes))
    if params:
        more = len({p.rsplit(" dim ", 1)[0] for p, *_ in params}) - 1
        return params[0][0] + (f" (and {more} more parameter{'s' * (more > 1)})" if more else "")
    if sites["data"]:
        return sites["data"][0][0]
    for v, before, after in fg.cuts:
        for d, (b, a) in enumerate(zip(before, after, strict=True)):
            if f in (a, b):
                p = graph.values[v].producer
                return f"{graph.ops[p].module if p is not None else 'the'} region boundary dim {d}"
    return f"factor {f}"


def _clash(graph: OpGraph, fg: FactorGraph, in_map: dict[int, int], fa: dict[int, tuple[str, ...]]) -> str:
    """Two factors of one tensor on the same axis cannot be expressed as a sharding."""
    for f, axes in fa.items():
        for h in fg.cooccur.get(f, ()):
            if h != f and h in fa and set(axes) & set(fa[h]):
                return NotApplicable(
                    f"{factor_site(graph, fg, f, in_map)} (size {fg.factor_size(f)}) and "
                    f"{factor_site(graph, fg, h, in_map)} (size {fg.factor_size(h)}) are dims of one tensor and "
                    f"would share mesh axes {sorted(set(axes) & set(fa[h]))}",
                    "Fix: a mesh with an axis for each of them.")
    return ""
