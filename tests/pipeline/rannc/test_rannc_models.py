"""RaNNC on traced debug models (jax only here, for tracing; the partitioner itself is pure)."""

from __future__ import annotations

import pytest

import autoshard
import models
from autoshard._src.pipeline.atomic import atomic_partition
from autoshard._src.pipeline.costs import PipelineCosts
from autoshard._src.pipeline.rannc.blocks import partition_blocks
from autoshard._src.pipeline.rannc.stages import plan_stages
from autoshard._src.pipeline.rannc.uniform import best_uniform

from ._rannc_graphs import check_plan, component_dag, convex


@pytest.fixture(scope="module", params=["bert", "gpt"])
def traced(request):
    m = models.get(request.param, "debug")
    return autoshard.trace(m.train_step, *m.abstract_state())


def test_traced_model_partitions_into_valid_stages(traced):
    graph = traced
    atomic = atomic_partition(graph)
    ops = graph.ops
    # backward and optimizer ops land in a component of their own module (module attribution
    # names them; a few root-level ops such as the loss gradient may not match)
    attached = [(c, o) for c in range(len(atomic)) for o in atomic.attached[c]]
    same = sum(ops[o].module == ops[atomic.tasks[c]].module for c, o in attached)
    assert same >= 0.9 * len(attached)
    # every parameter's weight update sits with a forward op reading that parameter
    for v in graph.inputs:
        val = graph.values[v]
        if val.role != "parameter":
            continue
        readers = {c for d in val.consumers if ops[d].phase == "forward" for c in atomic.components_of(d)}
        updates = {atomic.component_of[d] for d in val.consumers if ops[d].phase == "optimizer"}
        assert updates <= readers, val.keypath

    costs = PipelineCosts(atomic, "v100-sxm")
    blocks = partition_blocks(atomic, 8, costs=costs)
    dag = component_dag(atomic)
    assert len(blocks) == 8 and all(convex(dag, b) for b in blocks.blocks)

    total = costs.totals(range(len(atomic)))
    # no stage may hold 60 %: blocks balance time, not memory (after fusion the embeddings weigh more)
    budget = 0.6 * (2 * total["params"] + total["state"] + total["act_const"])
    plan = plan_stages(graph, 8, "v100-sxm", k=8, memory_budget=budget, atomic=atomic, blocks=blocks)
    check_plan(plan, atomic, budget)
    assert len(plan.stages) >= 3
    assert plan.microbatches >= 1 and all(s.predicted_backward > 0 for s in plan.stages)

    uniform = best_uniform(costs, 8, grouping=autoshard.group(graph))
    assert uniform is not None
    check_plan(uniform, atomic, uniform.memory_budget)
