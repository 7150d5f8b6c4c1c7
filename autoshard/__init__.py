"""autoshard: automatic tensor and pipeline parallelism for JAX train steps."""

from ._audit import Audit as Audit
from ._audit import audit as audit
from ._decorator import Autosharded as Autosharded
from ._decorator import ConfigError as ConfigError
from ._decorator import autoshard as autoshard
from ._errors import AutoshardError as AutoshardError
from ._errors import GroupingError as GroupingError
from ._errors import InfeasiblePlanError as InfeasiblePlanError
from ._errors import MeshError as MeshError
from ._errors import NotCallableError as NotCallableError
from ._errors import PlanError as PlanError
from ._errors import TraceFailedError as TraceFailedError
from ._errors import UnknownHardwareError as UnknownHardwareError
from ._errors import UntraceableArgumentError as UntraceableArgumentError
from ._experts import EXPERTS as EXPERTS
from ._graph import Op as Op
from ._graph import OpGraph as OpGraph
from ._graph import Value as Value
from ._group import BlockInstance as BlockInstance
from ._group import BlockType as BlockType
from ._group import Grouping as Grouping
from ._group import group as group
from ._hardware import HardwareSpec as HardwareSpec
from ._hardware import get_hardware as get_hardware
from ._mesh import MeshSpec as MeshSpec
from ._pipelined import Pipelined as Pipelined
from ._pipelined import PipelineSplitError as PipelineSplitError
from ._pipelined import StageInfo as StageInfo
from ._pipelined import pipelined as pipelined
from ._pipelined_step import value_and_grad as value_and_grad
from ._plan import Plan as Plan
from ._planner import expert_plan as expert_plan
from ._planner import plan as plan
from ._search import SearchOptions as SearchOptions
from ._trace import trace as trace

__version__ = "0.1.0"
