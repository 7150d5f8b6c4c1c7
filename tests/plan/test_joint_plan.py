"""autoshard.plan(mesh="auto") searches the 3-D space: stages x data x model x remat on a traced step."""

from __future__ import annotations

import math

import pytest

import autoshard
import models
from autoshard._src.plan.joint_planner import auto_mesh_options


def gpt():
    m = models.get("gpt", "debug", batch_size=64, d_model=256, num_heads=4, seq_len=64)
    return m, m.abstract_state()


@pytest.fixture(scope="module")
def alpa_like():
    """Three blocks, a large vocabulary head joining the last: on 8 H100s the search gives the last
    stage more devices than the other two (Alpa's stages of 2, 2 and 4), which the runtime cannot
    run yet. (model, args, plan) The head must be heavy enough: at vocabulary 2048 (priced after
    fusion) two equal stages win."""
    m = models.get("gpt", "debug", vocab_size=16384, num_layers=3, d_model=256, batch_size=64, seq_len=64)
    args = m.abstract_state()
    return m, args, autoshard.plan(m.train_step, *args, mesh="auto", devices=8, hardware="h100-sxm")


def test_auto_mesh_plans_the_3d_space_and_beats_its_reference_points():
    m, args = gpt()
    p = autoshard.plan(m.train_step, *args, mesh="auto", devices=8, hardware="h100-sxm")
    j = p.predicted["3d"]
    assert j["units"] == 2 and j["points"] > 10
    for key in ("tensor_only", "pipeline_only", "megatron_grid"):
        if j[key] is not None:
            assert p.predicted["step_time"] <= j[key]["step_time"] * (1 + 1e-9), key
    used = 1
    for _, s in p.mesh:
        used *= s
    assert used == 8
    text = p.explain()
    assert "best tensor-only" in text and "Megatron-LM grid" in text
    again = autoshard.Plan.from_json(p.to_json())
    assert again.stages == p.stages and again.predicted["3d"]["chosen"] == j["chosen"]


@pytest.mark.slow
def test_tight_memory_gets_stages_or_remat_and_no_fit_names_the_least_memory_plan():
    m, args = gpt()
    loose = autoshard.plan(m.train_step, *args, mesh="auto", devices=8, hardware="h100-sxm")
    need = loose.predicted["3d"]["tensor_only"]["memory"]
    tight = autoshard.plan(m.train_step, *args, mesh="auto", devices=8, hardware="h100-sxm",
                           memory_budget=need * 0.4)
    chosen = tight.predicted["3d"]["chosen"]
    assert chosen["memory"] <= need * 0.4
    assert chosen["stages"] > 1 or chosen["remat"] != ("none",)
    if tight.is_pipeline:
        assert all(s.memory <= need * 0.4 for s in tight.stages)
        assert [s.units for s in tight.stages][0][0] == 0
        assert "runs MPMD" not in tight.explain() and tight.predicted["3d"]["equal_submeshes"]
    with pytest.raises(autoshard.InfeasiblePlanError, match="least memory") as err:
        autoshard.plan(m.train_step, *args, mesh="auto", devices=8, hardware="h100-sxm", memory_budget=1e5)
    assert err.value.min_memory > 1e5


@pytest.mark.slow
def test_the_decorator_keeps_tensor_plans_for_auto_meshes():
    m, args = gpt()
    step = autoshard.autoshard(m.train_step, mesh="auto", hardware="h100-sxm")
    step.lower(*args)
    assert not step.plan.is_pipeline and "3d" not in step.plan.predicted


def test_unequal_submeshes_are_planned_compared_and_marked_mpmd(alpa_like):
    _, _, p = alpa_like
    j = p.predicted["3d"]
    assert not j["equal_submeshes"] and p.runtime == "mpmd" and not j["chosen"]["equal_submeshes"]
    assert len({s.mesh for s in p.stages}) > 1
    assert sum(math.prod(k for _, k in s.mesh) for s in p.stages) == 8 and p.mesh == (("devices", 8),)
    assert [s.mesh for s in p.stages] == [tuple((n, k) for n, k in (("data", d), ("model", t)) if k > 1)
                                          for d, t in j["chosen"]["submeshes"]]
    alt = j["spmd_alternative"]
    assert alt["equal_submeshes"] and alt["data"] * alt["model"] * alt["stages"] == 8
    assert p.predicted["step_time"] < alt["step_time"]
    text = p.explain()
    assert "runs MPMD" in text and "single-program (SPMD) alternative" in text
    assert alt["label"] in text and f"{alt['step_time'] * 1e3:.3f} ms" in text
    again = autoshard.Plan.from_json(p.to_json())
    assert again.stages == p.stages and again.mesh == p.mesh
    assert again.predicted["3d"]["equal_submeshes"] is False and again.predicted["3d"]["spmd_alternative"] == alt
    assert again.runtime == "mpmd"


def test_equal_submeshes_keeps_to_single_program_plans(alpa_like):
    m, args, free = alpa_like
    p = autoshard.plan(m.train_step, *args, mesh="auto", devices=8, hardware="h100-sxm",
                       pipeline_options={"equal_submeshes": True})       # the public way, as the error says
    assert p.runtime == "spmd" and p.predicted["3d"]["equal_submeshes"]
    assert p.predicted["3d"]["spmd_alternative"] is None
    assert p.predicted["3d"]["chosen"] == free.predicted["3d"]["spmd_alternative"]
    with pytest.raises(autoshard.ConfigError, match="equal_submeshes"):
        auto_mesh_options({"equal_submeshes": "yes"})
    with pytest.raises(autoshard.ConfigError, match=r"\['k'\] do not apply to mesh='auto'"):
        autoshard.plan(m.train_step, *args, mesh="auto", devices=8, pipeline_options={"k": 3})


def test_the_decorator_takes_a_plan_with_unequal_submeshes_as_mpmd(alpa_like):
    m, args, p = alpa_like
    assert p.runtime == "mpmd"
    step = autoshard.autoshard(m.train_step, plan=p)
    # abstract arguments: the MPMD step runs the step up to its loss on real values first
    with pytest.raises(autoshard.PlanError, match="concrete example arguments"):
        step.lower(*args)
