"""Dead-code elimination before costing (core/liveness.py) on hand-built graphs: pure, no jax."""

from __future__ import annotations

from autoshard._src.core.graph import Loop
from autoshard._src.core.liveness import live_ops, live_weights

from ._synthetic import GraphBuilder


def test_unread_broadcast_is_dead_and_its_producers_too():
    b = GraphBuilder()
    x = b.input((4, 8), role="data")
    y = b.op("tanh", [x])                                  # 0: live, reaches the output
    s = b.op("reduce_sum", [y], [()], params={"axes": (0, 1)})   # 1: live
    z = b.op("exp", [x])                                   # 2: read only by the dead broadcast
    b.op("broadcast_in_dim", [z], [(2, 4, 8)], params={"broadcast_dimensions": (1, 2)})  # 3: dead
    b.output(s)
    g = b.build()
    assert live_ops(g).tolist() == [True, True, False, False]
    assert live_ops(g) is live_ops(g)                      # cached on the graph
    assert live_weights(g, {0: 2.0, 3: 5.0}) == {0: 2.0, 3: 0.0}


def test_effects_and_no_results_keep_an_op():
    b = GraphBuilder()
    x = b.input((4,), role="data")
    b.op("tanh", [x], params={"effectful": True})          # a callback's result nobody reads
    b.op("debug_callback", [x])                            # known effectful primitive
    b.op("exp", [x])                                       # plain dead
    g = b.build()
    assert live_ops(g).tolist() == [True, True, False]


def test_loop_carried_value_is_live_while_its_loop_runs():
    # a scan body seen once: h' = tanh(h) is carried to the next iteration only (its final value is
    # unread), y = h * 2 is the stacked output; h' must stay live because the loop runs
    loop = Loop(0, "scan", 5)
    b = GraphBuilder()
    h = b.input((4,), role="data")
    h2 = b.op("tanh", [h], loops=(loop,))                  # 0: carry-out
    y = b.op("mul", [h, b.literal()], loops=(loop,))       # 1: ys, read after the loop
    dead = b.op("exp", [h], loops=(loop,))                 # 2: neither carried nor read
    b.output(y)
    g = b.build()
    g.carried = {h2: (loop.uid,)}
    assert live_ops(g).tolist() == [True, True, False]
    assert dead is not None



def test_the_table_walk_agrees_with_marking_from_the_roots():
    # a traced step (dead cotangent broadcasts of jnp.where, a loss, parameter updates, a callback): the
    # breadth-first walk over the op table's edges marks what a walk from the roots over the ops marks
    import jax

    import models
    from autoshard._src.bridge.trace.trace import trace
    from autoshard._src.core.liveness import EFFECTFUL, is_live

    m = models.get("gpt", "debug", num_layers=3)

    def step(*args):
        jax.debug.callback(lambda: None)              # effects, no results
        return m.train_step(*args)

    g = trace(step, *m.abstract_state())
    outputs = set(g.outputs)
    want = [False] * len(g.ops)
    stack = [op.index for op in g.ops if not op.outputs or op.params.get("effectful") or op.primitive in EFFECTFUL
             or not outputs.isdisjoint(op.outputs)]
    while stack:
        i = stack.pop()
        if not want[i]:
            want[i] = True
            stack.extend(p for v in g.ops[i].inputs if (p := g.values[v].producer) is not None)
    assert live_ops(g).tolist() == want
    assert not all(want) and any(want)
    assert any(op.params.get("effectful") for op in g.ops)
    live = is_live(g)
    assert [live(i) for i in range(len(g.ops))] == want
