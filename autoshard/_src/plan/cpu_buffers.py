"""Buffers XLA:CPU holds across the backward pass that a GPU backend does not (pure: no jax import).

Two, both read off XLA:CPU's buffer assignment of compiled train steps (`bench/step_memory.py` on a
dump), both alive from the end of the forward to the backward op that last reads them:

- **Parameter copies.** A donated parameter's buffer is the updated parameter's: XLA's copy insertion
  orders the update after every read of the old value only where the data dependencies order it, and
  otherwise copies the parameter and lets the readers read the copy. A weight's backward read -- the
  activation gradient `dY @ W.T`, a convolution's backward-data pass, a norm's `dy * scale` -- is no
  ancestor of its own gradient, so the update is unordered with it unless something else orders it: a
  gradient reduction does (XLA's combiner puts the gradients' all-reduces into a few collectives after
  the backward pass, and every update waits for them). So a parameter whose gradient no collective
  reduces (a replicated batch: Megatron on one data replica) is copied, per device, from its first
  forward read to its last backward read. Buffer assignment then reuses what the copies vacate: a copy
  lives in the donated buffer an earlier copy of its size vacated, and each copied parameter's gradient
  in its own (the update overwrites it in place). A stack of equal layers so holds one copy in
  temporaries (Megatron MLP, 6 x [128, 1024] kernels per device: 524,288 B); a convolutional net whose
  kernels all differ holds every one (wide_classifier, Megatron on 8: 595 KB of copies in a 962 KB
  peak, its gradients in no temporary).
- **Reversed convolution kernels.** The backward-data convolution reads its kernel spatially reversed
  (jax's transpose rule: `rev` + swapped dimension numbers); XLA:CPU materialises that kernel
  (`copy_reverse_fusion`), and since it depends on the parameter alone the scheduler computes it early:
  it lives from about the forward's end to its convolution. XLA:GPU hands the kernel to cuDNN's
  backward-data convolution, which reads it in place. (A 1 x 1 kernel's transform is a transpose of its
  feature dims, which XLA:CPU's layout assignment folds into a parameter copy or computes late in the
  dumps: not counted.)
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import Any

from ..core.graph import OpGraph

# ops through which a parameter is read without a buffer of its own on the way to its readers
_VIEWS = frozenset({"convert_element_type", "transpose", "reshape", "broadcast_in_dim", "squeeze", "expand_dims",
                    "rev", "copy", "copy_p", "reduce_precision", "sharding_constraint"})
_CONVOLUTIONS = frozenset({"conv_general_dilated"})


@dataclasses.dataclass(frozen=True)
class BackwardStart:
    """What XLA:CPU holds at the backward's start beside the saved activations (`bytes` per device), and
    the largest gradient that needs a temporary of its own (per device) when some parameters are copied:
    a copied parameter's gradient is written into the buffer its copy vacated (the update then overwrites
    it in place), so only a gradient no collective reduces and of a parameter not copied (a first layer's
    kernel, a bias the backward never reads) takes one; None when nothing is copied."""
    bytes: float
    largest_gradient: float | None


def cpu_backward_start(plan: Any, graph: OpGraph) -> BackwardStart:
    """The copies of parameters whose update is not ordered after their backward reads, less those living
    in buffers earlier copies vacated, and the materialised reversed kernels of backward-data convolutions
    (module docstring). `plan`: a one-stage tensor plan of `graph` (its parameters' per-device bytes and
    gradient syncs)."""
    per_device = {p.keypath: float(p.bytes_per_device) for p in plan.params}
    sizes = dict(plan.mesh)
    reduced = {p.keypath for p in plan.params if _reduced(p.grad_sync, sizes)}
    params = {v: graph.values[v].keypath for v in graph.inputs
              if graph.values[v].role == "parameter" and graph.values[v].keypath in per_device}
    readers = {v: _readers(graph, v) for v in params}
    copies = [v for v in _unordered_parameters(graph, params, readers, reduced)
              if _read_across_backward(graph, readers[v])]
    held = _copies_beyond_vacated(per_device[params[v]] for v in copies)
    kernel_of = {c: v for v, rs in readers.items() for c in rs if _backward_data_convolution(graph, c, v)}
    held += sum(per_device[params[v]] for v in kernel_of.values())
    if not copies:
        return BackwardStart(held, None)
    copied = {params[v] for v in copies}
    alone = [b for kp, b in per_device.items() if kp not in copied and kp not in reduced]
    return BackwardStart(held, max(alone, default=0.0))


def _reduced(grad_sync: str, sizes: dict[str, int]) -> bool:
    """Does a collective sum the gradient (`ParamReport.grad_sync` names an axis of more than one device)?"""
    axes = [a for part in re.findall(r"over ([^ +]+)", grad_sync) for a in part.split(",")]
    return any(sizes.get(a, 1) > 1 for a in axes)


def _copies_beyond_vacated(copies: Iterable[float]) -> float:
    """The bytes of `copies` (per-device bytes each) the temporary allocation holds. Each copy vacates its
    parameter's donated buffer until the update writes it, and XLA's buffer assignment places a later
    value in an allocation it fits in whole (one value at a time, at offset 0), largest values first. In
    the compiled steps a copy takes the buffer vacated by an earlier copy of its own size (same-shaped
    layers rotate through each other's buffers: a Megatron MLP's six [128, 1024] kernels hold one copy in
    temporaries), while a larger vacated buffer goes to a larger value first -- its own parameter's
    reversed kernel or gradient -- (a CNN's head copy and a ResNet's 1 x 1 projection copy, each smaller
    than an earlier kernel, stay in temporaries). So one copy of each size is held."""
    return float(sum(set(copies)))


def _readers(graph: OpGraph, v: int) -> set[int]:
    """The ops reading parameter `v`, directly or through views (the views included)."""
    out: set[int] = set()
    todo = [v]
    while todo:
        for c in graph.values[todo.pop()].consumers:
            if c in out:
                continue
            out.add(c)
            op = graph.ops[c]
            if op.primitive in _VIEWS:
                todo.extend(op.outputs)
    return out


def _unordered_parameters(graph: OpGraph, params: dict[int, str], readers: dict[int, set[int]],
                          reduced: set[str]) -> list[int]:
    """The donated parameters some reader of which is no ancestor of the parameter's update (nor, for a
    parameter whose gradient is reduced, of any reduced gradient's update: the combined reduction orders
    them all)."""
    out_value = {kp: o for o, kp in zip(graph.outputs, graph.output_keypaths, strict=True)}
    donated = _donated_arguments(graph, set(out_value))
    bit: dict[int, int] = {}             # producing op of an update -> its parameters' bits
    index = {}
    for k, (v, kp) in enumerate(params.items()):
        o = out_value.get(kp)
        producer = graph.values[o].producer if o is not None else None
        if producer is None or o == v or _argument(kp) not in donated:
            continue                     # not returned, returned unchanged, or not donated: nothing overwrites it
        index[v] = k
        bit[producer] = bit.get(producer, 0) | (1 << k)
    if not index:
        return []
    # per op, the updates it is an ancestor of (ops are in program order, producers first)
    below = [0] * len(graph.ops)
    for i in range(len(graph.ops) - 1, -1, -1):
        acc = bit.get(i, 0)
        for o in graph.ops[i].outputs:
            for c in graph.values[o].consumers:
                acc |= below[c]
        below[i] = acc
    reduced_bits = sum(1 << k for v, k in index.items() if params[v] in reduced)
    out = []
    for v, k in index.items():
        mine = 1 << k
        waits = reduced_bits if mine & reduced_bits else mine
        if any(not below[c] & waits for c in readers[v]):
            out.append(v)
    return out


def _argument(keypath: str) -> int | None:
    """The positional argument a flat input's keypath ("[0]['params']...") belongs to."""
    m = re.match(r"\[(\d+)\]", keypath or "")
    return int(m.group(1)) if m else None


def _donated_arguments(graph: OpGraph, returned: set[str]) -> set[int | None]:
    """The arguments the compiled step donates: those all of whose leaves it returns (emission's rule,
    `bridge.emit.emit.donated_argnums`), so XLA aliases their buffers with the results."""
    leaves: dict[int | None, list[str]] = {}
    for v in graph.inputs:
        kp = graph.values[v].keypath or ""
        leaves.setdefault(_argument(kp), []).append(kp)
    return {a for a, kps in leaves.items() if a is not None and all(kp in returned for kp in kps)}


def _read_across_backward(graph: OpGraph, readers: set[int]) -> bool:
    """Is the parameter read both in the forward and in the backward (its copy then lives across the
    backward's start)?"""
    phases = {graph.ops[c].phase for c in readers}
    return "forward" in phases and "backward" in phases


def _backward_data_convolution(graph: OpGraph, c: int, param: int) -> bool:
    """Is op `c` a backward convolution reading parameter `param` as its kernel (rhs), spatially reversed
    (a window wider than one element: a 1 x 1 kernel's transform is a transpose of its feature dims, which
    XLA:CPU's layout assignment folds into a parameter copy or computes late, so it is not counted)?"""
    op = graph.ops[c]
    if op.primitive not in _CONVOLUTIONS or op.phase != "backward" or len(op.inputs) < 2:
        return False
    v, reversed_ = op.inputs[1], False
    while v != param:
        producer = graph.values[v].producer
        if producer is None or graph.ops[producer].primitive not in _VIEWS:
            return False
        view = graph.ops[producer]
        if view.primitive == "rev":
            reversed_ |= any(view.in_shapes[0][d] > 1 for d in view.params.get("dimensions", ()))
        v = view.inputs[0]
    return reversed_
