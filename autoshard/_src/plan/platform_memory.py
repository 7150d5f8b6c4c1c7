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
from ..tensor.evaluator import SearchOptions
from ..tensor.search import PlanSpace, analysis, sequence_parallel_analysis


def memory_terms_on(plan: Any, graph: OpGraph, platform: str) -> dict[str, float]:
    """The plan's memory terms (params, grads, optimizer, activations, data, cpu_temp_extra, total), the
    activation terms priced under `platform`'s fusion: XLA:CPU's for "cpu" when the plan was made for a GPU
    kernel model (`hardware.kernels`), otherwise the plan's own. `graph`: the step the plan was made for
    (same fingerprint). Pipeline, 3-D and remat plans, and plans saved without their space, keep their
    numbers."""
    own = dict(plan.predicted["memory"])
    hw_given = plan.provenance.get("hardware")
    if (platform != "cpu" or plan.is_pipeline or plan.stages[0].remat != "none" or not hw_given
            or hw_given.get("kernels") is None):
        return own          # (a remat plan's activations are the 3-D tables', not the tensor evaluator's)
    space_kind = plan.predicted.get("space")
    hw = get_hardware(hw_given)
    as_planned = _repriced_memory(plan, graph, space_kind, hw) if space_kind is not None else None
    if as_planned is None:
        return own
    on_cpu = _repriced_memory(plan, graph, space_kind, dataclasses.replace(hw, kernels=None))
    # the plan's own numbers moved by what the other fusion changes (a wrong number stays wrong)
    for term in ("activations", "grads", "cpu_temp_extra"):
        own[term] = own.get(term, 0.0) + on_cpu.get(term, 0.0) - as_planned.get(term, 0.0)
    own["total"] = sum(own[k] for k in ("params", "grads", "optimizer", "activations", "data"))
    return own


def _repriced_memory(plan: Any, graph: OpGraph, space_kind: str, hw: Any) -> dict[str, float] | None:
    """The memory terms of the plan's assignment priced on `hw` (its kernel model decides the fusion: GPU
    with one, CPU without); None when the plan's space cannot be rebuilt (its factors are not those of
    this graph's analysis)."""
    opts = _options(plan.provenance.get("options", {}))
    mesh = mesh_spec(dict(plan.mesh))
    grouping = group(graph)
    analysed = analysis(graph, grouping)
    if space_kind == "sequence_parallel":
        analysed = sequence_parallel_analysis(graph, grouping, analysed)
        if analysed is None:
            return None
    factor_axes = {f: tuple(axes) for f, _, _, axes in plan.factors if axes}
    if any(f not in analysed.fg.factor_sizes for f in factor_axes):
        return None
    a = analysed      # the plan's split factors are the candidates: the others stay whole either way
    space = PlanSpace(graph, mesh, a.weights, a.fg, a.grad_ops, tuple(sorted(factor_axes)),
                      np.zeros((0, len(factor_axes)), np.int64), a.periods, a.in_map, [], a.fused_update, a.window)
    ev = space.evaluator(hw, AnalyticalCostModel(mesh, hw), opts, space.weights)
    return dict(ev.evaluate_one(factor_axes, plan.storage).memory)


def _options(given: dict) -> SearchOptions:
    fields = {f.name for f in dataclasses.fields(SearchOptions)}
    kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in given.items() if k in fields}
    return SearchOptions(**kw)
