"""Fused projections with their composite dim exposed (issue 34).

GPT-2's `c_attn` (and many hand-written attentions) compute q, k and v with one matmul whose output
dim is 3 x heads x head_dim, then `jnp.split` it into three; the backward concatenates the three
cotangents into one before the weight and input gradients. A head-parallel plan splits each of q, k,
v along the heads, which a contiguous split of the fused dim never lines up with (device 0 of 4 would
hold all of q's first three heads and none of k), so XLA reshuffles activations with all-to-alls and
collective-permutes no plan can price, and no sharding of the fused (B, S, 3*H*hd) value says "the
heads of each third".

The rewrite below gives the program the layout a head-parallel plan needs without changing what it
computes: the fused dim is exposed as two dims (k chunks x m), by reshaping the *weight* (a free
reshape of a weight-sized value) instead of slicing the activation:

    forward   y = x @ W (+ b); q, k, v = split(y)   ->   y3 = x @ W.reshape(.., k, m) (+ b.reshape)
                                                          q, k, v = y3[.., 0, :], y3[.., 1, :], y3[.., 2, :]
    backward  g = concat(gq, gk, gv); dW = x^T g; dx = g W^T; db = sum(g)
              ->  g3 = stack(gq, gk, gv); dW = (x^T g3).reshape(..); dx = g3 . W.reshape(..); db = ...

Each matmul stays one matmul of the same shape (same flops, same kernel), and the m dim of every
exposed value is linked to the heads by the factor analysis, so the heads can be split with no
activation moved; what a plan pays instead is weight-sized: the merged weight gradient is gathered
over the heads' axes (priced by the reshape rule of tensor/link_rules.py). Only top-level eqns are
rewritten, and only when every reader of the fused value is one the rewrite understands; anything
else keeps its program as traced. Numerics: identical per element (the same sums, in the same matmul).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from .. import compat as jc


@dataclasses.dataclass(frozen=True)
class _Forward:
    """`split` eqn `at` of the output of dot eqn `dot` (optionally through bias add eqn `add`)."""

    at: int
    dot: int
    add: int | None
    operand: int          # which dot operand's free dim becomes the fused dim
    operand_dim: int      # that dim, in the operand
    dim: int              # the fused dim, in the dot's output
    chunks: int


@dataclasses.dataclass(frozen=True)
class _Backward:
    """`concatenate` eqn `at` of k equal cotangent chunks along `dim`, read only by `readers`."""

    at: int
    dim: int
    chunks: int
    readers: tuple[int, ...]


def expose_fused(closed: Any) -> Any:
    """`closed` with every fused projection it can prove safe rewritten (see the module docstring);
    `closed` itself when there is none."""
    jaxpr = closed.jaxpr
    uses = _uses(jaxpr)
    producer = {v: k for k, e in enumerate(jaxpr.eqns) for v in e.outvars}
    forwards = [f for k, e in enumerate(jaxpr.eqns) if e.primitive.name == "split"
                if (f := _forward_at(jaxpr.eqns, k, uses, producer)) is not None]
    backwards = [b for k, e in enumerate(jaxpr.eqns) if e.primitive.name == "concatenate"
                 if (b := _backward_at(jaxpr, k, uses)) is not None]
    if not forwards and not backwards:
        return closed
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in jaxpr.invars]
    return jax.make_jaxpr(lambda *args: _run(closed, list(args), forwards, backwards))(*avals)


def _uses(jaxpr: Any) -> dict:
    uses: dict = {}
    for e in jaxpr.eqns:
        for v in e.invars:
            if not jc.is_literal(v):
                uses[v] = uses.get(v, 0) + 1
    for v in jaxpr.outvars:
        if not jc.is_literal(v):
            uses[v] = uses.get(v, 0) + 2        # a program output is never rewritten away
    return uses


def _dot_dims(eqn: Any) -> tuple:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    return tuple(lc), tuple(rc), tuple(lb), tuple(rb)


def _free_dims(rank: int, contract: tuple, batch: tuple) -> list[int]:
    return [d for d in range(rank) if d not in contract and d not in batch]


def _out_source(eqn: Any, dim: int) -> tuple[int, int] | None:
    """(operand, operand dim) a dot_general's output dim comes from, when it is a free dim."""
    lc, rc, lb, rb = _dot_dims(eqn)
    lfree = _free_dims(len(eqn.invars[0].aval.shape), lc, lb)
    rfree = _free_dims(len(eqn.invars[1].aval.shape), rc, rb)
    if dim < len(lb):
        return None
    dim -= len(lb)
    if dim < len(lfree):
        return 0, lfree[dim]
    return 1, rfree[dim - len(lfree)]


def _forward_at(eqns: list, k: int, uses: dict, producer: dict) -> _Forward | None:
    split = eqns[k]
    sizes, dim = tuple(split.params["sizes"]), split.params["axis"]
    y = split.invars[0]
    if len(sizes) < 2 or len(set(sizes)) != 1 or jc.is_literal(y) or uses.get(y) != 1 or y not in producer:
        return None
    p = producer[y]
    add = None
    if eqns[p].primitive.name == "add":
        add = p
        dots = [v for v in eqns[p].invars if not jc.is_literal(v) and v in producer
                and eqns[producer[v]].primitive.name == "dot_general" and uses.get(v) == 1]
        bias = [v for v in eqns[p].invars if v not in dots]
        if len(dots) != 1 or len(bias) != 1 or not _broadcastable(bias[0], y.aval.shape, dim):
            return None
        p = producer[dots[0]]
    if eqns[p].primitive.name != "dot_general":
        return None
    src = _out_source(eqns[p], dim)
    if src is None:
        return None
    return _Forward(k, p, add, src[0], src[1], dim, len(sizes))


def _broadcastable(v: Any, shape: tuple, dim: int) -> bool:
    s = getattr(v.aval, "shape", None) if not jc.is_literal(v) else None
    return (s is not None and len(s) == len(shape) and s[dim] == shape[dim]
            and all(a in (1, b) for a, b in zip(s, shape, strict=True)))


def _backward_at(jaxpr: Any, k: int, uses: dict) -> _Backward | None:
    cat = jaxpr.eqns[k]
    dim = cat.params["dimension"]
    sizes = {v.aval.shape[dim] for v in cat.invars if not jc.is_literal(v)}
    g = cat.outvars[0]
    if len(cat.invars) < 2 or len(sizes) != 1 or any(jc.is_literal(v) for v in cat.invars):
        return None
    readers = tuple(j for j, e in enumerate(jaxpr.eqns) if any(v is g for v in e.invars))
    if not readers or uses.get(g, 0) != sum(sum(v is g for v in jaxpr.eqns[j].invars) for j in readers):
        return None
    for j in readers:
        e = jaxpr.eqns[j]
        if sum(v is g for v in e.invars) != 1:
            return None
        if e.primitive.name == "reduce_sum":
            if dim in e.params["axes"]:
                return None
        elif e.primitive.name == "dot_general":
            lc, rc, lb, rb = _dot_dims(e)
            pos = 0 if e.invars[0] is g else 1
            if dim in (lb if pos == 0 else rb):
                return None
        else:
            return None
    return _Backward(k, dim, len(cat.invars), readers)


def _expose(x: Any, dim: int, chunks: int) -> Any:
    """x with dim d (size chunks*m) as two dims (chunks, m)."""
    s = x.shape
    return x.reshape(s[:dim] + (chunks, s[dim] // chunks) + s[dim + 1:])


def _remap(dims: tuple, at: int) -> tuple:
    """Dim indices after dim `at` became two: those after it move up one; `at` itself -> (at, at+1)."""
    out: list[int] = []
    for d in dims:
        out += [d, d + 1] if d == at else [d + 1 if d > at else d]
    return tuple(out)


def _run(closed: Any, args: list, forwards: list[_Forward], backwards: list[_Backward]) -> list:
    jaxpr = closed.jaxpr
    env: dict = dict(zip(jaxpr.constvars, closed.consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    fwd_at = {f.at: f for f in forwards}
    lazy = {f.dot for f in forwards} | {f.add for f in forwards if f.add is not None}
    bwd_at = {b.at: b for b in backwards}
    stacked: dict = {}            # a concatenate's output var -> (its chunks stacked, fused dim)
    reader_of = {j: b for b in backwards for j in b.readers}

    def read(v: Any) -> Any:
        return v.val if jc.is_literal(v) else env[v]

    for k, eqn in enumerate(jaxpr.eqns):
        if k in lazy:
            continue
        if k in fwd_at:
            outs = _split_forward(jaxpr.eqns, fwd_at[k], read)
        elif k in bwd_at:
            b = bwd_at[k]
            with jc.eqn_context(eqn):
                parts = [jax.lax.expand_dims(read(v), (b.dim,)) for v in eqn.invars]
                stacked[eqn.outvars[0]] = (jax.lax.concatenate(parts, b.dim), b.dim)
            continue
        elif k in reader_of:
            outs = [_read_stacked(eqn, stacked, read)]
        else:
            outs = jc.bind_eqn(eqn, [read(v) for v in eqn.invars])
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def _split_forward(eqns: list, f: _Forward, read: Any) -> list:
    """The chunks of the fused output, from one matmul with the operand's fused dim exposed."""
    dot = eqns[f.dot]
    ops = [read(v) for v in dot.invars]
    lc, rc, lb, rb = _dot_dims(dot)
    if f.operand == 0:
        lc, lb = _remap(lc, f.operand_dim), _remap(lb, f.operand_dim)
    else:
        rc, rb = _remap(rc, f.operand_dim), _remap(rb, f.operand_dim)
    # bound in the eqns' own contexts: the exposing reshapes belong to the forward pass (phase, module)
    with jc.eqn_context(dot), dot.ctx.manager:
        ops[f.operand] = _expose(ops[f.operand], f.operand_dim, f.chunks)
        y = dot.primitive.bind(*ops, **{**dot.params, "dimension_numbers": ((lc, rc), (lb, rb))})
    if f.add is not None:
        add = eqns[f.add]
        bias = next(read(v) for v in add.invars if v is not dot.outvars[0])
        with jc.eqn_context(add), add.ctx.manager:
            bias = (_expose(bias, f.dim, f.chunks) if bias.shape[f.dim] > 1
                    else jax.numpy.expand_dims(bias, f.dim))
        y = jc.bind_eqn(add, [y, bias] if add.invars[0] is dot.outvars[0] else [bias, y])[0]
    with jc.eqn_context(eqns[f.at]):
        return [jax.lax.index_in_dim(y, c, f.dim, keepdims=False) for c in range(f.chunks)]


def _read_stacked(eqn: Any, stacked: dict, read: Any) -> Any:
    """A reader of a concatenated cotangent, run on the chunks stacked along a new dim instead."""
    pos = next(i for i, v in enumerate(eqn.invars) if not jc.is_literal(v) and v in stacked)
    g3, dim = stacked[eqn.invars[pos]]
    chunks = g3.shape[dim]
    out_shape = eqn.outvars[0].aval.shape
    with jc.eqn_context(eqn), eqn.ctx.manager:
        if eqn.primitive.name == "reduce_sum":
            axes = _remap(tuple(eqn.params["axes"]), dim)
            y = eqn.primitive.bind(g3, **{**eqn.params, "axes": axes})
            return y.reshape(out_shape)
        ops = [read(v) if i != pos else g3 for i, v in enumerate(eqn.invars)]
        lc, rc, lb, rb = _dot_dims(eqn)
        mine, other = (lc, rc) if pos == 0 else (rc, lc)
        if dim in mine:             # contracted: the other operand's matching dim is exposed too
            odim = other[mine.index(dim)]
            ops[1 - pos] = _expose(ops[1 - pos], odim, chunks)
            ldim, rdim = (dim, odim) if pos == 0 else (odim, dim)
            lc, lb, rc, rb = _remap(lc, ldim), _remap(lb, ldim), _remap(rc, rdim), _remap(rb, rdim)
        elif pos == 0:              # a free dim: the output gets (chunks, m) where it had the fused dim
            lc, lb = _remap(lc, dim), _remap(lb, dim)
        else:
            rc, rb = _remap(rc, dim), _remap(rb, dim)
        y = eqn.primitive.bind(*ops, **{**eqn.params, "dimension_numbers": ((lc, rc), (lb, rb))})
        return y.reshape(out_shape)
