"""Input maps (tensor/instances.py): each input of a layer another layer stands for maps to that layer's input of
the same role, shape, dtype and keypath without the layers' own path components -- parameters and each
optimizer moment alike. Layers whose inputs come in the same order are matched one by one; the others by key."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from autoshard._src.bridge.trace.trace import trace
from autoshard._src.core.grouping import group
from autoshard._src.tensor.instances import _input_maps, _same_but_instance


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(x.shape[-1])(nn.relu(nn.Dense(24)(x)))


class _Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(4):
            x = _Block()(x)
        return x


def _traced():
    model, opt = _Net(), optax.adam(1e-3)
    x = jnp.ones((4, 8))
    params = model.init(jax.random.key(0), x)["params"]

    def step(p, s, x):
        g = jax.grad(lambda p: jnp.mean(model.apply({"params": p}, x) ** 2))(p)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    graph = trace(step, params, opt.init(params), x)
    return graph, group(graph)


def _strip(parts, path):
    """The keypath without the block's own path components (the longest suffix of its path found in it)."""
    comps, tail = path.split("/"), [str(p).lstrip(".") for p in parts]
    for s in range(len(comps)):
        want = comps[s:]
        for k in range(len(tail) - len(want) + 1):
            if tail[k:k + len(want)] == want:
                return tuple(tail[:k] + tail[k + len(want):])
    return tuple(tail)


def _expected(graph, grouping):
    """Every later block's input -> the first block's with the same role, shape, dtype and stripped keypath."""
    want = {}
    bt = grouping.block_types[0]
    under = {inst.path: [v for v in graph.inputs if (graph.values[v].module + "/").startswith(inst.path + "/")]
             for inst in bt.instances}

    def key(v, path):
        val = graph.values[v]
        return val.role, val.shape, val.dtype, _strip(val.keypath_parts, path)

    first = {key(v, bt.instances[0].path): v for v in under[bt.instances[0].path]}
    for inst in bt.instances[1:]:
        want.update({v: first[key(v, inst.path)] for v in under[inst.path]})
    return want


def test_every_later_input_maps_to_the_first_blocks_own():
    graph, grouping = _traced()
    assert [bt.count for bt in grouping.block_types] == [4]
    got = _input_maps(graph, grouping, (1,))
    want = _expected(graph, grouping)
    assert len(want) == 3 * 3 * 4       # 3 later blocks x (param, mu, nu) x (2 kernels, 2 biases)
    assert got == want
    roles = {graph.values[v].role for v in got}
    assert roles == {"parameter", "state"}


def test_inputs_out_of_order_are_matched_by_key():
    """A block whose leaves come in another order than its representative's (a custom pytree, a renamed
    leaf) is not paired by position: each input still finds the input with its key."""
    graph, grouping = _traced()
    inst = grouping.block_types[0].instances[2]
    mine = [v for v in graph.inputs if graph.values[v].module.startswith(inst.path + "/")
            and graph.values[v].role == "parameter" and len(graph.values[v].shape) == 2]
    a, b = (graph.values[v] for v in mine[:2])      # swap two kernels' keypaths (and shapes with them)
    a.keypath_parts, b.keypath_parts = b.keypath_parts, a.keypath_parts
    a.shape, b.shape = b.shape, a.shape
    first = grouping.block_types[0].instances[0].path
    under = [[v for v in graph.inputs if graph.values[v].module.startswith(p + "/")] for p in (inst.path, first)]
    assert not _same_but_instance(graph, *under, inst.path, first)      # not paired by position
    got = _input_maps(graph, grouping, (1,))
    assert got == _expected(graph, grouping)
    assert graph.values[got[a.id]].shape == a.shape and graph.values[got[b.id]].shape == b.shape
