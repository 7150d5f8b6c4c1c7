"""Honest audit labels (issue 20): a gap counts against `fidelity_ok` unless a named backend behaviour
accounts for its bytes, and the plan states its collectives and memory per backend, so a CPU audit
and a GPU audit each compare like with like."""

from __future__ import annotations

import dataclasses

import pytest

import autoshard
import models


@pytest.fixture(scope="module")
def mlp():
    m = models.get("mlp", "debug", num_layers=2, batch_size=16, hidden_dim=128, in_dim=128, out_dim=128)
    return m, m.abstract_state()


def test_a_wrong_temp_estimate_fails_fidelity_and_names_its_parts(mlp):
    m, args = mlp
    plan = autoshard.expert_plan("data-parallel", m.train_step, *args, mesh={"data": 8}, hardware="h100-sxm")
    good = autoshard.audit(plan, m.train_step, *args)
    assert good.fidelity_ok and not good.gaps, good.report()
    mem = dict(plan.predicted["memory"])
    mem["activations"] += 2 * good.memory["temp"]          # a deliberately wrong temp estimate
    wrong = dataclasses.replace(plan, predicted={**plan.predicted, "memory": mem})
    bad = autoshard.audit(wrong, m.train_step, *args)
    assert not bad.fidelity_ok
    (gap,) = bad.gaps
    assert gap.what == "memory argument+temp" and not gap.backend_specific
    assert dict(gap.modules)["saved activations"] == mem["activations"]
    assert gap.predicted == pytest.approx(good.predicted_memory["argument+temp"] + 2 * good.memory["temp"])
    assert "[backend-specific]" not in bad.report()


def test_an_unpredicted_collective_fails_fidelity(mlp):
    m, args = mlp
    plan = autoshard.expert_plan("data-parallel", m.train_step, *args, mesh={"data": 8}, hardware="h100-sxm")
    silent = dataclasses.replace(plan, predicted={**plan.predicted, "collectives": [], "comm_bytes": {}})
    report = autoshard.audit(silent, m.train_step, *args)
    assert not report.fidelity_ok
    assert [g.note for g in report.gaps] == ["collective the plan does not predict"]


def test_fsdp_states_collectives_and_memory_per_backend(mlp):
    m, args = mlp
    plan = autoshard.expert_plan("fsdp", m.train_step, *args, mesh={"data": 8}, hardware="h100-sxm")
    gpu, cpu = plan.collectives_on("gpu"), plan.collectives_on("cpu")
    scattered = [c for c in gpu if c["kind"] == "reduce-scatter"]
    assert scattered and all(c["phase"] == "grad" for c in scattered)
    assert not [c for c in cpu if c["kind"] == "reduce-scatter"]
    # the same gradient bytes, all-reduced whole on XLA:CPU
    cpu_grad = sum(c["bytes"] for c in cpu if c["phase"] == "grad" and c["kind"] == "all-reduce")
    gpu_grad = sum(c["bytes"] for c in gpu if c["phase"] == "grad" and c["kind"] in ("all-reduce", "reduce-scatter"))
    assert cpu_grad == pytest.approx(gpu_grad)
    assert "(XLA:CPU: all-reduce over data)" in plan.explain()
    extra = plan.predicted["memory"]["cpu_temp_extra"]
    assert plan.memory_on("cpu")["temp"] == pytest.approx(plan.memory_on("gpu")["temp"] + extra)
    assert extra >= 0
    report = autoshard.audit(plan, m.train_step, *args)
    assert report.fidelity_ok, report.report()
    assert report.predicted_memory == plan.memory_on("cpu")
    # the parameter table says how each FSDP gradient is synchronised (never "none")
    assert all("reduce-scatter" in r.grad_sync for r in plan.params), [r.grad_sync for r in plan.params]
