"""The one place that touches jax internals (name stacks, jaxpr node types, key types).

Everything here is small and tested, so that a jax upgrade breaks one file, loudly.
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple

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


def is_tracer(x: Any) -> bool:
    """A value being traced by an enclosing jax transformation (jit, grad, vmap, scan, ...)."""
    return isinstance(x, jax.core.Tracer)


def tracing() -> bool:
    """Whether a jax transformation is tracing now (jax.set_mesh refuses to run then)."""
    from jax._src import core

    return not core.trace_state_clean()


def typed_sharding(sharding: Any) -> bool:
    """Whether an array's sharding is a NamedSharding on a mesh with a non-Auto axis (an array placed on
    jax.make_mesh's default Explicit mesh): its sharding is then part of its type, which a step traced
    for Auto shardings rejects ("Mesh for all inputs should be equal")."""
    types = getattr(getattr(sharding, "mesh", None), "axis_types", ())
    return isinstance(sharding, jax.sharding.NamedSharding) and any(t != jax.sharding.AxisType.Auto for t in types)


def untyped(args: Any) -> Any:
    """`args` with each array placed on an Explicit mesh as a ShapeDtypeStruct of its shape and dtype:
    what autoshard traces and lowers (it plans the shardings itself); other leaves unchanged."""
    def one(x: Any) -> Any:
        if isinstance(x, jax.Array) and typed_sharding(getattr(x, "sharding", None)):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=getattr(jax.typeof(x), "weak_type", False))
        return x

    return jax.tree.map(one, args)


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


def eqn_context(eqn: Any) -> Any:
    """The context an eqn was traced in (name stack, source info): ops bound inside it carry the eqn's
    module path, so a rewrite of the eqn keeps its attribution."""
    from jax._src import source_info_util

    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    return source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack)


def bind_eqn(eqn: Any, invals: list) -> list:
    """Run one eqn on concrete or traced values, as `jax.core.eval_jaxpr` does; its name stack and
    source info are kept so the compiled program's op metadata is unchanged."""
    bind_params = eqn.primitive.get_bind_params(eqn.params)
    subfuns: list = []
    if isinstance(bind_params, tuple):  # older jax returned (subfuns, params)
        subfuns, bind_params = bind_params
    with eqn_context(eqn), eqn.ctx.manager:
        ans = eqn.primitive.bind(*subfuns, *invals, **bind_params)
    return list(ans) if eqn.primitive.multiple_results else [ans]


def eval_jaxpr_with(closed: Any, args: list, after_eqn: Any, bind: Any = None) -> list:
    """Evaluate a ClosedJaxpr like `jax.core.eval_jaxpr`, calling `after_eqn(index, outs)` on the
    outputs of every top-level eqn (it returns the outputs to use, e.g. sharding-constrained). `bind(index,
    eqn, invals)`: the outputs of an eqn bound otherwise (a call re-bound with a rewritten body), or None."""
    jaxpr = closed.jaxpr
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    for var, val in zip(jaxpr.constvars, closed.consts, strict=True):
        env[var] = val
    for var, val in zip(jaxpr.invars, args, strict=True):
        env[var] = val
    for k, eqn in enumerate(jaxpr.eqns):
        invals = [read(v) for v in eqn.invars]
        outs = bind(k, eqn, invals) if bind is not None else None
        outs = after_eqn(k, bind_eqn(eqn, invals) if outs is None else outs)
        for var, val in zip(eqn.outvars, outs, strict=True):
            env[var] = val
    return [read(v) for v in jaxpr.outvars]


def rebind_with_body(eqn: Any, invals: list, body: Any) -> list:
    """Bind a call eqn whose body is the open jaxpr param `jaxpr` (remat2) with the body traced from
    `body(*inner_args)` instead (same values: the caller adds only identities such as sharding
    constraints); its other params (prevent_cse, differentiated, policy) and its context are kept."""
    from jax._src.interpreters import partial_eval as pe

    inner = eqn.params["jaxpr"]
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=getattr(v.aval, "weak_type", False))
             for v in inner.invars]
    with eqn_context(eqn):
        closed = jax.make_jaxpr(body)(*avals)
    jaxpr = pe.convert_constvars_jaxpr(closed.jaxpr)
    bind_params = eqn.primitive.get_bind_params({**eqn.params, "jaxpr": jaxpr})
    subfuns: list = []
    if isinstance(bind_params, tuple):
        subfuns, bind_params = bind_params
    with eqn_context(eqn), eqn.ctx.manager:
        ans = eqn.primitive.bind(*subfuns, *closed.consts, *invals, **bind_params)
    return list(ans) if eqn.primitive.multiple_results else [ans]


CALL_PRIMITIVES = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr"}


class FlatEqn(NamedTuple):
    """An eqn of a jaxpr with its plain call wrappers (jit, closed_call) inlined: inputs are value
    keys (ints) or Literals, outputs fresh keys; `scope` is the joined name stack."""

    eqn: Any
    inputs: tuple
    outputs: tuple[int, ...]
    scope: str


class FlatProgram(NamedTuple):
    eqns: list[FlatEqn]
    consts: dict[int, Any]        # key -> constant value (closed-over arrays)
    inputs: tuple[int, ...]       # keys of the flat arguments
    outputs: tuple                # keys (or Literals) of the flat results


def flatten_calls(closed: Any) -> FlatProgram:
    """Inline jit / closed_call wrappers so a program can be cut between any two remaining eqns.
    Control flow (scan, while, cond), custom derivatives and remat stay whole: cutting them would
    change what they compute or how they differentiate."""
    keys = itertools.count()
    consts: dict[int, Any] = {}
    out: list[FlatEqn] = []

    def bind_vars(variables: list, values: list, env: dict) -> None:
        for var, val in zip(variables, values, strict=True):
            env[var] = val

    def walk(jaxpr: Any, const_vals: list, in_keys: list, scope: str) -> list:
        env: dict = {}
        for var, val in zip(jaxpr.constvars, const_vals, strict=True):
            env[var] = k = next(keys)
            consts[k] = val
        bind_vars(jaxpr.invars, in_keys, env)

        def read(a):
            return a if isinstance(a, Literal) else env[a]

        for eqn in jaxpr.eqns:
            inner = name_stack(eqn)
            sc = f"{scope}/{inner}" if scope and inner else (scope or inner)
            ins = [read(a) for a in eqn.invars]
            sub = as_open_jaxpr(eqn.params.get(CALL_PRIMITIVES.get(eqn.primitive.name, ""), None))
            if sub is not None and len(sub[0].invars) == len(ins) and len(sub[0].outvars) == len(eqn.outvars):
                bind_vars(eqn.outvars, walk(sub[0], sub[1], ins, sc), env)
                continue
            outs = tuple(next(keys) for _ in eqn.outvars)
            out.append(FlatEqn(eqn, tuple(ins), outs, sc))
            bind_vars(eqn.outvars, list(outs), env)
        return [read(a) for a in jaxpr.outvars]

    in_keys = [next(keys) for _ in closed.jaxpr.invars]
    results = walk(closed.jaxpr, list(closed.consts), in_keys, "")
    return FlatProgram(out, consts, tuple(in_keys), tuple(results))
