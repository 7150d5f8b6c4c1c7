"""The loss as users write it, as `loss_fn(params, batch)` for the pipeline cut.

A pipelined step cuts and micro-batches a function of (parameters, batch). Users write
`jax.value_and_grad(lambda p: loss(p, batch))(params)`, a nested `def loss(p)` reading `batch`
from the enclosing step, `value_and_grad(loss, argnums=1)(rng, params, batch)` or
`has_aux=True`. `LossCall` turns any of those calls into that form: the differentiated
argument(s) are the parameters; the batch is every array leaf with the step's batch size as
leading dimension among the other arguments and the values the function closes over (closure
cells, `functools.partial` arguments); everything else stays as it is. `rebuild` calls the user's
function again with a micro-batch in place of those leaves (a fresh function object on the same
code with new closure cells: the user's function is never modified).
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ...core.errors import PlanError


def _opaque(x: Any) -> bool:
    """Only plain containers are searched for batch arrays: a model object, optimizer or config the
    loss closes over stays whole (its parameters are never mistaken for the batch)."""
    return not isinstance(x, (dict, list, tuple)) or isinstance(x, jax.Array)


def _is_batch_leaf(x: Any, batch_size: int) -> bool:
    shape = getattr(x, "shape", None)
    return shape is not None and len(shape) >= 1 and shape[0] == batch_size and hasattr(x, "dtype")


@dataclasses.dataclass
class LossCall:
    """One `value_and_grad(fun, argnums, has_aux)(*args)` call, split into parameters and batch."""

    fun: Callable
    args: tuple
    argnums: int | tuple[int, ...]
    has_aux: bool
    batch_size: int

    def __post_init__(self) -> None:
        nums = (self.argnums,) if isinstance(self.argnums, int) else tuple(self.argnums)
        if not nums or any(not isinstance(i, int) or not -len(self.args) <= i < len(self.args) for i in nums):
            raise PlanError(f"autoshard.value_and_grad: argnums={self.argnums!r} does not index the "
                            f"{len(self.args)} argument(s) the loss was called with.")
        self._nums = tuple(i % len(self.args) for i in nums)
        # the places batch leaves can come from: the other arguments and the closed-over values
        self._cells, self._base = _closure(self.fun)
        others = [a for i, a in enumerate(self.args) if i not in self._nums]
        leaves, self._treedef = jax.tree.flatten((others, list(self._cells)), is_leaf=_opaque)
        self._is_batch = [_is_batch_leaf(x, self.batch_size) for x in leaves]
        self._fixed = [None if b else x for x, b in zip(leaves, self._is_batch, strict=True)]
        if not any(self._is_batch):
            raise PlanError(
                f"autoshard.value_and_grad: the pipelined loss {getattr(self.fun, '__name__', self.fun)!r} reads no "
                f"array with the step's batch size {self.batch_size} as leading dimension (among its non-"
                "differentiated arguments and the values it closes over), so there is nothing to micro-batch. "
                "Fix: pass the batch as an argument or close over it.")

    @property
    def params(self) -> Any:
        return self.args[self._nums[0]] if isinstance(self.argnums, int) else tuple(self.args[i] for i in self._nums)

    @property
    def batch(self) -> list:
        leaves = jax.tree.leaves((self._others(), list(self._cells)), is_leaf=_opaque)
        return [x for x, b in zip(leaves, self._is_batch, strict=True) if b]

    def fixed_arrays(self) -> list:
        """The arrays the loss reads besides its parameters and batch (keys, scales, masks)."""
        return [x for x in self._fixed if x is not None and hasattr(x, "shape") and hasattr(x, "dtype")]

    def _others(self) -> list:
        return [a for i, a in enumerate(self.args) if i not in self._nums]

    def loss_fn(self, params: Any, batch: list) -> Any:
        """The scalar loss at `params` on `batch` (the list `self.batch` has, any leading size)."""
        it = iter(batch)
        leaves = [next(it) if b else x for x, b in zip(self._fixed, self._is_batch, strict=True)]
        others, cells = jax.tree.unflatten(self._treedef, leaves)
        fun = _with_closure(self.fun, self._base, cells)
        args, k = [], iter(others)
        for i in range(len(self.args)):
            if i in self._nums:
                args.append(params if isinstance(self.argnums, int) else params[self._nums.index(i)])
            else:
                args.append(next(k))
        out = fun(*args)
        return out[0] if self.has_aux else out

    def aux(self) -> Any:
        """The auxiliary output of `has_aux` losses: the user's function once more on the whole batch
        (a forward pass outside the pipeline)."""
        return self.fun(*self.args)[1]

    def same_as(self, other: LossCall) -> bool:
        return _same_code(self.fun, other.fun) and self._nums == other._nums and self.has_aux == other.has_aux


def _closure(fun: Callable) -> tuple[tuple, Any]:
    """(closed-over values, how to rebuild) of a plain function or a functools.partial of one."""
    if isinstance(fun, functools.partial):
        return (fun.args, fun.keywords), "partial"
    cells = getattr(fun, "__closure__", None) or ()
    return tuple(_cell_value(c) for c in cells), "function"


def _cell_value(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:      # an empty cell (a name assigned later): nothing to micro-batch
        return None


def _with_closure(fun: Callable, base: str, values: Any) -> Callable:
    if base == "partial":
        args, keywords = values
        return functools.partial(fun.func, *args, **keywords)
    if not values:
        return fun
    cells = tuple(types.CellType(v) for v in values)
    new = types.FunctionType(fun.__code__, fun.__globals__, fun.__name__, fun.__defaults__, cells)
    new.__kwdefaults__ = fun.__kwdefaults__
    return new


def _same_code(a: Callable, b: Callable) -> bool:
    if a is b or a == b:
        return True
    fa, fb = getattr(a, "func", a), getattr(b, "func", b)
    code_a, code_b = getattr(fa, "__code__", None), getattr(fb, "__code__", None)
    return code_a is not None and code_a is code_b


def batch_size_of(args: tuple) -> int:
    """The most common leading dimension among `args`' array leaves (the step's batch)."""
    dims = [x.shape[0] for x in jax.tree.leaves(args) if getattr(x, "shape", ())]
    if not dims:
        return 0
    values, counts = np.unique(dims, return_counts=True)
    return int(values[np.argmax(counts)])
