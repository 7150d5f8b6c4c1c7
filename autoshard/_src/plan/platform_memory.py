"""A tensor plan's memory as another compiler lays the step out (pure: no jax import).

What the backward pass keeps depends on the compiler's fusion: XLA:GPU fuses a layer norm's or softmax's
row reductions with the elementwise ops that use them (one kernel keeps the normalised rows only), XLA:CPU
does not, and then keeps the centred input, its scaled copy and the GELU's tanh as separate buffers
(`core.fusion`, `gpu=False`). A plan made for a GPU is priced under XLA:GPU's fusion; when it is compiled on
CPU devices (an audit on this machine), the saved activations and the backward's working set are those of
XLA:CPU's fusion of the same program. `memory_terms_on` prices the plan's own assignment (factors, axes,
storage) under both fusions and moves the plan's numbers by the difference, so the audit compares the
compiled program with the memory the model predicts for that compiler, and a wrong number in the plan
still shows as a gap.

XLA:CPU also lays out buffers a GPU backend does not have and keeps what a GPU frees: copies of parameters
whose update nothing orders after their backward reads and convolution kernels reversed ahead of time
(`plan.cpu_buffers`, for a plan made for any hardware), and the forward values of a user's remat blocks,
which its compiled programs keep anyway (`core.recompute`: the step is priced unrecomputed).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ..core.cost import AnalyticalCostModel
from ..core.graph import OpGraph
from ..core.grouping import group
from ..core.hardware import get_hardware
from ..core.mesh import mesh_spec
from ..core.recompute import without_recomputation
from ..tensor.evaluator import SearchOptions
from ..tensor.search import PlanSpace, analysis, sequence_parallel_analysis
from .cpu_buffers import cpu_backward_start


def memory_terms_on(plan: Any, graph: OpGraph, platform: str) -> dict[str, float]:
    """The plan's memory terms (params, grads, optimizer, activations, data, cpu_temp_extra, total) as
    `platform` lays the step out. For "cpu": the activation terms priced under XLA:CPU's fusion when the
    plan was made for a GPU kernel model (`hardware.kernels`) or the step has user remat blocks (priced
    unrecomputed), and XLA:CPU's own buffers at the backward's start (parameter copies, reversed kernels:
    `plan.cpu_buffers`) for any plan. `graph`: the step the plan was made for (same fingerprint).
    Pipeline, 3-D and planner-remat plans, and plans saved without their space, keep their numbers."""
    own = dict(plan.predicted["memory"])
    hw_given = plan.provenance.get("hardware")
    if platform != "cpu" or plan.is_pipeline or plan.stages[0].remat != "none" or not hw_given:
        return own          # (a remat plan's activations are the 3-D tables', not the tensor evaluator's)
    space = _plan_space(plan, graph, plan.predicted.get("space"))
    if space is None:
        return own
    hw = get_hardware(hw_given)
    cpu_space = _space_without_recomputation(plan, graph, space)
    on_cpu = _priced_memory(plan, cpu_space, dataclasses.replace(hw, kernels=None))
    if hw.kernels is not None or cpu_space is not space:
        as_planned = _priced_memory(plan, space, hw)
        # the plan's own numbers moved by what the other fusion (and XLA:CPU's ignoring a user's remat)
        # changes: a wrong number stays wrong
        for term in ("activations", "grads", "cpu_temp_extra"):
            own[term] = own.get(term, 0.0) + on_cpu.get(term, 0.0) - as_planned.get(term, 0.0)
    # what XLA:CPU holds beside the saved activations when the backward starts; the live set then peaks
    # there or at the backward's end (the gradients and their reductions), whichever is larger; a copied
    # parameter's gradient lives in the buffer its copy vacated (`plan.cpu_buffers`)
    held = cpu_backward_start(plan, graph)
    acts, end = own["activations"], on_cpu["grads_end_cpu"]
    own["cpu_temp_extra"] = own.get("cpu_temp_extra", 0.0) + max(0.0, acts + held.bytes - max(acts, end))
    if held.largest_gradient is not None:
        own["cpu_temp_extra"] -= max(0.0, on_cpu["grads_alone"] - held.largest_gradient)
    own["total"] = sum(own[k] for k in ("params", "grads", "optimizer", "activations", "data"))
    return own


def _plan_space(plan: Any, graph: OpGraph, space_kind: str | None) -> PlanSpace | None:
    """The plan's space with its split factors as the candidates (the others stay whole either way); None
    when it cannot be rebuilt (no space recorded, or factors that are not this graph's analysis's)."""
    if space_kind is None:
        return None
    grouping = group(graph)
    a = analysis(graph, grouping)
    if space_kind == "sequence_parallel":
        a = sequence_parallel_analysis(graph, grouping, a)
        if a is None:
            return None
    split = tuple(sorted(f for f, _, _, axes in plan.factors if axes))
    if any(f not in a.fg.factor_sizes for f in split):
        return None
    return PlanSpace(graph, mesh_spec(dict(plan.mesh)), a.weights, a.fg, a.grad_ops, split,
                     np.zeros((0, len(split)), np.int64), a.periods, a.in_map, [], a.fused_update, a.window)


def _space_without_recomputation(plan: Any, graph: OpGraph, space: PlanSpace) -> PlanSpace:
    """The plan's space on the step with no user remat block recomputed (`core.recompute`: XLA:CPU keeps
    the forward values anyway), or `space` itself when nothing is recomputed or the dims are not numbered
    as in the plan's (then the plan's factors would name other dims)."""
    plain = without_recomputation(graph)
    if plain is None:
        return space
    other = _plan_space(plan, plain, plan.predicted.get("space"))
    if other is None or any(other.fg.value_factors(v) != space.fg.value_factors(v) for v in graph.inputs):
        return space
    return other


def _priced_memory(plan: Any, space: PlanSpace, hw: Any) -> dict[str, float]:
    """The memory terms of the plan's assignment priced on `hw` (its kernel model decides the fusion: GPU
    with one, CPU without)."""
    opts = _options(plan.provenance.get("options", {}))
    ev = space.evaluator(hw, AnalyticalCostModel(space.mesh, hw), opts, space.weights)
    factor_axes = {f: tuple(axes) for f, _, _, axes in plan.factors if axes}
    res = ev.evaluate_modes(ev.row(factor_axes)[None, :], (plan.storage,))[plan.storage]
    return {k: float(res[k][0]) for k in _TERMS}


_TERMS = ("params", "grads", "optimizer", "activations", "data", "cpu_temp_extra", "grads_end_cpu",
          "grads_alone")


def _options(given: dict) -> SearchOptions:
    fields = {f.name for f in dataclasses.fields(SearchOptions)}
    kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in given.items() if k in fields}
    return SearchOptions(**kw)
