"""Pipeline parallelism: stage partitioners (RaNNC, GraphPipe), schedules, simulator, runtime.

Pure planning code over autoshard's OpGraph/Grouping lives here; only the runtime imports jax.

Schedules are data: a stage DAG, per-stage micro-batch counts and, per rank, an ordered list of
(stage, micro-batch, "F"|"B") tasks, checked by a validator and timed by an event simulator:

    sched = pipeline.schedule("1f1b", num_stages=4, num_microbatches=8)   # also "gpipe", "graph-1f1b"
    sim = pipeline.simulate(sched, forward=1.0, backward=2.0)             # scalars or per-stage lists
    sim.makespan, sim.bubble_fraction, sim.peak_inflight                  # peak_inflight: per stage
"""

from ._graph_schedule import compute_inflight as compute_inflight
from ._graph_schedule import static_inflight as static_inflight
from ._schedule import Schedule as Schedule
from ._schedule import ScheduleError as ScheduleError
from ._schedule import Task as Task
from ._schedule import register_schedule as register_schedule
from ._schedule import schedule as schedule
from ._schedule import schedule_names as schedule_names
from ._simulate import SimResult as SimResult
from ._simulate import TaskTiming as TaskTiming
from ._simulate import simulate as simulate
from ._validate import tick_table as tick_table
from ._validate import validate as validate
