"""Emit an inference partition as a jax program (bridge: imports jax).

Two forms, both numerically the single-device function:

- `constrained_program`: every layer's output gets a sharding constraint on its split dim (replicated
  where the plan says so) and XLA's SPMD partitioner inserts the exchanges itself: collective-permutes
  of the halos for a convolution split along H or W, all-gathers where a split changes direction.
  Used when every split is even, the nodes equal and nothing fused: the form XLA compiles best.
- `explicit_program`: one `shard_map` over the nodes, each node computing its slab of every layer
  (`local.py`) from operands it assembles itself: rows it holds, rows it receives from their owners
  by `ppermute` (only what the graph optimiser keeps, §3.3), and padding. Uneven and heterogeneous
  splits (equal slab lengths, a node ignoring the rows past its part) and fused runs (a run's layers
  computed on grown slabs; only the run's head receives) need it.

Assembling an operand: the node's receive buffer is its own rows plus one piece per source node
(equal-length pieces per source offset, one `ppermute` each), then one gather with a static table
per node picks each needed row from the buffer, or the fill value for rows outside the tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ...core.errors import PlanError
from ...core.layers import Layer
from ...core.shapemap import Split, direction_axis
from .. import compat as jc
from .local import Cut, LocalRule, Need, Slab, local_rule
from .trace import TracedInference

# ---- layouts: which rows of a tensor each node holds ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
    """A value held as `slab` on each node (None: whole everywhere); `owned` rows are each node's part
    (fetched from it by others), `valid` the rows it holds correctly (its part, or a fused run's grown
    slab clipped to the tensor)."""

    slab: Slab | None
    size: int = 0
    owned: tuple[tuple[int, int], ...] = ()
    valid: tuple[tuple[int, int], ...] = ()


def split_slab(shape: Sequence[int], split: Split) -> tuple[Slab | None, tuple[tuple[int, int], ...]]:
    """The slab (max-part rows from each part's start) and parts of `split` on a tensor of `shape`."""
    if split.direction is None:
        return None, ()
    axis = direction_axis(split.direction, len(shape))
    sizes = split.sizes(shape)
    starts = tuple(int(v) for v in np.cumsum([0, *sizes[:-1]]))
    parts = tuple((s, s + m) for s, m in zip(starts, sizes, strict=True))
    return Slab(axis, starts, max(sizes), tuple(sizes)), parts


def split_layout(shape: Sequence[int], split: Split) -> Layout:
    slab, parts = split_slab(shape, split)
    if slab is None:
        return Layout(None)
    return Layout(slab, shape[slab.axis], parts, parts)


def grown_layout(slab: Slab, size: int, parts: tuple[tuple[int, int], ...]) -> Layout:
    """A fused run's inner layer: computed on a grown slab, correct where it lies inside the tensor."""
    valid = tuple((max(s, 0), min(s + c, size)) for s, c in zip(slab.starts, slab.counts, strict=True))
    return Layout(slab, size, parts, valid)


# ---- gathers with static per-node tables ------------------------------------------------------------------


def _take(x: jax.Array, axis: int, table: np.ndarray, fill: float, me: jax.Array) -> jax.Array:
    """Rows table[me] of x along axis (-1: the fill value). Equal rows on every node: a static slice."""
    table = np.asarray(table, dtype=np.int64)
    if (table >= 0).all() and (table == table[0]).all() and (np.diff(table[0]) == 1).all():
        return jax.lax.slice_in_dim(x, int(table[0, 0]), int(table[0, -1]) + 1, axis=axis)
    if (table < 0).any():
        pad_shape = list(x.shape)
        pad_shape[axis] = 1
        x = jnp.concatenate([x, jnp.full(pad_shape, fill, x.dtype)], axis)
    index = np.where(table < 0, x.shape[axis] - 1, table).astype(np.int32)
    return jnp.take(x, jnp.asarray(index)[me], axis=axis, mode="clip")


def _rows_table(slab: Slab, size: int) -> np.ndarray:
    """[node][row] global row of each slab row, -1 outside the tensor or past the rows that matter."""
    rows = np.asarray(slab.starts)[:, None] + np.arange(slab.length)[None, :]
    matters = np.arange(slab.length)[None, :] < np.asarray(slab.counts)[:, None]
    return np.where((rows >= 0) & (rows < size) & matters, rows, -1)


class Assembler:
    """Builds each node's operands inside the shard_map over `axis_name` (`n` nodes)."""

    def __init__(self, axis_name: str, n: int) -> None:
        self.axis_name, self.n = axis_name, n
        self.me = jax.lax.axis_index(axis_name)

    def acquire(self, x: jax.Array, layout: Layout, need: Need, shape: Sequence[int]) -> jax.Array:
        """`need` of a value of global `shape` held per `layout`."""
        if layout.slab is None:
            if need.slab is None:
                return x
            return _take(x, need.slab.axis, _rows_table(need.slab, shape[need.slab.axis]), need.fill, self.me)
        if need.slab is not None and need.slab.axis == layout.slab.axis:
            return self._halo(x, layout, need)
        return self._gather(x, layout, need, shape)

    def _send(self, piece: jax.Array, shift: int, senders: Sequence[int]) -> jax.Array:
        perm = [(j, (j + shift) % self.n) for j in senders]
        return jax.lax.ppermute(piece, self.axis_name, perm)

    def _halo(self, x: jax.Array, layout: Layout, need: Need) -> jax.Array:
        """Same axis: own rows locally, the rest from their owners (Fig. 5 b/e; nothing when c/d)."""
        held, n, axis = layout.slab, self.n, layout.slab.axis
        assert held is not None and need.slab is not None
        rows = _rows_table(need.slab, layout.size)
        where = np.full(rows.shape, -1, dtype=np.int64)       # position in [own, piece 1, piece 2, ...]
        spans: dict[int, dict[int, tuple[int, int]]] = {}     # shift -> sender -> rows (lo, hi) it sends
        for i in range(n):
            lo_v, hi_v = layout.valid[i]
            for r, g in enumerate(rows[i]):
                if g < 0:
                    continue
                if lo_v <= g < hi_v:
                    where[i, r] = g - held.starts[i]
                    continue
                j = next(j for j, (a, b) in enumerate(layout.owned) if a <= g < b)
                span = spans.setdefault((i - j) % n, {}).setdefault(j, (g, g + 1))
                spans[(i - j) % n][j] = (min(span[0], g), max(span[1], g + 1))
        pieces, offset = [x], held.length
        for shift in sorted(spans):
            senders = spans[shift]
            length = max(b - a for a, b in senders.values())
            send = np.zeros((n, length), dtype=np.int64)
            for j, (a, _) in senders.items():
                send[j] = np.clip(np.arange(a, a + length) - held.starts[j], 0, held.length - 1)
            pieces.append(self._send(_take(x, axis, send, 0.0, self.me), shift, sorted(senders)))
            for j, (a, _) in senders.items():
                i = (j + shift) % n
                for r, g in enumerate(rows[i]):
                    owner = layout.owned[j][0] <= g < layout.owned[j][1]
                    if where[i, r] < 0 and g >= 0 and a <= g < a + length and owner:
                        where[i, r] = offset + g - a
            offset += length
        missing = (rows >= 0) & (where < 0)
        if missing.any():
            raise PlanError(f"autoshard (inference): internal error, rows {np.argwhere(missing)[:4].tolist()} of an "
                            "operand have no owner; please report the model.")
        buffer = jnp.concatenate(pieces, axis) if len(pieces) > 1 else x
        return _take(buffer, axis, where, need.fill, self.me)

    def _gather(self, x: jax.Array, layout: Layout, need: Need, shape: Sequence[int]) -> jax.Array:
        """Another axis (or the whole tensor): every owner sends its part, cut to the receiver's need."""
        held, n, axis = layout.slab, self.n, layout.slab.axis
        assert held is not None
        width = max(b - a for a, b in layout.owned)
        own = np.stack([np.clip(np.arange(a, a + width) - s, 0, held.length - 1)
                        for (a, _), s in zip(layout.owned, held.starts, strict=True)])
        part = _take(x, axis, own, 0.0, self.me)                  # [part rows padded to width]
        needed = None if need.slab is None else _rows_table(need.slab, shape[need.slab.axis])
        pieces = []
        for shift in range(n):
            piece = part
            if needed is not None:                                  # cut to what receiver (me + shift) needs
                piece = _take(piece, need.slab.axis, np.roll(needed, -shift, axis=0), need.fill, self.me)
            pieces.append(piece if shift == 0 else self._send(piece, shift, range(n)))
        where = np.zeros((n, layout.size), dtype=np.int64)
        for i in range(n):
            for j, (a, b) in enumerate(layout.owned):
                where[i, a:b] = ((i - j) % n) * width + np.arange(b - a)
        return _take(jnp.concatenate(pieces, axis), axis, where, 0.0, self.me)


SCOPE = "bbgrap."


def scope_of(layer_name: str) -> str:
    """The name scope a layer's ops (and the collectives feeding it) carry in the compiled program."""
    return SCOPE + layer_name.replace(":", "_")


def layer_of_op(op_name: str) -> str | None:
    """The layer name in a compiled op's metadata (`scope_of` reversed), or None."""
    at = op_name.rfind(SCOPE)
    if at < 0:
        return None
    word = op_name[at + len(SCOPE):].split("/")[0]
    return word.replace("_", ":", 1)


# ---- the explicit program ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LayerStep:
    layer: Layer
    slab: Slab | None           # the node's part of the output it computes
    layout: Layout              # how the output is then held
    rule: LocalRule | None      # None: compute the whole layer, keep the slab


def plan_steps(traced: TracedInference, directions: Mapping[str, str | None], fused: Sequence[Sequence[str]],
               n: int, weights: Sequence[float] | None) -> dict[str, LayerStep | Layout]:
    """Per layer: its input layout (graph inputs) or the step computing it. A fused run's inner layers
    compute the slab the next layer of the run reads (required_input backwards, in padded rows)."""
    prog = traced.program
    index = {name: e for e, name in traced.eqn_layers.items()}
    inner = {name: run for run in fused for name in run[:-1]}
    out: dict[str, LayerStep | Layout] = {}
    for layer in reversed(traced.layers):
        split = Split(directions[layer.name], n, tuple(weights) if weights else None)
        if layer.kind == "input":
            out[layer.name] = split_layout(layer.output_shape, split)
            continue
        eqn = prog.eqns[index[layer.name]].eqn
        acts = tuple(not jc.is_literal(a) and _is_act(traced, a) for a in prog.eqns[index[layer.name]].inputs)
        slab, parts = split_slab(layer.output_shape, split)
        layout = split_layout(layer.output_shape, split)
        if layer.name in inner:
            run = inner[layer.name]
            nxt = out[run[run.index(layer.name) + 1]]
            need = nxt.rule.operands[0] if isinstance(nxt, LayerStep) and nxt.rule is not None else None
            if not isinstance(need, Need) or need.slab is None:
                raise PlanError(f"autoshard (inference): layer {nxt.layer.name} ({nxt.layer.kind}) of fused run "
                                f"{list(run)} cannot compute its part from a grown slab of {layer.name}; plan with "
                                "max_fuse=1.")
            slab = need.slab
            layout = grown_layout(slab, layer.output_shape[slab.axis], parts)
        rule = local_rule(layer, eqn, slab, acts)
        if layer.name in inner and rule is None:
            raise PlanError(f"autoshard (inference): layer {layer.name} ({layer.kind}) cannot compute a grown slab "
                            "for its fused run; plan with max_fuse=1.")
        out[layer.name] = LayerStep(layer, slab, layout, rule)
    return out


def _is_act(traced: TracedInference, key: Any) -> bool:
    return key in traced.input_keys or key in traced.act_keys


def explicit_program(traced: TracedInference, directions: Mapping[str, str | None], fused: Sequence[Sequence[str]],
                     mesh: jax.sharding.Mesh, weights: Sequence[float] | None) -> Callable:
    """fn(*args) -> result: the partition as one shard_map over the mesh's single axis."""
    (axis_name,), n = mesh.axis_names, mesh.size
    steps = plan_steps(traced, directions, fused, n, weights)
    prog, by_name = traced.program, traced.by_name

    def body(*flat):
        asm = Assembler(axis_name, n)
        env = dict(prog.consts)
        env.update(zip(prog.inputs, flat, strict=True))
        layouts: dict[Any, Layout] = {}
        shapes: dict[Any, tuple[int, ...]] = {}
        for key, name in traced.input_keys.items():
            layout = steps[name]
            layer = by_name[name]
            if layout.slab is not None:
                env[key] = _take(env[key], layout.slab.axis, _rows_table(layout.slab, layer.output_shape[
                    layout.slab.axis]), 0.0, asm.me)
            layouts[key], shapes[key] = layout, layer.output_shape
        for e, fe in enumerate(prog.eqns):
            ins = [a.val if jc.is_literal(a) else env[a] for a in fe.inputs]
            if e not in traced.eqn_layers:
                outs = jc.bind_eqn(fe.eqn, ins)
            else:
                step = steps[traced.eqn_layers[e]]
                with jax.named_scope(scope_of(step.layer.name)):
                    outs = [_run_step(asm, step, fe, ins, layouts, shapes)]
                layouts[fe.outputs[0]], shapes[fe.outputs[0]] = step.layout, step.layer.output_shape
            env.update(zip(fe.outputs, outs, strict=True))
        results = []
        for a in prog.outputs:
            value = a.val if jc.is_literal(a) else env[a]
            if not jc.is_literal(a) and a in layouts and layouts[a].slab is not None:
                with jax.named_scope(SCOPE + "output"):
                    value = asm.acquire(value, layouts[a], Need(None), shapes[a])
            results.append(value)
        return tuple(results)

    spec = PartitionSpec()
    mapped = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)

    def run(*args):
        flat = jax.tree.leaves(args)
        return jax.tree.unflatten(traced.out_tree, list(mapped(*flat)))

    return run


def _run_step(asm: Assembler, step: LayerStep, fe: Any, ins: list, layouts: Mapping[Any, Layout],
              shapes: Mapping[Any, tuple[int, ...]]) -> jax.Array:
    """The node's slab of one layer's output."""
    layer, rule = step.layer, step.rule
    if rule is not None:
        local = []
        for key, value, how in zip(fe.inputs, ins, rule.operands, strict=True):
            if isinstance(how, Need):
                local.append(asm.acquire(value, layouts[key], how, shapes[key]))
            elif isinstance(how, Cut):
                local.append(_take(value, how.axis, np.clip(_rows_table(how.slab, value.shape[how.axis]), 0, None),
                                   0.0, asm.me))
            else:
                local.append(value)
        return _bind_local(fe.eqn, local, rule.params, layer.output_shape, step.slab)
    whole = [asm.acquire(v, layouts[k], Need(None), shapes[k]) if not jc.is_literal(k) and k in layouts else v
             for k, v in zip(fe.inputs, ins, strict=True)]
    out = jc.bind_eqn(fe.eqn, whole)[0]
    if step.slab is None:
        return out
    return _take(out, step.slab.axis, _rows_table(step.slab, layer.output_shape[step.slab.axis]), 0.0, asm.me)


_CALLS = {"custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr", "pjit": "jaxpr", "jit": "jaxpr",
          "closed_call": "call_jaxpr", "checkpoint": "jaxpr", "remat": "jaxpr"}


def _bind_local(eqn: Any, ins: list, params: dict, full: tuple[int, ...], slab: Slab) -> jax.Array:
    """Bind eqn with `params` on local operands; a call (relu is a custom_jvp call) runs its body with
    every full-output-shaped `shape` param made local (inference needs no derivative rules)."""
    local = tuple(slab.length if a == slab.axis else s for a, s in enumerate(full))
    sub = jc.as_open_jaxpr(params.get(_CALLS.get(eqn.primitive.name, ""), None))
    if sub is None:
        return jc.bind_eqn(eqn.replace(params=params), ins)[0]
    jaxpr, consts = sub
    env = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, ins, strict=True))
    read = lambda v: v.val if jc.is_literal(v) else env[v]   # noqa: E731
    for inner in jaxpr.eqns:
        p = dict(inner.params)
        if tuple(p.get("shape", ())) == full:
            p["shape"] = local
        args = [read(v) for v in inner.invars]
        outs = ([_bind_local(inner, args, p, full, slab)] if inner.primitive.name in _CALLS
                else jc.bind_eqn(inner.replace(params=p), args))
        env.update(zip(inner.outvars, outs, strict=True))
    return read(jaxpr.outvars[0])


# ---- the constrained program -------------------------------------------------------------------------------


def spec_of(direction: str | None, rank: int, axis_name: str) -> PartitionSpec:
    if direction is None:
        return PartitionSpec()
    parts: list[Any] = [None] * rank
    parts[direction_axis(direction, rank)] = axis_name
    return PartitionSpec(*parts)


def constrained_program(traced: TracedInference, directions: Mapping[str, str | None],
                        mesh: jax.sharding.Mesh) -> Callable:
    """fn(*args) -> result with each layer's output constrained to its split (XLA inserts the exchanges)."""
    (axis_name,) = mesh.axis_names
    prog, by_name = traced.program, traced.by_name

    def place(value: jax.Array, name: str) -> jax.Array:
        spec = spec_of(directions[name], len(by_name[name].output_shape), axis_name)
        return jax.lax.with_sharding_constraint(value, NamedSharding(mesh, spec))

    def run(*args):
        env = dict(prog.consts)
        env.update(zip(prog.inputs, jax.tree.leaves(args), strict=True))
        for key, name in traced.input_keys.items():
            env[key] = place(env[key], name)
        for e, fe in enumerate(prog.eqns):
            ins = [a.val if jc.is_literal(a) else env[a] for a in fe.inputs]
            if e not in traced.eqn_layers:
                outs = jc.bind_eqn(fe.eqn, ins)
            else:
                with jax.named_scope(scope_of(traced.eqn_layers[e])):
                    outs = jc.bind_eqn(fe.eqn, ins)
                    outs = [place(outs[0], traced.eqn_layers[e]), *outs[1:]]
            env.update(zip(fe.outputs, outs, strict=True))
        return jax.tree.unflatten(traced.out_tree, [a.val if jc.is_literal(a) else env[a] for a in prog.outputs])

    return run
