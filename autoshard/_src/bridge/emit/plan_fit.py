"""Is a plan the plan of this step? The checks every entry that runs or compiles a given plan applies
(the decorator's plan= and plan cache, audit): the step's fingerprint and its outputs."""

from __future__ import annotations

from typing import Any

from ...core.errors import PlanError
from ...core.graph import OpGraph, fingerprint
from ...plan.plan import Plan


def check_fingerprint(plan: Plan, graph: OpGraph, where: str) -> None:
    """PlanError unless `plan` was made for the step traced as `graph` (same inputs, shapes, ops, outputs)."""
    fp = fingerprint(graph)
    if plan.provenance.get("fingerprint") != fp:
        raise PlanError(
            f"{where} was made for another model or step, or other argument shapes (plan fingerprint "
            f"{plan.provenance.get('fingerprint')}, step {plan.provenance.get('step')!r}; this step's "
            f"fingerprint {fp}, step {graph.name!r}). Fix: re-plan with autoshard.plan(step, *args, mesh=...) "
            "for these arguments.")


def check_outputs(plan: Plan, graph: OpGraph, where: str) -> None:
    """PlanError unless the plan's outputs are the step's: the same keypaths, one spec per output that
    fits its rank. The plan's out_shardings are unflattened into the step's output tree, so a plan of a
    step returning other values (one more, say the gradients) would otherwise fail inside jax."""
    ranks = [len(graph.values[v].shape) for v in graph.outputs]
    ok = tuple(plan.output_keypaths) == tuple(graph.output_keypaths) and len(plan.output_specs_flat) == len(ranks)
    bad = [] if not ok else [kp for kp, spec, r in zip(plan.output_keypaths, plan.output_specs_flat, ranks,
                                                         strict=True) if len(spec) > r]
    if ok and not bad:
        return
    reason = (f"its output specs of {bad[:3]} have more dimensions than those outputs" if ok else
              f"it has {len(plan.output_keypaths)} output(s) {_few(plan.output_keypaths)} but the step returns "
              f"{len(graph.output_keypaths)} {_few(graph.output_keypaths)}")
    raise PlanError(f"{where} does not fit the step's outputs: {reason}. The plan was made for a step that returns "
                    "something else. Fix: re-plan with autoshard.plan(step, *args, mesh=...).")


def _few(keypaths: Any) -> str:
    keypaths = list(keypaths)
    return "(" + ", ".join(keypaths[:4]) + (", ..." if len(keypaths) > 4 else "") + ")"
