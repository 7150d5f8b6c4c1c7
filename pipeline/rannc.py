"""RaNNC (Tanaka et al., IPDPS'21), step by step: the public face of `autoshard/_src/pipeline/rannc`.

`autoshard.plan(..., pipeline="rannc")` runs all of it; these are its published stages, for
reproducing the paper's numbers or reusing one stage's result across many cells:

    atomic = rannc.atomic_partition(graph)                  # atomic components (§III-A)
    costs = rannc.PipelineCosts(atomic, "v100-sxm")         # per-component compute and memory
    blocks = rannc.partition_blocks(atomic, 32, costs=costs)   # k convex, balanced blocks (§III-B)
    plan = rannc.plan_stages(graph, 32, "v100-sxm", costs=costs, blocks=blocks)   # stage DP (Alg. 1-2)
    base = rannc.best_uniform(costs, 32, grouping=autoshard.group(graph))       # the uniform-split baseline
"""

from autoshard._src.pipeline.atomic import AtomicPartition as AtomicPartition
from autoshard._src.pipeline.atomic import atomic_partition as atomic_partition
from autoshard._src.pipeline.costs import PipelineCosts as PipelineCosts
from autoshard._src.pipeline.rannc.blocks import BlockPartition as BlockPartition
from autoshard._src.pipeline.rannc.blocks import partition_blocks as partition_blocks
from autoshard._src.pipeline.rannc.partitioner import RANNC as RANNC
from autoshard._src.pipeline.rannc.stages import StagePlan as StagePlan
from autoshard._src.pipeline.rannc.stages import plan_stages as plan_stages
from autoshard._src.pipeline.rannc.uniform import best_uniform as best_uniform
