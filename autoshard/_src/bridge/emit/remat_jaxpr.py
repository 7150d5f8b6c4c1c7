"""Rematerialisation of a traced training step as it is written (jax.grad, jax.value_and_grad, nnx.grad,
Hugging Face scripts): no `autoshard.value_and_grad`, no change to the user's code.

The traced step already holds the forward pass, the backward pass and the update as one program: the
backward reads forward values (residuals) saved since the forward ran. Remat replays part of the forward
inside the backward instead, the way `jax.checkpoint` does after differentiation:

- for each block instance the plan rematerialises (its unit labels, e.g. "GPT/block_3"), the forward
  eqns of the block whose results the backward reads are the residuals; the policy says which of
  them are recomputed: "full" all, "dots" all but matmul results (kept), "selective" the attention
  scores, softmax and dropout only (`core.attention.recomputed_ops`);
- just before the first backward eqn that reads a recomputed residual, the eqns that produce those
  residuals run again from the values they read outside themselves (the block's input, its
  parameters, kept matmul results), and the backward reads the new results;
- those inputs pass through `jax.lax.optimization_barrier` together with the backward values that first
  eqn reads, so XLA does not merge the replay with the forward (CSE), and the activations among them are
  made to depend on those backward values by data (`_after_trigger`), so XLA does not schedule the replay
  before the backward reaches the block: XLA:CPU removes optimization barriers before it schedules
  (XLA:GPU after), which is why `jax.checkpoint` saves no memory on CPU (a measured 8-layer chain: temp
  17.8 MB without it, 25.2 MB with it) while this replay does.

Values are the same ops on the same inputs (random bits from the same keys), so results are unchanged;
the forward results only the backward read are no longer alive between the passes. The plan's sharding
constraints are placed on the replayed eqns as on the originals.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from ...core.attention import attention_cores, recomputed_ops
from ...core.graph import OpGraph
from .. import compat as jc

POLICIES = ("full", "dots", "selective")


@dataclasses.dataclass(frozen=True)
class Replay:
    """One block's replay: its eqns (program order), the values they read from outside (barriered),
    and the residuals the backward reads from it instead of the saved ones."""

    label: str
    eqns: tuple[int, ...]
    inputs: tuple[Any, ...]
    recomputed: frozenset


def replays(closed: Any, graph: OpGraph, labels: Sequence[str], policy: str) -> dict[int, list[Replay]]:
    """{first backward eqn reading the block's recomputed residuals: the replays to run before it} for the
    top-level eqns of `closed` (the traced step; `graph` its op graph, whose ops name their top eqn)."""
    if policy not in POLICIES:
        raise ValueError(f"remat policy {policy!r}: valid {', '.join(map(repr, POLICIES))}")
    eqns = closed.jaxpr.eqns
    phase, block = _eqn_phases_and_blocks(graph, len(eqns), labels)
    replayable = _replayable(graph, eqns, phase, policy)
    producer = {v: e for e, eqn in enumerate(eqns) for v in eqn.outvars}
    readers: dict[Any, list[int]] = {}
    for e, eqn in enumerate(eqns):
        for v in eqn.invars:
            if not jc.is_literal(v):
                readers.setdefault(v, []).append(e)
    by_block: dict[str, list[int]] = {}
    for e in range(len(eqns)):
        if phase[e] == "forward" and block[e] is not None:
            by_block.setdefault(block[e], []).append(e)
    out: dict[int, list[Replay]] = {}
    for label, members in by_block.items():
        inside = set(members)
        resid = {v for e in members if e in replayable for v in eqns[e].outvars
                 if any(phase[r] != "forward" for r in readers.get(v, ()))}
        if not resid:
            continue
        run = _slice(eqns, resid, producer, inside & replayable)
        if any(eqns[e].effects for e in run):        # an effect (a callback, a print) runs once
            continue
        made = {v for e in run for v in eqns[e].outvars}
        ins = tuple(dict.fromkeys(v for e in run for v in eqns[e].invars if not jc.is_literal(v) and v not in made))
        trigger = min(r for v in resid for r in readers[v] if phase[r] != "forward")
        out.setdefault(trigger, []).append(Replay(label, tuple(run), ins, frozenset(resid)))
    return out


def _eqn_phases_and_blocks(graph: OpGraph, n: int, labels: Sequence[str]) -> tuple[list[str], list[str | None]]:
    """Per top-level eqn: its phase (forward only when every op in it is) and, for forward eqns, the block
    instance (longest label prefix of its module) or None."""
    ordered = sorted({lb.removesuffix(" (scan)") for lb in labels}, key=len, reverse=True)
    phase: list[str] = ["other"] * n
    module: list[str] = [""] * n
    seen = [False] * n
    for op in graph.ops:
        e = op.top_eqn
        if e is None or e >= n:
            continue
        if not seen[e]:
            phase[e], module[e], seen[e] = op.phase, op.module or "", True
        elif op.phase != "forward":
            phase[e] = op.phase
    block: list[str | None] = []
    for e in range(n):
        m = module[e]
        block.append(next((lb for lb in ordered if m == lb or m.startswith(lb + "/")), None)
                     if phase[e] == "forward" else None)
    return phase, block


def _replayable(graph: OpGraph, eqns: list, phase: list[str], policy: str) -> set[int]:
    """The forward eqns the policy recomputes (within blocks, `replays` restricts them further). A loop
    (an nn.scan of layers) is never replayed: that would rebuild every iteration's residuals at once."""
    fwd = {e for e, p in enumerate(phase) if p == "forward" and eqns[e].primitive.name not in ("scan", "while")}
    if policy == "full":
        return fwd
    if policy == "dots":
        return {e for e in fwd if eqns[e].primitive.name not in ("dot_general", "conv_general_dilated")}
    chosen: set[int] = set()
    for core in attention_cores(graph):
        chosen |= {graph.ops[o].top_eqn for o in recomputed_ops(graph, core)}
    return chosen & fwd


def _slice(eqns: list, wanted: set, producer: dict, allowed: set[int]) -> list[int]:
    """The eqns among `allowed` that produce `wanted`, transitively through their inputs (program order)."""
    todo = [producer[v] for v in wanted if v in producer]
    picked: set[int] = set()
    while todo:
        e = todo.pop()
        if e in picked or e not in allowed:
            continue
        picked.add(e)
        todo.extend(producer[v] for v in eqns[e].invars if not jc.is_literal(v) and v in producer)
    return sorted(picked)


def eval_with_replays(closed: Any, args: list, after: Callable[[int, list], list],
                      plan: dict[int, list[Replay]]) -> list:
    """`closed` evaluated like `compat.eval_jaxpr_with(closed, args, after)`, each block's replay run before
    its trigger eqn and the backward reading the replayed residuals."""
    jaxpr = closed.jaxpr
    env: dict = dict(zip(jaxpr.constvars, closed.consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    fresh: dict = {}          # residual -> its replayed value (read by non-forward eqns)
    arguments = frozenset(jaxpr.invars) | frozenset(jaxpr.constvars)

    def read(v: Any, replayed: bool) -> Any:
        if jc.is_literal(v):
            return v.val
        return fresh[v] if replayed and v in fresh else env[v]

    for k, eqn in enumerate(jaxpr.eqns):
        pending = plan.get(k, ())
        invals = [read(v, True) for v in eqn.invars]
        if pending:
            invals = _run_replays(jaxpr.eqns, pending, env, fresh, eqn, invals, after, arguments)
        outs = after(k, jc.bind_eqn(eqn, invals))
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v, False) for v in jaxpr.outvars]


def _after_trigger(values: list, trigger_values: list, params: frozenset) -> list:
    """`values` made to depend on the trigger's inputs by data, not by a barrier: XLA:CPU removes
    optimization barriers before scheduling (XLA:GPU after), and its scheduler then runs a replay as
    soon as its inputs exist, right after the forward. select(t == t, x, 0) is x unless the trigger's
    first element is NaN, when every gradient the replay feeds is NaN anyway (the cotangent multiplies
    it); parameters are left alone (the activations all derive from the other inputs)."""
    probe = next((t for t in trigger_values if jax.numpy.issubdtype(t.dtype, jax.numpy.inexact) and t.size), None)
    if probe is None:
        return values
    first = probe.reshape(-1)[0]
    ok = first == first
    return [v if (k in params or not jax.numpy.issubdtype(v.dtype, jax.numpy.inexact))
            else jax.lax.select(jax.numpy.broadcast_to(ok, v.shape), v, jax.numpy.zeros_like(v))
            for k, v in enumerate(values)]


def _run_replays(eqns: list, pending: Sequence[Replay], env: dict, fresh: dict, trigger: Any, invals: list,
                 after: Callable[[int, list], list], arguments: frozenset) -> list:
    """Run `pending` replays behind one barrier with the trigger eqn's other inputs; returns those inputs
    (through the barrier, same values) with the replayed residuals it reads."""
    ins = list(dict.fromkeys(v for rp in pending for v in rp.inputs))
    replayed = frozenset().union(*(rp.recomputed for rp in pending))
    own = [i for i, v in enumerate(trigger.invars) if not jc.is_literal(v) and v not in replayed and v not in fresh]
    held = jax.lax.optimization_barrier(([env[v] for v in ins], [invals[i] for i in own]))
    values = _after_trigger(held[0], held[1], frozenset(k for k, v in enumerate(ins) if v in arguments))
    local = dict(zip(ins, values, strict=True))
    for rp in pending:
        for e in rp.eqns:
            eqn = eqns[e]
            outs = after(e, jc.bind_eqn(eqn, [v.val if jc.is_literal(v) else local[v] for v in eqn.invars]))
            local.update(zip(eqn.outvars, outs, strict=True))
        fresh.update({v: local[v] for v in rp.recomputed})
    out = list(invals)
    for i, val in zip(own, held[1], strict=True):
        out[i] = val
    for i, v in enumerate(trigger.invars):
        if not jc.is_literal(v) and v in fresh:
            out[i] = fresh[v]
    return out
