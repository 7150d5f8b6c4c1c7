"""Every typed error autoshard raises, in one hierarchy under `AutoshardError`.

Messages follow the jax style: name the argument (by pytree keypath), its value or shape, the mesh
where it matters, why it fails and how to fix it. The user's own exception is chained
(`raise ... from err`), never lost. Each class also derives from the builtin a caller would
expect (TypeError for wrong types, ValueError for wrong values), so generic handlers keep working.

    AutoshardError
    ├── NotCallableError (TypeError)          the step function is not callable
    ├── UntraceableArgumentError (TypeError)  an argument leaf jax cannot trace
    ├── TraceFailedError (RuntimeError)       the user's function raised while jax traced it
    ├── StepFailedError (RuntimeError)        the compiled step failed while it ran (says what it consumed)
    ├── ConfigError (ValueError)              a config file, option or cost query that is invalid
    │   ├── CheckpointError                   a checkpoint that cannot be written, or read back exactly
    │   ├── HardwareError                     an unknown preset, a bad override, an impossible number
    │   └── MeshError                         a bad axis name or size, an impossible device count
    ├── GroupingError (ValueError)            invalid options for grouping an OpGraph
    └── PlanError (ValueError)                a plan that cannot be made or used as asked
        ├── InfeasiblePlanError               no plan fits the memory budget
        └── PipelineError                     a step that cannot be cut or run as pipeline stages
            └── ScheduleError                 a schedule that cannot run (bad order, deadlock)
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


class StepFailedError(AutoshardError, RuntimeError):
    """The compiled step failed while it ran; the message says whether its donated inputs are gone.
    jax's runtime error is chained."""


class ConfigError(AutoshardError, ValueError):
    """An autoshard config file, keyword option or cost-model query that is invalid."""


class CheckpointError(ConfigError):
    """A checkpoint that cannot be written (unwritable path) or read back exactly as saved (corrupt,
    truncated, incomplete); the message says where the previous good checkpoint is when one exists."""


class HardwareError(ConfigError):
    """A hardware preset name that does not exist, or a HardwareSpec number that cannot describe a
    device (non-positive, missing dtype or collective kind)."""


class MeshError(ConfigError):
    """A mesh description with a bad axis name or size, or an impossible device count."""


class GroupingError(AutoshardError, ValueError):
    """Invalid options for grouping an OpGraph."""


class PlanError(AutoshardError, ValueError):
    """A plan that cannot be made or used as asked (wrong arguments, wrong model, unreadable file)."""


class InfeasiblePlanError(PlanError):
    """No plan fits the memory budget (tensor or pipeline). `min_memory` is the smallest per-device
    peak any plan tried needed and `budget` the per-device budget, in bytes, when the planner knows them."""

    def __init__(self, message: str, *, min_memory: float | None = None, budget: float | None = None) -> None:
        super().__init__(message)
        self.min_memory = min_memory
        self.budget = budget


class PipelineError(PlanError):
    """A step or loss that cannot be partitioned, cut or run as pipeline stages."""


class ScheduleError(PipelineError):
    """A pipeline schedule that cannot run: bad arguments, a broken task order, or a deadlock."""
