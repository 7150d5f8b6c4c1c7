"""3-D plans run: a mesh with a "pipe" axis plus pipeline="auto" plans stages x data x model, and the
decorated step runs each stage's tensor plan on the automatic axes inside the pipeline runtime's
shard_map (manual over `pipe` only). Training equals one device; the compiled program has the
collectives the plan implies; each device stores one stage's state, split by its tensor plan."""

from __future__ import annotations

import math
import warnings

import jax
import numpy as np
import optax
import pytest

import autoshard
import models
from autoshard._src.bridge.audit.hlo import collectives
from autoshard._src.bridge.emit.remat_jaxpr import replays
from autoshard._src.bridge.trace.trace import trace_step
from autoshard._src.core.hardware import get_hardware, hardware_dict

from .._reference import run_steps

MESH = {"pipe": 2, "data": 2, "model": 2}


def make_step(m):
    def step(params, opt_state, batch):
        value, grads = autoshard.value_and_grad(m.loss)(params, batch)
        updates, opt_state = m.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step


def slow_compute() -> dict:
    """A machine whose links are free and compute dear: splitting work over `model` always pays, so
    the 3-D search itself puts tensor plans in the stages of a debug-sized model."""
    hw = hardware_dict(get_hardware("cpu-sim"))
    hw.update(name="slow-compute", flops={k: 1e6 for k in hw["flops"]}, memory_bandwidth=1e13,
              intra_node_bandwidth=1e13, intra_node_latency=1e-9, inter_node_bandwidth=1e13,
              inter_node_latency=1e-9)
    return hw


def train_both(name, steps=2, **kw):
    """`name`'s debug model under `@autoshard(**kw)` (no mesh or plan given: the 3-D mesh, pipeline="auto") for `steps`
    steps, losses and parameters equal to one device within 1e-5."""
    m = models.get(name, "debug")
    params, batch = m.init(jax.random.key(0)), m.batch()
    step = make_step(m)
    defaults = {} if "mesh" in kw or "plan" in kw else {"mesh": MESH, "pipeline": "auto"}
    fast = autoshard.autoshard(step, **defaults, **kw)
    got, p1, _ = run_steps(fast, params, m.optimizer.init(params), batch, steps)
    want, p2, _ = run_steps(jax.jit(step), params, m.optimizer.init(params), batch, steps)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    return fast, m, params, batch


def model_split(stage) -> int:
    return sum(1 for _, spec in stage.param_specs if any("model" in axes for axes in spec))


@pytest.mark.slow
def test_gpt_megatron_stages_train_like_one_device_and_compile_as_planned():
    fast, m, params, batch = train_both("gpt", hardware="h100-sxm",
                                        pipeline_options={"expert": "megatron", "remat": "full"})
    plan = fast.plan
    assert plan.mesh == (("pipe", 2), ("data", 2), ("model", 2)) and plan.predicted["3d"]["equal_submeshes"]
    assert all(model_split(st) > 0 and st.batch_axes == ("data",) and st.remat == "full" for st in plan.stages)
    prog = fast.pipelined.program
    assert prog.auto and prog.tensor_in_stages and prog.data_axes == ("data",)
    # every activation constraint of the stage plans found its eqn in the loss and was placed
    acts = prog.activation_specs
    assert acts.enabled and len(acts.specs) == acts.wanted == sum(len(st.activation_constraints)
                                                                  for st in plan.stages) > 0

    # collectives the plan implies: Megatron's all-reduces over `model` inside the stages (forward
    # and backward), gradient all-reduces over `data`, activations and gradients between stages as
    # collective-permutes over `pipe` -- and nothing that spans pipe ranks except those
    hlo = prog.checked_hlo      # the pipeline program as compiled for the runtime check (CPU)
    inner = [c for c in collectives(hlo, ("pipe", "data", "model"), (2, 2, 2)) if "shard_map" in c.op_name]
    kinds = {(c.kind, c.axes) for c in inner}
    assert ("all-reduce", ("model",)) in kinds
    assert any(k == "all-reduce" and "data" in ax and "pipe" not in ax for k, ax in kinds)
    assert ("collective-permute", ("pipe",)) in kinds
    assert "checkpoint" in hlo                # each stage's blocks ran rematerialised
    in_branches = [c for c in inner if "/cond/" in c.op_name]
    assert {c.axes for c in in_branches if c.kind == "all-reduce"} >= {("model",)}
    assert all("pipe" not in c.axes for c in in_branches)

    # per device: one stage's parameters, split by its tensor plan (the shard-major buffers hold
    # the largest stage's leaves / their shard counts, plus padding)
    codec = fast.pipelined.stack(params).layouts
    itemsize = 4
    per_device = sum(w * itemsize for w in codec.widths)
    sizes = dict(prog.mesh.shape)
    stage_bytes = [sum(math.prod(leaf.shape) * itemsize / math.prod(sizes[a] for ax in leaf.spec for a in ax)
                       for leaf in lay.leaves) for lay in codec.layouts]
    assert per_device <= 1.25 * max(stage_bytes)
    whole = sum(x.nbytes for x in jax.tree.leaves(params))
    assert per_device < 0.5 * whole


@pytest.mark.slow
def test_bert_megatron_stages_train_like_one_device():
    # BERT's masked-LM loss is a ratio (sum of masked losses / mask count): one micro-batch keeps it exact
    fast, *_ = train_both("bert", hardware="h100-sxm", pipeline_options={"expert": "megatron"}, num_microbatches=1)
    assert all(model_split(st) > 0 for st in fast.plan.stages) and fast.pipelined.program.tensor_in_stages


@pytest.mark.slow
def test_t5_megatron_stages_train_like_one_device():
    # encoder-decoder stages with Megatron inside (heads of the relative attention bias split, its
    # buckets whole); one micro-batch: T5's token-mean loss is a ratio like BERT's
    with warnings.catch_warnings():
        warnings.simplefilter("error")            # no data-parallel fallback: tensor plans ran
        fast, *_ = train_both("t5", hardware="h100-sxm", pipeline_options={"expert": "megatron"},
                              num_microbatches=1)
    assert all(model_split(st) > 0 for st in fast.plan.stages) and fast.pipelined.program.tensor_in_stages


@pytest.mark.slow
def test_t5_searched_stage_plans_train_like_one_device():
    # the 3-D search's own stage plans
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fast, *_ = train_both("t5", hardware=slow_compute(), num_microbatches=1)
    assert any(model_split(st) > 0 for st in fast.plan.stages)
    prog = fast.pipelined.program
    # this CPU runtime cannot run collective-permutes inside the per-stage branches; without the
    # plan's activation constraints XLA placed some there and the stages fell back to data
    # parallel -- with them placed, the stage plans run as planned
    assert not any("collective-permute" in str(w.message) for w in caught)
    assert prog.tensor_in_stages and len(prog.activation_specs.specs) == prog.activation_specs.wanted > 0


def test_pipe_axis_beyond_the_block_count_is_a_typed_error():
    m = models.get("gpt", "debug")
    params, batch = m.init(jax.random.key(0)), m.batch()
    args = (params, m.optimizer.init(params), batch)
    # a "pipe" axis fixes the 3-D shape: stages x data x model searched on exactly that shape
    q = autoshard.plan(make_step(m), *args, mesh={"pipe": 2, "data": 4}, pipeline="auto", hardware="h100-sxm")
    chosen = q.predicted["3d"]["chosen"]
    assert (chosen["stages"], chosen["data"], chosen["model"]) == (2, 4, 1) and len(q.stages) == 2
    assert q.mesh == (("pipe", 2), ("data", 4)) and q.predicted["3d"]["megatron_grid"]["stages"] == 2
    assert "best tensor-only              none (not of the mesh's fixed shape pipe 2 x data 4 x model 1)" in q.explain()
    with pytest.raises(autoshard.PlanError, match=r"'pipe' axis has 4 ranks but the step has only 2 pipeline unit"):
        autoshard.plan(make_step(m), *args, mesh={"pipe": 4, "data": 2}, pipeline="auto", hardware="h100-sxm")
    with pytest.raises(autoshard.ConfigError, match="must be named 'data' and/or 'model'"):
        autoshard.plan(make_step(m), *args, mesh={"pipe": 2, "x": 4}, pipeline="auto", hardware="h100-sxm")
    with pytest.raises(autoshard.ConfigError, match=r"pipeline_options keys \['k'\] are unknown"):
        autoshard.plan(make_step(m), *args, mesh=MESH, pipeline="auto", pipeline_options={"k": 2})


@pytest.mark.slow
def test_tensor_plan_with_planned_remat_trains_like_one_device_within_its_memory():
    """A tight budget makes the planner rematerialise a one-stage plan; the emission replays the blocks'
    forward in the traced backward pass (bridge/emit/remat_jaxpr.py, autoshard.value_and_grad or not), with
    the plan's activation constraints on the replayed eqns, and XLA's memory matches the prediction."""
    m = models.get("gpt", "debug")
    params, batch = m.init(jax.random.key(0)), m.batch()
    step = make_step(m)
    args = (params, m.optimizer.init(params), batch)
    kw = dict(mesh={"pipe": 1, "data": 2, "model": 4}, pipeline="auto", hardware="cpu-sim", num_microbatches=1,
              pipeline_options={"remat": ["none", "dots", "full"]})
    free = autoshard.plan(step, *args, **kw)
    with pytest.raises(autoshard.InfeasiblePlanError) as least:      # what the leanest point needs
        autoshard.plan(step, *args, memory_budget=1024, **kw)
    assert "1 KiB per device" in str(least.value) and "GiB" not in str(least.value)
    plan = autoshard.plan(step, *args, memory_budget=1.05 * least.value.min_memory, **kw)
    assert not plan.is_pipeline and plan.stages[0].remat != "none" and free.stages[0].remat == "none"
    fast = autoshard.autoshard(step, plan=plan, hardware="cpu-sim")
    got, p1, _ = run_steps(fast, params, m.optimizer.init(params), batch, 2)
    want, p2, _ = run_steps(jax.jit(step), params, m.optimizer.init(params), batch, 2)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    traced = trace_step(step, *args)
    schedule = replays(traced.closed, traced.graph, plan.predicted["3d"]["unit_labels"], plan.stages[0].remat)
    assert len([r for rs in schedule.values() for r in rs]) == 2        # one replay per block
    compiled = fast.lower(*args).compile()
    mem, pred = compiled.memory_analysis(), plan.memory_on("cpu")     # as XLA:CPU lays the buffers out
    assert mem.argument_size_in_bytes == pytest.approx(pred["argument"], rel=0.01)
    compiled_bytes = mem.argument_size_in_bytes + mem.temp_size_in_bytes
    assert abs(compiled_bytes - pred["argument+temp"]) <= 0.15 * max(compiled_bytes, pred["argument+temp"])
    whole = autoshard.autoshard(step, plan=free, hardware="cpu-sim").lower(*args).compile().memory_analysis()
    assert whole.argument_size_in_bytes + whole.temp_size_in_bytes == pytest.approx(
        free.memory_on("cpu")["argument+temp"], rel=0.15)
    assert mem.temp_size_in_bytes < whole.temp_size_in_bytes
