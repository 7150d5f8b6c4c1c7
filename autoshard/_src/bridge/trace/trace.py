"""trace(): a step function and example args → OpGraph.

`jax.make_jaxpr` gives the program; nested jaxprs are expanded inline so nothing is hidden:
calls (jit, remat, custom_jvp/vjp) are transparent, loop bodies (scan, while) appear once with
their trip counts, and every branch of a `cond` appears, merged by a zero-cost `cond` op. Name
stacks of nested eqns are relative, so each is joined with its enclosing eqn's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import numpy as np

from ...core.attribution import attribute_modules, infer_phases, join_modules, parse_scope
from ...core.errors import NotCallableError, TraceFailedError, UntraceableArgumentError
from ...core.flops import estimate_flops
from ...core.graph import Loop, Op, OpGraph, Value, nbytes
from .. import compat as jc
from .fused import expose_fused

# call-like primitives whose body runs once with the eqn's operands: inlined
_REMAT_CALLS = frozenset({"remat2", "checkpoint"})     # jax.checkpoint / nn.remat
_TRANSPARENT = {
    "pjit": ("jaxpr",), "jit": ("jaxpr",), "closed_call": ("call_jaxpr",),
    "core_call": ("call_jaxpr",), "remat2": ("jaxpr",), "checkpoint": ("jaxpr",),
    "custom_jvp_call": ("call_jaxpr",), "custom_vjp_call": ("call_jaxpr", "fun_jaxpr"),
    "custom_vjp_call_jaxpr": ("fun_jaxpr",), "custom_lin": (),
}


def check_args(args: tuple) -> None:
    leaves = jax.tree_util.tree_flatten_with_path(args)[0]
    for path, leaf in leaves:
        where = "args" + jc.keystr(path)
        if isinstance(leaf, jax.ShapeDtypeStruct | np.ndarray | np.generic) and not _jax_dtype(leaf.dtype):
            raise UntraceableArgumentError(
                f"autoshard.trace: argument {where} has dtype {leaf.dtype} (shape {tuple(leaf.shape)}), which is "
                "no jax array type (jax takes bool, integer, float, complex and PRNG key arrays). Fix: encode "
                "it as numbers (e.g. token ids), or keep it outside the step's arguments.")
        if isinstance(leaf, jax.ShapeDtypeStruct | jax.Array | np.ndarray | np.generic
                      | bool | int | float | complex):
            continue
        raise UntraceableArgumentError(
            f"autoshard.trace: argument {where} is a {type(leaf).__module__}."
            f"{type(leaf).__qualname__} ({_short(leaf)}), which jax cannot trace. Arguments must "
            "be pytrees whose leaves are arrays, Python/numpy scalars or jax.ShapeDtypeStruct. "
            "Fix: pass it as an array, close over it in the function, or register its type as a "
            "pytree (jax.tree_util.register_dataclass / register_pytree_node).")


def _jax_dtype(dtype: Any) -> bool:
    return any(jax.numpy.issubdtype(dtype, kind) for kind in (np.number, np.bool_, jax.dtypes.prng_key))


def _short(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) <= 60 else text[:57] + "..."


def _simple_params(primitive: str, params: dict) -> dict:
    """The eqn params that later stages need, as plain data (no jaxprs, no jax objects)."""
    out: dict[str, Any] = {}
    if primitive == "dot_general":
        (lc, rc), (lb, rb) = params["dimension_numbers"]
        out["contracting"] = (tuple(lc), tuple(rc))
        out["batch"] = (tuple(lb), tuple(rb))
        return out
    if primitive == "conv_general_dilated":
        dn = params["dimension_numbers"]
        out["lhs_spec"], out["rhs_spec"], out["out_spec"] = (tuple(dn.lhs_spec),
                                                             tuple(dn.rhs_spec), tuple(dn.out_spec))
        out["rhs_in_feature_dim"] = dn.rhs_spec[1]
        out["rhs_spatial_dims"] = tuple(dn.rhs_spec[2:])
    for k, v in params.items():
        if k in out:
            continue
        plain = _plain(v)
        if plain is not _SKIP:
            out[k] = plain
    return out


_SKIP = object()


def _plain(v: Any, depth: int = 0) -> Any:
    if v is None or isinstance(v, bool | int | float | str):
        return v
    if isinstance(v, np.dtype):
        return str(v)
    if isinstance(v, np.generic):  # numpy scalars in params (e.g. broadcast_dimensions)
        return v.item()
    if isinstance(v, tuple | list) and depth < 3 and len(v) <= 16:
        items = [_plain(x, depth + 1) for x in v]
        return _SKIP if any(x is _SKIP for x in items) else tuple(items)
    return _SKIP


class _Scope(NamedTuple):
    """Where an eqn sits: the joined name stack text, its module path and its transforms."""

    text: str
    module: str
    transforms: tuple[str, ...]

    def enter(self, inner: str) -> _Scope:
        if not inner:
            return self
        hit = _entered.get((self, inner))
        if hit is None:     # a program repeats few (scope, name stack) pairs: join each once
            module, transforms = parse_scope(inner)
            text = f"{self.text}/{inner}" if self.text else inner
            hit = _entered[(self, inner)] = _Scope(text, join_modules(self.module, module),
                                                   self.transforms + transforms)
        return hit


_entered: dict[tuple[_Scope, str], _Scope] = {}


class _Builder:
    def __init__(self) -> None:
        self.values: dict[int, Value] = {}
        self.ops: list[Op] = []
        self._ids = itertools.count()
        self._loop_ids = itertools.count()
        self.eqns: dict[int, Any] = {}      # op index -> the jaxpr eqn it stands for (leaf ops)
        self._avals: dict[Any, tuple[tuple[int, ...], str, int]] = {}
        # the graph's edges as the ops are added, and the ops marked effectful (OpGraph.recorded_edges): flat
        # lists, not a pass over the ops
        self.edges: tuple[list[int], ...] = ([], [], [], [], [])
        self.carried: dict[int, tuple[int, ...]] = {}

    def shape_dtype(self, atom: Any) -> tuple[tuple[int, ...], str, int]:
        """(shape, dtype name, bytes) of an atom. A step has tens of thousands of atoms but few
        distinct avals (jax interns them), so each is converted once."""
        aval = atom.aval
        try:
            return self._avals[aval]
        except KeyError:
            shape, dtype = jc.aval_shape_dtype(atom)
            out = self._avals[aval] = (shape, dtype, nbytes(shape, dtype))
            return out
        except TypeError:   # an unhashable aval: convert it every time
            shape, dtype = jc.aval_shape_dtype(atom)
            return shape, dtype, nbytes(shape, dtype)

    def new_value(self, atom: Any, kind: str, producer: int | None = None) -> int:
        shape, dtype, _ = self.shape_dtype(atom)
        vid = next(self._ids)
        self.values[vid] = Value(vid, shape, dtype, producer=producer, kind=kind)
        return vid

    def read(self, env: dict, atom: Any) -> int:
        if jc.is_literal(atom):
            return self.new_value(atom, "literal")
        return env[atom]

    def add_op(self, primitive: str, inputs: list[int], out_atoms: list[Any], scope: _Scope,
               loops: tuple[Loop, ...], params: dict, in_atoms: list[Any] | None = None) -> list[int]:
        index = len(self.ops)
        values, sd = self.values, self.shape_dtype
        out_sd = [sd(a) for a in out_atoms]
        outs = []
        for shape, dtype, _ in out_sd:
            vid = next(self._ids)
            values[vid] = Value(vid, shape, dtype, producer=index, kind="intermediate")
            outs.append(vid)
        if in_atoms is not None:
            in_sd = [sd(a) for a in in_atoms]
        else:
            in_sd = [(val.shape, val.dtype, val.nbytes) for val in map(values.__getitem__, inputs)]
        in_shapes = tuple([x[0] for x in in_sd])
        out_shapes = tuple([x[0] for x in out_sd])
        self.ops.append(Op(
            index=index, primitive=primitive, inputs=tuple(inputs), outputs=tuple(outs),
            in_shapes=in_shapes, in_dtypes=tuple([x[1] for x in in_sd]),
            out_shapes=out_shapes, out_dtypes=tuple([x[1] for x in out_sd]),
            flops=estimate_flops(primitive, in_shapes, out_shapes, params),
            bytes=sum([x[2] for x in in_sd]) + sum([x[2] for x in out_sd]),
            scope=scope.text, scope_module=scope.module, transforms=scope.transforms, loops=loops,
            params=params,
        ))
        for v in inputs:
            values[v].consumers.append(index)
        read, n_read, written, n_written, _ = self.edges
        read.extend(inputs)
        n_read.append(len(inputs))
        written.extend(outs)
        n_written.append(len(outs))
        return outs

    def carry(self, loop: Loop, outs: list[int]) -> None:
        """Note the values `loop` feeds back into its next iteration (OpGraph.carried)."""
        for v in outs:
            self.carried[v] = (*self.carried.get(v, ()), loop.uid)

    def inline(self, jaxpr: Any, consts: list, in_ids: list[int], scope: _Scope,
               loops: tuple[Loop, ...]) -> list[int]:
        env: dict = {}
        for var in jaxpr.constvars:
            env[var] = self.new_value(var, "const")
        for var, vid in zip(jaxpr.invars, in_ids, strict=True):
            env[var] = vid
        self.walk(jaxpr, env, scope, loops)
        return [self.read(env, a) for a in jaxpr.outvars]

    def walk(self, jaxpr: Any, env: dict, scope: _Scope, loops: tuple[Loop, ...],
             top: bool = False) -> None:
        # the body of a top-level remat call: its leaf eqns are numbered on their ops (emission pins them
        # by re-binding the call with a constrained body)
        remat_body, self._remat_body = getattr(self, "_remat_body", False), False
        for k, eqn in enumerate(jaxpr.eqns):
            start = len(self.ops)
            full = scope.enter(jc.name_stack(eqn))
            name = eqn.primitive.name
            in_ids = [self.read(env, a) for a in eqn.invars]
            self._remat_body = top and name in _REMAT_CALLS
            outs = self._expand(eqn, name, in_ids, full, loops)
            self._remat_body = False
            if outs is None:
                params = _simple_params(name, eqn.params)
                # a container kept whole (shard_map, pallas_call, ...): say how big (a jaxpr can only
                # be among the params that are not plain data, which `params` leaves out)
                nested = jc.nested_eqn_count(eqn.params) if any(k not in params for k in eqn.params) else 0
                if nested:
                    params["nested_eqns"] = nested
                if eqn.effects:       # a callback, I/O: XLA keeps it whether or not its results are read
                    params["effectful"] = True
                outs = self.add_op(name, in_ids, list(eqn.outvars), full, loops, params,
                                   in_atoms=list(eqn.invars))
                if params.get("effectful"):
                    self.edges[4].append(len(self.ops) - 1)
                self.eqns[len(self.ops) - 1] = eqn
            for var, vid in zip(eqn.outvars, outs, strict=True):
                env[var] = vid
            if remat_body and len(self.ops) - start == 1 and self.ops[start].primitive == name:
                self.ops[start].remat_eqn = k
            if top:
                leaf = len(self.ops) - start == 1 and self.ops[start].primitive == name
                for op in self.ops[start:]:
                    op.top_eqn, op.nested = k, not leaf

    def _expand(self, eqn: Any, name: str, in_ids: list[int], scope: _Scope,
                loops: tuple[Loop, ...]) -> list[int] | None:
        params = eqn.params
        if name in _TRANSPARENT:
            for key in _TRANSPARENT[name]:
                sub = jc.as_open_jaxpr(params.get(key))
                if sub is not None and len(sub[0].invars) == len(in_ids) \
                        and len(sub[0].outvars) == len(eqn.outvars):
                    return self.inline(sub[0], sub[1], in_ids, scope, loops)
            return None
        if name == "scan":
            sub = jc.as_open_jaxpr(params["jaxpr"])
            loop = Loop(next(self._loop_ids), "scan", int(params["length"]))
            outs = self.inline(sub[0], sub[1], in_ids, scope, loops + (loop,))
            self.carry(loop, outs[:int(params["num_carry"])])
            return outs
        if name == "while":
            cn, bn = params["cond_nconsts"], params["body_nconsts"]
            loop = Loop(next(self._loop_ids), "while", None)
            carry = in_ids[cn + bn:]
            cond = jc.as_open_jaxpr(params["cond_jaxpr"])
            # the condition decides every iteration: live while the loop is
            self.carry(loop, self.inline(cond[0], cond[1], in_ids[:cn] + carry, scope, loops + (loop,)))
            body = jc.as_open_jaxpr(params["body_jaxpr"])
            outs = self.inline(body[0], body[1], in_ids[cn:cn + bn] + carry, scope, loops + (loop,))
            self.carry(loop, outs)
            return outs
        if name == "cond":
            branch_outs: list[int] = []
            for branch in params["branches"]:
                sub = jc.as_open_jaxpr(branch)
                branch_outs += self.inline(sub[0], sub[1], in_ids[1:], scope, loops)
            return self.add_op("cond", [in_ids[0], *branch_outs], list(eqn.outvars), scope,
                               loops, {"branches": len(params["branches"])})
        return None


def eqn_flops(eqn: Any, scope: str = "") -> float:
    """Forward flops of one jaxpr eqn as the OpGraph counts them: nested jaxprs (remat, custom
    derivatives, scan/while bodies, cond branches) expanded, loop bodies times their trip counts.
    The pipeline cut keeps such eqns whole and prices them with this, the planner's own lowering."""
    b = _Builder()
    in_ids = [b.new_value(a, "literal" if jc.is_literal(a) else "input") for a in eqn.invars]
    name = eqn.primitive.name
    if b._expand(eqn, name, in_ids, _Scope(scope, "", ()), ()) is None:
        b.add_op(name, in_ids, list(eqn.outvars), _Scope(scope, "", ()), (),
                 _simple_params(name, eqn.params), in_atoms=list(eqn.invars))
    return float(sum(op.flops * op.repeat for op in b.ops))


def flat_graph(prog: jc.FlatProgram) -> tuple[OpGraph, list[int]]:
    """The OpGraph of a flattened program (`compat.flatten_calls`) and, per op, the index of the flat
    eqn it comes from: eqns the flat program keeps whole (a custom_jvp, a scan) are expanded into
    their ops here, as `trace` does, so the core analyses (attention cores) see inside them."""
    b = _Builder()
    env: dict = {}
    inputs: list[int] = []
    owner: list[int] = []
    top = _Scope("", "", ())
    for e, fe in enumerate(prog.eqns):
        in_ids = []
        for key, atom in zip(fe.inputs, fe.eqn.invars, strict=True):
            if jc.is_literal(key):
                in_ids.append(b.new_value(atom, "literal"))
                continue
            if key not in env:
                env[key] = b.new_value(atom, "const" if key in prog.consts else "input")
                inputs.append(env[key])
            in_ids.append(env[key])
        name, scope = fe.eqn.primitive.name, top.enter(fe.scope)
        outs = b._expand(fe.eqn, name, in_ids, scope, ())
        if outs is None:
            outs = b.add_op(name, in_ids, list(fe.eqn.outvars), scope, (), _simple_params(name, fe.eqn.params),
                            in_atoms=list(fe.eqn.invars))
        owner.extend([e] * (len(b.ops) - len(owner)))
        env.update(zip(fe.outputs, outs, strict=True))
    outputs = [env[k] for k in prog.outputs if not jc.is_literal(k) and k in env]
    graph = OpGraph(ops=b.ops, values=b.values, inputs=inputs, outputs=outputs, output_keypaths=[""] * len(outputs),
                    output_keypath_parts=[()] * len(outputs), carried=b.carried, recorded_edges=b.edges)
    infer_phases(graph, ())
    return graph, owner


@dataclasses.dataclass(frozen=True)
class Traced:
    """One trace of a step, shared by everything that needs it: the OpGraph (planning and the
    fingerprint), the closed jaxpr it was built from (emission re-evaluates it with sharding
    constraints) and the output pytree structure (out shardings)."""

    graph: OpGraph
    closed: Any                     # jax.core.ClosedJaxpr
    out_tree: Any                   # PyTreeDef of the step's outputs


def trace(fn: Callable, *args: Any, name: str | None = None,
          optimizer_scopes: tuple[str, ...] = ("optimizer",), keep_eqns: bool = False) -> OpGraph:
    """Trace `fn(*args)` into an OpGraph.

    Args may be arrays or `jax.ShapeDtypeStruct`s (nothing is materialised, so a 175B-parameter
    step traces in host memory of its graph only). Ops carry primitive, shapes, dtypes, bytes,
    flops, module path, phase; program inputs carry their pytree keypaths. `keep_eqns=True` also
    keeps, in `graph.eqns`, the jaxpr equation of every leaf op (for profiling ops on a device).
    """
    return trace_step(fn, *args, name=name, optimizer_scopes=optimizer_scopes, keep_eqns=keep_eqns).graph


def trace_step(fn: Callable, *args: Any, name: str | None = None,
               optimizer_scopes: tuple[str, ...] = ("optimizer",), keep_eqns: bool = False) -> Traced:
    """`trace`, keeping the jaxpr and output structure with the graph (one `jax.make_jaxpr`)."""
    if not callable(fn):
        raise NotCallableError(
            f"autoshard.trace: the step function must be callable, got a "
            f"{type(fn).__qualname__} ({_short(fn)}). Pass the function itself, e.g. "
            "autoshard.trace(train_step, params, opt_state, batch).")
    check_args(args)
    fn_name = name or getattr(fn, "__qualname__", None) or type(fn).__qualname__
    with _gc_paused():
        closed, out_shape = make_jaxpr(fn, jc.untyped(args), fn_name)   # arrays on an Explicit mesh: as shapes
        closed = expose_fused(closed)       # fused q/k/v projections: heads splittable without moving activations
        graph = _build_graph(closed, out_shape, args, fn_name, keep_eqns)
        infer_phases(graph, optimizer_scopes)
        attribute_modules(graph)
        graph.table()                       # the ops as columns, once the graph is final (core.optable)
    return Traced(graph, closed, jax.tree_util.tree_structure(out_shape))


_PROMOTE_AFTER = 200_000   # objects left young by a paused trace: promote them in one collection


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Python's cyclic collector off while a step is traced: tracing allocates millions of
    long-lived objects, so the collector would repeatedly walk a growing heap and find little
    garbage (GPT-3 175B: ~10 full collections, 2.2 s of a 9.5 s trace). It runs again after; a
    large trace is first collected once, which moves its survivors to the oldest generation
    (otherwise each younger generation's next collection walks them all again)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
            if gc.get_count()[0] > _PROMOTE_AFTER:
                gc.collect()


def make_jaxpr(fn: Callable, args: tuple, fn_name: str) -> tuple[Any, Any]:
    try:
        return jax.make_jaxpr(fn, return_shape=True)(*args)
    except Exception as err:  # the user's error, chained below
        first = str(err).strip().splitlines()[0].rstrip(".") if str(err).strip() else ""
        raise TraceFailedError(
            f"autoshard.trace: tracing {fn_name}(...) with {len(args)} argument(s) raised "
            f"{type(err).__name__}: {first}. The error comes from the function (or from jax "
            "rejecting what it does with abstract values); the original exception is chained "
            "above. Fix it so that jax.make_jaxpr(fn)(*args) succeeds.") from err


def _build_graph(closed: Any, out_shape: Any, args: tuple, fn_name: str, keep_eqns: bool) -> OpGraph:
    """The OpGraph of a closed jaxpr (before phases and modules), inputs named by `args`' keypaths."""
    b = _Builder()
    in_paths = jax.tree_util.tree_flatten_with_path(args)[0]
    jaxpr = closed.jaxpr
    env: dict = {}
    for var in jaxpr.constvars:
        env[var] = b.new_value(var, "const")
    inputs: list[int] = []
    for var, (path, _) in zip(jaxpr.invars, in_paths, strict=True):
        vid = b.new_value(var, "input")
        b.values[vid].keypath = jc.keystr(path)
        b.values[vid].keypath_parts = jc.keypath_parts(path)
        env[var] = vid
        inputs.append(vid)
    b.walk(jaxpr, env, _Scope("", "", ()), (), top=True)
    outputs = [b.read(env, a) for a in jaxpr.outvars]
    out_paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(out_shape)[0]]
    graph = OpGraph(
        ops=b.ops, values=b.values, inputs=inputs, outputs=outputs,
        output_keypaths=[jc.keystr(p) for p in out_paths],
        output_keypath_parts=[jc.keypath_parts(p) for p in out_paths], name=fn_name, carried=b.carried,
        recorded_edges=b.edges,
    )
    if keep_eqns:
        graph.eqns = b.eqns
    return graph
