"""Pipeline parallelism: stage partitioners (RaNNC, GraphPipe), schedules, simulator, runtime.

Pure planning code over autoshard's OpGraph/Grouping lives here; only the runtime imports jax.

Schedules are data: a stage DAG, per-stage micro-batch counts and, per rank, an ordered list of
(stage, micro-batch, "F"|"B") tasks, checked by a validator and timed by an event simulator:

    sched = pipeline.schedule("1f1b", num_stages=4, num_microbatches=8)   # also "gpipe", "graph-1f1b"
    sim = pipeline.simulate(sched, forward=1.0, backward=2.0)             # scalars or per-stage lists
    sim.makespan, sim.bubble_fraction, sim.peak_inflight                  # peak_inflight: per stage
"""

from ._atomic import AtomicPartition as AtomicPartition
from ._atomic import PipelineError as PipelineError
from ._atomic import PipelineGraphError as PipelineGraphError
from ._atomic import atomic_partition as atomic_partition
from ._blocks import BlockPartition as BlockPartition
from ._blocks import partition_blocks as partition_blocks
from ._costs import PipelineCosts as PipelineCosts
from ._graph_schedule import compute_inflight as compute_inflight
from ._graph_schedule import static_inflight as static_inflight
from ._graphpipe import GraphPipePlan as GraphPipePlan
from ._graphpipe import GraphStage as GraphStage
from ._graphpipe import graphpipe_partition as graphpipe_partition
from ._layer_graph_build import curve_sizes as curve_sizes
from ._layer_graph_build import layer_graph as layer_graph
from ._layer_graph_build import op_curves as op_curves
from ._schedule import Schedule as Schedule
from ._schedule import ScheduleError as ScheduleError
from ._schedule import Task as Task
from ._schedule import register_schedule as register_schedule
from ._schedule import schedule as schedule
from ._schedule import schedule_names as schedule_names
from ._simulate import SimResult as SimResult
from ._simulate import TaskTiming as TaskTiming
from ._simulate import simulate as simulate
from ._sp import SPTree as SPTree
from ._sp import sp_decompose as sp_decompose
from ._spp import spp_partition as spp_partition
from ._stages import PipelineInfeasibleError as PipelineInfeasibleError
from ._stages import Stage as Stage
from ._stages import StagePlan as StagePlan
from ._stages import StageProblem as StageProblem
from ._stages import form_stage as form_stage
from ._stages import form_stage_dp as form_stage_dp
from ._stages import plan_stages as plan_stages
from ._uniform import best_uniform as best_uniform
from ._uniform import uniform_split as uniform_split
from ._validate import tick_table as tick_table
from ._validate import validate as validate
