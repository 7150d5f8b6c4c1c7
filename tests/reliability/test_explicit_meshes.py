"""Explicit-axis meshes (issue 32): `jax.make_mesh` makes Explicit axes by default, autoshard's runtime emits
sharding constraints for XLA to propagate (Auto axes). Every public entry that accepts a mesh, a caller's
`jax.set_mesh(explicit)` context, and arguments already placed on an Explicit mesh either give the same
result as on an Auto mesh of the same devices, or a typed autoshard error naming the mesh and the fix —
never jax's raw ValueError / TypeError."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import autoshard
import models
from autoshard import AutoshardError, MeshError

M = models.get("mlp", "debug")
SHAPE, NAMES = (2, 4), ("data", "model")
MESH = dict(zip(NAMES, SHAPE, strict=True))
HW = {"hardware": "cpu-sim"}


def explicit(shape=SHAPE, names=NAMES, devices=None):
    mesh = jax.make_mesh(shape, names, devices=devices)
    assert mesh.axis_types == (AxisType.Explicit,) * len(names)
    return mesh


def auto(shape=SHAPE, names=NAMES, devices=None):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names), devices=devices)


def fresh():
    params = M.init(jax.random.key(0))
    return params, M.optimizer.init(params), M.batch()


def assert_close(got, want, tol=1e-6):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol)


def same_plan(a, b):
    assert (a.mesh, a.input_specs_flat, a.output_specs_flat, a.activation_constraints) == (
        b.mesh, b.input_specs_flat, b.output_specs_flat, b.activation_constraints)


def run_steps(step, n=2):
    """`n` steps of `step` from fresh state: the final (params, opt_state) and the losses."""
    params, opt_state, batch = fresh()
    losses = []
    for _ in range(n):
        params, opt_state, metrics = step(params, opt_state, batch)
        losses.append(metrics["loss"] if isinstance(metrics, dict) else metrics)
    return (params, opt_state), losses


@pytest.fixture(scope="module")
def reference():
    """The decorated step on an Auto mesh of the same devices: what every Explicit entry must match."""
    step = autoshard.autoshard(M.train_step, mesh=auto(), **HW)
    return run_steps(step), step


# --- planning: plan, expert_plan, Config --------------------------------------------------------------

def test_plan_and_expert_plan_take_an_explicit_mesh_as_its_axes():
    args = fresh()
    same_plan(autoshard.plan(M.train_step, *args, mesh=explicit(), **HW),
              autoshard.plan(M.train_step, *args, mesh=auto(), **HW))
    same_plan(autoshard.expert_plan("megatron", M.train_step, *args, mesh=explicit(), **HW),
              autoshard.expert_plan("megatron", M.train_step, *args, mesh=MESH, **HW))


def test_config_takes_an_explicit_mesh_as_its_axes(tmp_path):
    cfg = autoshard.Config(mesh=explicit())
    assert cfg == autoshard.Config(mesh=MESH)
    toml = tmp_path / "c.toml"
    toml.write_text('hardware = "cpu-sim"\n[mesh]\ndata = 8\n')
    assert autoshard.Config.make(str(toml), mesh=explicit()).mesh == autoshard.Config(mesh=MESH).mesh


# --- the decorator ----------------------------------------------------------------------------------

def test_decorated_step_on_an_explicit_mesh_matches_the_auto_mesh(reference):
    (want, want_losses), ref = reference
    step = autoshard.autoshard(M.train_step, mesh=explicit(), **HW)
    got, losses = run_steps(step)
    assert step.mesh.axis_types == (AxisType.Auto,) * 2
    same_plan(step.plan, ref.plan)
    assert_close(losses, want_losses)
    assert_close(got, want)


def test_decorated_step_with_a_plan_and_an_explicit_mesh(reference):
    (want, want_losses), ref = reference
    step = autoshard.autoshard(M.train_step, plan=ref.plan, mesh=explicit(), **HW)
    got, losses = run_steps(step)
    assert_close(losses, want_losses)
    assert_close(got, want)


def test_decorated_step_under_a_callers_explicit_mesh_context(reference):
    (want, want_losses), _ = reference
    step = autoshard.autoshard(M.train_step, mesh=MESH, **HW)
    with jax.set_mesh(explicit()):
        got, losses = run_steps(step)
    assert_close(losses, want_losses)
    assert_close(got, want)


def pipelined_step(params, opt_state, batch):
    loss, grads = autoshard.value_and_grad(M.loss)(params, batch)
    updates, opt_state = M.optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:autoshard. the plan gives its stages")
def test_decorated_pipeline_step_on_an_explicit_mesh_and_under_its_context():
    opts = {"pipeline": "rannc", "num_microbatches": 2, **HW}
    want, want_losses = run_steps(autoshard.autoshard(pipelined_step, mesh={"pipe": 2, "data": 2}, **opts), n=1)
    em = explicit((2, 2), ("pipe", "data"), jax.devices()[:4])
    step = autoshard.autoshard(pipelined_step, mesh=em, **opts)
    with jax.set_mesh(em):
        got, losses = run_steps(step, n=1)
    assert step.mesh.axis_types == (AxisType.Auto,) * 2
    assert_close(losses, want_losses)
    assert_close(got, want)


def test_arguments_placed_on_an_explicit_mesh(reference):
    """State already on an Explicit mesh of the step's devices (replicated, or batch split on 'data')."""
    (want, want_losses), _ = reference
    mesh = explicit()
    params, opt_state, batch = fresh()
    placed = (jax.device_put((params, opt_state), NamedSharding(mesh, P())),
              jax.device_put(batch, NamedSharding(mesh, P("data"))))
    step = autoshard.autoshard(M.train_step, mesh=MESH, **HW)
    (params, opt_state), batch = placed
    losses = []
    for _ in range(2):
        params, opt_state, metrics = step(params, opt_state, batch)
        losses.append(metrics["loss"] if isinstance(metrics, dict) else metrics)
    assert_close(losses, want_losses)
    assert_close((params, opt_state), want)


def on_explicit(args, mesh):
    """(params, opt_state) replicated and the batch split on 'data', on the Explicit `mesh`."""
    state = jax.device_put(args[:2], NamedSharding(mesh, P()))
    return (*state, jax.device_put(args[2], NamedSharding(mesh, P("data"))))


def test_plan_and_bind_of_arguments_placed_on_an_explicit_mesh(reference):
    """Traced as their shapes (was a TraceFailedError: jax typed the batch's split into the matmuls)."""
    (want_state, want_losses), _ = reference
    mesh = explicit()
    args = fresh()
    placed = on_explicit(args, mesh)
    want = autoshard.plan(M.train_step, *args, mesh=MESH, **HW)
    got = autoshard.plan(M.train_step, *placed, mesh=mesh, **HW)
    same_plan(got, want)
    same_plan(autoshard.bind(want, *placed), want)
    with jax.set_mesh(mesh):
        same_plan(autoshard.plan(M.train_step, *placed, mesh=mesh, **HW), want)
    step = autoshard.autoshard(M.train_step, plan=got, **HW)       # same fingerprint as the step's own trace
    state, losses = run_steps(step)
    assert_close(losses, want_losses)
    assert_close(state, want_state)


def test_lower_place_and_shardings_of_arguments_on_an_explicit_mesh():
    args = fresh()
    placed = on_explicit(args, explicit())
    step = autoshard.autoshard(M.train_step, mesh=MESH, **HW)
    assert step.lower(*placed).as_text() == step.lower(*args).as_text()
    moved = step.place(*placed)
    assert all(s.mesh.axis_types == (AxisType.Auto,) * 2 for s in jax.tree.leaves(step.shardings(*placed)))
    assert all(x.sharding.mesh.axis_types == (AxisType.Auto,) * 2 for x in jax.tree.leaves(moved))


def test_an_abstract_mesh_names_the_axes():
    """jax.sharding.get_abstract_mesh()'s kind of mesh (axes, no devices): planned and run on local devices."""
    args = fresh()
    abstract = explicit().abstract_mesh
    same_plan(autoshard.plan(M.train_step, *args, mesh=abstract, **HW),
              autoshard.plan(M.train_step, *args, mesh=MESH, **HW))
    run = autoshard.pipelined(M.loss, args[0], args[2], mesh=explicit((2, 2), ("pipe", "data"), jax.devices()[:4])
                              .abstract_mesh, num_microbatches=2)
    assert run.mesh.axis_types == (AxisType.Auto,) * 2 and dict(run.mesh.shape) == {"pipe": 2, "data": 2}


# --- audit, pipelined, inference ----------------------------------------------------------------------

def test_audit_on_an_explicit_mesh_and_under_its_context():
    args = fresh()
    plan = autoshard.expert_plan("megatron", M.train_step, *args, mesh=MESH, **HW)
    want = autoshard.audit(plan, M.train_step, *args, mesh=auto())
    got = autoshard.audit(plan, M.train_step, *args, mesh=explicit())
    assert got.audited_collectives == want.audited_collectives and got.memory == want.memory
    with jax.set_mesh(explicit()):
        inside = autoshard.audit(plan, M.train_step, *args)
    assert inside.audited_collectives == want.audited_collectives


@pytest.mark.slow
def test_pipelined_on_an_explicit_mesh_and_under_its_context():
    params, _, batch = fresh()
    mesh4 = {"pipe": 2, "data": 2}
    want, want_grads = autoshard.pipelined(M.loss, params, batch, mesh=mesh4,
                                           num_microbatches=2).value_and_grad(params, batch)
    em = explicit((2, 2), ("pipe", "data"), jax.devices()[:4])
    run = autoshard.pipelined(M.loss, params, batch, mesh=em, num_microbatches=2)
    assert run.mesh.axis_types == (AxisType.Auto,) * 2
    loss, grads = run.value_and_grad(params, batch)
    assert_close(loss, want)
    assert_close(grads, want_grads)
    with jax.set_mesh(em):
        loss, grads = autoshard.pipelined(M.loss, params, batch, mesh=em,
                                          num_microbatches=2).value_and_grad(params, batch)
    assert_close(loss, want)
    assert_close(grads, want_grads)


@pytest.fixture(scope="module")
def toy():
    net = models.get("convnet_toy", "bbgrap")
    params = net.init(jax.random.key(0))
    images = jax.random.normal(jax.random.key(1), (4, *net.batch()["images"].shape[1:]))
    return net.apply, params, images


def test_inference_on_an_explicit_mesh_and_under_its_context(toy):
    apply, params, images = toy
    opts = {"direction": "H", **HW}
    want = autoshard.plan(apply, params, images, mode="inference", mesh={"x": 2}, **opts)
    got = autoshard.plan(apply, params, images, mode="inference", mesh=explicit((2,), ("x",)), **opts)
    assert got.partition.directions == want.partition.directions and got.emission == want.emission
    ref = np.asarray(apply(params, images))
    fast = autoshard.autoshard(mode="inference", mesh=explicit((2,), ("x",)), **opts)(apply)
    np.testing.assert_allclose(np.asarray(fast(params, images)), ref, atol=1e-5)
    with jax.set_mesh(explicit((2,), ("x",))):
        inside = autoshard.autoshard(mode="inference", mesh={"x": 2}, **opts)(apply)
        np.testing.assert_allclose(np.asarray(inside(params, images)), ref, atol=1e-5)
    # inputs already on the Explicit mesh (was jax's "Mesh for all inputs should be equal")
    xm = explicit((2,), ("x",), jax.devices()[:2])
    placed = (jax.device_put(params, NamedSharding(xm, P())), jax.device_put(images, NamedSharding(xm, P("x"))))
    np.testing.assert_allclose(np.asarray(fast(*placed)), ref, atol=1e-5)


# --- checkpoints ----------------------------------------------------------------------------------------

def test_save_and_restore_with_explicit_shardings(tmp_path, reference):
    """A checkpoint of arrays on an Explicit mesh, restored into `like`s on another Explicit mesh, runs."""
    (want, _), _ = reference
    mesh = explicit()
    args = jax.device_put(fresh(), NamedSharding(mesh, P()))
    autoshard.save(tmp_path / "ck", args[:2])
    other = explicit((8,), ("x",))
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(other, P())),
                        args[:2])
    params, opt_state = autoshard.restore(tmp_path / "ck", like)
    assert_close((params, opt_state), jax.tree.map(np.asarray, args[:2]), tol=0)
    step = autoshard.autoshard(M.train_step, mesh=explicit(), **HW)
    for _ in range(2):
        params, opt_state, _ = step(params, opt_state, args[2])
    assert_close((params, opt_state), want)


# --- what cannot be converted: typed errors -------------------------------------------------------------

def resharding_step(params, opt_state, batch):
    """A step that shards by the caller's mesh context itself (a PartitionSpec with no mesh)."""
    return M.train_step(params, opt_state, dict(batch, x=jax.sharding.reshard(batch["x"], P("data"))))


@pytest.mark.parametrize("entry", ["decorator", "plan"])
def test_a_step_that_needs_the_callers_explicit_context_is_a_mesh_error(entry):
    """autoshard runs steps on its own mesh, without the caller's jax.set_mesh context: explicit-sharding
    calls in the step have no mesh then. A MeshError naming the mesh, its axis types and the fix."""
    args = fresh()
    mesh = explicit()
    with jax.set_mesh(mesh), pytest.raises(MeshError) as info:
        if entry == "decorator":
            autoshard.autoshard(resharding_step, mesh=mesh, **HW)(*args)
        else:
            autoshard.plan(resharding_step, *args, mesh=mesh, **HW)
    text = str(info.value)
    for part in ("jax.set_mesh", "{'data': 2, 'model': 4}", "Explicit, Explicit", "reshard",
                 "axis_types=(AxisType.Auto,) * n"):
        assert part in text, (part, text)


@pytest.mark.parametrize("mesh, error, pattern", [
    (lambda: explicit((4, 2), ("data", "model")), autoshard.PlanError, "differs from the plan's mesh"),
    (lambda: explicit().abstract_mesh, autoshard.PlanError, "is not a jax.sharding.Mesh"),
])
def test_audit_on_a_mesh_it_cannot_use_is_typed(mesh, error, pattern):
    args = fresh()
    plan = autoshard.expert_plan("megatron", M.train_step, *args, mesh=MESH, **HW)
    with pytest.raises(error, match=pattern):
        autoshard.audit(plan, M.train_step, *args, mesh=mesh())


def test_an_inference_mesh_of_two_explicit_axes_is_a_config_error(toy):
    apply, params, images = toy
    with pytest.raises(autoshard.ConfigError, match="has 2 axes"):
        autoshard.autoshard(mode="inference", mesh=explicit((2, 4), ("x", "y")), **HW)(apply)(params, images)
    with pytest.raises(AutoshardError, match="mesh must be a jax Mesh or a dict.*Fix"):
        autoshard.pipelined(M.loss, params, images, mesh="pipe=2", num_microbatches=2)
