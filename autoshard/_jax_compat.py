"""The one place that touches jax internals (name stacks, jaxpr node types, key types).

Everything here is small and tested, so that a jax upgrade breaks one file, loudly.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.extend import core as jex_core

Literal = jex_core.Literal
ClosedJaxpr = jex_core.ClosedJaxpr
Jaxpr = jex_core.Jaxpr


def name_stack(eqn: Any) -> str:
    """The eqn's name stack as jax prints it, e.g. "transpose(jvp(GPT))/block_3/fc1".

    Name stacks of eqns inside nested jaxprs are relative to the enclosing eqn.
    """
    info = getattr(eqn, "source_info", None)
    stack = getattr(info, "name_stack", None)
    return str(stack) if stack is not None else ""


def is_literal(atom: Any) -> bool:
    return isinstance(atom, Literal)


def aval_shape_dtype(atom: Any) -> tuple[tuple[int, ...], str]:
    aval = atom.aval
    shape = tuple(int(d) if isinstance(d, int) else -1 for d in getattr(aval, "shape", ()))
    dtype = getattr(aval, "dtype", None)
    return shape, (str(dtype) if dtype is not None else type(aval).__name__)


def as_open_jaxpr(obj: Any) -> tuple[Any, list[Any]] | None:
    """(jaxpr, consts) for a ClosedJaxpr or an open Jaxpr param value; None for anything else."""
    if isinstance(obj, ClosedJaxpr):
        return obj.jaxpr, list(obj.consts)
    if isinstance(obj, Jaxpr):
        return obj, []
    return None


def keypath_parts(path: tuple) -> tuple[str | int, ...]:
    """Plain parts of a pytree keypath: dict keys and sequence indices as is, attributes as
    ".name" (so `mu` in `opt_state[0].mu` reads ".mu")."""
    out: list[str | int] = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            out.append(k.key if isinstance(k.key, int | str) else str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            out.append(k.idx)
        elif isinstance(k, jax.tree_util.GetAttrKey):
            out.append("." + k.name)
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            out.append(k.key)
        else:  # unknown key kinds: their printed form
            out.append(str(k))
    return tuple(out)


def keystr(path: tuple) -> str:
    return jax.tree_util.keystr(path)


def nested_eqn_count(params: dict) -> int:
    """Equations inside the jaxprs an eqn carries (for container primitives kept opaque)."""
    total = 0
    for sub in jex_core.jaxprs_in_params(params):
        total += len(sub.eqns)
    return total


def eval_jaxpr_with(closed: Any, args: list, after_eqn: Any) -> list:
    """Evaluate a ClosedJaxpr like `jax.core.eval_jaxpr`, calling `after_eqn(index, outs)` on the
    outputs of every top-level eqn (it returns the outputs to use, e.g. sharding-constrained).
    Name stacks and source info are kept so the compiled program's op metadata is unchanged."""
    from jax._src import source_info_util

    jaxpr = closed.jaxpr
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    for var, val in zip(jaxpr.constvars, closed.consts, strict=True):
        env[var] = val
    for var, val in zip(jaxpr.invars, args, strict=True):
        env[var] = val
    for k, eqn in enumerate(jaxpr.eqns):
        bind_params = eqn.primitive.get_bind_params(eqn.params)
        subfuns: list = []
        if isinstance(bind_params, tuple):  # older jax returned (subfuns, params)
            subfuns, bind_params = bind_params
        name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), \
                eqn.ctx.manager:
            ans = eqn.primitive.bind(*subfuns, *map(read, eqn.invars), **bind_params)
        outs = list(ans) if eqn.primitive.multiple_results else [ans]
        outs = after_eqn(k, outs)
        for var, val in zip(eqn.outvars, outs, strict=True):
            env[var] = val
    return [read(v) for v in jaxpr.outvars]
