"""Plan validation for interleaved 1F1B: v x pipe stages in a chain, micro-batches in groups of pipe."""

from __future__ import annotations

import dataclasses

import pytest

from autoshard import PlanError
from autoshard._src.plan.plan import Plan, Stage
from autoshard._src.plan.validate import check_plan


def _plan(stages=4, mesh=(("pipe", 2),), microbatches=4, schedule="interleaved-1f1b"):
    st = tuple(Stage(index=i, mesh=(("data", 1),), replicas=1, microbatch_size=2, predicted_forward=1e-3,
                     predicted_backward=2e-3, memory=1.0, microbatches=microbatches,
                     after=(i - 1,) if i else (), units=(i,)) for i in range(stages))
    return Plan(mesh=mesh, hardware="cpu-sim", input_keypaths=(), input_specs_flat=(), output_keypaths=(),
                output_specs_flat=(), stages=st, predicted={}, params=(), warnings=(), provenance={},
                schedule=schedule, microbatches=microbatches)


@pytest.mark.parametrize(("stages", "pipe"), [(4, 2), (6, 2), (6, 3), (2, 2), (8, 4)])
def test_v_times_pipe_stages_are_accepted(stages, pipe):
    check_plan(_plan(stages, (("pipe", pipe), ("data", 2)), microbatches=2 * pipe))


@pytest.mark.parametrize(("kw", "match"), [
    ({"stages": 3}, r"has 3 stages, not a multiple of 2.*Fix: give the plan v x 2 stages"),
    ({"stages": 4, "mesh": (("pipe", 3),)}, r"has 4 stages, not a multiple of 3"),
    ({"microbatches": 3}, r"microbatches=3 is not a multiple of 2.*Fix: microbatches=4"),
    ({"mesh": (("data", 2),)}, r"has no 'pipe' axis"),
])
def test_mismatches_are_plan_errors(kw, match):
    with pytest.raises(PlanError, match=match):
        check_plan(_plan(**kw))


def test_a_dag_is_refused_and_other_schedules_unchanged():
    plan = _plan()
    dag = dataclasses.replace(plan, stages=plan.stages[:3] + (dataclasses.replace(plan.stages[3], after=(1,)),))
    with pytest.raises(PlanError, match=r"stages \[3\] do not run right after"):
        check_plan(dag)
    check_plan(_plan(stages=3, schedule="1f1b"))          # one stage per rank: not this check's business
