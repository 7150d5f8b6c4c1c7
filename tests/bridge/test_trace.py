"""trace(): op records, keypaths, phases, module paths, nested jaxprs, abstract inputs."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import networkx as nx
import numpy as np
import pytest

import autoshard
import models


@pytest.fixture(scope="module")
def gpt4():
    m = models.get("gpt", "debug", num_layers=4)
    return m, autoshard.trace(m.train_step, *m.abstract_state())


def test_op_records_shapes_bytes_flops():
    def f(x, w):
        return jnp.tanh(x @ w)

    g = autoshard.trace(f, jnp.ones((8, 16), jnp.float32), jax.ShapeDtypeStruct((16, 4), jnp.bfloat16))
    dot = g.find(primitive="dot_general")[0]
    assert dot.in_shapes == ((8, 16), (16, 4))
    assert dot.out_shapes == ((8, 4),)
    assert dot.flops == 2 * 8 * 16 * 4
    assert dot.bytes == sum(int(np.prod(s)) * jnp.dtype(d).itemsize
                            for s, d in zip(dot.in_shapes + dot.out_shapes,
                                            dot.in_dtypes + dot.out_dtypes, strict=True))
    tanh = g.find(primitive="tanh")[0]
    assert tanh.flops == 8 * 4
    assert [g.values[v].keypath for v in g.inputs] == ["[0]", "[1]"]
    assert g.values[g.inputs[1]].dtype == "bfloat16"
    # no jvp anywhere: an inference program is all forward
    assert {op.phase for op in g.ops} == {"forward"}


def test_input_keypaths_and_roles(gpt4):
    m, g = gpt4
    keypaths = {g.values[v].keypath: g.values[v] for v in g.inputs}
    kernel = keypaths["[0]['block_3']['fc1']['kernel']"]
    assert kernel.shape == (m.config.d_model, 4 * m.config.d_model)
    assert kernel.role == "parameter" and kernel.module == "GPT/block_3/fc1"
    mu = next(v for k, v in keypaths.items() if k.endswith(".mu['block_3']['fc1']['kernel']"))
    assert mu.role == "state" and mu.module == "GPT/block_3/fc1"
    assert keypaths["[2]['inputs']"].role == "data"
    assert len(g.output_keypaths) == len(g.outputs)
    assert g.output_keypaths[-1] == "[2]"  # the loss
    assert "[0]['block_3']['fc1']['kernel']" in g.output_keypaths


def test_phases_present_and_ordered(gpt4):
    _, g = gpt4
    by = g.ops_by_phase()
    assert by["forward"] > 0 and by["backward"] > 0 and by["optimizer"] > 0
    first_bwd = min(op.index for op in g.ops if op.phase == "backward")
    last_fwd = max(op.index for op in g.ops if op.phase == "forward")
    assert last_fwd < first_bwd
    assert all(op.phase == "optimizer" for op in g.ops if op.index > max(
        o.index for o in g.ops if o.phase == "backward"))


def test_backward_ops_carry_module_path(gpt4):
    """The fc1 kernel's gradient matmul sits under .../block_3/fc1."""
    m, g = gpt4
    d = m.config.d_model
    grads = [op for op in g.find(primitive="dot_general", phase="backward")
             if op.out_shapes[0] in ((d, 4 * d), (4 * d, d)) and "block_3" in op.module]
    assert grads, "no weight-gradient matmul found for block_3"
    assert all(op.module == "GPT/block_3/fc1" or op.module == "GPT/block_3/fc2" for op in grads)
    assert any(op.module == "GPT/block_3/fc1" for op in grads)


def test_optimizer_ops_belong_to_parameter_module(gpt4):
    _, g = gpt4
    opt = g.find(module="GPT/block_3/fc1", phase="optimizer")
    # adamw touches kernel and bias: moment updates, bias correction, decay, apply
    assert len(opt) >= 2 * 10
    assert all(op.scope.startswith("optimizer") for op in opt)


def test_nested_jaxprs_expanded_with_joined_paths():
    @jax.custom_vjp
    def clip_grad(x):
        return x

    clip_grad.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1, 1),))

    class Inner(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(4, name="proj")(x)
            x = jax.jit(lambda a: jnp.sin(a) * 2)(x)              # pjit
            x = jax.checkpoint(lambda a: jnp.cos(a))(x)            # remat
            x = jax.nn.relu(x)                                     # custom_jvp
            x = clip_grad(x)                                       # custom_vjp
            x = jax.lax.cond(x.sum() > 0, jnp.exp, jnp.negative, x)
            return x

    class Outer(nn.Module):
        @nn.compact
        def __call__(self, x):
            return Inner(name="inner")(x)

    model = Outer()
    x = jnp.ones((2, 4))
    params = model.init(jax.random.key(0), x)
    g = autoshard.trace(lambda p, x: jax.grad(lambda p: model.apply(p, x).sum())(p), params, x)
    prims = {op.primitive for op in g.ops}
    assert {"sin", "cos", "max", "min", "exp", "neg"} <= prims
    assert not prims & {"pjit", "jit", "remat2", "custom_jvp_call", "custom_vjp_call"}
    sin = g.find(primitive="sin", phase="forward")[0]
    assert sin.module == "Outer/inner"
    cond = g.find(primitive="cond")
    assert cond and cond[0].params["branches"] == 2
    # both branches are visible
    assert g.find(primitive="exp") and g.find(primitive="neg")
    assert g.find(primitive="min", phase="backward")  # the custom_vjp clip in the backward


def test_scan_body_once_with_trip_count():
    def f(w, x):
        def body(c, wi):
            return jnp.tanh(c @ wi), None
        return jax.lax.scan(body, x, w)[0].sum()

    g = autoshard.trace(f, jax.ShapeDtypeStruct((12, 8, 8), jnp.float32),
                        jax.ShapeDtypeStruct((4, 8), jnp.float32))
    dots = g.find(primitive="dot_general")
    assert len(dots) == 1
    assert dots[0].loops[0].kind == "scan" and dots[0].loops[0].trip_count == 12
    assert dots[0].repeat == 12
    assert g.total_flops >= 12 * 2 * 4 * 8 * 8


def test_while_loop_represented():
    def f(x):
        return jax.lax.while_loop(lambda c: c[1] < 5, lambda c: (c[0] * 2.0, c[1] + 1), (x, 0))[0]

    g = autoshard.trace(f, jnp.ones(3))
    mul = g.find(primitive="mul")[0]
    assert mul.loops[0].kind == "while" and mul.loops[0].trip_count is None
    assert g.find(primitive="lt")


def test_abstract_and_concrete_inputs_trace_the_same():
    m = models.get("mlp", "debug")
    params = m.init(jax.random.key(0))
    concrete = (params, m.init_opt_state(params), m.batch())
    g1 = autoshard.trace(m.train_step, *concrete)
    g2 = autoshard.trace(m.train_step, *m.abstract_state())
    assert [(o.primitive, o.out_shapes, o.module, o.phase) for o in g1.ops] == \
           [(o.primitive, o.out_shapes, o.module, o.phase) for o in g2.ops]


def test_networkx_view_is_a_dag(gpt4):
    _, g = gpt4
    dg = g.to_networkx()
    assert dg.number_of_nodes() == len(g.ops)
    assert nx.is_directed_acyclic_graph(dg)
    # program order is a topological order
    assert all(u < v for u, v in dg.edges)


@pytest.mark.slow
def test_gpt3_175b_traces_abstractly():
    """96 layers, d 12288: ~54k ops, no parameter memory (all ShapeDtypeStructs)."""
    m = models.get("gpt", "gpt3-175b")
    args = m.abstract_state()
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(args))
    g = autoshard.trace(m.train_step, *args)
    assert len(g.ops) > 50_000
    params = sum(int(np.prod(g.values[v].shape)) for v in g.inputs
                 if g.values[v].role == "parameter")
    assert abs(params - 175e9) / 175e9 < 0.02
    grouping = autoshard.group(g)
    assert [bt.count for bt in grouping.block_types] == [96]


def test_jitted_step_is_inlined_and_opaque_containers_report_size():
    m = models.get("mlp", "debug")
    plain = autoshard.trace(m.train_step, *m.abstract_state())
    jitted = autoshard.trace(jax.jit(m.train_step), *m.abstract_state())
    assert [(o.primitive, o.module, o.phase) for o in jitted.ops] == \
           [(o.primitive, o.module, o.phase) for o in plain.ops]

    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    f = jax.shard_map(lambda a: jnp.sin(a) * 2, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    g = autoshard.trace(f, jax.ShapeDtypeStruct((16,), jnp.float32))
    (op,) = g.ops
    assert op.primitive == "shard_map" and op.params["nested_eqns"] >= 2


def test_batchnorm_statistics_are_buffers_not_parameters():
    m = models.get("resnet", "debug")
    g = autoshard.trace(m.train_step, *m.abstract_state())
    roles = {}
    for v in g.inputs:
        val = g.values[v]
        roles.setdefault(val.role, []).append(val.keypath)
    assert roles["buffer"] and all("batch_stats" in k for k in roles["buffer"])
    assert all("batch_stats" not in k for k in roles["parameter"])
    # Adam moments of the trainable parameters are matched to them although the optimizer sees
    # only the "params" collection
    assert len(roles["state"]) == 2 * len(roles["parameter"])
    assert len(roles["data"]) == len(jax.tree.leaves(m.batch(abstract=True))) + 1  # + Adam's step count
