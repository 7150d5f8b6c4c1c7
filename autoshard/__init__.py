"""autoshard: automatic tensor and pipeline parallelism for JAX train steps."""

from ._errors import AutoshardError as AutoshardError
from ._errors import GroupingError as GroupingError
from ._errors import NotCallableError as NotCallableError
from ._errors import TraceFailedError as TraceFailedError
from ._errors import UntraceableArgumentError as UntraceableArgumentError
from ._graph import Op as Op
from ._graph import OpGraph as OpGraph
from ._graph import Value as Value
from ._group import BlockInstance as BlockInstance
from ._group import BlockType as BlockType
from ._group import Grouping as Grouping
from ._group import group as group
from ._trace import trace as trace

__version__ = "0.1.0"
