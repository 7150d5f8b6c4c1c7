"""Phases and module attribution for an OpGraph (pure: no jax import).

Name stacks give linen programs module paths ("GPT/block_3/fc1") and give every differentiated
program its phase markers: `jvp(...)` wraps forward scopes, `transpose(jvp(...))` backward ones.
flax.nnx and plain-jax programs carry no module names, so modules are recovered from the
parameters an op consumes and from data flow:

1. Parameters get a module path from their pytree keypath ("[0]['blocks'][3]['fc1']['kernel']" →
   "blocks/3/fc1"), renamed to the name-scope module of their forward consumers where that exists,
   so that both sources agree. Optimizer-state leaves and the step's outputs are matched to the
   parameter whose keypath is their suffix (`mu['blocks'][3]['fc1']['kernel']`).
2. An op with a name-scope module keeps it (name scopes win), except in the optimizer phase where
   scopes like "optimizer" describe the phase, not the module.
3. An op that consumes a parameter (or a cast/transpose of one) belongs to that parameter's module.
4. Backwards: an op all of whose same-phase consumers belong to one module belongs to it (layer-norm
   statistics belong to the norm that scales them; the gradient and Adam moments of a kernel belong
   to the kernel's module because they only flow into its update).
5. Forwards: what is left joins the module of its most recently produced input (the residual add
   after fc2 joins fc2), except the forward tail after the last parameterised op (the loss),
   which stays at the root.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from .graph import Op, OpGraph, Value

_WRAPPED = re.compile(r"^([A-Za-z_][\w\-]*)\((.*)\)$")
# scopes jax inserts that are not user modules
_PSEUDO_SCOPES = frozenset({"rematted_computation", "checkpoint"})
# movement/cast ops through which a parameter keeps its module (W.T, W.astype(bf16), W.reshape)
_PASS_THROUGH = frozenset({
    "convert_element_type", "transpose", "reshape", "broadcast_in_dim", "copy", "copy_p",
    "squeeze", "expand_dims", "reduce_precision", "sharding_constraint",
})
_COLLECTIONS = frozenset({"params"})  # flax's parameter collection
# jax.random's primitives that read a key: a legacy uint32[..., 2] key enters them through random_wrap
_KEY_READERS = frozenset({"random_wrap", "random_bits", "random_split", "random_fold_in", "random_unwrap",
                          "random_clone", "threefry2x32"})
# ops that pick keys out of an array of them (`keys[i]`, a reshape) on the way to a reader
_KEY_PICKS = frozenset({"slice", "squeeze", "reshape", "expand_dims", "dynamic_slice", "gather", "copy", "copy_p",
                        "broadcast_in_dim", "concatenate", "transpose"})
_VALUE_LEAVES = frozenset({".value", ".raw_value"})  # nnx Variable wrappers around the array

_scope_cache: dict[str, tuple[str, tuple[str, ...]]] = {}


def parse_scope(scope: str) -> tuple[str, tuple[str, ...]]:
    """Split a joined name stack into (module path, transforms).

    "transpose(jvp(GPT))/block_3/rematted_computation/fc1" → ("GPT/block_3/fc1", ("transpose", "jvp")).
    """
    hit = _scope_cache.get(scope)
    if hit is not None:
        return hit
    # a transform-wrapped component starts a segment; segments are joined like nested scopes
    # ("transpose(jvp(GPT))/jvp(GPT)/block_1" is GPT/block_1, seen from remat recomputation)
    segments: list[list[str]] = [[]]
    transforms: list[str] = []
    for comp in scope.split("/") if scope else ():
        wrapped = False
        while (m := _WRAPPED.match(comp)) is not None:
            transforms.append(m.group(1))
            comp, wrapped = m.group(2), True
        if wrapped and segments[-1]:
            segments.append([])
        # jnp.einsum names its scope after the spec ("bqhd,bkhd->bhqk"): not a module
        if comp and comp not in _PSEUDO_SCOPES and "->" not in comp:
            segments[-1].append(comp)
    module = ""
    for seg in segments:
        module = join_modules(module, "/".join(seg))
    out = (module, tuple(transforms))
    _scope_cache[scope] = out
    return out


def join_modules(outer: str, inner: str) -> str:
    """Module path of an eqn in a nested jaxpr. Name stacks inside nested jaxprs are relative,
    except where jax re-traces a body with its original stack (remat recomputation in the
    backward pass carries "jvp(GPT)/block_1/..." under "transpose(jvp(GPT))"): the overlap of
    the outer path's tail with the inner path's head is counted once."""
    if not outer:
        return inner
    if not inner:
        return outer
    o, i = outer.split("/"), inner.split("/")
    for k in range(min(len(o), len(i)), 0, -1):
        if o[len(o) - k:] == i[:k]:
            return "/".join(o + i[k:])
    return "/".join(o + i)


def infer_phases(graph: OpGraph, optimizer_scopes: Sequence[str] = ("optimizer",)) -> None:
    """Set `op.phase` for every op, in program order."""
    opt = frozenset(optimizer_scopes)
    has_backward = any("transpose" in op.transforms for op in graph.ops)
    values = graph.values
    phase_of: list[str] = []
    for op in graph.ops:
        if "transpose" in op.transforms:
            phase = "backward"
        elif "jvp" in op.transforms:
            phase = "forward"
        elif opt and any(c in opt for c in op.scope.split("/")):
            phase = "optimizer"
        elif any((p := values[v].producer) is not None and phase_of[p] in ("backward", "optimizer")
                 for v in op.inputs):
            phase = "optimizer"  # consumes gradients: the update
        else:
            phase = "other" if has_backward else "forward"
        phase_of.append(phase)
        op.phase = phase  # type: ignore[assignment]


def _rel_parts(v: Value) -> tuple:
    """Keypath parts below the argument index, without nnx's `.value` wrapper."""
    parts = v.keypath_parts[1:]
    while parts and parts[-1] in _VALUE_LEAVES:
        parts = parts[:-1]
    return parts


def _join(parts: Iterable) -> str:
    return "/".join(str(p).lstrip(".") for p in parts)


def _common_prefix(seqs: list[tuple]) -> tuple:
    if not seqs:
        return ()
    first = seqs[0]
    n = min(len(s) for s in seqs)
    i = 0
    while i < n and all(s[i] == first[i] for s in seqs):
        i += 1
    return first[:i]


def parameter_modules(graph: OpGraph) -> tuple[dict[int, str], dict[str, str]]:
    """Module path of each program input that is a parameter or per-parameter state, and of each
    output keypath that is one. Returns ({value id: module}, {output keypath: module}) and sets
    `role` and `module` on the input values."""
    values = graph.values
    # a PRNG key is no parameter and no batch: never split, never the batch size (dataflow says which)
    keys = {v for v in graph.inputs if is_prng_key(graph, v)}
    fwd_inputs = [v for v in graph.inputs if v not in keys
                  and any(graph.ops[c].phase == "forward" for c in values[v].consumers)]
    by_arg: dict[object, list[int]] = {}
    for v in fwd_inputs:
        if values[v].keypath_parts:
            by_arg.setdefault(values[v].keypath_parts[0], []).append(v)
    module_of: dict[int, str] = {}
    rel_to_module: dict[tuple, str] = {}
    # with the optimizer in the step, a trainable parameter is read by the update; model state read
    # only by the forward pass (BatchNorm running statistics) is a "buffer": no gradient, no sync
    has_update = any(op.phase == "optimizer" for op in graph.ops)

    def updated(v: int) -> bool:
        return any(graph.ops[c].phase == "optimizer" for c in values[v].consumers)

    for vids in by_arg.values():
        mods = [_rel_parts(values[v])[:-1] for v in vids]
        # strip wrappers all leaves of one argument share ("params" in linen, ".params" in a
        # TrainState); real module names ("blocks") stay even when every parameter is under them
        prefix = _common_prefix(mods) if len(vids) > 1 else ()
        keep = 0
        while keep < len(prefix) and (prefix[keep] in _COLLECTIONS
                                      or str(prefix[keep]).startswith(".")):
            keep += 1
        prefix = prefix[:keep]
        for v, mod in zip(vids, mods, strict=True):
            own = mod[len(prefix):]
            # {"params": ..., "batch_stats": ...} in one argument: the collection name is no module
            while own and own[0] in _COLLECTIONS:
                own = own[1:]
            name = _join(own)
            if not name:
                nested = any(len(m) > len(prefix) for m in mods)
                name = _top_leaf_module(graph, v, nested, has_update and updated(v))
                if not name:
                    continue
            name = _scope_name_for(graph, v, name)
            module_of[v] = name
            rel = _rel_parts(values[v])
            rel_to_module[rel] = name
            # the optimizer sees only the collection's contents: its state paths lack the name
            rel_to_module.setdefault(rel[len(mod) - len(own):], name)

    def match(parts: tuple) -> str | None:
        for k in range(len(parts)):
            hit = rel_to_module.get(parts[k:])
            if hit is not None:
                return hit
        return None

    for v in graph.inputs:
        val = values[v]
        if v in keys:
            val.role = "rng"
        elif v in module_of:
            trained = not has_update or updated(v)
            val.role, val.module = ("parameter" if trained else "buffer"), module_of[v]
        elif (hit := match(_rel_parts(val))) is not None:
            module_of[v] = hit
            val.role, val.module = "state", hit
        else:
            val.role = "data"
    out_modules: dict[str, str] = {}
    for kp, parts in zip(graph.output_keypaths, graph.output_keypath_parts, strict=True):
        p = parts[1:]
        while p and p[-1] in _VALUE_LEAVES:
            p = p[:-1]
        if (hit := match(p)) is not None:
            out_modules[kp] = hit
    return module_of, out_modules


def is_prng_key(graph: OpGraph, v: int) -> bool:
    """Is value `v` a PRNG key: a typed key array (`key<fry>`), or a uint32 array of trailing dim 2 (a legacy
    `jax.random.PRNGKey`, or several) that reaches a jax.random primitive, directly or through ops that pick
    keys out of it? Dataflow decides: a uint32 pair no random op reads is data."""
    val = graph.values[v]
    if val.dtype.startswith("key<"):
        return True
    if val.dtype != "uint32" or not val.shape or val.shape[-1] != 2:
        return False
    seen, todo = {v}, [v]
    while todo:
        for c in graph.values[todo.pop()].consumers:
            op = graph.ops[c]
            if op.primitive in _KEY_READERS:
                return True
            if op.primitive in _KEY_PICKS:
                todo += [o for o in op.outputs if o not in seen and graph.values[o].dtype == "uint32"]
                seen.update(op.outputs)
    return False


def _top_leaf_module(graph: OpGraph, v: int, nested: bool, by_role: bool) -> str:
    """The module of a leaf at the top of its argument ("" if none): a leaf at the top of a tree of
    parameters (BERT's output bias; `nested`) belongs to the module reading it; top-level leaves of
    other arguments (the batch) are data, unless the step's update reads them (`by_role`): a flat dict
    of weights is parameters by role, each named by its key."""
    if not nested and not by_role:
        return ""
    readers = [parse_scope(graph.ops[c].scope)[0] for c in graph.values[v].consumers
               if graph.ops[c].phase == "forward"]
    name = next((r for r in readers if r), "")
    return name or (_join(_rel_parts(graph.values[v])[-1:]) if by_role else "")


def _scope_name_for(graph: OpGraph, v: int, keypath_module: str) -> str:
    """The name-scope module of a parameter's forward consumers that ends with its keypath module
    (linen: keypath "block_3/fc1" ↔ scope "GPT/block_3/fc1"); the keypath module otherwise."""
    best = None
    for c in graph.values[v].consumers:
        sm = graph.ops[c].scope_module
        if graph.ops[c].phase != "forward" or not sm:
            continue
        if sm == keypath_module or sm.endswith("/" + keypath_module):
            return sm
        if best is None and keypath_module.endswith(sm.rsplit("/", 1)[-1]):
            best = sm
    return best or keypath_module


def attribute_modules(graph: OpGraph) -> None:
    """Set `op.module` for every op (phases must be inferred first)."""
    ops = graph.ops
    input_module, output_module = parameter_modules(graph)
    value_module = _parameter_values(graph, input_module)
    label = _direct_labels(graph, value_module)
    direct = list(label)
    out_label: dict[int, str] = {}
    for vid, kp in zip(graph.outputs, graph.output_keypaths, strict=True):
        if kp in output_module:
            out_label[vid] = output_module[kp]
    # the forward tail after the last parameterised forward op (the loss) belongs to no module
    last_param_op = max((op.index for op in ops if op.phase == "forward"
                         and any(v in value_module for v in op.inputs)), default=len(ops))
    _label_backwards(graph, label, out_label, last_param_op)
    _label_forwards(graph, label, last_param_op)
    if not any(op.scope_module for op in ops if op.phase == "forward"):
        _residual_adds(graph, label, direct)
    for op in ops:
        op.module = label[op.index] or ""


def _parameter_values(graph: OpGraph, input_module: dict[int, str]) -> dict[int, str]:
    """Module of each parameter-valued tensor: the inputs plus pass-through copies/casts of them."""
    value_module: dict[int, str] = dict(input_module)
    for op in graph.ops:
        if op.primitive in _PASS_THROUGH and len(op.inputs) >= 1:
            m = value_module.get(op.inputs[0])
            if m is not None:
                for o in op.outputs:
                    value_module[o] = m
    return value_module


def _direct_labels(graph: OpGraph, value_module: dict[int, str]) -> list[str | None]:
    """Per op, the module of its name scope (rule 2) or of its largest parameter input (rule 3);
    None where neither decides."""
    ops, values = graph.ops, graph.values
    # In a program with name scopes, an unscoped forward/backward op lies outside every module
    # (the loss, say): it stays at the root instead of being guessed from data flow.
    has_scopes = any(op.scope_module for op in ops if op.phase == "forward")
    canonical = _canonical_scopes(graph)
    label: list[str | None] = [None] * len(ops)
    for op in ops:
        if op.phase != "optimizer" and (op.scope_module or (has_scopes and op.phase != "other")):
            label[op.index] = canonical.get(op.scope_module, op.scope_module)
            continue
        best, best_bytes = None, -1
        for v in op.inputs:
            m = value_module.get(v)
            if m is not None and values[v].nbytes > best_bytes:
                best, best_bytes = m, values[v].nbytes
        label[op.index] = best
    if not has_scopes:
        _activations(graph, label)
    return label


def _activations(graph: OpGraph, label: list[str | None]) -> None:
    """Without name scopes, an elementwise function applied straight to a parameterised op's output
    (tanh(x @ w + b), a gelu's first op) belongs to that op's module: the next layer reads it too, and
    its derivative residual only feeds the backward pass, so neither consumer should claim it."""
    ops, values = graph.ops, graph.values
    for op in ops:
        if label[op.index] is not None or op.phase != "forward" or len(op.inputs) != 1 or len(op.outputs) != 1:
            continue
        p = values[op.inputs[0]].producer
        if p is not None and label[p] and ops[p].phase == "forward" and op.out_shapes[0] == op.in_shapes[0]:
            label[op.index] = label[p]


def _residual_adds(graph: OpGraph, label: list[str | None], direct: list[str | None]) -> None:
    """A residual add (the sum of a parameterised op's output and another stream) belongs to the
    module whose output it adds, not to whatever reads the sum next: without name scopes (nnx) the
    last block's add would join the head and each other add the next block's norm, and repeated
    blocks would no longer look alike."""
    ops, values = graph.ops, graph.values
    for op in ops:
        if direct[op.index] is not None or op.phase != "forward" or op.primitive not in ("add", "add_any"):
            continue
        producers = [values[v].producer for v in op.inputs]   # None: an input, or a loop's carry
        if len(producers) != 2 or any(p is not None and ops[p].phase != "forward" for p in producers):
            continue
        owned = [p for p in producers if p is not None and direct[p]]   # outputs of parameterised ops
        if owned:
            label[op.index] = direct[max(owned)]


def _consensus(graph: OpGraph, label: list[str | None], out_label: dict[int, str], op: Op) -> str | None:
    """The one module the labelled consumers of op's outputs (and the step outputs they are)
    agree on; None if they disagree or none is labelled."""
    ops, values = graph.ops, graph.values
    # a forward op is judged by its forward consumers; residuals kept only for the backward
    # pass (gelu's 3x² term, say) by their backward consumers
    forward = op.phase == "forward" and any(
        ops[c].phase == "forward" for v in op.outputs for c in values[v].consumers)
    if op.phase == "forward" and not forward and not any(v in out_label for v in op.outputs):
        # a residual computed only for the backward pass (rsqrt's derivative in a norm): its backward
        # consumers flow into the previous layer's gradient, so it is decided from its inputs
        return None
    agreed = None
    for v in op.outputs:
        cands = [label[c] for c in values[v].consumers
                 if not (forward and ops[c].phase != "forward")]
        if v in out_label:
            cands.append(out_label[v])
        for lc in cands:
            if lc is None:
                continue  # decided later, from its inputs
            if agreed is not None and lc != agreed:
                return None
            agreed = lc
    return agreed


def _label_backwards(graph: OpGraph, label: list[str | None], out_label: dict[int, str],
                     last_param_op: int) -> None:
    """Rule 4, in reverse program order: unlabelled ops take their consumers' consensus; the
    forward tail after `last_param_op` stays at the root."""
    for op in reversed(graph.ops):
        if label[op.index] is None:
            label[op.index] = _consensus(graph, label, out_label, op)
        if label[op.index] is None and op.phase == "forward" and op.index > last_param_op:
            label[op.index] = ""


def _label_forwards(graph: OpGraph, label: list[str | None], last_param_op: int) -> None:
    """Rule 5 and the leftovers: the module of the most recently produced labelled input, then of
    the first labelled consumer, then of the op before."""
    ops, values = graph.ops, graph.values
    for op in ops:
        if label[op.index] is not None:
            continue
        best, best_producer = None, -1
        for v in op.inputs:
            p = values[v].producer
            if p is not None and p > best_producer and label[p]:
                best, best_producer = label[p], p
        label[op.index] = best

    # constants built inside the step (iota, broadcast scalars) join their first consumer
    for op in reversed(ops):
        if label[op.index] is None:
            label[op.index] = next((label[c] for v in op.outputs for c in values[v].consumers
                                    if label[c]), None)
    # what is left reads and feeds nothing labelled (dead code): it joins the op before it
    previous = ""
    for op in ops:
        if label[op.index] is None:
            label[op.index] = previous if op.phase != "forward" or op.index < last_param_op else ""
        elif label[op.index]:
            previous = label[op.index]


def _canonical_scopes(graph: OpGraph) -> dict[str, str]:
    """Map scope modules seen without their enclosing scopes to the full path: ops hoisted out of
    an nn.scan body carry "blocks/..." where the body has "GPT/blocks/..."."""
    full = {op.scope_module for op in graph.ops if op.phase == "forward" and op.scope_module}
    by_suffix: dict[str, set[str]] = {}
    for m in full:
        parts = m.split("/")
        for k in range(1, len(parts)):
            by_suffix.setdefault("/".join(parts[k:]), set()).add(m)
    out = {}
    for op in graph.ops:
        sm = op.scope_module
        if sm and sm not in full and len(by_suffix.get(sm, ())) == 1:
            out[sm] = next(iter(by_suffix[sm]))
    return out
