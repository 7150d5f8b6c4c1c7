"""Which instances of a block type the tensor search analyses (`tensor/search.py _find_analysed_ops`): one
middle instance stands for the others, except an instance exchanging its residual stream with the
remainder -- T5's FFN sublayers sit between unrepeated attention sublayers -- whose factors would
otherwise not link the stream through it, so a plan could lay the stream out differently on its two
sides without pricing the reshard."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import autoshard
import models
from autoshard._src.bridge.trace.trace import trace
from autoshard._src.core.grouping import group
from autoshard._src.tensor.instances import bordering_remainder, instance_maps, instance_roles
from autoshard._src.tensor.search import _find_analysed_ops

D, LAYERS = 32, 4


class Mixer(nn.Module):
    """An unrepeated sublayer: its inner width differs per layer, so it never groups."""
    width: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(D)(jnp.tanh(nn.Dense(self.width)(x)))


class FFN(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(D)(nn.relu(nn.Dense(4 * D)(nn.LayerNorm()(x))))


class Interleaved(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(LAYERS):
            x = x + Mixer(8 * (i + 1))(x)
            x = x + FFN()(x)
        return x


def _traced(model, opt):
    """(step, args, traced graph) of a mean-square loss on `model` updated by `opt`."""
    x = jnp.ones((8, 16, D))
    params = model.init(jax.random.key(0), x)

    def step(params, opt_state, x):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean(model.apply(p, x) ** 2))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    args = (params, opt.init(params), x)
    return step, args, trace(step, *args)


def _traced_interleaved():
    return _traced(Interleaved(), optax.adam(1e-3))


def test_instances_between_remainder_ops_count_for_themselves():
    _, _, graph = _traced_interleaved()
    grouping = group(graph)
    ffn = [bt for bt in grouping.block_types if bt.count == LAYERS]
    assert ffn, grouping.table()
    assert bordering_remainder(graph, grouping, ffn[0]) == set(range(LAYERS))
    weights = _find_analysed_ops(graph, grouping)[0]
    for inst in ffn[0].instances:       # each analysed once, none standing for another
        assert {weights.get(i, 0.0) for i in inst.ops if graph.ops[i].phase == "forward"} <= {0.0, 1.0}
        assert any(weights.get(i, 0.0) == 1.0 for i in inst.ops)


def test_a_stack_of_layers_keeps_one_middle_instance_for_the_rest():
    m = models.get("gpt", "debug", num_layers=6)
    graph = trace(m.train_step, *m.abstract_state())
    grouping = group(graph)
    (bt,) = grouping.block_types
    assert bordering_remainder(graph, grouping, bt) == {0, 5}     # the embedding's and the head's layers
    weights = _find_analysed_ops(graph, grouping)[0]
    middle = [k for k, inst in enumerate(bt.instances) if weights.get(inst.ops[0], 0.0) > 1.0]
    assert len(middle) == 1 and weights[bt.instances[middle[0]].ops[0]] == 4.0


def test_the_interleaved_model_plans_and_compiles_as_predicted():
    step, args, _ = _traced_interleaved()
    plan = autoshard.plan(step, *args, mesh={"data": 2, "model": 4}, hardware="cpu-sim")
    report = autoshard.audit(plan, step, *args)
    assert report.fidelity_ok, report.report()


def test_an_instance_nobody_analyses_takes_the_layouts_of_the_one_standing_for_it():
    """The plan's per-op layouts (activation constraints) of a layer the search did not analyse come from the
    middle instance standing for it, not from the first layer: that one differs at its edge (its input is
    the embedding's output, whose cotangent the table gradient reads whole)."""
    m = models.get("gpt", "debug", num_layers=6)
    graph = trace(m.train_step, *m.abstract_state())
    grouping = group(graph)
    (bt,) = grouping.block_types
    exact, stands = instance_roles(graph, grouping, bt, 1)
    assert exact == {0, 5} and stands == {1: 1, 2: 1, 3: 1, 4: 1}
    op_map = instance_maps(graph, grouping, (1,))
    mids = set(bt.instances[1].ops)
    for k in (2, 3, 4):
        mapped = {op_map[i] for i in bt.instances[k].ops if i in op_map}
        assert mapped and mapped <= mids, k
    # the search's weights: every layer counted once (the middle one for four)
    weights = _find_analysed_ops(graph, grouping)[0]
    assert sum(weights.get(inst.ops[0], 0.0) for inst in bt.instances) == 6.0


class Residual(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(D)(nn.relu(nn.Dense(4 * D)(nn.LayerNorm()(x))))


class TappedStack(nn.Module):
    """Five residual layers; the second one's output also feeds an auxiliary head (an unrepeated op)."""

    @nn.compact
    def __call__(self, x):
        aux = 0.0
        for i in range(5):
            x = Residual()(x)
            if i == 1:
                aux = nn.Dense(1)(x)
        return x + aux


def test_a_class_whose_first_middle_instance_borders_the_remainder_still_has_a_stand_in():
    """The second layer hands its output to the auxiliary head: it counts for itself, where the class's
    stand-in would be. The third layer stands for the third and fourth instead (they were counted by none)."""
    _, _, graph = _traced(TappedStack(), optax.sgd(0.1))
    grouping = group(graph)
    (bt,) = [bt for bt in grouping.block_types if bt.count == 5]
    exact, stands = instance_roles(graph, grouping, bt, 1)
    assert {0, 1, 4} <= exact and stands == {2: 2, 3: 2}, (exact, stands)
    weights = _find_analysed_ops(graph, grouping)[0]
    assert sum(weights.get(inst.ops[0], 0.0) for inst in bt.instances) == 5.0
