"""Plans from outside (issue 29): a plan file or Plan object that is edited, truncated or of another kind,
a plan cache entry that is corrupt, plans given to audit / inference / experts they do not belong to,
and Explicit-axis meshes. Each gets a typed PlanError naming the field, leaf, spec and fix (or runs
correctly), checked once where the plan enters (`plan.validate`); the caller's arrays survive."""

from __future__ import annotations

import dataclasses
import json
import os
import warnings

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

import autoshard
import models
from autoshard import PlanError
from autoshard._src.bridge import compat as jc
from autoshard._src.bridge import decorator
from autoshard._src.bridge.inference.api import audit_inference
from autoshard._src.bridge.runtimes.cut_3d import ActivationSpecs
from autoshard._src.core.attribution import parse_scope

M = models.get("mlp", "debug")
MESH = {"data": 2, "model": 4}


def fresh():
    params = M.init(jax.random.key(0))
    return params, M.optimizer.init(params), M.batch()


def assert_intact(args):
    deleted = [jax.tree_util.keystr(kp) for kp, x in jax.tree_util.tree_flatten_with_path(args)[0]
               if isinstance(x, jax.Array) and x.is_deleted()]
    assert not deleted, deleted


@pytest.fixture(scope="module")
def megatron():
    """A tensor plan with activation constraints (Megatron's on the MLP's dense layers)."""
    plan = autoshard.expert_plan("megatron", M.train_step, *fresh(), mesh=MESH, hardware="cpu-sim")
    assert len(plan.activation_constraints) == 2
    return plan


def edited(plan, edit) -> str:
    d = json.loads(plan.to_json())
    edit(d)
    return json.dumps(d)


def spec_of(i, spec):
    return lambda d: d["input_specs_flat"].__setitem__(i, spec)


def stage(**fields):
    return lambda d: d["stages"][0].update(fields)


def two_stages(d):
    d["stages"].append(dict(d["stages"][0], index=1))
    d["schedule"] = "1f1b"


def empty_pipeline_stage(d):
    two_stages(d)
    d["stages"][0].update(units=[], ops=[], params=[], modules=[])


KERNEL = "[0]['dense_0']['kernel']"     # leaf 1
EDITS = [
    # (id, edit of the JSON dict, message pattern)
    ("unknown mesh axis in a spec", spec_of(1, [["zzz"], []]),
     r"input_specs_flat leaf \[0\]\['dense_0'\]\['kernel'\]: spec P\(zzz, None\) names axes \['zzz'\] that its mesh"),
    ("one axis on two dims", spec_of(1, [["model"], ["model"]]), r"P\(model, model\) uses mesh axes \['model'\] more"),
    ("one axis twice in a dim", spec_of(1, [["model", "model"], []]), r"P\(\(model,model\), None\) uses mesh axes"),
    ("spec written as a string", spec_of(1, "model"), "the spec 'model' is not a list of per-dimension lists"),
    ("a spec missing", lambda d: d["input_specs_flat"].pop(), "input_specs_flat holds 26 specs for 27 keypaths"),
    ("output spec on an unknown axis", lambda d: d["output_specs_flat"].__setitem__(0, [["zz"]]),
     r"output_specs_flat leaf .*names axes \['zz'\]"),
    ("mesh naming an axis twice", lambda d: d.update(mesh=[["data", 2], ["data", 4]]),   # segfaulted in jax
     "mesh axis name 'data' appears twice"),
    ("mesh axis of size 0", lambda d: d.update(mesh=[["data", 0], ["model", 4]]), "'data' has size 0"),
    ("mesh axis of size 2.5", lambda d: d.update(mesh=[["data", 2.5], ["model", 4]]), "'data' has size 2.5"),
    ("no stages", lambda d: d.update(stages=[]), "the plan has no stages"),
    ("two stages in a tensor plan", lambda d: d["stages"].append(dict(d["stages"][0], index=1)),
     "a tensor plan .* has 2 stages"),
    ("an empty pipeline stage", empty_pipeline_stage, "pipeline stage 0 is empty"),
    ("stage after a stage that is not there", lambda d: (two_stages(d), d["stages"][1].update(after=[7])),
     r"stage 1 runs after stages \[7\]"),
    ("storage mode unknown", stage(storage="zero9"), "stage 0 storage='zero9' is not one of"),
    ("remat policy unknown", stage(remat="most"), "stage 0 remat='most'"),
    ("activation constraint on an unknown axis", stage(activation_constraints=[["MLP/dense_0/dot_general:0",
                                                                                 [["zzz"], []]]]),
     r"stage 0 activation_constraints op MLP/dense_0/dot_general:0: spec P\(zzz, None\)"),
    ("batch axes unknown", stage(batch_axes=["pipe"]), r"batch_axes names axes \['pipe'\]"),
    ("zero micro-batches", lambda d: d.update(microbatches=0), "microbatches=0 must be an int >= 1"),
    ("micro-batches as text", lambda d: d.update(microbatches="4"), "microbatches='4' must be an integer"),
    ("keypaths as one string", lambda d: d.update(input_keypaths="[0]"), "input_keypaths must be a JSON list"),
    ("newer format", lambda d: d.update(format_version=3), "format_version 2, got 3. Fix"),
    ("format as text", lambda d: d.update(format_version="2"), "format_version 2, got '2'"),
]


@pytest.mark.parametrize("case", EDITS, ids=[c[0] for c in EDITS])
def test_an_edited_plan_file_is_refused_where_it_is_loaded(case, megatron, tmp_path):
    _, edit, pattern = case
    text = edited(megatron, edit)
    with pytest.raises(PlanError, match=pattern) as err:
        autoshard.Plan.from_json(text)
    assert "Fix:" in str(err.value)
    # the decorator loads plan files through the same checks, before anything is placed or donated
    path = tmp_path / "plan.json"
    path.write_text(text)
    args = fresh()
    with pytest.raises(PlanError, match=pattern):
        autoshard.autoshard(M.train_step, plan=path, hardware="cpu-sim")(*args)
    assert_intact(args)


@pytest.mark.parametrize("text, pattern", [
    ("[1, 2]", r"not an autoshard plan \(a JSON list"),
    ("null", r"not an autoshard plan \(a JSON NoneType"),
    ("{}", "format_version 2, got None"),
    (b"\x00\xff\xfe\x80" * 8, "not UTF-8"),
    ("[" * 100_000, "not JSON"),
])
def test_a_file_that_is_not_a_plan_is_refused(text, pattern, tmp_path):
    with pytest.raises(PlanError, match=pattern):
        autoshard.Plan.from_json(text)
    path = tmp_path / "plan.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    args = fresh()
    with pytest.raises(PlanError, match=pattern):
        autoshard.autoshard(M.train_step, plan=path, hardware="cpu-sim")(*args)
    with pytest.raises(PlanError, match="cannot read the plan file"):      # a directory where the file should be
        autoshard.autoshard(M.train_step, plan=tmp_path, hardware="cpu-sim")(*args)
    assert_intact(args)


def test_a_plan_object_edited_in_python_gets_the_file_checks(megatron):
    bad = dataclasses.replace(megatron, input_specs_flat=(((("data", "data")),), *megatron.input_specs_flat[1:]))
    args = fresh()
    with pytest.raises(PlanError, match=r"autoshard: plan=: input_specs_flat leaf .*uses mesh axes \['data'\]"):
        autoshard.autoshard(M.train_step, plan=bad, hardware="cpu-sim")(*args)
    with pytest.raises(PlanError, match="neither an autoshard.Plan nor the path"):
        autoshard.autoshard(M.train_step, plan={"mesh": MESH}, hardware="cpu-sim")(*args)
    assert_intact(args)


def test_specs_that_do_not_fit_their_leaves_name_the_leaf():
    """Checked against the step's arguments when the plan is bound: a split that does not divide a dim
    (the bias of 32 over a mesh axis of 3), or a spec with more dims than the leaf."""
    args = fresh()
    plan = autoshard.plan(M.train_step, *args, mesh={"data": 3}, hardware="cpu-sim")
    bias = plan.input_keypaths.index("[0]['dense_0']['bias']")
    for spec, pattern in (([["data"]], r"splits dim 0 \(size 32\) into 3 parts over \['data'\] of mesh \{'data': 3\}"),
                          ([[], ["data"]], r"of shape \(32,\) has the spec P\(None, data\) of 2 dimensions")):
        text = edited(plan, spec_of(bias, spec))
        with pytest.raises(PlanError, match=r"argument \[0\]\['dense_0'\]\['bias'\] .*" + pattern):
            autoshard.autoshard(M.train_step, plan=autoshard.Plan.from_json(text), hardware="cpu-sim")(*args)
    assert_intact(args)


def _keys_renamed(plan, count):
    def edit(d):
        acts = d["stages"][0]["activation_constraints"]
        for row in acts[:count]:
            row[0] = row[0].replace("MLP/", "MLP_v2/")
    return autoshard.Plan.from_json(edited(plan, edit))


def test_activation_constraints_that_match_no_op_are_refused(megatron):
    """All of an edited plan's constraints naming no op: the plan is not what would run (PlanError);
    some: a warning naming how many, and the step trains as one device does."""
    args = fresh()
    with pytest.raises(PlanError, match=r"2 of the plan's 2 activation constraints name ops the step does not have "
                                        r"\(e.g. \['MLP_v2/dense_0/dot_general:0'"):
        autoshard.autoshard(M.train_step, plan=_keys_renamed(megatron, 2), hardware="cpu-sim")(*args)
    renamed = _keys_renamed(megatron, 2)        # a remat plan: its step is traced again, then constrained
    remat = dataclasses.replace(renamed, stages=(dataclasses.replace(renamed.stages[0], remat="full"),))
    with warnings.catch_warnings(), pytest.raises(PlanError, match="2 of the plan's 2 activation constraints"):
        warnings.simplefilter("ignore")         # (this step does not call autoshard.value_and_grad: warned)
        autoshard.autoshard(M.train_step, plan=remat, hardware="cpu-sim")(*args)
    assert_intact(args)
    step = autoshard.autoshard(M.train_step, plan=_keys_renamed(megatron, 1), hardware="cpu-sim", donate=False)
    with pytest.warns(UserWarning, match="1 of the plan's 2 activation constraints name ops the step does not have"):
        got = step(*args)
    want = jax.jit(M.train_step)(*args)
    np.testing.assert_allclose(float(got[2]), float(want[2]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert_intact(args)


def test_three_d_stage_constraints_that_match_no_op_are_refused(megatron):
    """The 3-D runtime matches its stages' constraints on the loss's eqns (`ActivationSpecs`): none
    matching is a PlanError there too; all matching places every one."""
    params, _, batch = fresh()
    closed = jax.make_jaxpr(M.loss)(params, batch)
    prog = jc.flatten_calls(closed)
    modules = [parse_scope(fe.scope)[0] for fe in prog.eqns]
    mesh = jax.make_mesh((1, 2, 4), ("pipe", "data", "model"), axis_types=(AxisType.Auto,) * 3)
    three_d = dataclasses.replace(megatron, schedule="1f1b", predicted={**megatron.predicted, "3d": {}})
    acts = ActivationSpecs(prog, modules, three_d, mesh)
    assert len(acts.specs) == acts.wanted == 2
    renamed = dataclasses.replace(_keys_renamed(megatron, 2), schedule="1f1b")
    with pytest.raises(PlanError, match=r"autoshard \(3-D stages\): 2 of the plan's 2 activation constraints"):
        ActivationSpecs(prog, modules, renamed, mesh)


def _cache_entry(tmp_path, args):
    decorator._PLAN_CACHE.clear()         # planned (and written to cache_dir) here, not taken from memory
    step = autoshard.autoshard(M.train_step, mesh={"data": 8}, hardware="cpu-sim", cache_dir=str(tmp_path),
                               donate=False)
    want = step(*args)
    (entry,) = tmp_path.glob("*.json")
    return entry, want


@pytest.mark.parametrize("damage", ["truncated", "binary", "empty", "other step", "bad spec", "directory"])
def test_a_corrupt_plan_cache_entry_is_planned_again_and_rewritten(damage, tmp_path):
    args = fresh()
    entry, want = _cache_entry(tmp_path, args)
    good = entry.read_text()
    if damage == "directory":
        entry.unlink()
        entry.mkdir()
    else:
        entry.write_bytes({"truncated": good[:len(good) // 2].encode(), "binary": os.urandom(64), "empty": b"",
                           "other step": edited(autoshard.Plan.from_json(good), lambda d: d["provenance"].update(
                               fingerprint="0" * 16)).encode(),
                           "bad spec": edited(autoshard.Plan.from_json(good), spec_of(0, [["nope"]])).encode()}[damage])
    decorator._PLAN_CACHE.clear()         # a new process: only the disk cache is left
    step = autoshard.autoshard(M.train_step, mesh={"data": 8}, hardware="cpu-sim", cache_dir=str(tmp_path),
                               donate=False)
    with pytest.warns(UserWarning, match="plan cache entry"):
        got = step(*args)
    np.testing.assert_allclose(float(got[2]), float(want[2]), rtol=1e-6)
    if damage != "directory":     # rewritten whole (a directory in its place is left to the user)
        assert autoshard.Plan.from_json(entry.read_text()) == step.plan
    assert not list(tmp_path.glob(".*.tmp"))
    assert_intact(args)


def test_a_cache_dir_that_cannot_be_written_costs_the_cache_not_the_run(tmp_path):
    args = fresh()
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    decorator._PLAN_CACHE.clear()
    step = autoshard.autoshard(M.train_step, mesh={"data": 8}, hardware="cpu-sim", cache_dir=str(blocker / "cache"),
                               donate=False)
    with pytest.warns(UserWarning, match="cannot write the plan cache entry"):
        got = step(*args)
    np.testing.assert_allclose(float(got[2]), float(jax.jit(M.train_step)(*args)[2]), rtol=1e-6)
    assert blocker.read_text() == "not a directory"
    assert_intact(args)


@pytest.fixture(scope="module")
def toy():
    net = models.get("convnet_toy", "bbgrap")
    params = net.init(jax.random.key(0))
    images = jax.random.normal(jax.random.key(1), (4, *net.batch()["images"].shape[1:]))
    return net.apply, params, images


def test_plans_given_to_the_wrong_mode_are_typed_errors(megatron, toy):
    apply, tparams, images = toy
    inference = autoshard.plan(apply, tparams, images, mode="inference", mesh={"x": 2}, hardware="cpu-sim")
    args = fresh()
    with pytest.raises(PlanError, match=r"plan=InferencePlan is not a training autoshard.Plan\. An inference plan's "
                                        r"program is compiled by its decorated function"):
        autoshard.audit(inference, M.train_step, *args)
    with pytest.raises(PlanError, match="an inference plan: decorate with autoshard.autoshard"):
        autoshard.autoshard(M.train_step, plan=inference, hardware="cpu-sim")(*args)
    with pytest.raises(PlanError, match="autoshard.bind: plan=InferencePlan is not a training"):
        autoshard.bind(inference, *args)
    with pytest.raises(PlanError, match="audit_inference: expected the function"):
        audit_inference(megatron, tparams, images)
    assert_intact(args)


@pytest.mark.parametrize("predicted, name", [({"3d": {"equal_submeshes": True}}, "3-D"), ({}, "pipeline"),
                                             ({"pipeline": {"method": "rannc"}}, "rannc")])
def test_audit_of_a_pipeline_or_3d_plan_says_what_to_call(megatron, predicted, name):
    """Was `KeyError: 'pipeline'` for a 3-D plan (its predictions have no pipeline method)."""
    plan = dataclasses.replace(megatron, schedule="1f1b", predicted={**megatron.predicted, **predicted})
    args = fresh()
    with pytest.raises(PlanError, match=rf"this is a {name}.* pipeline plan .*Audit.read_collectives"):
        autoshard.audit(plan, M.train_step, *args)
    assert_intact(args)


def test_explicit_axis_meshes_work_like_auto_ones(megatron, toy):
    """jax.make_mesh's default axis type is Explicit; audit, expert plans and inference take such a mesh as
    the same devices with Auto axes (was a raw with_sharding_constraint error in audit)."""
    args = fresh()
    explicit = jax.make_mesh((2, 4), ("data", "model"))
    assert explicit.axis_types == (AxisType.Explicit,) * 2
    auto = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    got, want = (autoshard.audit(megatron, M.train_step, *args, mesh=m) for m in (explicit, auto))
    assert got.audited_collectives == want.audited_collectives and got.memory == want.memory
    expert = autoshard.expert_plan("megatron", M.train_step, *args, mesh=explicit, hardware="cpu-sim")
    assert (expert.mesh, expert.input_specs_flat, expert.activation_constraints) == (
        megatron.mesh, megatron.input_specs_flat, megatron.activation_constraints)
    apply, tparams, images = toy
    fast = autoshard.autoshard(mode="inference", mesh=jax.make_mesh((2,), ("x",)), direction="H",
                               hardware="cpu-sim")(apply)
    np.testing.assert_allclose(np.asarray(fast(tparams, images)), np.asarray(apply(tparams, images)), atol=1e-5)
    with pytest.raises(PlanError, match="mesh=dict is not a jax.sharding.Mesh"):
        autoshard.audit(megatron, M.train_step, *args, mesh=MESH)
    assert_intact(args)


def test_plans_written_by_this_autoshard_still_load(megatron):
    """The checks refuse nothing a planner writes (tensor, expert and pipeline plans round-trip)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for plan in (megatron, autoshard.plan(M.train_step, *fresh(), mesh=MESH, hardware="cpu-sim")):
            assert autoshard.Plan.from_json(plan.to_json()) == plan


@pytest.mark.parametrize("damage, pattern", [("binary", "not UTF-8"), ("mesh axis twice", "appears twice")])
def test_the_cli_loads_plan_files_through_the_same_checks(damage, pattern, megatron, tmp_path, capsys):
    """A binary file (was a raw UnicodeDecodeError) or a mesh naming an axis twice (segfaulted in jax once
    run): one line naming the problem, exit 1."""
    from autoshard._src.cli import main

    bad = tmp_path / "plan.json"
    bad.write_bytes(b"\x00\xff\xfe\x80" * 8 if damage == "binary" else
                    edited(megatron, lambda d: d.update(mesh=[["data", 2], ["data", 4]])).encode())
    assert main(["explain", "--plan", str(bad)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and pattern in err[0], err


def _twice_mesh(names=("data",), shape=(2,)):
    from jax.sharding import Mesh
    return Mesh(np.array([jax.devices()[0]] * 2).reshape(shape), names)


@pytest.mark.parametrize("entry", ["decorator", "plan", "audit", "pipelined", "inference"])
def test_a_mesh_listing_a_device_twice_is_a_mesh_error(entry):
    args = fresh()
    mesh = _twice_mesh(("pipe", "data"), (2, 1)) if entry == "pipelined" else _twice_mesh()
    run = {
        "decorator": lambda: autoshard.autoshard(M.train_step, mesh=mesh, hardware="cpu-sim")(*args),
        "plan": lambda: autoshard.plan(M.train_step, *args, mesh=mesh, hardware="cpu-sim"),
        "audit": lambda: autoshard.audit(autoshard.plan(M.train_step, *args, mesh={"data": 2}, hardware="cpu-sim"),
                                         M.train_step, *args, mesh=mesh),
        "pipelined": lambda: autoshard.pipelined(M.loss, args[0], args[2], mesh=mesh, num_microbatches=2),
        "inference": lambda: autoshard.autoshard(mode="inference", mesh=mesh, hardware="cpu-sim")(
            lambda params, x: M.module.apply({"params": params}, x))(args[0], args[2]["x"]),
    }[entry]
    with pytest.raises(autoshard.MeshError, match=r"lists device cpu:0 2 times.*Fix: build it from distinct"):
        run()
    assert_intact(args)
