"""Hand-built OpGraphs for the pure grouping/attribution tests (no jax, no tracing).

`GraphBuilder` makes values and ops from a compact description and fills producers, consumers,
indices, bytes and flops. Grouping tests set `op.module` / `op.phase` directly (bypassing
attribution); attribution tests pass a raw `scope` instead and call infer_phases/attribute_modules.
`model()` emits embedding → transformer-ish blocks → head → loss (+ backward, optimizer).
"""

from __future__ import annotations

from collections.abc import Sequence

from autoshard._src.core.attribution import parse_scope
from autoshard._src.core.flops import estimate_flops
from autoshard._src.core.graph import Loop, Op, OpGraph, Value, nbytes
from autoshard._src.core.grouping import Grouping

B, D, F, V = 8, 16, 64, 32          # tokens, model dim, mlp hidden, vocab
MATMUL = {"contracting": ((1,), (0,)), "batch": ((), ())}


def keystr(parts: Sequence) -> str:
    return "".join(p if isinstance(p, str) and p.startswith(".") else f"[{p!r}]" for p in parts)


class GraphBuilder:
    def __init__(self):
        self.ops: list[Op] = []
        self.values: dict[int, Value] = {}
        self.inputs: list[int] = []
        self.outputs: list[int] = []
        self.out_parts: list[tuple] = []
        self.outer: tuple[Loop, ...] = ()   # loops around every op emitted (a microbatch scan)

    def _value(self, shape, dtype="float32", **kw) -> int:
        vid = len(self.values)
        self.values[vid] = Value(vid, tuple(shape), dtype, **kw)
        return vid

    def input(self, shape, parts: Sequence = (), *, role="", module="", dtype="float32") -> int:
        vid = self._value(shape, dtype, kind="input", keypath=keystr(parts) if parts else None,
                          keypath_parts=tuple(parts), role=role, module=module)
        self.inputs.append(vid)
        return vid

    def literal(self, shape=(), dtype="float32") -> int:
        """A literal constant (kind "literal"), e.g. the scalar of `x * 2.0`."""
        return self._value(shape, dtype, kind="literal")

    def param(self, module: str, shape, leaf="kernel", arg=0) -> int:
        """A parameter input already attributed (role/module set) for grouping tests."""
        parts = (arg, *[int(c) if c.isdigit() else c for c in module.split("/")], leaf)
        return self.input(shape, parts, role="parameter", module=module)

    def op(self, primitive: str, ins: Sequence[int], out_shapes=None, *, module="",
           phase="forward", scope=None, loops: tuple[Loop, ...] = (), params=None):
        """Append an op; returns its output value id (or a tuple for several outputs).
        Default output: one value shaped like the first input. With `scope` given, scope_module
        and transforms come from parse_scope and module/phase are left for attribution."""
        params = dict(params or {})
        in_shapes = tuple(self.values[v].shape for v in ins)
        out_shapes = [tuple(s) for s in (out_shapes or [in_shapes[0]])]
        idx = len(self.ops)
        outs = tuple(self._value(s, producer=idx) for s in out_shapes)
        for v in ins:
            self.values[v].consumers.append(idx)
        if scope is None:
            scope, scope_module, transforms = module, module, ()
        else:
            (scope_module, transforms), module, phase = parse_scope(scope), "", "other"
        nb = sum(nbytes(s, "float32") for s in in_shapes + tuple(out_shapes))
        self.ops.append(Op(
            index=idx, primitive=primitive, inputs=tuple(ins), outputs=outs, in_shapes=in_shapes,
            in_dtypes=("float32",) * len(ins), out_shapes=tuple(out_shapes),
            out_dtypes=("float32",) * len(outs),
            flops=estimate_flops(primitive, in_shapes, out_shapes, params), bytes=nb,
            scope=scope, scope_module=scope_module, transforms=transforms,
            loops=self.outer + tuple(loops),
            params=params, module=module, phase=phase))
        return outs[0] if len(outs) == 1 else outs

    def dot(self, a: int, b: int, contracting=((1,), (0,)), batch=((), ()), **kw) -> int:
        """dot_general with params as the tracer records them; output shape = batch, lhs free,
        rhs free dims."""
        sa, sb = self.values[a].shape, self.values[b].shape
        (lc, rc), (lb, rb) = contracting, batch
        out = ([sa[d] for d in lb] + [n for d, n in enumerate(sa) if d not in lc and d not in lb]
               + [n for d, n in enumerate(sb) if d not in rc and d not in rb])
        params = {"contracting": (tuple(lc), tuple(rc)), "batch": (tuple(lb), tuple(rb))}
        return self.op("dot_general", [a, b], [tuple(out)], params=params, **kw)

    def output(self, vid: int, parts: Sequence = ()) -> None:
        self.outputs.append(vid)
        self.out_parts.append(tuple(parts))

    def build(self, name="synthetic") -> OpGraph:
        return OpGraph(self.ops, self.values, list(self.inputs), list(self.outputs),
                       [keystr(p) for p in self.out_parts], list(self.out_parts), name)


def remainder_grouping(graph: OpGraph) -> Grouping:
    """A Grouping with no block types: every op is in the remainder (search analyses them all)."""
    return Grouping(graph, (), tuple(range(len(graph.ops))), (), 2)


def mlp_step(batch: int, dims: Sequence[int], *, adam: bool = True, stem: str = "M/dense_",
             act: str | None = "tanh") -> OpGraph:
    """A training step of an MLP without biases, as plain data: data input x[batch, dims[0]]
    (role "data"), kernels W_i[dims[i], dims[i+1]] (role "parameter", module f"{stem}{i}"),
    forward x @ W_0 → act → ... → loss = sum(h*h); backward: the output gradient, per layer
    the weight gradient dW_i = h_iᵀ g (contracting over the batch) and, except for the first
    layer, the input gradient g W_iᵀ; optimizer: with `adam`, a moment m_i (role "state")
    updated as m_i + dW_i and W_i - m_i, else plain SGD W_i - dW_i."""
    g = GraphBuilder()
    h = g.input((batch, dims[0]), (2, "x"), role="data")
    ws, saved = [], []
    for i, (n_in, n_out) in enumerate(zip(dims, dims[1:], strict=False)):
        mod = f"{stem}{i}"
        w = g.param(mod, (n_in, n_out))
        ws.append(w)
        saved.append(h)
        h = g.dot(h, w, module=mod)
        if act:
            h = g.op(act, [h], module=mod)
    loss = g.op("reduce_sum", [g.op("mul", [h, h])], [()], params={"axes": (0, 1)})
    g.output(loss, (2,))
    grad = g.op("mul", [h], phase="backward")
    grads = {}
    for i in reversed(range(len(ws))):
        mod = g.values[ws[i]].module
        if act:
            grad = g.op("mul", [grad], module=mod, phase="backward")
        grads[i] = g.dot(saved[i], grad, ((0,), (0,)), module=mod, phase="backward")
        if i:
            grad = g.dot(grad, ws[i], ((1,), (1,)), module=mod, phase="backward")
    for i, w in enumerate(ws):
        val = g.values[w]
        upd = grads[i]
        if adam:
            m = g.input(val.shape, (1, "mu", *val.keypath_parts[1:]), role="state", module=val.module)
            upd = g.op("add", [m, grads[i]], module=val.module, phase="optimizer")
            g.output(upd, g.values[m].keypath_parts)
        g.output(g.op("sub", [w, upd], module=val.module, phase="optimizer"), val.keypath_parts)
    return g.build()


def block(g: GraphBuilder, prefix: str, x: int, *, loops=(), extra_add=False, repeat=1,
          widths=(D, F)):
    """A transformer-ish block (13 forward ops) under `prefix`. Returns (output, tape) where tape
    lists (module, saved activation, param or None) for the backward pass."""
    d, f = widths
    tape = []

    def fwd(prim, ins, out, sub="", param=None, params=None):
        mod = f"{prefix}/{sub}" if sub else prefix
        y = g.op(prim, ins, [out], module=mod, loops=loops, params=params)
        tape.append((mod, ins[0], param, y))
        return y

    ws: dict[str, int] = {}   # parameters are shared by the `repeat` copies of the body

    def w(sub, shape, leaf="kernel"):
        if sub not in ws:
            ws[sub] = g.param(f"{prefix}/{sub}", shape, leaf)
        return ws[sub]

    def dense(sub, h, n_in, n_out):
        return fwd("dot_general", [h, w(sub, (n_in, n_out))], (B, n_out), sub, ws[sub], MATMUL)

    for _ in range(repeat):
        h = fwd("mul", [x, w("ln1", (d,), "scale")], (B, d), "ln1")
        q, k = dense("attn/q", h, d, d), dense("attn/k", h, d, d)
        s = fwd("dot_general", [q, k], (B, B), "attn")
        p = fwd("exp", [s], (B, B), "attn")
        a = fwd("dot_general", [p, h], (B, d), "attn")
        x = fwd("add", [x, dense("attn/o", a, d, d)], (B, d))
        h = fwd("mul", [x, w("ln2", (d,), "scale")], (B, d), "ln2")
        h = fwd("tanh", [dense("fc1", h, d, f)], (B, f), "fc1")
        x = fwd("add", [x, dense("fc2", h, f, d)], (B, d))
    if extra_add:
        x = fwd("add", [x, x], (B, d))
    return x, tape


def model(paths: Sequence[str], *, backward=True, optimizer=True, loops=(), extra_add=(),
          repeat=None, skip_backward=(), widths=None, hoisted=False, embed_ops=1,
          outer=()) -> OpGraph:
    """Embedding (M/embed) → one block per path → head (M/head) → loss (root), then the backward
    pass in reverse (dW and dx per dense layer, one mul per other op) and an SGD update per
    parameter. `loops` wraps the block ops (a scanned body); `hoisted` adds one loop-free
    forward op under the first block path (a loop invariant); `outer` wraps the forward and
    backward passes (gradient accumulation over microbatches)."""
    g = GraphBuilder()
    g.outer = tuple(outer)
    tokens = g.input((B, V), (2, "tokens"), role="data")
    x = g.op("dot_general", [tokens, g.param("M/embed", (V, D), "embedding")], [(B, D)],
             module="M/embed", params=MATMUL)
    for _ in range(embed_ops - 1):
        x = g.op("add", [x, x], module="M/embed")
    tapes = []
    for p in paths:
        if hoisted and p == paths[0]:
            g.op("convert_element_type", [x], module=p)
        x, tape = block(g, p, x, loops=loops, extra_add=p in extra_add,
                        repeat=(repeat or {}).get(p, 1), widths=(widths or {}).get(p, (D, F)))
        tapes.append((p, tape))
    logits = g.op("dot_general", [x, g.param("M/head", (D, V))], [(B, V)], module="M/head",
                  params=MATMUL)
    loss = g.op("reduce_sum", [g.op("mul", [logits, logits])], [()], params={"axes": (0, 1)})
    g.output(loss, (2,))
    if backward:
        grad, grads = g.op("mul", [logits], phase="backward"), {}
        for p, tape in reversed(tapes):
            for mod, saved, w, y in reversed(tape):
                kw = dict(module=mod, phase="backward", loops=loops)
                if w is not None:
                    grads[w] = g.op("dot_general", [saved, grad], [g.values[w].shape], **kw)
                    if p not in skip_backward:
                        grad = g.op("dot_general", [grad, w], [g.values[saved].shape], **kw)
                elif p not in skip_backward:
                    grad = g.op("mul", [grad, y], **kw)
        g.outer = ()
        if optimizer:
            for w, dw in grads.items():
                g.output(g.op("sub", [w, dw], module=g.values[w].module, phase="optimizer"),
                         g.values[w].keypath_parts)
    return g.build()
