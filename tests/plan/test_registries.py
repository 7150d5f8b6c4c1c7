"""Schedules and partitioners are registered, not hard-coded: a toy of each, defined here outside
the package, is registered and planned with like the built-ins."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import autoshard
import pipeline
from autoshard import ConfigError, ScheduleError


@pytest.fixture
def toy_schedule():
    @pipeline.register_schedule("toy-reverse")
    def reverse_gpipe(num_stages: int, num_microbatches: int) -> pipeline.Schedule:
        """GPipe with backwards youngest first: valid, and different from every built-in."""
        ranks = tuple(tuple([pipeline.Task(s, m, "F") for m in range(num_microbatches)]
                            + [pipeline.Task(s, m, "B") for m in reversed(range(num_microbatches))])
                      for s in range(num_stages))
        edges = tuple((s, s + 1) for s in range(num_stages - 1))
        return pipeline.Schedule("toy-reverse", num_stages, edges, (num_microbatches,) * num_stages, ranks)

    yield "toy-reverse"
    pipeline.unregister_schedule("toy-reverse")


class HalvesPartitioner:
    """Two stages: the first half of the forward ops and the second, every device replicating both."""

    name = "halves"
    schedules = ("1f1b", "toy-reverse")
    options = frozenset({"stages"})

    def unsupported(self, mesh, options):
        return None if options.get("stages", 2) == 2 else "only 2 stages"

    def partition(self, problem):
        graph = problem.graph
        fwd = [op.index for op in graph.ops if op.phase == "forward"]
        cut = fwd[len(fwd) // 2]
        halves = [tuple(i for i in range(len(graph.ops)) if i < cut),
                  tuple(i for i in range(len(graph.ops)) if i >= cut)]
        stages = tuple(pipeline.PartitionedStage(
            units=(k,), ops=ops, replicas=problem.devices // 2, microbatch_size=4, forward=1e-3, backward=2e-3,
            memory=1e6, microbatches=2, after=(k - 1,) if k else ()) for k, ops in enumerate(halves))
        return pipeline.StagePartition(
            method="halves", stages=stages, schedule=pipeline.schedule(problem.schedule, num_stages=2,
                                                                       num_microbatches=2),
            step_time=1e-2, memory_budget=1e9, batch_size=8, pipelines=1, search_seconds=0.0, units=2,
            unit="halves", baseline_name="none", baseline_reason="a toy")


@pytest.fixture
def halves():
    part = pipeline.register_partitioner(HalvesPartitioner())
    yield part
    pipeline.unregister_partitioner(part.name)


def _step(params, batch):
    def loss(p):
        h = jnp.tanh(batch["x"] @ p["w1"])
        return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value


ARGS = ({"w1": jax.ShapeDtypeStruct((16, 32), jnp.float32), "w2": jax.ShapeDtypeStruct((32, 4), jnp.float32)},
        {"x": jax.ShapeDtypeStruct((8, 16), jnp.float32), "y": jax.ShapeDtypeStruct((8, 4), jnp.float32)})


def test_toy_schedule_and_partitioner_plan_like_builtins(toy_schedule, halves):
    assert "halves" in pipeline.partitioner_names() and toy_schedule in pipeline.schedule_names()
    plan = autoshard.plan(_step, *ARGS, mesh={"data": 8}, hardware="v100-sxm", pipeline="halves",
                          schedule=toy_schedule)
    assert len(plan.stages) == 2 and plan.stages[1].after == (0,)
    assert plan.predicted["pipeline"]["method"] == "halves"
    assert plan.predicted["pipeline"]["schedule"] == toy_schedule
    # the event simulator times the toy schedule's own order: all forwards, then all backwards
    assert plan.predicted["pipeline"]["simulated_step_time"] > 0
    assert "halves" in plan.explain()


def test_auto_considers_registered_partitioners(halves):
    plan = autoshard.plan(_step, *ARGS, mesh={"data": 8}, hardware="v100-sxm", pipeline="auto")
    auto = plan.predicted["pipeline"]["auto"]
    assert "halves" in auto["simulated_step_time"] or "halves" in auto["skipped"]


def test_registry_errors():
    with pytest.raises(ConfigError, match="reserved"):
        pipeline.register_partitioner(type("Auto", (HalvesPartitioner,), {"name": "auto"})())
    with pytest.raises(ConfigError, match="lacks"):
        pipeline.register_partitioner(object())
    with pytest.raises(ConfigError, match="built-in"):
        pipeline.unregister_partitioner("rannc")
    with pytest.raises(ScheduleError, match="built-in"):
        pipeline.unregister_schedule("1f1b")
    with pytest.raises(ConfigError, match="'halves' is unknown"):
        autoshard.Config(mesh={"data": 8}, pipeline="halves")
