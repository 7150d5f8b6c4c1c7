"""Hand-built OpGraphs for the pure grouping/attribution tests (no jax, no tracing).

`GraphBuilder` makes values and ops from a compact description and fills producers, consumers,
indices, bytes and flops. Grouping tests set `op.module` / `op.phase` directly (bypassing
attribution); attribution tests pass a raw `scope` instead and call infer_phases/attribute_modules.
`model()` emits embedding → transformer-ish blocks → head → loss (+ backward, optimizer).
"""

from __future__ import annotations

from collections.abc import Sequence

from autoshard._flops import estimate_flops
from autoshard._graph import Loop, Op, OpGraph, Value, nbytes
from autoshard._graph_attribution import parse_scope

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

    def output(self, vid: int, parts: Sequence = ()) -> None:
        self.outputs.append(vid)
        self.out_parts.append(tuple(parts))

    def build(self, name="synthetic") -> OpGraph:
        return OpGraph(self.ops, self.values, list(self.inputs), list(self.outputs),
                       [keystr(p) for p in self.out_parts], list(self.out_parts), name)


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
    loss = g.op("reduce_sum", [g.op("mul", [logits, logits])], [()])
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
