"""autoshard: automatic tensor and pipeline parallelism for JAX train steps."""

from ._errors import AutoshardError as AutoshardError
from ._errors import GroupingError as GroupingError
from ._errors import NotCallableError as NotCallableError
from ._errors import TraceFailedError as TraceFailedError
from ._errors import UntraceableArgumentError as UntraceableArgumentError
from ._graph import Op as Op
from ._graph import OpGraph as OpGraph
from ._graph import Value as Value
from ._trace import trace as trace

__version__ = "0.1.0"
