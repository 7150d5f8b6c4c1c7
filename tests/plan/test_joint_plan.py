"""autoshard.plan(mesh="auto") searches the 3-D space: stages x data x model x remat on a traced step."""

from __future__ import annotations

import pytest

import autoshard
import models


def gpt():
    m = models.get("gpt", "debug", batch_size=64, d_model=256, num_heads=4, seq_len=64)
    return m, m.abstract_state()


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
        assert "runnable: not yet" not in tight.explain() and tight.predicted["3d"]["runnable"]
    with pytest.raises(autoshard.InfeasiblePlanError, match="least memory") as err:
        autoshard.plan(m.train_step, *args, mesh="auto", devices=8, hardware="h100-sxm", memory_budget=1e5)
    assert err.value.min_memory > 1e5


def test_the_decorator_keeps_tensor_plans_for_auto_meshes():
    m, args = gpt()
    step = autoshard.autoshard(m.train_step, mesh="auto", hardware="h100-sxm")
    step.lower(*args)
    assert not step.plan.is_pipeline and "3d" not in step.plan.predicted
