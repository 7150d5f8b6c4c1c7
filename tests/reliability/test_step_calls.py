"""The decorated step at call time, called as users call it (issue 29): typed PRNG keys, keywords, an
outer jax transformation, pytree structures and shapes that change between calls, donated leaves
passed twice, a step that fails while it runs. Results match jax.jit on one device; misuse is a
typed error; the caller's arrays survive unless the step donated them by design."""

from __future__ import annotations

import inspect
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autoshard
import models
from autoshard import PlanError, StepFailedError, UntraceableArgumentError
from autoshard._src.bridge import decorator

M = models.get("mlp", "debug")


def fresh():
    params = M.init(jax.random.key(0))
    return params, M.optimizer.init(params), M.batch()


def assert_same(got, want):
    """Leaf by leaf equal (PRNG keys by their key data)."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        if jnp.issubdtype(g.dtype, jax.dtypes.prng_key):
            assert g.dtype == w.dtype
            g, w = jax.random.key_data(g), jax.random.key_data(w)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def alive(tree):
    return not any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(tree))


def noisy(batch, key):
    return {**batch, "x": batch["x"] + 0.01 * jax.random.normal(key, batch["x"].shape)}


def key_argument(params, opt_state, batch, key):
    key, sub = jax.random.split(key)
    return (*M.train_step(params, opt_state, noisy(batch, sub)), key)


def key_in_state(state, batch):
    key, sub = jax.random.split(state["key"])
    params, opt_state, loss = M.train_step(state["params"], state["opt"], noisy(batch, sub))
    return {"params": params, "opt": opt_state, "key": key}, loss


def keys_per_example(params, opt_state, batch):
    noise = jax.vmap(lambda k, row: jax.random.normal(k, row.shape))(batch["keys"], batch["x"])
    return M.train_step(params, opt_state, {"x": batch["x"] + 0.01 * noise, "y": batch["y"]})


def key_pipelined(params, opt_state, batch, key):
    loss, grads = autoshard.value_and_grad(M.loss)(params, noisy(batch, key))
    updates, opt_state = M.optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, jax.random.fold_in(key, 1)


def loss_with_keys(params, batch):
    noise = jax.vmap(lambda k, row: jax.random.normal(k, row.shape))(batch["keys"], batch["x"])
    return M.loss(params, {"x": batch["x"] + 0.01 * noise, "y": batch["y"]})


def keys_pipelined(params, opt_state, batch):        # the keys reach the pipeline stages' micro-batches
    loss, grads = autoshard.value_and_grad(loss_with_keys)(params, batch)
    updates, opt_state = M.optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


PIPELINE = dict(mesh={"pipe": 2, "data": 4}, pipeline="rannc", num_microbatches=2)


def key_first(p, o, b):
    return p, o, b, jax.random.key(1)


def key_in(p, o, b):
    return {"params": p, "opt": o, "key": jax.random.key(2)}, b


def keys_in_batch(p, o, b):
    return p, o, {**b, "keys": jax.random.split(jax.random.key(3), b["x"].shape[0])}


# case: (step, its first arguments from (params, opt_state, batch), its next arguments from (outputs,
# arguments), decorator options)
KEY_CASES = {
    "key argument, returned": (key_argument, key_first, lambda out, a: (out[0], out[1], a[2], out[3]), {}),
    "key inside the donated state": (key_in_state, key_in, lambda out, a: (out[0], a[1]), {}),
    "per-example keys in the batch": (keys_per_example, keys_in_batch, lambda out, a: (out[0], out[1], a[2]), {}),
    "key argument, pipeline plan": (key_pipelined, key_first, lambda out, a: (out[0], out[1], a[2], out[3]),
                                    PIPELINE),
    "per-example keys in a pipelined loss's batch": (keys_pipelined, keys_in_batch,
                                                     lambda out, a: (out[0], out[1], a[2]), PIPELINE),
}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*the plan gives its stages")   # the pipeline case's replicas
@pytest.mark.parametrize("case", KEY_CASES, ids=list(KEY_CASES))
def test_typed_prng_keys_train_like_one_device(case):
    """Typed keys (dtype key<fry>) as arguments, in the state and in the batch: traced, planned, placed
    and run like any small array, with jax.jit's numbers on one device, for two steps."""
    fn, first, advance, kw = KEY_CASES[case]
    args = first(*fresh())
    fast = autoshard.autoshard(fn, **{"mesh": {"data": 8}, "hardware": "cpu-sim", **kw})

    def two_steps(step):
        return step(*advance(step(*args), args))

    want = two_steps(jax.jit(fn))
    assert_same(two_steps(fast), want)
    assert alive(args)                     # the first call protects the caller's arrays


def test_keywords_bind_to_their_positions():
    params, opt, batch = fresh()
    want = jax.jit(M.train_step)(params, opt, batch)
    fast = autoshard.autoshard(M.train_step, mesh={"data": 8}, hardware="cpu-sim", donate=False)
    assert_same(fast(params, opt, batch=batch), want)
    assert_same(fast(params=params, opt_state=opt, batch=batch), want)
    assert fast.lower(params, opt_state=opt, batch=batch) is not None
    assert alive((params, opt, batch))


def keyword_only(params, opt_state, *, batch):
    return M.train_step(params, opt_state, batch)


def defaulted(params, opt_state, scale=1.0, batch=None):
    return M.train_step(params, opt_state, batch)


@pytest.mark.parametrize("fn, kwargs, pattern", [
    (M.train_step, {"bacth": None}, r"unknown keyword argument\(s\) \['bacth'\].*params, opt_state, batch"),
    (M.train_step, {"params": None}, r"params=.*multiple values for argument 'params'"),
    (keyword_only, {"batch": None}, r"\['batch'\] of keyword_only.*no position to bind to"),
    (defaulted, {"batch": None}, r"\['batch'\] of defaulted.*left to its default"),
], ids=["misspelt", "given twice", "keyword-only", "after a defaulted parameter"])
def test_keywords_that_cannot_bind_are_typed_errors(fn, kwargs, pattern):
    params, opt, batch = fresh()
    kwargs = {k: batch for k in kwargs}
    with pytest.raises(PlanError, match=pattern):
        autoshard.autoshard(fn, mesh={"data": 8}, hardware="cpu-sim")(params, opt, **kwargs)
    assert alive((params, opt, batch))


@pytest.mark.slow
@pytest.mark.parametrize("outer", ["jit", "grad", "vmap"])
def test_a_step_under_an_outer_transformation_says_how_to_compose(outer):
    params, opt, batch = fresh()
    fast = autoshard.autoshard(M.train_step, mesh={"data": 8}, hardware="cpu-sim", donate=False)
    calls = {"jit": lambda: jax.jit(fast)(params, opt, batch),
             "grad": lambda: jax.grad(lambda p: fast(p, opt, batch)[2])(params),
             "vmap": lambda: jax.vmap(lambda b: fast(params, opt, b)[2])(jax.tree.map(lambda x: x[None], batch))}
    with pytest.raises(PlanError, match=r"argument \[\d\].* is a jax tracer.*top level.*step\.jitted"):
        calls[outer]()
    assert alive((params, opt, batch))
    # the composition the message names: after one call, step.jitted is a plain jax.jit
    fast(params, opt, batch)
    assert_same(jax.jit(fast.jitted)(params, opt, batch), jax.jit(M.train_step)(params, opt, batch))
    assert_same(jax.grad(lambda p: fast.jitted(p, opt, batch)[2])(params),
                jax.grad(lambda p: M.train_step(p, opt, batch)[2])(params))


def test_structures_and_shapes_that_change_replan_once_each():
    """A new pytree structure (a batch key, a parameter and its optimizer state) or batch shape is
    planned for; returning to an earlier one reuses its program (no re-trace)."""
    params, opt, batch = fresh()
    fast = autoshard.autoshard(M.train_step, mesh={"data": 8}, hardware="cpu-sim", donate=False)
    ref = jax.jit(M.train_step)
    wide = {**params, "unused": jnp.ones(4)}
    calls = [(params, opt, batch), (params, opt, {**batch, "mask": jnp.ones(8)}),
             (wide, M.optimizer.init(wide), batch), (params, opt, jax.tree.map(lambda x: x[:4], batch))]
    programs = []
    for args in calls:
        assert_same(fast(*args), ref(*args))
        programs.append(fast.jitted)
    for args, program in zip(calls, programs, strict=True):     # back to each: its own program again
        assert_same(fast(*args), ref(*args))
        assert fast.jitted is program
    assert len(set(map(id, programs))) == len(calls)
    assert alive(calls)


def test_a_structure_that_cannot_run_leaves_the_step_as_it_was():
    """A later call whose new structure fails (a string array in the batch: no jax type) is a typed
    error every time, and the structure planned before still runs."""
    params, opt, batch = fresh()
    fast = autoshard.autoshard(M.train_step, mesh={"data": 8}, hardware="cpu-sim", donate=False)
    fast(params, opt, batch)
    first = fast.jitted
    for _ in range(2):
        with pytest.raises(UntraceableArgumentError, match=r"args\[2\]\['names'\] has dtype <U2 \(shape \(8,\)\)"):
            fast(params, opt, {**batch, "names": np.array(["ab"] * 8)})
    assert_same(fast(params, opt, batch), jax.jit(M.train_step)(params, opt, batch))
    assert fast.jitted is first and alive((params, opt, batch))


def passes_twice(p, q, batch):
    loss, grads = jax.value_and_grad(M.loss)(p, batch)
    return jax.tree.map(lambda a, g: a - 0.1 * g, p, grads), jax.tree.map(lambda a: 0.9 * a, q), loss


def test_donated_leaves_passed_twice_run_instead_of_crashing_xla():
    """One array in two donated arguments, or donated and also read from the batch: XLA reports it and
    then crashes the process (SIGSEGV); the step copies the aliased donated leaves, every call."""
    params, _, batch = fresh()
    fast = autoshard.autoshard(passes_twice, mesh={"data": 8}, hardware="cpu-sim")
    p, _, _ = fast(params, params, batch)
    assert fast.donate_argnums == (0, 1)
    assert alive(params)
    keep = jax.tree.map(np.asarray, p)
    got = fast(p, p, batch)                               # a later call: the same arrays twice
    assert_same(got, jax.jit(passes_twice)(keep, keep, batch))

    def reads_its_weight(p, batch):
        loss, g = jax.value_and_grad(lambda p: jnp.mean((batch["x"] @ p["w"]) ** 2))(p)
        return {"w": p["w"] - 0.1 * g["w"]}, loss

    step = autoshard.autoshard(reads_its_weight, mesh={"data": 8}, hardware="cpu-sim")
    w, _ = step({"w": jnp.eye(8) * 0.5}, {"x": jnp.ones((8, 8))})
    want = jax.jit(reads_its_weight)({"w": np.asarray(w["w"])}, {"x": np.asarray(w["w"])})
    assert_same(step(w, {"x": w["w"]}), want)             # donated and read as the batch
    assert alive(w)                                       # its donated use was a copy


@pytest.mark.parametrize("donate", [True, False])
def test_a_step_that_fails_while_running_says_what_it_consumed(donate):
    """A failure jax reports at the call (here an ordered callback that raises, on one device) is a
    StepFailedError with the cause; with donation it says the inputs are gone, without it that they
    are intact and the step runs again."""
    fail = []

    def watch(x):
        if fail:
            raise ValueError("loss watcher: batch rejected")

    def step(params, opt_state, batch):
        jax.debug.callback(watch, batch["x"], ordered=True)
        return M.train_step(params, opt_state, batch)

    params, opt, batch = fresh()
    fast = autoshard.autoshard(step, mesh={"data": 1}, hardware="cpu-sim", donate=donate)
    state = fast(params, opt, batch)[:2]
    fail.append(True)
    expect = "consumed its donated inputs.*donate=False" if donate else "arguments are intact"
    cause = r"XLA failed on the step \(compiling or running it\).*ValueError: loss watcher.*"
    with pytest.raises(StepFailedError, match=cause + expect):
        fast(*state, batch)
    assert alive(state) is not donate
    assert alive((params, opt, batch))
    if not donate:
        fail.clear()
        assert_same(fast(*state, batch), jax.jit(step)(*state, batch))


def test_inference_functions_take_keywords_too():
    toy = models.get("convnet_toy", "bbgrap")
    params, images = toy.init(jax.random.key(0)), toy.batch()["images"]
    fast = autoshard.autoshard(mode="inference", mesh={"x": 2}, hardware="cpu-sim")(toy.apply)
    name = list(inspect.signature(toy.apply).parameters)[1]
    np.testing.assert_allclose(fast(params, **{name: images}), toy.apply(params, images), rtol=1e-5, atol=1e-5)
    with pytest.raises(PlanError, match=r"unknown keyword argument\(s\) \['imgs'\]"):
        fast(params, imgs=images)
    assert alive((params, images))


# --- plan identity, argument dtypes, context meshes, empty steps, audit (red-team pass) -------------------

def step_v1(params, opt_state, batch):
    loss, grads = jax.value_and_grad(M.loss)(params, batch)
    updates, opt_state = M.optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def step_v2(params, opt_state, batch):        # the same ops, and it also returns the gradients
    loss, grads = jax.value_and_grad(M.loss)(params, batch)
    updates, opt_state = M.optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, grads


def test_steps_alike_but_in_their_outputs_never_share_a_plan(tmp_path, monkeypatch):
    args = fresh()
    for cache in (None, tmp_path):      # the in-process cache, then a shared cache_dir (a new process)
        monkeypatch.setattr(decorator, "_PLAN_CACHE", {})
        kw = {"mesh": {"data": 2, "model": 4}, "hardware": "cpu-sim", "donate": False, "cache_dir": cache}
        autoshard.autoshard(step_v1, **kw)(*args)
        if cache is not None:
            monkeypatch.setattr(decorator, "_PLAN_CACHE", {})
        assert_same(autoshard.autoshard(step_v2, **kw)(*args), jax.jit(step_v2)(*args))
    assert alive(args)


def test_a_plan_whose_outputs_are_not_the_steps_is_refused_or_replanned(tmp_path, monkeypatch):
    args = fresh()
    kw = {"mesh": {"data": 2, "model": 4}, "hardware": "cpu-sim", "donate": False}
    fast = autoshard.autoshard(step_v2, cache_dir=tmp_path, **kw)
    fast(*args)
    d = json.loads(fast.plan.to_json())       # an edit that keeps the fingerprint: one output fewer
    d["output_keypaths"], d["output_specs_flat"] = d["output_keypaths"][:-1], d["output_specs_flat"][:-1]
    with pytest.raises(PlanError, match=r"does not fit the step's outputs.*re-plan"):
        autoshard.autoshard(step_v2, plan=autoshard.Plan.from_json(json.dumps(d)), **kw)(*args)
    (entry,) = tmp_path.glob("*.json")
    entry.write_text(json.dumps(d))
    monkeypatch.setattr(decorator, "_PLAN_CACHE", {})
    with pytest.warns(UserWarning, match="unusable plan cache entry.*does not fit the step's outputs"):
        got = autoshard.autoshard(step_v2, cache_dir=tmp_path, **kw)(*args)
    assert_same(got, jax.jit(step_v2)(*args))
    assert alive(args)


def with_scale(params, opt_state, batch, scale):
    params, opt_state, loss = M.train_step(params, opt_state, batch)
    return params, opt_state, loss * scale


@pytest.mark.parametrize("case", ["f64 batch", "f64 params", "int64 scalar", "f64 scalar", "lower", "rannc"])
def test_numpy_64_bit_leaves_run_like_jax_jit(case):
    params, opt, batch = fresh()
    b64 = {k: np.asarray(v, np.float64) for k, v in batch.items()}
    p64 = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
    args = {"f64 batch": (params, opt, b64), "f64 params": (p64, opt, batch), "lower": (params, opt, b64),
            "int64 scalar": (params, opt, batch, np.int64(2)), "f64 scalar": (params, opt, batch, np.float64(2.0)),
            "rannc": (params, opt, b64)}[case]
    fn = want = with_scale if len(args) == 4 else M.train_step
    kw = {"pipeline": "rannc", "mesh": {"pipe": 2, "data": 4}} if case == "rannc" else {"mesh": {"data": 8}}
    if case == "rannc":
        def fn(params, opt_state, batch):
            loss, grads = autoshard.value_and_grad(M.loss)(params, batch)
            updates, opt_state = M.optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss
    fast = autoshard.autoshard(fn, hardware="cpu-sim", donate=False, **kw)
    if case == "lower":
        assert "dot" in fast.lower(*args).as_text()
        return
    got = fast(*args)
    assert_same(got, jax.jit(want)(*args))
    assert_same(fast(*fresh()[:2], batch, *args[3:]), got)      # the 32-bit twin: the same program
    assert alive(args)


def test_the_plain_program_for_other_arguments_is_a_typed_error():
    args = fresh()
    fast = autoshard.autoshard(M.train_step, mesh={"data": 8}, hardware="cpu-sim", donate=False)
    fast(*args)
    half = {k: v[:4] for k, v in args[2].items()}
    with pytest.raises(PlanError, match=r"planned for arguments .* call the decorated step itself"):
        fast.jitted(args[0], args[1], half)
    assert alive(args)


@pytest.mark.parametrize("same", [True, False])
def test_a_step_called_inside_a_context_mesh_runs(same):
    args = fresh()
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    with jax.set_mesh(mesh if same else jax.make_mesh((4, 2), ("a", "b"))):
        fast = autoshard.autoshard(M.train_step, mesh=mesh if same else {"data": 2, "model": 4},
                                   hardware="cpu-sim", donate=False)
        got = fast(*args)
        assert fast.lower(*args) is not None
        assert jax.sharding.get_abstract_mesh().axis_names == (("data", "model") if same else ("a", "b"))
    assert_same(got, jax.jit(M.train_step)(*args))
    assert alive(args)


@pytest.mark.parametrize("fn", [lambda p, o, b: p, lambda p, o, b: None, lambda p, o, b: jnp.zeros(())],
                         ids=["identity", "none", "constant"])
def test_a_step_with_nothing_to_shard_gets_a_trivial_plan(fn):
    args = fresh()
    assert autoshard.plan(fn, *args, mesh={"data": 8}, hardware="cpu-sim").stages[0].factors == ()
    fast = autoshard.autoshard(fn, mesh={"data": 8}, hardware="cpu-sim")
    assert_same(fast(*args), fn(*args))
    assert alive(args[2])


def test_audit_refuses_a_plan_of_another_step_or_other_shapes():
    args = fresh()
    plan = autoshard.plan(M.train_step, *args, mesh={"data": 8}, hardware="cpu-sim")
    doubled = {k: jnp.concatenate([v, v]) for k, v in args[2].items()}     # divides: only the fingerprint sees it
    with pytest.raises(PlanError, match="another model or step, or other argument shapes"):
        autoshard.audit(plan, M.train_step, args[0], args[1], doubled)
    with pytest.raises(PlanError, match="another model or step"):
        autoshard.audit(plan, lambda p, o, b: M.train_step(p, o, {k: v * 2 for k, v in b.items()}), *args)
    assert autoshard.audit(plan, M.train_step, *args).platform == "cpu"
    assert alive(args)


def pipelined_step(params, opt_state, batch):
    loss, grads = autoshard.value_and_grad(M.loss)(params, batch)
    updates, opt_state = M.optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


@pytest.mark.filterwarnings("ignore:.*the plan gives its stages")
@pytest.mark.parametrize("pipeline", [None, "rannc"])
def test_arrays_committed_to_another_device_are_moved_on_every_call(pipeline):
    """jax.device_put(x, device) or a restore without shardings commits arrays to one device; jit with
    explicit in_shardings refuses them, so the step moves them (the first call always did)."""
    mesh = {"pipe": 2, "data": 4} if pipeline else {"data": 2, "model": 4}
    step = autoshard.autoshard(pipelined_step, mesh=mesh, hardware="cpu-sim", pipeline=pipeline)
    args = fresh()
    want = jax.jit(pipelined_step)(*args)
    step(*jax.tree.map(lambda x: x + 0, args))
    committed = jax.device_put(args, jax.devices()[1])
    assert_same(step(*committed), want)


def test_inference_functions_that_cannot_trace_are_typed_errors():
    """Train mode's argument checks and trace wrapping hold in inference mode too (raw flax / Python
    errors before): a string image, an image of the wrong layout, parameters of None."""
    toy = models.get("convnet_toy", "debug")
    params, images = toy.init(jax.random.key(0)), toy.batch()["images"]
    run = autoshard.autoshard(mode="inference", mesh={"x": 2}, hardware="cpu-sim")(toy.apply)
    with pytest.raises(UntraceableArgumentError, match=r"args\[1\] is a builtins.str"):
        run(params, "images")
    with pytest.raises(autoshard.TraceFailedError, match="ScopeParamShapeError"):
        run(params, jnp.moveaxis(images, -1, 1))          # NCHW into an NHWC network
    with pytest.raises(autoshard.TraceFailedError, match="ApplyScopeInvalidVariablesTypeError"):
        run(None, images)
    assert alive((params, images))
    np.testing.assert_allclose(run(params, images), toy.apply(params, images), rtol=1e-5, atol=1e-6)
