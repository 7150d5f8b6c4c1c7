"""One expert verdict per plan: the comparison inside a plan (`plan.predicted["experts"]`, `explain()`)
and `autoshard.expert_plan` price an expert plan the same way, even when it splits dims the search
left out of its plan space (a small `max_plans`)."""

from __future__ import annotations

import pytest

import autoshard
import models

CASES = [("megatron", {"model": 4}), ("data-megatron", {"data": 2, "model": 4})]


@pytest.fixture(scope="module")
def gpt():
    m = models.get("gpt", "debug", num_layers=2, d_model=64, num_heads=4, seq_len=32, vocab_size=256, batch_size=8)
    return m, m.abstract_state()


@pytest.mark.parametrize("name,mesh", CASES)
@pytest.mark.slow
def test_capped_search_still_prices_every_expert_like_expert_plan(gpt, name, mesh):
    m, args = gpt
    search = {"max_plans": 4}        # the plan space holds one or two factors: experts split more
    plan = autoshard.plan(m.train_step, *args, mesh=mesh, hardware="h100-sxm", search=search)
    assert any("plan space cap" in w for w in plan.warnings)
    compared = plan.predicted["experts"][name]
    assert "step_time" in compared, compared
    alone = autoshard.expert_plan(name, m.train_step, *args, mesh=mesh, hardware="h100-sxm", search=search)
    assert compared["step_time"] == pytest.approx(alone.predicted["step_time"], rel=1e-9)
    assert compared["memory"] == pytest.approx(alone.predicted["memory"]["total"], rel=1e-9)
    line = next(ln for ln in plan.explain().splitlines() if ln.strip().startswith(name + " "))
    assert "not applicable" not in line


@pytest.mark.parametrize("name,mesh", [*CASES, ("data-megatron", {"x": 2, "y": 2, "z": 2})])
def test_an_expert_is_priced_on_its_layout_whatever_the_plan_space_cap(gpt, name, mesh):
    """Issue 34 (T5's megatron expert priced at twice the parameter bytes it ran with): an expert
    splitting dims outside the capped search's candidates is priced by a wider evaluator, which read the
    narrower one's candidate indices for the same factor sets (shared per plan space) and so priced
    another layout. Capped or not, one layout has one price."""
    m, args = gpt
    capped = autoshard.expert_plan(name, m.train_step, *args, mesh=mesh, hardware="h100-sxm", search={"max_plans": 4})
    full = autoshard.expert_plan(name, m.train_step, *args, mesh=mesh, hardware="h100-sxm")
    assert capped.input_specs == full.input_specs
    for key in ("params", "optimizer", "activations", "total"):
        assert capped.predicted["memory"][key] == pytest.approx(full.predicted["memory"][key], rel=1e-9), key
    assert capped.predicted["step_time"] == pytest.approx(full.predicted["step_time"], rel=1e-9)
