"""Planning on abstract inputs: plans behave as the physics says; Plan contract; errors."""

from __future__ import annotations

import json

import jax
import pytest

import autoshard
import models


def _plan(name, mesh, hardware="h100-sxm", memory_budget=None, **overrides):
    m = models.get(name, "debug", **overrides)
    return autoshard.plan(m.train_step, *m.abstract_state(), mesh=mesh, hardware=hardware,
                          memory_budget=memory_budget)


def _specs(plan, contains=""):
    return {k: s for k, s in plan.specs_by_keypath().items() if contains in k}


def test_narrow_mlp_large_batch_is_data_parallel():
    p = _plan("mlp", {"x": 8}, batch_size=16384, hidden_dim=256, in_dim=256, out_dim=256)
    kernels = _specs(p, "[0]")
    assert all(not any(s) for s in kernels.values()), p.explain()
    assert p.specs_by_keypath()["[2]['x']"][0] == ("x",)


def test_wide_mlp_small_batch_alternates_column_and_row():
    p = _plan("mlp", {"x": 8}, batch_size=8, hidden_dim=8192, in_dim=8192, out_dim=8192, num_layers=4)
    ks = [p.specs_by_keypath()[f"[0]['dense_{i}']['kernel']"] for i in range(4)]
    assert all(any(s) for s in ks), p.explain()
    for a, b in zip(ks, ks[1:], strict=False):
        assert a == b[::-1], f"consecutive kernels should be transposed splits: {a} then {b}"
    assert ks[0] in ((((), ("x",))), ((("x",), ())))


def test_predicted_collectives_follow_the_plan():
    # Megatron on a 4-layer wide MLP: one activation all-reduce per row-parallel layer (2 of 4)
    # forward, the same backward for the column-parallel layers' input gradients; each moves the
    # [batch, hidden] fp32 activation. Data parallel instead: only gradient all-reduces of all params.
    b, h = 8, 8192
    p = _plan("mlp", {"x": 8}, batch_size=b, hidden_dim=h, in_dim=h, out_dim=h, num_layers=4)
    colls = {(c["kind"], c["axes"], c["phase"]): c for c in p.predicted["collectives"]}
    fwd = colls[("all-reduce", ("x",), "forward")]
    assert fwd["count"] == 2 and fwd["bytes"] == 2 * b * h * 4, p.predicted["collectives"]
    assert p.predicted["comm_bytes"]["all-reduce@x"] == sum(
        c["bytes"] for c in p.predicted["collectives"] if c["kind"] == "all-reduce")
    dp = _plan("mlp", {"x": 8}, batch_size=16384, hidden_dim=256, in_dim=256, out_dim=256)
    grad = [c for c in dp.predicted["collectives"] if c["phase"] == "grad"]
    n_params = models.get("mlp", "debug", hidden_dim=256, in_dim=256, out_dim=256).num_params()
    assert len(grad) == 1 and grad[0]["bytes"] == 4 * n_params, dp.predicted["collectives"]


def test_tight_memory_budget_forces_parameter_or_optimizer_sharding():
    kw = dict(vocab_size=4096, d_model=1024, num_heads=8, num_layers=4, seq_len=128, batch_size=64)
    roomy = _plan("gpt", {"data": 8}, **kw)
    # plenty of memory: plain data parallelism, replicated parameters and Adam state
    assert roomy.storage == "replicated" and not any(any(s) for s in _specs(roomy, "[0]").values())
    # a budget the replicated Adam state does not fit in, but a split one does
    budget = roomy.predicted["memory"]["total"] - 0.5 * roomy.predicted["memory"]["optimizer"]
    tight = _plan("gpt", {"data": 8}, memory_budget=budget, **kw)
    assert tight.predicted["memory"]["total"] <= budget
    assert tight.storage in ("zero1", "zero3"), tight.explain()

    def state_bytes(p):
        return p.predicted["memory"]["params"] + p.predicted["memory"]["optimizer"]

    assert state_bytes(tight) < 0.5 * state_bytes(roomy)
    assert tight.predicted["step_time"] >= roomy.predicted["step_time"]  # memory is paid in time
    sharded = [k for k, s in tight.specs_by_keypath().items() if any(s) and k.startswith("[1]")]
    assert sharded, "optimizer state should be split over the data axis"


def test_vocabulary_heavy_head_gets_its_weight_sharded():
    p = _plan("gpt", {"data": 2, "model": 4}, vocab_size=2**18, d_model=256, num_heads=4, seq_len=128,
              batch_size=16)
    assert any(p.specs_by_keypath()["[0]['wte']['embedding']"]), p.explain()


@pytest.mark.parametrize("mesh", [{"x": 3}, {"a": 3, "b": 2}, {"p": 5, "q": 7}])
@pytest.mark.parametrize("name", ["mlp", "gpt", "bert"])
def test_indivisible_dims_never_sharded(name, mesh):
    m = models.get(name, "debug")
    hw = {"base": "h100-sxm", "intra_node_latency": 1e-12, "inter_node_latency": 1e-12}
    p = autoshard.plan(m.train_step, *m.abstract_state(), mesh=mesh, hardware=hw)
    shapes = [leaf.shape for leaf in jax.tree.leaves(m.abstract_state())]
    for shape, spec in zip(shapes, p.input_specs_flat, strict=True):
        for size, axes in zip(shape, spec, strict=True):
            n = 1
            for a in axes:
                n *= mesh[a]
            assert size % n == 0, (shape, spec)


def test_axis_names_carry_no_meaning():
    # to the cost model; they only break ties between mirror plans (tests/tensor/test_axis_hints.py)
    kw = dict(batch_size=64, d_model=256, num_heads=4, seq_len=64)
    a = _plan("gpt", {"data": 2, "model": 4}, **kw)
    b = _plan("gpt", {"u": 2, "v": 4}, **kw)
    rename = {"data": "u", "model": "v"}
    assert [tuple(tuple(rename[x] for x in axes) for axes in s) for s in a.input_specs_flat] == \
        list(b.input_specs_flat)


def test_plan_is_deterministic_and_round_trips_json():
    a = _plan("gpt", {"data": 2, "model": 4})
    b = _plan("gpt", {"data": 2, "model": 4})
    ja, jb = json.loads(a.to_json()), json.loads(b.to_json())
    for d in (ja, jb):
        d["predicted"].pop("search_seconds")
        d["predicted"].pop("timing")
    assert ja == jb
    back = autoshard.Plan.from_json(a.to_json())
    assert back == a
    with pytest.raises(autoshard.PlanError, match="bind"):
        back.input_specs  # noqa: B018
    m = models.get("gpt", "debug")
    bound = autoshard.bind(back, *m.abstract_state())
    specs = bound.input_specs
    assert jax.tree.structure(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)) \
        == jax.tree.structure(m.abstract_state())
    text = a.explain()
    assert "[0]['block_0']['fc1']['kernel']" in text and "predicted step" in text


def test_unknown_hardware_preset():
    with pytest.raises(autoshard.HardwareError, match="h100-sxm"):
        _plan("mlp", {"x": 8}, hardware="tpu-v9")


def test_memory_budget_no_plan_fits():
    with pytest.raises(autoshard.InfeasiblePlanError, match=r"KiB per device") as info:
        _plan("gpt", {"data": 2, "model": 4}, memory_budget=1000)
    msg = str(info.value)
    assert "budget of 0.98 KiB per device" in msg and "memory_budget" in msg
    # it names the least-memory plan (storage, what it splits) and the 3-D way out
    assert "least memory (storage zero" in msg and "-> " in msg and "mesh='auto'" in msg


def test_running_on_a_mesh_larger_than_the_host():
    m = models.get("mlp", "debug")
    step = autoshard.autoshard(m.train_step, mesh={"data": 4, "model": 4}, hardware="cpu-sim")
    params = m.init(jax.random.key(0))
    with pytest.raises(autoshard.MeshError, match="needs 16 devices, but 8"):
        step(params, m.init_opt_state(params), m.batch())


def test_plan_for_another_model_is_rejected(tmp_path):
    gpt = models.get("gpt", "debug")
    p = autoshard.plan(gpt.train_step, *gpt.abstract_state(), mesh={"data": 8}, hardware="cpu-sim")
    path = tmp_path / "plan.json"
    path.write_text(p.to_json())
    mlp = models.get("mlp", "debug")
    step = autoshard.autoshard(mlp.train_step, mesh={"data": 8}, plan=path)
    params = mlp.init(jax.random.key(0))
    with pytest.raises(autoshard.PlanError, match="another model"):
        step(params, mlp.init_opt_state(params), mlp.batch())


def test_decorator_caches_the_plan_and_does_not_replan(tmp_path):
    m = models.get("mlp", "debug")
    step = autoshard.autoshard(m.train_step, mesh={"data": 8}, hardware="cpu-sim", cache_dir=tmp_path)
    params = m.init(jax.random.key(0))
    opt = m.init_opt_state(params)
    params, opt, _ = step(params, opt, m.batch())
    first = step.plan
    jitted = step._jitted
    params, opt, _ = step(params, opt, m.batch())
    assert step._jitted is jitted and step.plan is first
    assert len(list(tmp_path.glob("*.json"))) == 1
    again = autoshard.autoshard(m.train_step, mesh={"data": 8}, hardware="cpu-sim", cache_dir=tmp_path)
    again.lower(*m.abstract_state())
    assert again.plan == first
    text = again.lower(*m.abstract_state()).as_text()
    assert "sharding" in text  # the lowered program carries the planned shardings


def test_first_call_leaves_the_callers_arrays_alive():
    # data parallel replicates the parameters; placing a single-device array on a replicated
    # sharding reuses its buffer, and the step donates: the caller's arrays must survive anyway
    m = models.get("mlp", "debug")
    step = autoshard.autoshard(m.train_step, mesh={"data": 8}, hardware="cpu-sim")
    params = m.init(jax.random.key(0))
    opt = m.init_opt_state(params)
    step(params, opt, m.batch())
    assert not any(x.is_deleted() for x in jax.tree.leaves((params, opt)))
    jax.jit(m.train_step)(params, opt, m.batch())


def test_decorator_replans_when_shapes_change():
    m = models.get("mlp", "debug", batch_size=16)
    # donate=False: the same arguments are used twice (donated state is consumed, as with jax.jit)
    step = autoshard.autoshard(m.train_step, mesh={"data": 8}, hardware="cpu-sim", donate=False)
    params = m.init(jax.random.key(0))
    opt = m.init_opt_state(params)
    step(params, opt, m.batch())
    first = step.plan
    small = models.get("mlp", "debug", batch_size=4).batch()   # 4 rows cannot split 8 ways
    _, _, loss = step(params, opt, small)
    assert step.plan is not first
    assert step.plan.specs_by_keypath()["[2]['x']"][0] == ()
    ref = jax.jit(m.train_step)(params, opt, small)[2]
    assert abs(float(loss) - float(ref)) < 1e-5


@pytest.mark.slow
def test_auto_mesh_chooses_a_factorisation():
    m = models.get("gpt", "debug", batch_size=64, d_model=256, num_heads=4, seq_len=64)
    p = autoshard.plan(m.train_step, *m.abstract_state(), mesh="auto", devices=8, hardware="h100-sxm")
    sizes = [s for _, s in p.mesh]
    n = 1
    for s in sizes:
        n *= s
    assert n == 8
    # it is the best of the candidate meshes
    for axes in ({"a0": 8}, {"a0": 2, "a1": 4}, {"a0": 4, "a1": 2}):
        other = autoshard.plan(m.train_step, *m.abstract_state(), mesh=axes, hardware="h100-sxm")
        assert p.predicted["step_time"] <= other.predicted["step_time"] + 1e-12


def test_config_file(tmp_path):
    cfg = tmp_path / "autoshard.toml"
    cfg.write_text('hardware = "cpu-sim"\nmemory_budget = 2e9\n[mesh]\ndata = 4\nmodel = 2\n'
                   '[options]\nstorage_modes = ["replicated"]\n')
    m = models.get("mlp", "debug")
    step = autoshard.autoshard(m.train_step, config=cfg)
    step.lower(*m.abstract_state())
    assert step.plan.mesh == (("data", 4), ("model", 2))
    assert step.plan.storage == "replicated" and step.plan.hardware == "cpu-sim"
    bad = tmp_path / "bad.toml"
    bad.write_text('mesh = {data = 8}\nhardwre = "h100-sxm"\n')
    with pytest.raises(autoshard.ConfigError, match="hardwre"):
        autoshard.autoshard(m.train_step, config=bad)


def test_unknown_primitive_is_replicated_with_a_warning():
    import jax.numpy as jnp
    from jax.extend.core import Primitive

    my_op = Primitive("my_opaque_op")
    my_op.def_impl(lambda x: x * 2)
    my_op.def_abstract_eval(lambda x: x)
    jax.interpreters.ad.deflinear(my_op, lambda t: [my_op.bind(t)])

    def loss(w, x):
        return jnp.sum(my_op.bind(x @ w) ** 2)

    def step(w, x):
        g = jax.grad(loss)(w, x)
        return w - 0.1 * g

    w = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    x = jax.ShapeDtypeStruct((256, 64), jnp.float32)
    p = autoshard.plan(step, w, x, mesh={"x": 8}, hardware="h100-sxm")
    assert any("my_opaque_op" in warning for warning in p.warnings), p.warnings


@pytest.mark.slow
def test_megatron_expert_keeps_position_tables_whole():
    """T5's relative attention bias ([buckets, heads]) is named like an embedding; Megatron splits
    its heads, never its buckets, and the shared vocabulary embedding is split by rows."""
    m = models.get("t5", "debug")
    plan = autoshard.expert_plan("data-megatron", m.train_step, *m.abstract_state(), mesh={"data": 4, "model": 2},
                                 hardware="h100-sxm")
    params = plan.input_specs[0]
    bias = params["encoder"]["relative_attention_bias"]["embedding"]["embedding"]
    assert bias[0] is None and bias[1] is not None
    assert params["shared"]["embedding"][0] is not None
    assert params["encoder"]["layer_0"]["self_attn"]["q"]["kernel"][1] is not None


def test_parameter_table_shows_fsdp_gradient_sync():
    """ZeRO-3 shards a parameter over the batch axes too: its gradient is still summed over them
    (reduce-scattered), and the table says so instead of "none"."""
    m = models.get("gpt", "debug", batch_size=8)
    plan = autoshard.expert_plan("fsdp", m.train_step, *m.abstract_state(), mesh={"data": 2, "model": 4},
                                 hardware="cpu-sim")
    syncs = {r.keypath: r.grad_sync for r in plan.params}
    fc1 = syncs["[0]['block_0']['fc1']['kernel']"]
    assert fc1 == "reduce-scatter over data,model", syncs
    assert all(s != "none" for s in syncs.values()), syncs
    dp = autoshard.expert_plan("data-parallel", m.train_step, *m.abstract_state(), mesh={"data": 2, "model": 4},
                               hardware="cpu-sim")
    assert {r.grad_sync for r in dp.params} == {"all-reduce over data,model"}


def test_a_capped_plan_space_warns_with_the_dim_and_the_option():
    p = autoshard.plan(models.get("mlp", "debug").train_step, *models.get("mlp", "debug").abstract_state(),
                       mesh={"data": 2, "model": 4}, hardware="cpu-sim", search={"max_plans": 2})
    capped = [w for w in p.warnings if "left unsplit" in w]
    assert capped, p.warnings
    for w in capped:
        assert w.startswith("[") and " dim " in w.split(" left unsplit")[0], w       # a keypath and its dim
        assert 'search={"max_plans": ' in w and "plan space cap of 2" in w, w


def test_a_negligible_factor_over_the_cap_is_left_whole_without_a_warning():
    """BERT's token-type table (2 x hidden, 256 B) is the last factor ranked: over the cap it stays whole
    silently (its values hold under 0.1 % of the bytes the search prices), while a factor that matters
    still warns when a small cap leaves it out."""
    m = models.get("bert", "debug")
    mesh, hw = {"x": 2, "y": 2, "z": 2}, {"base": "cpu-sim", "intra_node_latency": 1e-12}   # so it shards
    p = autoshard.plan(m.train_step, *m.abstract_state(), mesh=mesh, hardware=hw)
    assert not any("plan space cap" in w for w in p.warnings), p.warnings
    small = autoshard.plan(m.train_step, *m.abstract_state(), mesh=mesh, hardware=hw, search={"max_plans": 64})
    capped = [w for w in small.warnings if "plan space cap" in w]
    assert capped and not any("type_emb" in w for w in capped), small.warnings


def test_a_capped_activation_dim_is_named_by_the_op_producing_it():
    """A capped factor no parameter or input carries (GPT's positions, from an iota) is named by the first
    op producing it, never by a bare factor number."""
    m = models.get("gpt", "debug")
    p = autoshard.plan(m.train_step, *m.abstract_state(), mesh={"data": 2, "model": 4}, hardware="cpu-sim",
                       search={"max_plans": 3})
    capped = [w for w in p.warnings if "left unsplit" in w]
    assert any(" result dim " in w for w in capped), capped
    assert not any(w.startswith("factor ") for w in capped), capped
