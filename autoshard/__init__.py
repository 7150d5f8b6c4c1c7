"""autoshard: automatic tensor and pipeline parallelism for JAX train steps.

The public face: every name below is defined in `autoshard/_src` (layers: core, tensor, pipeline,
plan, bridge). Names from the jax bridge and the planners load on first use, so `import autoshard`
itself needs no jax, numpy or scipy.
"""

from typing import TYPE_CHECKING

from ._src.core.errors import AutoshardError as AutoshardError
from ._src.core.errors import CheckpointError as CheckpointError
from ._src.core.errors import ConfigError as ConfigError
from ._src.core.errors import GroupingError as GroupingError
from ._src.core.errors import HardwareError as HardwareError
from ._src.core.errors import InfeasiblePlanError as InfeasiblePlanError
from ._src.core.errors import MeshError as MeshError
from ._src.core.errors import NotCallableError as NotCallableError
from ._src.core.errors import PipelineError as PipelineError
from ._src.core.errors import PlanError as PlanError
from ._src.core.errors import ScheduleError as ScheduleError
from ._src.core.errors import StepFailedError as StepFailedError
from ._src.core.errors import TraceFailedError as TraceFailedError
from ._src.core.errors import UntraceableArgumentError as UntraceableArgumentError
from ._src.core.version import VERSION
from ._src.lazy import lazy_attributes

if TYPE_CHECKING:   # the lazy names below, for type checkers and IDEs
    from ._src.bridge.api import bind as bind
    from ._src.bridge.api import expert_plan as expert_plan
    from ._src.bridge.api import plan as plan
    from ._src.bridge.audit.audit import Audit as Audit
    from ._src.bridge.audit.audit import audit as audit
    from ._src.bridge.checkpoint.api import restore as restore
    from ._src.bridge.checkpoint.api import save as save
    from ._src.bridge.decorator import autoshard as autoshard
    from ._src.bridge.runtimes.choose import pipelined as pipelined
    from ._src.bridge.runtimes.pipelined_step import value_and_grad as value_and_grad
    from ._src.bridge.trace.trace import trace as trace
    from ._src.core.graph import OpGraph as OpGraph
    from ._src.core.grouping import Grouping as Grouping
    from ._src.core.grouping import group as group
    from ._src.core.hardware import HardwareSpec as HardwareSpec
    from ._src.core.hardware import get_hardware as get_hardware
    from ._src.plan.config import Config as Config
    from ._src.plan.plan import Plan as Plan
    from ._src.tensor.experts import EXPERTS as EXPERTS

__getattr__, __dir__ = lazy_attributes(__name__, {
    "autoshard": "autoshard._src.bridge.decorator",
    "trace": "autoshard._src.bridge.trace.trace",
    "plan": "autoshard._src.bridge.api",
    "expert_plan": "autoshard._src.bridge.api",
    "bind": "autoshard._src.bridge.api",
    "audit": "autoshard._src.bridge.audit.audit",
    "Audit": "autoshard._src.bridge.audit.audit",
    "value_and_grad": "autoshard._src.bridge.runtimes.pipelined_step",
    "pipelined": "autoshard._src.bridge.runtimes.choose",
    "save": "autoshard._src.bridge.checkpoint.api",
    "restore": "autoshard._src.bridge.checkpoint.api",
    # pure, but they load numpy, scipy and networkx (0.5 s): lazy too, so the CLI's Ctrl-C handler
    # (autoshard._src.cli, imported after this package) is in place within milliseconds of start
    "OpGraph": "autoshard._src.core.graph",
    "Grouping": "autoshard._src.core.grouping",
    "group": "autoshard._src.core.grouping",
    "HardwareSpec": "autoshard._src.core.hardware",
    "get_hardware": "autoshard._src.core.hardware",
    "Config": "autoshard._src.plan.config",
    "Plan": "autoshard._src.plan.plan",
    "EXPERTS": "autoshard._src.tensor.experts",
}, eager=[n for n in dir() if not n.startswith("_") and n not in ("TYPE_CHECKING", "lazy_attributes", "VERSION")])

__version__ = VERSION
del TYPE_CHECKING, lazy_attributes, VERSION
