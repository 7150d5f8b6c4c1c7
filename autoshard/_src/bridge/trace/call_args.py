"""The decorated step's call boundary: what a call may pass, checked once per call before anything
is planned, placed or donated (keywords bound to positions, tracers, deleted or abstract leaves,
aliased donated leaves), and a runtime failure of the compiled step reported with what it cost.

What jax does when the compiled step fails while it runs (jaxlib 0.10.2), and what is guarded:
- an error jax reports at the call (an argument XLA refuses, an ordered callback that raised, memory
  exhausted when the program starts): a StepFailedError here, saying whether the donated inputs are
  already deleted (the caller's arrays on a first call never are: they were copied when placed);
- an error inside the running program otherwise: jax dispatches asynchronously, so it surfaces as
  jax's JaxRuntimeError where a result is first read, after the inputs were donated;
- a host callback (jax.pure_callback, io_callback) that raises on some devices of a multi-device
  program: the other devices wait in the next collective; XLA's CPU runtime aborts the process
  (SIGABRT) after its 40 s rendezvous timeout, and GPU collectives hang. Python cannot catch either:
  make such callbacks return a status instead of raising, and checkpoint (autoshard.save) the state.
Nothing is donated before the checks below pass, so misuse never costs the caller an array."""

from __future__ import annotations

import collections
import inspect
from collections.abc import Callable

import jax

from ...core.errors import PlanError, StepFailedError
from .. import compat as jc


def positional(fn: Callable, args: tuple, kwargs: dict) -> tuple:
    """`args` with `kwargs` bound to their positions in `fn`'s signature: the compiled step (a
    jax.jit with in_shardings per position) takes positional arguments only."""
    if not kwargs:
        return args
    name = getattr(fn, "__name__", "step")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as err:
        raise PlanError(f"autoshard: keyword argument(s) {sorted(kwargs)} cannot be bound: the signature of "
                        f"{name} cannot be read ({err}). Fix: pass every argument positionally.") from err
    params = sig.parameters
    unknown = sorted(set(kwargs) - set(params))
    if unknown and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        raise PlanError(f"autoshard: unknown keyword argument(s) {unknown} for {name}, whose parameters are "
                        f"{', '.join(params)}. Fix: spell them as in {name}{sig}, or pass them by position.")
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as err:
        raise PlanError(f"autoshard: the call {name}(<{len(args)} positional>, {', '.join(f'{k}=' for k in kwargs)}) "
                        f"does not fit its signature {name}{sig}: {err}. Fix: call it as you would call "
                        f"{name} itself.") from err
    if bound.kwargs:      # keyword-only parameters, **kwargs, or a defaulted parameter left out before them
        raise PlanError(
            f"autoshard: keyword argument(s) {sorted(bound.kwargs)} of {name}{sig} have no position to bind to "
            "(keyword-only, **kwargs, or a parameter before them left to its default); the compiled step takes "
            "its arguments by position. Fix: make them positional parameters and pass every parameter before "
            "them, or close over constant options (functools.partial) before decorating.")
    return bound.args


def check_leaves(args: tuple, leaves: list, planned: tuple | None, concrete: bool) -> None:
    """Typed errors for arguments the compiled step cannot take: tracers (the step called under
    jax.jit / grad / vmap), donated (deleted) arrays, abstract values on a call (`lower` takes them),
    another argument count than the step was planned for."""
    if planned is not None and len(args) != len(planned):
        raise PlanError(f"autoshard: the step was planned for {len(planned)} argument(s) and is now called with "
                        f"{len(args)}. Fix: call it with the same arguments (a new batch shape is fine: it re-plans).")
    bad = next((x for x in leaves if jc.is_tracer(x) or (isinstance(x, jax.Array) and x.is_deleted())
                or (concrete and isinstance(x, jax.ShapeDtypeStruct))), None)
    if bad is None:          # the per-call cost: one pass over the leaves; paths only for the message
        return
    kp = next(kp for kp, x in jax.tree_util.tree_flatten_with_path(args)[0] if x is bad)
    where = f"argument {jax.tree_util.keystr(kp)}"
    if jc.is_tracer(bad):
        raise PlanError(
            f"autoshard: {where} is a jax tracer ({bad.aval.str_short()}): the step was called inside a jax "
            "transformation (jax.jit, jax.grad, jax.vmap, lax.scan, ...). An autoshard step plans, places and "
            "compiles its own program, so it runs at the top level, eagerly. Fix: call it outside the "
            "transformation and put the transformation inside the step function (e.g. jax.grad or jax.vmap "
            "in the step's body), or call the step once and then compose its plain jax.jit program, "
            "step.jitted, like any jitted function (jax.jit(step.jitted), jax.grad(lambda p: "
            "step.jitted(p, ...)[k])).")
    if isinstance(bad, jax.ShapeDtypeStruct):
        raise PlanError(
            f"autoshard: {where} is an abstract jax.ShapeDtypeStruct {bad.shape}; the step runs on arrays. Fix: "
            "plan abstractly with autoshard.plan(step.fn, *abstract_args, ...), or compile with "
            "step.lower(*abstract_args).")
    raise PlanError(
        f"autoshard: {where} (shape {tuple(bad.shape)}) was deleted: an earlier call of the step consumed it "
        "(the step donates the state it returns, like jax.jit(donate_argnums=...)). Fix: pass the arrays "
        "the previous call returned, or decorate with donate=False to keep the inputs.")


def unaliased(args: tuple, leaves: list, donated: tuple[int, ...]) -> tuple:
    """`args` with every donated occurrence of an array passed more than once replaced by its own copy.
    XLA cannot donate one buffer twice, nor donate a buffer another argument reads: it reports that and
    then crashes the process (SIGSEGV). A copy costs only the aliased leaves; the caller's array survives."""
    if not donated:
        return args
    counts = collections.Counter(id(x) for x in leaves if isinstance(x, jax.Array))
    shared = {i for i, n in counts.items() if n > 1}
    if not shared:
        return args
    out = list(args)
    for i in donated:
        out[i] = jax.tree.map(lambda x: x.copy() if id(x) in shared else x, out[i])
    return tuple(out)


def failed(err: Exception, args: tuple, donated: tuple[int, ...]) -> StepFailedError:
    """The typed error for the compiled step failing while it ran (a callback that raised, memory
    exhausted at run time, a device error): jax's message, and whether the caller's donated inputs
    (`args` as the caller passed them) are gone."""
    gone = [f"[{i}]{jax.tree_util.keystr(kp)}" for i in donated
            for kp, x in jax.tree_util.tree_flatten_with_path(args[i])[0]
            if isinstance(x, jax.Array) and x.is_deleted()]
    if gone:
        lost = (f"It had already consumed its donated inputs ({len(gone)} arrays, e.g. argument {gone[0]}): they "
                "are deleted and cannot be reused. Fix: keep a checkpoint (autoshard.save) or a copy of the state "
                "to resume from, or decorate with donate=False while debugging so that a failed step leaves "
                "its inputs intact.")
    else:
        lost = "Your arguments are intact: fix the cause and call the step again."
    return StepFailedError(f"autoshard: XLA failed on the step (compiling or running it): {_first_line(err)}. {lost}")


def _first_line(err: Exception) -> str:
    """jax's message in one line; for a Python callback that raised, its exception (the last line)."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    head = lines[0].removesuffix("Traceback (most recent call last):").strip()
    return (head if len(lines) == 1 else f"{head} {lines[-1]}")[:400]
