"""autoshard.plan(..., pipeline="rannc"): stages in the Plan, JSON, explain, measured profiles, errors."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import autoshard
import models
from autoshard._src.bridge.audit.profile import measure_op_curves, measure_op_times


@pytest.fixture(scope="module")
def bert():
    m = models.get("bert", "debug")
    return m, m.abstract_state()


@pytest.fixture(scope="module")
def bert_plan(bert):
    m, args = bert
    return autoshard.plan(m.train_step, *args, mesh={"data": 8}, hardware="v100-sxm", pipeline="rannc",
                          pipeline_options={"k": 8})


def test_stages_cover_the_step_and_fit(bert, bert_plan):
    m, args = bert
    p = bert_plan
    graph = autoshard.trace(m.train_step, *args)
    assert p.stages and p.microbatches >= 1
    covered = set().union(*(s.ops for s in p.stages))
    assert covered == set(range(len(graph.ops)))
    # stages hold contiguous block ranges, in order, and form a chain
    assert p.stages[0].units[0] == 0
    for a, b in zip(p.stages, p.stages[1:], strict=False):
        assert b.units == tuple(range(a.units[-1] + 1, b.units[-1] + 1)) and b.after == (a.index,)
    pp = p.predicted["pipeline"]
    assert sum(s.replicas for s in p.stages) == pp["devices"]
    for s in p.stages:
        assert s.memory <= p.predicted["memory_budget"]
        # each replica computes its share of a micro-batch (the busiest one when they don't divide)
        q = -(-pp["batch_size"] // (pp["pipelines"] * p.microbatches))     # the busiest micro-batch
        assert s.microbatch_size == -(-q // (s.replicas // pp["pipelines"]))
        assert s.predicted_forward > 0 and s.predicted_backward > 0
    # every parameter is held by some stage, and the report says which devices sync it
    held = set().union(*(s.params for s in p.stages))
    params = {r.keypath for r in p.params}
    assert held == params
    assert p.predicted["memory"]["total"] == max(s.memory for s in p.stages)


def test_json_round_trip_and_explain(bert, bert_plan):
    m, args = bert
    q = autoshard.Plan.from_json(bert_plan.to_json())
    assert q.stages == bert_plan.stages and q.microbatches == bert_plan.microbatches
    assert q.predicted["pipeline"] == bert_plan.predicted["pipeline"]
    assert autoshard.bind(q, *args).to_json() == bert_plan.to_json()
    text = bert_plan.explain()
    assert "pipeline plan (rannc" in text and "uniform layer split" in text
    for s in bert_plan.stages:
        assert f"\n{s.index}  " in text


def test_pipe_axis_fixes_the_stage_count(bert):
    m, args = bert
    for pipe in (2, 4):
        p = autoshard.plan(m.train_step, *args, mesh={"pipe": pipe, "data": 8 // pipe}, hardware="v100-sxm",
                           pipeline="rannc", pipeline_options={"k": 8})
        assert len(p.stages) == pipe


def test_memory_limits_force_more_stages(bert):
    m, args = bert
    roomy = autoshard.plan(m.train_step, *args, mesh={"data": 8}, hardware="v100-sxm", pipeline="rannc",
                           pipeline_options={"k": 8})
    whole = roomy.predicted["memory"]["total"]
    tight = autoshard.plan(m.train_step, *args, mesh={"data": 8}, hardware="v100-sxm", pipeline="rannc",
                           pipeline_options={"k": 8}, memory_budget=0.75 * whole)
    assert len(tight.stages) > len(roomy.stages) or tight.predicted["memory"]["total"] < whole
    assert tight.predicted["memory"]["total"] <= 0.75 * whole
    with pytest.raises(autoshard.InfeasiblePlanError, match="memory budget") as err:
        autoshard.plan(m.train_step, *args, mesh={"data": 8}, hardware="v100-sxm", pipeline="rannc",
                       pipeline_options={"k": 8}, memory_budget=1e3)
    assert isinstance(err.value, autoshard.InfeasiblePlanError) and err.value.min_memory > 1e3


@pytest.mark.parametrize("kw, match", [
    ({"pipeline": "alpa"}, "pipeline='alpa' is unknown"),
    ({"pipeline": "rannc", "schedule": "zb-v"}, "schedule='zb-v'"),
    ({"pipeline": "rannc", "profile": "guess"}, "profile='guess'"),
    ({"pipeline": "rannc", "pipeline_options": {"blocks": 4}}, "keys \\['blocks'\\]"),
    ({"pipeline": "rannc", "pipeline_options": {"search": "some"}}, "search='some'"),
    ({"profile": "measured"}, "pipeline plans only"),
])
def test_bad_pipeline_arguments_are_typed_errors(bert, kw, match):
    m, args = bert
    with pytest.raises(autoshard.ConfigError, match=match):
        autoshard.plan(m.train_step, *args, mesh={"data": 8}, hardware="v100-sxm", **kw)


@pytest.mark.slow
def test_measured_profile_times_ops_on_the_device():
    m = models.get("mlp", "debug")
    args = m.abstract_state()
    graph = autoshard.trace(m.train_step, *args, keep_eqns=True)
    times, notes = measure_op_times(graph, lambda i: -1.0, min_seconds=1e-4, max_runs=5)
    assert len(times) == len(graph.ops) and all(t > 0 for t in times), notes
    # the step's biggest matmul takes longer than its cheapest elementwise op
    dots = [i for i, op in enumerate(graph.ops) if op.primitive == "dot_general"]
    big = max(dots, key=lambda i: graph.ops[i].flops)
    assert times[big] > min(times)
    p = autoshard.plan(m.train_step, *args, mesh={"pipe": 2, "data": 4}, hardware="cpu-sim", pipeline="rannc",
                       profile="measured", pipeline_options={"k": 4})
    model = autoshard.plan(m.train_step, *args, mesh={"pipe": 2, "data": 4}, hardware="cpu-sim",
                           pipeline="rannc", pipeline_options={"k": 4})
    assert p.predicted["pipeline"]["profile"] == "measured" and len(p.stages) == 2
    assert p.predicted["step_time"] != model.predicted["step_time"]


def test_untimeable_ops_keep_the_estimate_and_are_named():
    def step(key, x):
        return jax.random.normal(key, x.shape) * x

    graph = autoshard.trace(step, jax.random.key(0), np.ones((4, 4), np.float32), keep_eqns=True)
    times, notes = measure_op_times(graph, lambda i: 123.0, min_seconds=1e-4, max_runs=3)
    assert 123.0 in times and notes and all("keep the cost model's estimate" in n for n in notes)
    mul = [t for t, op in zip(times, graph.ops, strict=True) if op.primitive == "mul"]
    assert mul and all(0 < t < 1 for t in mul)


def test_pipeline_plans_are_not_run_or_audited_as_one_program(bert, bert_plan):
    m, args = bert
    with pytest.raises(autoshard.PlanError, match="pipeline plan"):
        autoshard.audit(bert_plan, m.train_step, *args)


def test_cli_plans_pipelines(capsys):
    from autoshard._src.cli import main

    assert main(["plan", "mlp", "--config", "debug", "--mesh", "pipe=2,data=4", "--hardware", "v100-sxm",
                 "--pipeline", "rannc", "--blocks", "4"]) == 0
    out = capsys.readouterr().out
    assert "pipeline plan (rannc" in out and "stage" in out


def test_simulated_schedule_matches_the_memory_models_in_flight_counts(bert):
    m, args = bert
    p = autoshard.plan(m.train_step, *args, mesh={"pipe": 4, "data": 2}, hardware="cpu-sim", pipeline="rannc")
    pp = p.predicted["pipeline"]
    S, MB = len(p.stages), p.microbatches
    # 1F1B: stage s (0-based) keeps min(S - s, MB) micro-batches, as the DP's memory check assumes
    assert list(pp["peak_inflight"]) == [min(S - s, MB) for s in range(S)]
    # the DP's step formula (max forward + max backward per extra micro-batch) bounds the simulation
    assert pp["simulated_step_time"] <= p.predicted["step_time"] * (1 + 1e-9)
    assert 0 <= pp["bubble_fraction"] < 1


def test_cli_schedule_prints_a_gantt_chart(capsys):
    from autoshard._src.cli import main

    assert main(["schedule", "bert", "--config", "debug", "--mesh", "pipe=2,data=4", "--width", "60"]) == 0
    out = capsys.readouterr().out
    assert "rank 0 |" in out and "rank 1 |" in out and "F0" in out and "B0" in out


@pytest.fixture(scope="module")
def mmt():
    m = models.get("mmt", "debug")
    return m, m.abstract_state()


@pytest.mark.slow
def test_graphpipe_plans_keep_branches_parallel(mmt):
    m, args = mmt
    p = autoshard.plan(m.train_step, *args, mesh={"data": 8}, hardware="v100-sxm", pipeline="graphpipe")
    graph = autoshard.trace(m.train_step, *args)
    pp = p.predicted["pipeline"]
    assert pp["method"] == "graphpipe" and pp["schedule"] == "graph-1f1b"
    assert set().union(*(s.ops for s in p.stages)) == set(range(len(graph.ops)))
    assert sum(len(s.ops) for s in p.stages) == len(graph.ops)          # layer nodes never share ops
    # a DAG of stages: several sources (the branches) feed the join; depth < stage count
    sources = [s for s in p.stages if not s.after]
    assert len(sources) >= 2 and pp["depth"] < len(p.stages)
    assert pp["baseline"]["name"] == "sequential pipeline (SPP)" and pp["baseline"]["depth"] > pp["depth"]
    assert pp["baseline_reason"] == ""        # a baseline exists: no reason why not beside its numbers
    assert p.predicted["step_time"] == pytest.approx(pp["simulated_step_time"])
    # batch 4 over 8 devices: micro-batches of at most 4 samples leave devices idle, and the plan says so
    assert pp["devices_used"] == sum(s.replicas for s in p.stages)
    assert (pp["devices_used"] < 8) == any("uses" in w and "of the 8 devices" in w for w in p.warnings)
    assert autoshard.Plan.from_json(p.to_json()).stages == p.stages
    assert "after" in p.explain() and "vs sequential pipeline (SPP)" in p.explain()


@pytest.mark.parametrize("kw, match", [
    ({"mesh": {"pipe": 2, "data": 4}}, "has a 'pipe' axis"),
    ({"schedule": "gpipe"}, "schedule='gpipe'"),
    ({"pipeline_options": {"k": 8}}, "keys \\['k'\\] are unknown for pipeline='graphpipe'"),
])
def test_graphpipe_argument_errors(mmt, kw, match):
    m, args = mmt
    kw = {"mesh": {"data": 8}, **kw}
    with pytest.raises(autoshard.ConfigError, match=match):
        autoshard.plan(m.train_step, *args, hardware="v100-sxm", pipeline="graphpipe", **kw)


def test_cli_schedule_for_graphpipe(capsys):
    from autoshard._src.cli import main

    assert main(["schedule", "mmt", "--config", "debug", "--mesh", "data=8", "--pipeline", "graphpipe",
                 "--hardware", "v100-sxm"]) == 0
    out = capsys.readouterr().out
    assert "graphpipe, graph-1f1b" in out and "rank 4 |" in out


def test_a_pipe_axis_larger_than_the_blocks_is_a_clear_error(bert):
    m, args = bert
    with pytest.raises(autoshard.InfeasiblePlanError, match="No stage count was tried"):
        autoshard.plan(m.train_step, *args, mesh={"pipe": 8}, hardware="v100-sxm", pipeline="rannc",
                       pipeline_options={"k": 4})


@pytest.mark.slow
def test_graphpipe_measured_profile_times_every_micro_batch_size():
    """profile="measured" with GraphPipe: each op timed at micro-batch 1, 2, 4, 8 (the step traced
    again with its data cut), matched to the full trace; batch 1 broadcasts size-1 dims differently,
    and the plan says those ops keep the estimate."""
    m = models.get("candle_uno", "debug")
    args = m.abstract_state()
    kw = dict(mesh={"data": 4}, hardware="cpu-sim", pipeline="graphpipe")
    p = autoshard.plan(m.train_step, *args, profile="measured", **kw)
    model = autoshard.plan(m.train_step, *args, **kw)
    assert p.predicted["pipeline"]["profile"] == "measured"
    assert p.predicted["step_time"] != model.predicted["step_time"]
    assert any("at micro-batch 1" in w and "keep the cost model's estimate" in w for w in p.warnings)
    assert autoshard.Plan.from_json(p.to_json()).stages == p.stages


def test_measured_curves_refuse_a_program_that_changes_with_the_batch():
    def step(x):
        for _ in range(30 if x.shape[0] > 2 else 1):     # a different program below 3 samples
            x = jax.numpy.tanh(x * 1.5)
        return x.sum()

    args = (jax.ShapeDtypeStruct((8, 4), np.float32),)
    graph = autoshard.trace(step, *args, keep_eqns=True)
    with pytest.raises(autoshard.PlanError, match="cut from 8 to 1 samples, but only .* ops recur"):
        measure_op_curves(step, args, graph, 8, [1, 2, 4, 8], lambda i, k: 1.0, min_seconds=1e-5, max_runs=3)
    curves, full, notes = measure_op_curves(step, args, graph, 8, [4, 8], lambda i, k: 1.0,
                                            min_seconds=1e-5, max_runs=3)
    assert curves.shape == (len(graph.ops), 2) and (curves > 0).all() and not notes
    assert list(curves[:, 1]) == full                                    # the traced batch itself


@pytest.mark.slow
def test_auto_pipeline_picks_the_faster_partitioner(mmt):
    m, args = mmt
    kw = dict(mesh={"data": 8}, hardware="v100-sxm")
    p = autoshard.plan(m.train_step, *args, pipeline="auto", **kw)
    auto = p.predicted["pipeline"]["auto"]
    steps = auto["simulated_step_time"]
    assert set(steps) == {"rannc", "graphpipe"} and not auto["skipped"]
    assert auto["chosen"] == min(steps, key=steps.get)
    direct = autoshard.plan(m.train_step, *args, pipeline=auto["chosen"], **kw)
    assert p.stages == direct.stages and p.predicted["step_time"] == direct.predicted["step_time"]
    assert steps[auto["chosen"]] == pytest.approx(direct.predicted["pipeline"]["simulated_step_time"])
    assert f"pipeline='auto' chose {auto['chosen']}" in p.explain()
    q = autoshard.Plan.from_json(p.to_json())
    assert q.predicted["pipeline"]["auto"] == auto and q.provenance["options"]["pipeline"] == "auto"


@pytest.mark.parametrize("kw, chosen, skipped", [
    ({"schedule": "gpipe"}, "rannc", "graphpipe"),
    ({"schedule": "graph-1f1b"}, "graphpipe", "rannc"),
])
def test_auto_pipeline_skips_what_does_not_apply(mmt, kw, chosen, skipped):
    m, args = mmt
    kw = {"mesh": {"data": 8}, **kw}
    p = autoshard.plan(m.train_step, *args, hardware="v100-sxm", pipeline="auto", **kw)
    auto = p.predicted["pipeline"]["auto"]
    assert auto["chosen"] == chosen and set(auto["skipped"]) == {skipped}
    assert set(auto["simulated_step_time"]) == {chosen}
    assert f"{skipped} skipped: " in p.explain()


@pytest.mark.slow
def test_auto_pipeline_routes_options_and_reports_errors(mmt):
    m, args = mmt
    p = autoshard.plan(m.train_step, *args, mesh={"data": 8}, hardware="v100-sxm", pipeline="auto",
                       schedule="gpipe", pipeline_options={"k": 4, "max_microbatch_size": 2})
    assert p.predicted["pipeline"]["units"] == 4                         # k went to RaNNC
    # (a "pipe" axis with pipeline="auto" fixes a 3-D shape instead: tests/bridge/test_three_d.py)
    with pytest.raises(autoshard.ConfigError, match=r"keys \['blocks'\] are unknown for pipeline='auto'"):
        autoshard.plan(m.train_step, *args, mesh={"data": 8}, hardware="v100-sxm", pipeline="auto",
                       pipeline_options={"blocks": 4})
    # nothing fits 1 KiB: the first partitioner's typed infeasibility error, whole
    with pytest.raises(autoshard.InfeasiblePlanError):
        autoshard.plan(m.train_step, *args, mesh={"data": 8}, hardware="v100-sxm", pipeline="auto",
                       memory_budget=1024)


def test_cli_schedule_auto(capsys):
    from autoshard._src.cli import main

    assert main(["schedule", "mmt", "--config", "debug", "--mesh", "data=8", "--pipeline", "auto",
                 "--hardware", "v100-sxm"]) == 0
    out = capsys.readouterr().out
    assert "pipeline='auto' chose" in out and "rank 0 |" in out


@pytest.mark.slow
def test_graphpipe_per_stage_microbatch_option(mmt):
    m, args = mmt
    kw = dict(mesh={"data": 8}, hardware="v100-sxm", pipeline="graphpipe")
    base = autoshard.plan(m.train_step, *args, **kw)
    per = autoshard.plan(m.train_step, *args, pipeline_options={"per_stage_microbatch": True}, **kw)
    assert per.predicted["step_time"] <= base.predicted["step_time"] * (1 + 1e-12)
    assert per.provenance["options"]["per_stage_microbatch"] is True
    with pytest.raises(autoshard.AutoshardError, match="per_stage_microbatch=1 must be True or False"):
        autoshard.plan(m.train_step, *args, pipeline_options={"per_stage_microbatch": 1}, **kw)


def test_no_uniform_baseline_reason_names_its_numbers():
    """The RaNNC plan's reason for a missing uniform baseline states the layers and stage counts tried."""
    from types import SimpleNamespace

    from autoshard._src.core.hardware import get_hardware
    from autoshard._src.pipeline.atomic import atomic_partition
    from autoshard._src.pipeline.costs import PipelineCosts
    from autoshard._src.pipeline.rannc.partitioner import _no_uniform

    m = models.get("gpt", "debug", num_layers=2)
    graph = autoshard.trace(m.train_step, *m.abstract_state())
    costs = PipelineCosts(atomic_partition(graph), get_hardware("v100-sxm"))
    grouping = autoshard.group(graph)
    few = _no_uniform(costs, grouping, SimpleNamespace(stage_counts=[4, 8], devices=8), 2**30)
    assert few == "2 repeated layer(s) cannot fill 4 or more stages", few
    tight = _no_uniform(costs, grouping, SimpleNamespace(stage_counts=None, devices=8), 2**20)
    assert "the 2 repeated layers into [2] stages" in tight and "0.000977 GiB" in tight, tight
