"""Random training-step OpGraphs for the RaNNC partitioner tests (plain data, no jax).

`random_step(seed, ...)` builds a forward DAG over one data input: non-constant ops read one or two
recent activations (sometimes a far one: skip connections), some read a parameter or a *constant*
(a transpose of a parameter, possibly shared by several consumers, so the atomic partition must
clone it). Then a backward pass (per forward op in reverse: the input gradient reading the saved
output; per parameter use: the weight gradient), and an Adam-like update with one moment per
parameter (role "state", matched by keypath). Every value is [B, D] or [D, D].
"""

from __future__ import annotations

import random

import networkx as nx

from autoshard._src.core.graph import OpGraph

from ...core._synthetic import GraphBuilder

B, D = 8, 16


def random_step(seed: int, n_forward: int = 30, n_params: int = 4, p_const: float = 0.2,
                p_skip: float = 0.15, width: int = 3) -> OpGraph:
    rng = random.Random(seed)
    g = GraphBuilder()
    x = g.input((B, D), (2, "x"), role="data")
    params = [g.param(f"M/l{i}", (D, D)) for i in range(n_params)]
    acts: list[int] = [x]                 # non-constant values
    consts: list[int] = []                # constant [D, D] values
    fwd: list[tuple[int, list[int], int, str]] = []   # (op output, inputs, param or -1, module)
    for i in range(n_forward):
        module = f"M/l{(i * n_params) // n_forward}"
        if rng.random() < p_const:
            src = rng.choice(params + consts)
            consts.append(g.op("transpose", [src], module=module))
            continue
        a = acts[-1 - rng.randrange(min(width, len(acts)))]
        if rng.random() < p_skip:
            a = rng.choice(acts)
        kind = rng.random()
        if kind < 0.4:
            w = rng.choice(params + consts)
            y = g.dot(a, w, module=module)
            fwd.append((y, [a], w, module))
        elif kind < 0.7 and len(acts) > 1:
            b = rng.choice(acts[-width:])
            y = g.op("add", [a, b], module=module)
            fwd.append((y, [a, b], -1, module))
        else:
            y = g.op("tanh", [a], module=module)
            fwd.append((y, [a], -1, module))
        acts.append(y)
    loss = g.op("reduce_sum", [acts[-1]], [()], params={"axes": (0, 1)})
    g.output(loss, (2,))
    # backward: one gradient per activation, accumulated by add
    grad: dict[int, int] = {acts[-1]: g.op("mul", [acts[-1]], phase="backward")}
    wgrads: dict[int, list[int]] = {}
    for y, ins, w, module in reversed(fwd):
        if y not in grad:
            continue
        gy = g.op("mul", [grad[y], y], module=module, phase="backward")
        if w >= 0 and g.values[w].role == "parameter":
            wgrads.setdefault(w, []).append(g.dot(ins[0], gy, ((0,), (0,)), module=g.values[w].module,
                                                  phase="backward"))
        for a in ins:
            if a == x:
                continue
            ga = g.dot(gy, w, ((1,), (1,)), module=module, phase="backward") if w >= 0 else gy
            grad[a] = g.op("add", [grad[a], ga], module=module, phase="backward") if a in grad else ga
    for w in params:
        val = g.values[w]
        m = g.input(val.shape, (1, "mu", *val.keypath_parts[1:]), role="state", module=val.module)
        dws = wgrads.get(w, [])
        upd = m
        for dw in dws:
            upd = g.op("add", [upd, dw], module=val.module, phase="optimizer")
        g.output(upd, g.values[m].keypath_parts)
        g.output(g.op("sub", [w, upd], module=val.module, phase="optimizer"), val.keypath_parts)
    return g.build(f"random_step({seed})")


def component_dag(atomic) -> nx.DiGraph:
    dag = nx.DiGraph()
    dag.add_nodes_from(range(len(atomic)))
    dag.add_edges_from(atomic.edges)
    return dag


def convex(dag: nx.DiGraph, nodes) -> bool:
    """No path leaves `nodes` and re-enters it (networkx, independent of the code under test)."""
    s = set(nodes)
    out = set().union(*(nx.descendants(dag, n) for n in s)) - s
    back = set().union(*(nx.ancestors(dag, n) for n in s)) - s
    return not (out & back)


def check_plan(plan, atomic, budget: float) -> None:
    """Stages partition every component, each is convex, dependencies point forward, memory fits,
    devices add up, and every op of the step lies in some stage."""
    dag = component_dag(atomic)
    stage_of = {}
    for st in plan.stages:
        for c in st.components:
            assert c not in stage_of, f"component {c} in two stages"
            stage_of[c] = st.index
    assert set(stage_of) == set(range(len(atomic)))
    for st in plan.stages:
        assert convex(dag, st.components), f"stage {st.index} is not convex"
        assert st.memory <= budget * (1 + 1e-9), (st.index, st.memory, budget)
        assert st.replicas >= 1 and st.microbatch_size >= 1
    for u, v in atomic.edges:
        assert stage_of[u] <= stage_of[v], f"edge {u}->{v} goes from stage {stage_of[u]} back to {stage_of[v]}"
    assert sum(st.replicas for st in plan.stages) == plan.devices
    ops = set().union(*(st.ops for st in plan.stages))
    assert ops == set(range(len(atomic.graph.ops)))
    assert [st.blocks[0] for st in plan.stages][1:] == [st.blocks[1] for st in plan.stages][:-1]
