"""autoshard.audit: the compiled program of a plan against the plan's prediction (8 CPU devices)."""

from __future__ import annotations

import jax
import pytest
from jax.sharding import AxisType

import autoshard
import models
from autoshard._src.tensor.experts import EXPERTS


def _mesh(shape, names, n=None):
    devices = jax.devices()[: n or len(jax.devices())]
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names), devices=devices)


def test_megatron_mlp_activation_all_reduces_are_the_predicted_ones():
    # 6-layer MLP, batch 32, hidden 256 on a 4-way model axis: the plan's predicted forward and
    # backward activation all-reduces are exactly what XLA compiles, and there is nothing else
    # (apart from gradient all-reduces of replicated parameters, which the plan also predicts).
    m = models.get("mlp", "debug", num_layers=6, batch_size=32, hidden_dim=256, in_dim=256, out_dim=256)
    args = m.abstract_state()
    plan = autoshard.plan(m.train_step, *args, mesh={"model": 4}, hardware="cpu-sim")
    predicted = {c["phase"]: c for c in plan.predicted["collectives"]}
    assert {"forward", "backward"} <= set(predicted), plan.explain()  # a tensor-parallel plan
    report = autoshard.audit(plan, m.train_step, *args, mesh=_mesh((4,), ("model",), 4))
    for phase in ("forward", "backward"):
        got = [c for c in report.collectives if c.phase == phase]
        p = predicted[phase]
        assert all(c.kind == p["kind"] and c.axes == p["axes"] for c in got), report.report()
        assert sum(c.bytes * c.count for c in got) == p["bytes"], report.report()
        assert len(got) == p["count"], report.report()
    others = [c for c in report.collectives if c.phase not in ("forward", "backward")]
    grad = [c for c in plan.predicted["collectives"] if c["phase"] == "grad"]
    assert sum(c.bytes * c.count for c in others) == sum(c["bytes"] for c in grad)
    assert not report.gaps or all(g.what.startswith("memory") for g in report.gaps), report.report()


@pytest.mark.slow
def test_gpt_audit_names_every_collective_and_matches_bytes():
    m = models.get("gpt", "debug")
    args = m.abstract_state()
    plan = autoshard.plan(m.train_step, *args, mesh={"data": 2, "model": 4}, hardware="cpu-sim")
    report = autoshard.audit(plan, m.train_step, *args)
    assert report.collectives
    assert all(c.module for c in report.collectives), [c.op_name for c in report.collectives if not c.module]
    assert {c.module.split("/")[0] for c in report.collectives} <= {"GPT", "train_step"}
    # fidelity: bytes of every collective kind and axis set within 10 %, argument memory exact
    assert not [g for g in report.gaps if g.what.startswith("collective")], report.report()
    assert report.memory["argument"] == pytest.approx(report.predicted_memory["argument"], rel=0.01)
    assert report.cost["flops"] > 0
    text = report.report()
    assert "GPT/block_0" in text and "predicted" in text
    assert '"collectives"' in report.to_json()


def test_audit_rejects_a_mesh_that_differs_from_the_plan():
    m = models.get("mlp", "debug")
    args = m.abstract_state()
    plan = autoshard.plan(m.train_step, *args, mesh={"data": 2, "model": 4}, hardware="cpu-sim")
    with pytest.raises(autoshard.PlanError, match="differs from the plan's mesh"):
        autoshard.audit(plan, m.train_step, *args, mesh=_mesh((4, 2), ("data", "model")))


@pytest.mark.slow
@pytest.mark.parametrize("expert", EXPERTS)
def test_expert_plans_are_plans_the_audit_confirms(expert):
    m = models.get("gpt", "debug", batch_size=8, num_heads=8)
    args = m.abstract_state()
    plan = autoshard.expert_plan(expert, m.train_step, *args, mesh={"data": 2, "model": 4}, hardware="h100-sxm")
    assert plan.predicted["expert"] == expert
    specs = plan.specs_by_keypath()
    q = specs["[0]['block_0']['attn']['q']['kernel']"]
    if expert in ("data-parallel", "fsdp"):
        assert specs["[2]['inputs']"][0] == ("data", "model")
        assert (q == ((), ())) == (expert == "data-parallel"), q
    elif expert == "megatron":
        assert q == ((), ("data", "model")) and specs["[0]['block_0']['attn']['o']['kernel']"][0] == ("data", "model")
    else:
        assert q == ((), ("model",)) and specs["[2]['inputs']"][0] == ("data",)
        assert specs["[0]['wte']['embedding']"][0] == ("model",)  # vocabulary-parallel embedding
    report = autoshard.audit(plan, m.train_step, *args)
    assert not [g for g in report.gaps if g.what.startswith("collective") and not g.backend_specific], \
        report.report()


def test_auto_plan_is_never_slower_than_an_expert_and_explain_says_why():
    m = models.get("gpt", "debug", batch_size=8, num_heads=8)
    args = m.abstract_state()
    plan = autoshard.plan(m.train_step, *args, mesh={"data": 2, "model": 4}, hardware="h100-sxm")
    experts = plan.predicted["experts"]
    assert set(experts) == set(EXPERTS)
    for name, e in experts.items():
        if "step_time" in e and e["feasible"]:
            assert plan.predicted["step_time"] <= e["step_time"] * (1 + 1e-9), name
    text = plan.explain()
    assert "vs expert plans" in text and ("faster" in text or "ties" in text)
