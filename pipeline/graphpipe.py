"""GraphPipe (Jeon et al., ASPLOS'25), step by step: the public face of `autoshard/_src/pipeline/graphpipe`.

`autoshard.plan(..., pipeline="graphpipe")` runs all of it; these are its pieces, for reproducing
the paper's Table 1 on any `LayerGraph`:

    lg = graphpipe.layer_graph(graph, "v100-sxm")          # layer nodes with per-micro-batch curves
    gp = graphpipe.graphpipe_partition(lg, 16, "v100-sxm")   # SP decomposition + DP + binary search
    spp = graphpipe.spp_partition(lg, 16, "v100-sxm")        # the best sequential pipeline, same costs
    floor = graphpipe.tps_floor(lg, 16, batch) * batch       # no plan's step can be shorter
    op_time, op_curves, notes = graphpipe.measured_layer_costs(step, args, graph, "v100-sxm")  # jax
"""

from typing import TYPE_CHECKING

from autoshard._src.lazy import lazy_attributes
from autoshard._src.pipeline.graphpipe.layer_graph import LayerGraph as LayerGraph
from autoshard._src.pipeline.graphpipe.layer_graph_build import curve_sizes as curve_sizes
from autoshard._src.pipeline.graphpipe.layer_graph_build import layer_graph as layer_graph
from autoshard._src.pipeline.graphpipe.layer_graph_build import op_curves as op_curves
from autoshard._src.pipeline.graphpipe.partition import GraphPipePlan as GraphPipePlan
from autoshard._src.pipeline.graphpipe.partition import graphpipe_partition as graphpipe_partition
from autoshard._src.pipeline.graphpipe.partition import tps_floor as tps_floor
from autoshard._src.pipeline.graphpipe.partitioner import GRAPHPIPE as GRAPHPIPE
from autoshard._src.pipeline.graphpipe.spp import spp_partition as spp_partition

if TYPE_CHECKING:   # the lazy name below (it times ops on the local device with jax)
    from autoshard._src.bridge.audit.profile import measured_layer_costs as measured_layer_costs

__getattr__, __dir__ = lazy_attributes(__name__, {
    "measured_layer_costs": "autoshard._src.bridge.audit.profile",
}, eager=[n for n in dir() if not n.startswith("_") and n not in ("TYPE_CHECKING", "lazy_attributes")])

del TYPE_CHECKING, lazy_attributes
