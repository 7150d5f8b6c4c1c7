"""Typed errors. Every error autoshard raises derives from `AutoshardError`.

Messages follow the jax style: name the argument (by pytree keypath), its value or shape, why it
fails and how to fix it. The user's own exception is chained (`raise ... from err`), never lost.
"""

from __future__ import annotations


class AutoshardError(Exception):
    """Base of every typed error autoshard raises."""


class NotCallableError(AutoshardError, TypeError):
    """The object given as the step function cannot be called."""


class UntraceableArgumentError(AutoshardError, TypeError):
    """An argument leaf is not an array, a scalar or a jax.ShapeDtypeStruct."""


class TraceFailedError(AutoshardError, RuntimeError):
    """The user's function raised while jax traced it; the original exception is chained."""


class GroupingError(AutoshardError, ValueError):
    """Invalid options for grouping an OpGraph."""


class PlanError(AutoshardError, ValueError):
    """A plan cannot be used as asked (wrong arguments, wrong model, unreadable file)."""


class InfeasiblePlanError(AutoshardError, ValueError):
    """No plan fits the memory budget."""


class UnknownHardwareError(AutoshardError, ValueError):
    """A hardware preset name or an override field that does not exist."""


class InvalidHardwareError(AutoshardError, ValueError):
    """A HardwareSpec number that cannot describe a device (non-positive, missing dtype or kind)."""


class MeshError(AutoshardError, ValueError):
    """A mesh description with a bad axis name or size, or an impossible device count."""


class CostModelError(AutoshardError, ValueError):
    """A cost query with an unknown collective kind, unknown mesh axis or negative size."""
