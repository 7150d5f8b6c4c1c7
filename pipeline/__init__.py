"""Pipeline parallelism: schedules, the event simulator, stage partitioners and the runtime.

The public face of `autoshard/_src/pipeline` (pure) and the bridge's shard_map runtime (loaded on
first use, so `import pipeline` needs no jax). Schedules are data: a stage DAG, per-stage
micro-batch counts and, per rank, an ordered list of (stage, micro-batch, "F"|"B") tasks, checked
by a validator and timed by an event simulator:

    sched = pipeline.schedule("1f1b", num_stages=4, num_microbatches=8)   # also "gpipe", "graph-1f1b"
    sim = pipeline.simulate(sched, forward=1.0, backward=2.0)             # scalars or per-stage lists
    sim.makespan, sim.bubble_fraction, sim.peak_inflight                  # peak_inflight: per rank
    pipeline.schedule("interleaved-1f1b", num_stages=4, num_microbatches=8, virtual_stages=2)
    # ^ 4 ranks x 2 chunks: 8 stages, stage k on rank k % 4 (`Schedule.placement`)

Partitioners (RaNNC, GraphPipe, or your own `Partitioner`) are found by name in a registry that
`autoshard.plan(..., pipeline=name)` reads; `register_schedule` / `register_partitioner` add more.
The papers' algorithms step by step: `pipeline.rannc`, `pipeline.graphpipe`.
"""

from typing import TYPE_CHECKING

from autoshard._src.lazy import lazy_attributes
from autoshard._src.pipeline.partition import PartitionedStage as PartitionedStage
from autoshard._src.pipeline.partition import Partitioner as Partitioner
from autoshard._src.pipeline.partition import PartitionProblem as PartitionProblem
from autoshard._src.pipeline.partition import StagePartition as StagePartition
from autoshard._src.pipeline.registry import get_partitioner as get_partitioner
from autoshard._src.pipeline.registry import partitioner_names as partitioner_names
from autoshard._src.pipeline.registry import register_partitioner as register_partitioner
from autoshard._src.pipeline.registry import unregister_partitioner as unregister_partitioner
from autoshard._src.pipeline.schedules.registry import register_schedule as register_schedule
from autoshard._src.pipeline.schedules.registry import schedule as schedule
from autoshard._src.pipeline.schedules.registry import schedule_names as schedule_names
from autoshard._src.pipeline.schedules.registry import unregister_schedule as unregister_schedule
from autoshard._src.pipeline.schedules.schedule import Schedule as Schedule
from autoshard._src.pipeline.schedules.schedule import Task as Task
from autoshard._src.pipeline.schedules.schedule import tick_table as tick_table
from autoshard._src.pipeline.schedules.schedule import validate as validate
from autoshard._src.pipeline.schedules.simulate import SimResult as SimResult
from autoshard._src.pipeline.schedules.simulate import simulate as simulate

from . import graphpipe as graphpipe
from . import rannc as rannc

if TYPE_CHECKING:   # the lazy name below, for type checkers and IDEs
    from autoshard._src.bridge.runtimes.runtime import pipeline_value_and_grad as pipeline_value_and_grad

__getattr__, __dir__ = lazy_attributes(__name__, {
    "pipeline_value_and_grad": "autoshard._src.bridge.runtimes.runtime",
}, eager=[n for n in dir() if not n.startswith("_") and n not in ("TYPE_CHECKING", "lazy_attributes")])

del TYPE_CHECKING, lazy_attributes
