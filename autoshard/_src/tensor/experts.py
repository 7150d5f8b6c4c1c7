"""Expert reference plans: the shardings people write by hand, as points of the search space
(pure: no jax import).

Each expert is a rule over parameter keypaths, the way hand-written sharding rules are
(Megatron-LM, t5x/MaxText logical-axis rules): which dimension of which parameter is split on
which mesh axes. The rules are turned into an assignment of mesh axes to factors (logical dims),
so the planner's own cost and memory model prices them, and the audit checks them, exactly like
the automatic plan.

* data-parallel: the batch on every mesh axis, parameters and optimizer state replicated.
* fsdp: the batch on every axis, parameters and optimizer state sharded (ZeRO-3).
* megatron: tensor parallelism on every axis: attention heads and the FFN hidden dim split
  (column-parallel q/k/v/fc1, row-parallel o/fc2), the vocabulary of the embedding and an untied
  head split; a chain of dense layers alternates column and row.
* data-megatron: 2-D: the batch on every axis but the last, Megatron's splits on the last
  (tensor parallelism on the innermost, fastest axis, as Megatron-LM places it).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

from ..core.graph import OpGraph
from ..core.mesh import MeshSpec
from .factors import FactorGraph

EXPERTS = ("data-parallel", "fsdp", "megatron", "data-megatron")

# (pattern over "a/b/c" keypaths, dim to split); the pattern is searched, so a prefix may precede it
COLUMN_RULES: tuple[tuple[str, int], ...] = (
    (r"(^|/)(q|k|v|query|key|value|qkv|q_proj|k_proj|v_proj|wq|wk|wv)/kernel$", -1),
    (r"(^|/)(fc1|wi|wi_0|wi_1|up|up_proj|gate|gate_proj|intermediate|fc_in|ffn_in|dense_in)/kernel$", -1),
)
ROW_RULES: tuple[tuple[str, int], ...] = (
    (r"(^|/)(o|out|out_proj|o_proj|wo|attn_out)/kernel$", 0),
    (r"(^|/)(fc2|down|down_proj|fc_out|ffn_out|dense_out)/kernel$", 0),
)
VOCAB_RULES: tuple[tuple[str, int], ...] = (
    (r"(^|/)(wte|embed|embedding|embeddings|token_embed|token_embedding|tok_embeddings|shared)/embedding$", 0),
    (r"(^|/)(lm_head|head)/kernel$", -1),
)
# position tables (T5's relative attention bias, learned positions) look like embeddings but
# Megatron-LM keeps them whole: their rows are buckets or positions, not the vocabulary
NOT_VOCAB = re.compile(r"(^|/)(relative_attention_bias|rel_pos\w*|pos_emb\w*|position\w*|wpe)(/|$)")
_CHAIN = re.compile(r"(^|/)dense_(\d+)/kernel$")


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


def tensor_parallel_factors(graph: OpGraph, fg: FactorGraph, in_map: dict[int, int]) -> list[int]:
    """Factors Megatron splits, from the parameters' keypaths."""
    out: list[int] = []
    params = [(v, val, keypath_path(val.keypath or "")) for v in graph.inputs
              if (val := graph.values[v]).role == "parameter"]
    chain = [i for _, _, path in params if (i := _chain_index(path)) is not None]
    last = max(chain) if len(chain) > 1 else None
    for v, val, path in params:
        if len(val.shape) < 2:
            continue
        dims = list(_rule_dims(path, vocab_only=False))
        i = _chain_index(path)
        if i is not None and last is not None and i < last:
            dims.append(-1 if i % 2 == 0 else 0)  # column, row, column, ... not the last layer
        if not dims:
            continue
        src = in_map.get(v, v)
        fs = fg.value_factors(src)
        for d in dims:
            f = fs[d] if len(fs) == len(val.shape) else None
            if f is not None and f not in out:
                out.append(f)
    return out


@functools.lru_cache(maxsize=16384)
def _chain_index(path: str) -> int | None:
    """k of a chain of dense layers' "dense_<k>/kernel", else None."""
    m = _CHAIN.search(path)
    return int(m.group(2)) if m is not None else None


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
    batch = batch_factors(graph, fg)
    tp = [f for f in tensor_parallel_factors(graph, fg, in_map) if f not in batch]
    out: dict[str, tuple[dict[int, tuple[str, ...]], str] | str] = {}
    why_batch = (f"the batch does not divide the {mesh.size} devices of mesh {mesh}"
                 if not _fits(fg, batch, mesh, names) else "")
    for name, storage in (("data-parallel", "replicated"), ("fsdp", "zero3")):
        out[name] = why_batch or ({f: names for f in batch}, storage)
    if not tp:
        out["megatron"] = out["data-megatron"] = "no parameter matches the tensor-parallel rules"
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
    for name, a in out.items():
        if not isinstance(a, str):
            clash = _clash(fg, a[0])
            if clash:
                out[name] = clash
    return out


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
    rules = vocab if vocab_only else (*COLUMN_RULES, *ROW_RULES, *vocab)
    return tuple(d for pat, d in rules if re.search(pat, path))
