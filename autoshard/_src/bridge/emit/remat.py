"""Rematerialisation as planned: a loss evaluated block by block, each block under `jax.checkpoint`.

The 3-D planner gives each stage a remat policy: "none", "selective" (recompute only the attention
scores and probabilities, Korthikanti et al. 2022), "dots" (keep the matmul outputs, recompute the
rest in the backward pass) or "full" (keep only each block's inputs). The user's loss has no
block boundaries we could wrap, so the loss is traced, its eqns are grouped by the repeated block
instance their module belongs to (the grouping's instances: the plan's unit labels, e.g.
"GPT/block_3"), and every maximal run of eqns of one block runs as one `jax.checkpoint`ed function
of the values it reads. Eqns outside every block (embeddings, the head, the loss) run as they are.

    run = remat_loss(loss_fn, "full", labels)      # same values and gradients as loss_fn
    loss, grads = jax.value_and_grad(run)(params, batch)

"selective" finds the attention cores of the loss (core.attention, on `trace.flat_graph` of the
program) and checkpoints each block holding one with a policy that saves every value except those on
its cores' [.., Sq, Skv] grid or its softmax rows: jax.checkpoint policies see a primitive and its
operand shapes, not which eqn it came from, and the softmax's own residuals live inside jax's
differentiation rules, where no name can be attached. Blocks without attention run as under "none".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax

from ...core.attention import attention_cores, recomputed_ops
from ...core.attribution import parse_scope
from .. import compat as jc
from ..trace.trace import flat_graph

POLICIES: dict[str, Any] = {"dots": jax.checkpoint_policies.dots_saveable, "full": None}
NAMES = ("none", "selective", *POLICIES)      # selective's policy depends on the block: selective_policy


def block_labels(labels: Sequence[str]) -> tuple[str, ...]:
    """The plan's unit labels as module paths ("GPT/block_3 (scan)" -> "GPT/block_3")."""
    return tuple(label.removesuffix(" (scan)") for label in labels)


def eqn_blocks(prog: Any, labels: Sequence[str]) -> list[str | None]:
    """Per eqn of a flattened program: the block instance (longest label prefix of its module) or None."""
    ordered = sorted(block_labels(labels), key=len, reverse=True)
    out: list[str | None] = []
    for fe in prog.eqns:
        module = parse_scope(fe.scope)[0]
        out.append(next((lb for lb in ordered if module == lb or module.startswith(lb + "/")), None))
    return out


def _read(env: dict, a: Any) -> Any:
    return a.val if jc.is_literal(a) else env[a]


def _bind(prog: Any, e: int, env: dict, guard: Callable | None, after: Callable | None = None) -> None:
    fe = prog.eqns[e]
    ins = [_read(env, a) for a in fe.inputs]
    if guard is not None:
        ins = guard(fe.eqn, ins)
    outs = jc.bind_eqn(fe.eqn, ins)
    if after is not None:
        outs = after(e, outs)
    env.update(zip(fe.outputs, outs, strict=True))


def run_eqns(prog: Any, order: Sequence[int], env: dict, blocks: Sequence[str | None], policy: str,
             keep: set, guard: Callable | None = None, after: Callable | None = None) -> None:
    """Evaluate eqns `order` (program order) into `env`; with a policy other than "none", each run of
    consecutive eqns of one block is one checkpointed function. `keep`: keys read after `order`
    (outputs, values sent to other stages) besides the readers among `prog`'s eqns. `guard(eqn,
    inputs) -> inputs` may rewrite an eqn's inputs, `after(eqn index, outputs) -> outputs` its
    outputs (sharding constraints)."""
    if policy == "none":
        for e in order:
            _bind(prog, e, env, guard, after)
        return
    if policy not in NAMES:
        raise ValueError(f"remat policy {policy!r}: valid {', '.join(map(repr, NAMES))}")
    readers: dict[Any, set[int]] = {}
    for e, fe in enumerate(prog.eqns):
        for a in fe.inputs:
            if not jc.is_literal(a):
                readers.setdefault(a, set()).add(e)
    grids = attention_grids(prog) if policy == "selective" else {}
    for label, run in _runs(order, blocks):
        shapes = frozenset().union(*(grids.get(e, ()) for e in run))
        if label is None or (policy == "selective" and not shapes):
            for e in run:
                _bind(prog, e, env, guard, after)
            continue
        chosen = selective_policy(shapes) if policy == "selective" else POLICIES[policy]
        _checkpointed(prog, run, env, readers, keep, chosen, guard, after)


_GRIDS: dict[int, tuple[Any, dict]] = {}      # id(prog.eqns) -> (its eqns, grids): every stage of a cut reads one


def attention_grids(prog: Any) -> dict[int, frozenset[tuple[int, ...]]]:
    """Per flat eqn holding ops selective remat recomputes (`core.attention.recomputed_ops`): the
    shapes of those ops' outputs on their core's grid (Sq x Skv per row) or rows (one per row)."""
    hit = _GRIDS.get(id(prog.eqns))
    if hit is not None and hit[0] is prog.eqns:
        return hit[1]
    if len(_GRIDS) >= 8:
        _GRIDS.pop(next(iter(_GRIDS)))
    grids = _GRIDS[id(prog.eqns)] = (prog.eqns, _attention_grids(prog))
    return grids[1]


def _attention_grids(prog: Any) -> dict[int, frozenset[tuple[int, ...]]]:
    graph, owner = flat_graph(prog)
    out: dict[int, set[tuple[int, ...]]] = {}
    for core in attention_cores(graph):
        n = math.prod(graph.values[graph.ops[core.scores].outputs[0]].shape)
        on_grid = (n, n // core.dims[3])
        for o in recomputed_ops(graph, core):
            shapes = {graph.values[w].shape for w in graph.ops[o].outputs}
            out.setdefault(owner[o], set()).update(s for s in shapes if math.prod(s) in on_grid)
    return {e: frozenset(s) for e, s in out.items() if s}


def selective_policy(grids: frozenset[tuple[int, ...]]) -> Callable:
    """A jax.checkpoint policy saving every result but those shaped as an attention grid in `grids`.
    A matmul reading such a value (probabilities x V) is saved whatever its shape: its output is
    what selective recompute keeps (head_dim == Skv would otherwise match)."""
    def saveable(prim: Any, *avals: Any, **params: Any) -> bool:
        if prim.name == "dot_general" and any(tuple(getattr(a, "shape", ())) in grids for a in avals):
            return True
        try:
            outs = prim.abstract_eval(*avals, **params)
        except Exception:     # a primitive without a shape rule here: keep its result (as "none")
            return True
        outs = outs[0] if isinstance(outs, tuple) and len(outs) == 2 and isinstance(outs[1], frozenset | set) else outs
        outs = outs if isinstance(outs, list | tuple) else (outs,)
        return not any(tuple(getattr(a, "shape", ())) in grids for a in outs)
    return saveable


def _runs(order: Sequence[int], blocks: Sequence[str | None]) -> list[tuple[str | None, list[int]]]:
    runs: list[tuple[str | None, list[int]]] = []
    for e in order:
        if runs and runs[-1][0] == blocks[e]:
            runs[-1][1].append(e)
        else:
            runs.append((blocks[e], [e]))
    return runs


def _checkpointed(prog: Any, run: list[int], env: dict, readers: dict, keep: set, policy: Callable | None,
                  guard: Callable | None, after: Callable | None) -> None:
    inside = set(run)
    made = {k for e in run for k in prog.eqns[e].outputs}
    ins: list[Any] = []
    for e in run:
        for a in prog.eqns[e].inputs:
            if not jc.is_literal(a) and a not in made and a not in ins:
                ins.append(a)
    outs = [k for e in run for k in prog.eqns[e].outputs if k in keep or readers.get(k, set()) - inside]

    def block(*values: Any) -> tuple:
        local = dict(zip(ins, values, strict=True))
        for e in run:
            _bind(prog, e, local, guard, after)
        return tuple(local[k] for k in outs)

    values = jax.checkpoint(block, policy=policy)(*[env[k] for k in ins])
    env.update(zip(outs, values, strict=True))


def remat_loss(fun: Callable, policy: str, labels: Sequence[str],
               constrain: Callable[[Any, list[str]], Callable] | None = None) -> Callable:
    """`fun` evaluated block by block under `policy` (see the module docstring); same outputs, any
    pytree of them (a loss, or (loss, aux)). `constrain(prog, modules) -> after(eqn, outputs)`: the
    plan's activation constraints on the loss's eqns, applied inside the checkpointed blocks too."""
    if policy == "none":
        return fun

    def run(*args: Any) -> Any:
        structs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jax.numpy.shape(x), jax.numpy.result_type(x)), args)
        closed, out_shape = jax.make_jaxpr(fun, return_shape=True)(*structs)
        prog = jc.flatten_calls(closed)
        env: dict = dict(prog.consts)
        env.update(zip(prog.inputs, jax.tree.leaves(args), strict=True))
        outputs = [k for k in prog.outputs if not jc.is_literal(k)]
        after = constrain(prog, [parse_scope(fe.scope)[0] for fe in prog.eqns]) if constrain else None
        run_eqns(prog, range(len(prog.eqns)), env, eqn_blocks(prog, labels), policy, set(outputs), after=after)
        return jax.tree.unflatten(jax.tree.structure(out_shape), [_read(env, k) for k in prog.outputs])

    run.__name__ = getattr(fun, "__name__", "loss")
    return run
