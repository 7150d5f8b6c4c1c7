"""A GPU plan audited on CPU devices is compared with the memory its model predicts for XLA:CPU's fusion
(issue 32): XLA:CPU keeps a layer norm's centred input and scaled copy and the GELU's tanh as buffers of
their own, which XLA:GPU's normalisation fusion does not, so the saved activations differ by compiler."""

from __future__ import annotations

import dataclasses

import pytest

import autoshard
import models
from autoshard._src.bridge.trace.trace import trace
from autoshard._src.plan.cpu_buffers import BackwardStart, cpu_backward_start
from autoshard._src.plan.plan import buffers
from autoshard._src.plan.platform_memory import memory_terms_on

MESH = {"data": 2, "model": 4}


@pytest.fixture(scope="module")
def encoder():
    m = models.get("bert", "debug", num_layers=2, hidden=64, d_ff=256, num_heads=4, seq_len=32, batch_size=8,
                   vocab_size=512)
    args = m.abstract_state()
    return m, args, trace(m.train_step, *args)


@pytest.fixture(scope="module")
def gpu_plan(encoder):
    m, args, _ = encoder
    return autoshard.plan(m.train_step, *args, mesh=MESH, hardware="h100-sxm")


def test_cpu_fusion_keeps_more_activations_than_gpu_fusion(encoder, gpu_plan):
    _, _, graph = encoder
    own = gpu_plan.predicted["memory"]
    cpu = memory_terms_on(gpu_plan, graph, "cpu")
    assert gpu_plan.predicted["space"] in ("tensor", "sequence_parallel")
    assert cpu["activations"] > own["activations"]            # layer norms and GELUs unfused on CPU
    assert {k: cpu[k] for k in ("params", "optimizer", "data")} == {k: own[k] for k in ("params", "optimizer", "data")}
    assert cpu["total"] == pytest.approx(sum(cpu[k] for k in ("params", "grads", "optimizer", "activations", "data")))
    assert memory_terms_on(gpu_plan, graph, "gpu") == own


def test_a_roofline_plan_keeps_its_fusion_and_gains_only_xla_cpus_own_buffers(encoder, gpu_plan):
    m, args, graph = encoder
    roofline = autoshard.plan(m.train_step, *args, mesh=MESH, hardware={"base": "h100-sxm", "kernels": None})
    own, cpu = roofline.predicted["memory"], memory_terms_on(roofline, graph, "cpu")
    # planned with CPU-like fusion: the saved activations and gradients stay
    assert {k: cpu[k] for k in ("params", "grads", "optimizer", "activations", "data")} == \
        {k: own[k] for k in ("params", "grads", "optimizer", "activations", "data")}
    held = cpu_backward_start(roofline, graph)
    unreduced = [p for p in roofline.params if p.grad_sync == "none"]
    if unreduced:       # parameters copied for updates nothing orders after their backward reads
        assert held.largest_gradient is not None and cpu["cpu_temp_extra"] > own["cpu_temp_extra"]
    else:
        assert held == BackwardStart(0.0, None) and cpu == own
    older = dataclasses.replace(gpu_plan, predicted={k: v for k, v in gpu_plan.predicted.items() if k != "space"})
    assert memory_terms_on(older, graph, "cpu") == gpu_plan.predicted["memory"]


def test_parameters_are_copied_only_where_no_gradient_reduction_orders_their_updates(encoder):
    m, args, graph = encoder
    dp = autoshard.expert_plan("data-parallel", m.train_step, *args, mesh=MESH)
    assert cpu_backward_start(dp, graph) == BackwardStart(0.0, None)      # every update waits for the all-reduce
    replicated = autoshard.expert_plan("megatron", m.train_step, *args, mesh={"data": 1, "model": 4})
    held = cpu_backward_start(replicated, graph)
    assert all(p.grad_sync == "none" for p in replicated.params)
    # two equal layers: the later copies live in the buffers the earlier ones vacated, so the temporaries
    # hold far less than every copied parameter
    copied = sum(p.bytes_per_device for p in replicated.params if "kernel" in p.keypath)
    assert 0 < held.bytes < copied / 2
    # a copied parameter's gradient lives in the buffer its copy vacated; the word embedding is read by the
    # forward gather alone (its gradient is a scatter-add that never reads the table), so it is not copied
    # and its gradient, the largest, takes a temporary of its own
    emb = next(p for p in replicated.params if p.keypath.endswith("['word_emb']['embedding']"))
    assert held.largest_gradient == emb.bytes_per_device == max(p.bytes_per_device for p in replicated.params)


@pytest.mark.slow
def test_the_audit_compares_the_cpu_prediction_and_a_wrong_number_still_shows(encoder, gpu_plan):
    m, args, graph = encoder
    report = autoshard.audit(gpu_plan, m.train_step, *args)
    terms = memory_terms_on(gpu_plan, graph, "cpu")
    assert report.predicted_memory == buffers(terms, "cpu")
    assert report.fidelity_ok, report.report()
    mem = dict(gpu_plan.predicted["memory"])
    mem["activations"] += report.memory["temp"]            # a deliberately wrong estimate in the plan
    wrong = dataclasses.replace(gpu_plan, predicted={**gpu_plan.predicted, "memory": mem})
    bad = autoshard.audit(wrong, m.train_step, *args)
    assert not bad.fidelity_ok
    assert any(g.what == "memory argument+temp" for g in bad.gaps)
    assert bad.predicted_memory["temp"] == pytest.approx(report.predicted_memory["temp"] + report.memory["temp"])
