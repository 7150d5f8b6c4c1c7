"""How the loss combines the samples of its batch, so that a pipeline computes it exactly on every batch.

A pipeline runs the loss once per chunk of the batch (micro-batch x data-parallel replica) and
averages the chunks. That is the one-device loss only when the loss is linear in sums over samples
(a mean, a sum); a normaliser computed from the batch, as in sum(ce * mask) / sum(mask), differs
from chunk to chunk, so checking one batch proves nothing about the next (a mask of all ones passes,
a padded batch trains wrong). Instead the loss is traced at the chunk size and at the full batch
size: a value whose shape changes carries the batch axis, and an eqn that reads one and makes a
value that does not combines samples. Such an eqn is

* batch-only (no parameter upstream: sum(mask), a token count): its value on the whole batch is
  computed before the pipeline and replaces the chunk's own value in every stage (`LossForm.globals`);
* an additive reduction (reduce_sum, dot_general over the batch axis) of parameter-dependent values:
  scaled by the chunk count, each chunk's estimate of the whole batch's sum;
* anything else (a max over samples, one sample picked): the loss is not exact.

Literals and constants that depend on the batch size (jnp.mean's divisor) take their full-batch
values. Each chunk then computes the one-device loss with its sums replaced by estimates; when the
loss is affine in those sums (checked eqn by eqn downstream of them, `inexact` says where it is
not) the mean over chunks is the one-device loss and its gradient, whatever the batch holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ...core.errors import PipelineError
from .. import compat as jc
from ..emit.remat import run_eqns

ADDITIVE = frozenset({"reduce_sum", "dot_general"})
# eqns jointly linear in their inputs; `_LINEAR_IN` lists the others: (positions that may carry a
# sum estimate, or None: any one of them)
LINEAR = frozenset({"add", "add_any", "sub", "neg", "convert_element_type", "reduce_sum", "broadcast_in_dim",
                    "reshape", "squeeze", "expand_dims", "transpose", "copy", "copy_p", "concatenate", "slice",
                    "reduce_precision", "cumsum", "real", "imag"})
_LINEAR_IN: dict[str, frozenset[int] | None] = {"mul": None, "dot_general": None, "div": frozenset({0}),
                                                "select_n": None, "dynamic_slice": frozenset({0}),
                                                "dynamic_update_slice": frozenset({0, 1}), "pad": frozenset({0, 1})}


@dataclasses.dataclass(frozen=True)
class LossForm:
    """The loss as each chunk computes it (see the module docstring)."""

    chunks: int                      # chunks per batch (micro-batches x data-parallel replicas)
    batch_size: int                  # the whole batch the loss was cut for
    prog: Any = dataclasses.field(repr=False)    # the chunk program, batch-size literals at full-batch values
    stats: tuple[Any, ...]           # batch-only values combining samples: full-batch values replace them
    scaled: frozenset                # parameter-dependent sums over samples: scaled by `chunks`
    full: Any = dataclasses.field(repr=False)    # the program traced at the whole batch
    full_order: tuple[int, ...]      # its eqns computing `stats`
    n_params: int
    inexact: str                     # why the chunks' mean is not the loss ("": it is)

    def globals(self, batch: Any) -> tuple:
        """`stats` on the whole `batch`, each broadcast to [batch, ...] so it is micro-batched with it."""
        leaves = jax.tree.leaves(batch)
        sizes = sorted({x.shape[0] for x in leaves if getattr(x, "shape", ())})
        if sizes != [self.batch_size]:
            raise PipelineError(
                f"autoshard.pipelined: the loss was cut for a batch of {self.batch_size} samples (its normaliser is "
                f"computed on the whole batch); got leading dimensions {sizes}. Fix: cut it again "
                "(autoshard.pipelined) with an example batch of the size you train on.")
        env: dict = dict(self.full.consts)
        env.update(zip(self.full.inputs[self.n_params:], leaves, strict=True))
        run_eqns(self.full, self.full_order, env, [None] * len(self.full.eqns), "none", set())
        return tuple(jnp.broadcast_to(env[k], (self.batch_size, *jnp.shape(env[k]))) for k in self.stats)

    def after(self, rows: tuple) -> Callable[[int, list], list]:
        """run_eqns' `after` hook for one chunk: `rows[i]` (stats[i] on the whole batch) replaces the
        chunk's own value; sums over samples are scaled to the whole batch."""
        where = {k: i for i, k in enumerate(self.stats)}
        chunks = self.chunks

        def hook(e: int, outs: list) -> list:
            keys = self.prog.eqns[e].outputs
            if not any(k in where or k in self.scaled for k in keys):
                return outs
            outs = list(outs)
            for j, k in enumerate(keys):
                if k in where:
                    outs[j] = jnp.asarray(rows[where[k]], outs[j].dtype)
                elif k in self.scaled:
                    outs[j] = outs[j] * jnp.asarray(chunks, outs[j].dtype)
            return outs
        return hook

    def chunk_loss(self, p_leaves: list, b_leaves: list, rows: tuple) -> Any:
        """One chunk's loss as the pipeline's stages compute it (the check on the example batch)."""
        env: dict = dict(self.prog.consts)
        env.update(zip(self.prog.inputs, [*p_leaves, *b_leaves], strict=True))
        out = self.prog.outputs[0]
        run_eqns(self.prog, range(len(self.prog.eqns)), env, [None] * len(self.prog.eqns), "none",
                 set() if jc.is_literal(out) else {out}, after=self.after(rows))
        return out.val if jc.is_literal(out) else env[out]


def value_avals(prog: Any, closed: Any) -> dict[Any, Any]:
    """Value key -> aval of a flattened program's inputs and eqn outputs."""
    out: dict[Any, Any] = dict(zip(prog.inputs, closed.in_avals, strict=True))
    for fe in prog.eqns:
        for k, var in zip(fe.outputs, fe.eqn.outvars, strict=True):
            out[k] = var.aval
    return out


def loss_form(loss_fn: Callable, params: Any, batch: Any, prog: Any, closed: Any, mb: int, B: int,
              strict: bool) -> LossForm | None:
    """How `loss_fn` (flattened at the chunk size `mb` as `prog`) combines the `B` samples of `batch`;
    None when the batch is one chunk, or (not `strict`) when the loss traces differently at size B."""
    n_params = len(jax.tree.leaves(params))
    if B == mb:
        return None
    full_closed, why = _trace_full(loss_fn, params, batch)
    full = jc.flatten_calls(full_closed) if full_closed is not None else None
    why = why or _structure_differs(prog, full)
    if why:
        if not strict:
            return None
        raise PipelineError(
            f"autoshard.pipelined: the loss cannot be checked for micro-batching: traced at the micro-batch size "
            f"{mb} and at the batch size {B} it {why}, so how it combines samples is unknown. Fix: make the loss "
            "trace the same at every batch size (no Python branches on the batch's shape), or pass "
            "check_loss=False to train on the mean of the per-chunk losses instead of the one-device loss.")
    chunk_avals, full_avals = value_avals(prog, closed), value_avals(full, full_closed)
    batched = {k for k, a in chunk_avals.items() if a.shape != full_avals[k].shape}
    batched |= {k for k, v in prog.consts.items() if np.shape(v) != np.shape(full.consts[k])}
    stats, scaled, inexact = _classify(prog, set(prog.inputs[:n_params]), batched)
    return LossForm(B // mb, B, _at_full_size(prog, full, batched), tuple(stats), frozenset(scaled), full,
                    _producers(full, stats), n_params, inexact)


def _trace_full(loss_fn: Callable, params: Any, batch: Any) -> tuple[Any, str]:
    p_struct = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    b_struct = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
    try:
        return jax.make_jaxpr(loss_fn)(p_struct, b_struct), ""
    except Exception as e:
        return None, f"fails at the batch size ({type(e).__name__}: {str(e)[:200]})"


def _structure_differs(prog: Any, full: Any) -> str:
    """'' when both traces run the same eqns on the same values (the key counter is deterministic)."""
    if full is None:
        return ""
    if len(prog.eqns) != len(full.eqns) or set(prog.consts) != set(full.consts) or prog.inputs != full.inputs:
        return f"runs different programs ({len(prog.eqns)} vs {len(full.eqns)} eqns)"
    for e, (a, b) in enumerate(zip(prog.eqns, full.eqns, strict=True)):
        same_ins = [jc.is_literal(x) == jc.is_literal(y) and (jc.is_literal(x) or x == y)
                    for x, y in zip(a.inputs, b.inputs, strict=False)]
        if (a.eqn.primitive is not b.eqn.primitive or len(a.inputs) != len(b.inputs) or not all(same_ins)
                or a.outputs != b.outputs):
            return f"runs different programs from eqn {e} ('{a.eqn.primitive.name}' in {a.scope or 'the loss'})"
    if [jc.is_literal(k) or k for k in prog.outputs] != [jc.is_literal(k) or k for k in full.outputs]:
        return "returns different values"
    return ""


def _classify(prog: Any, param_keys: set, batched: set) -> tuple[list, set, str]:
    """(batch-only values combining samples, parameter-dependent sums over samples, the first reason the
    loss is not affine in those sums or '')."""
    dependent = set(param_keys)          # values with a parameter upstream
    estimates: set = set()               # values depending on a scaled sum
    stats: list = []
    scaled: set = set()
    inexact = ""
    for fe in prog.eqns:
        name = fe.eqn.primitive.name
        ins = [k for k in fe.inputs if not jc.is_literal(k)]
        if any(k in dependent for k in ins):
            dependent.update(fe.outputs)
        where = f"'{name}' in {fe.scope or 'the loss'}"
        carried = [i for i, k in enumerate(fe.inputs) if not jc.is_literal(k) and k in estimates]
        linear = name in LINEAR or _linear_in(name, carried)
        combines = any(k in batched for k in ins) and any(k not in batched for k in fe.outputs)
        if combines and not any(k in dependent for k in fe.outputs):
            stats.extend(k for k in fe.outputs if k not in batched)
        elif combines and name in ADDITIVE and (not carried or linear):
            scaled.update(fe.outputs)
            estimates.update(fe.outputs)
        elif combines:
            inexact = inexact or f"{where} combines the samples of the batch other than by a sum"
        elif carried and linear:
            estimates.update(fe.outputs)
        elif carried:
            inexact = inexact or f"{where} is not linear in a sum over the samples"
    return stats, scaled, inexact


def _linear_in(name: str, carried: list[int]) -> bool:
    if name not in _LINEAR_IN:
        return False
    allowed = _LINEAR_IN[name]
    if allowed is None:
        return len(carried) <= 1 and (name != "select_n" or 0 not in carried)
    return set(carried) <= allowed


def _at_full_size(prog: Any, full: Any, batched: set) -> Any:
    """`prog` with the literals and unbatched constants that depend on the batch size (jnp.mean's
    divisor) at their full-batch values."""
    eqns = []
    for a, b in zip(prog.eqns, full.eqns, strict=True):
        ins = tuple(y if jc.is_literal(x) and not _same(x.val, y.val) else x
                    for x, y in zip(a.inputs, b.inputs, strict=True))
        eqns.append(a if ins == a.inputs else a._replace(inputs=ins))
    consts = {k: full.consts[k] if k not in batched and not _same(v, full.consts[k]) else v
              for k, v in prog.consts.items()}
    return prog._replace(eqns=eqns, consts=consts)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, jax.core.Tracer) or isinstance(b, jax.core.Tracer):
        return True           # closed-over traced values: the same value in both traces
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(a, b, equal_nan=True))


def _producers(prog: Any, keys: list) -> tuple[int, ...]:
    """The eqns (program order) computing `keys`."""
    producer = {k: e for e, fe in enumerate(prog.eqns) for k in fe.outputs}
    want, chosen = set(keys), set()
    for e in range(len(prog.eqns) - 1, -1, -1):
        if any(k in want for k in prog.eqns[e].outputs):
            chosen.add(e)
            want.update(k for k in prog.eqns[e].inputs if not jc.is_literal(k) and k in producer)
    return tuple(sorted(chosen))
