"""Choose each inference layer's split direction by DP over predicted latency: BBGraP's partitioner
(shared/papers/bbgrap-black-box-graph-partitioner.md §3.2-3.3) extended to mixed directions and
heterogeneous nodes (its future work, §5). Pure: plain data, no jax.

Cost model (`CostModel`), per layer and output split:

- compute per node = its output region's elements x flops per output element (conv 2 x kernel volume
  x input channels / groups, pooling the kernel volume, dense 2 x input features, a reduction the
  elements it folds into one, elementwise ops ~1, data movement 0) / (node speed x peak flop/s of the
  dtype x compute efficiency). A speed of 1 is the HardwareSpec's device;
- receive per node = the sum over the transfers the graph optimiser keeps into it (§3.3, Fig. 5:
  `core.transfers`; removed ones cost nothing) of latency + bytes / bandwidth on the network between
  nodes, one point-to-point send each (`collective-permute` in `core.cost.alpha_beta`). The paper's
  runtime receives serially, so a node's receives add up;
- a layer's latency = max over nodes of (receive + compute); the plan's = the sum over layers.
  The network output stays distributed (assembling it is the emitter's business, as in
  `core.transfers`); graph inputs arrive already split as their chosen direction says.

Search (`partition`): layers in topological order; the state is the direction of every *live* layer
(produced, still to be read), the frontier of the DAG. A layer's cost depends only on its own split
and its producers', all in the state, so the DP is exact: on a chain the state is one direction, on a
ResNet the trunk plus the skip (<= 5^2 states). Beyond `max_states` states (wide concats) the cheapest
`max_states` are kept (a beam; no longer exact) and the single-direction baselines are compared, so
the result is never worse than them. Ties go to the earlier option in DIRECTION_ORDER, layer by layer.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from ..core.cost import alpha_beta
from ..core.errors import ConfigError, PlanError
from ..core.hardware import HardwareSpec
from ..core.shapemap import Layer, Split, direction_axis
from ..core.transfers import analyse_transfers

Direction = str | None                    # "N", "C", "H", "W", or None: replicated
DIRECTION_ORDER: tuple[Direction, ...] = ("N", "C", "H", "W", None)   # the tie-break order


def _name(direction: Direction) -> str:
    return direction or "replicated"


# ---- flops per output element ---------------------------------------------------------------------------


def flops_per_element(layer: Layer) -> float:
    """Flops one output element of `layer` costs (multiply-add = 2)."""
    kind = layer.kind
    if kind == "conv":
        window = layer.window
        volume = math.prod(window.kernel) if window else 1
        return 2.0 * volume * layer.input_shapes[0][-1] / layer.feature_group_count
    if kind == "pool":
        return float(math.prod(layer.window.kernel)) if layer.window else 1.0
    if kind == "dense":
        return 2.0 * layer.input_shapes[0][-1]
    if kind in ("reduce", "global_pool"):
        out = max(math.prod(layer.output_shape), 1)
        return math.prod(layer.input_shapes[0]) / out
    if kind in ("elementwise", "batchnorm", "add"):
        return 1.0
    return 0.0                            # input, concat, flatten: data movement only


# ---- the cost model -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """One layer's predicted time under a split, given its producers' splits."""

    compute: tuple[float, ...]            # [node] seconds
    receive: tuple[float, ...]            # [node] seconds, kept transfers into it, serial
    received_nbytes: tuple[int, ...]      # [node]

    @property
    def latency(self) -> float:
        return max(r + c for r, c in zip(self.receive, self.compute, strict=True))


class CostModel:
    """Predicts layer and plan latencies of an inference graph on `num_nodes` nodes of `hardware`.

    speeds: relative node speeds (default all 1). uneven: split proportionally to the speeds
    (heterogeneous nodes, uneven parts); False keeps Eq. 1's even parts whatever the speeds.
    """

    def __init__(self, layers: Sequence[Layer], hardware: HardwareSpec, num_nodes: int,
                 speeds: Sequence[float] | None = None, dtype: str = "float32", uneven: bool = True,
                 max_states: int = 4096) -> None:
        if not isinstance(hardware, HardwareSpec):
            raise ConfigError(f"autoshard: hardware={hardware!r} must be a HardwareSpec (see get_hardware).")
        if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
            raise ConfigError(f"autoshard: num_nodes={num_nodes!r} must be an int >= 1.")
        self.layers = tuple(layers)
        if not self.layers:
            raise PlanError("autoshard: no layers to partition; give at least one Layer.")
        self.by_name = {layer.name: layer for layer in self.layers}
        analyse_transfers(self.layers, {n: Split(None, num_nodes) for n in self.by_name})   # validates the graph
        self.hardware, self.num_nodes, self.dtype = hardware, num_nodes, dtype
        self.speeds = tuple(float(s) for s in speeds) if speeds is not None else (1.0,) * num_nodes
        Split(None, num_nodes, self.speeds)                # checks: one finite speed > 0 per node
        weighted = uneven and len(set(self.speeds)) > 1
        self.weights = self.speeds if weighted else None
        if isinstance(max_states, bool) or not isinstance(max_states, int) or max_states < 1:
            raise ConfigError(f"autoshard: max_states={max_states!r} must be an int >= 1.")
        self.max_states = max_states
        alpha, beta = alpha_beta("collective-permute", 2, hardware.inter_node_bandwidth,
                                 hardware.inter_node_latency, hardware.collective_efficiency["collective-permute"])
        self.alpha, self.beta = alpha, beta
        self.rate = hardware.peak_flops(dtype) * hardware.compute_efficiency
        self._cache: dict[tuple, LayerCost] = {}
        self._canonical = {layer.name: self._canonical_layer(layer) for layer in self.layers}
        self._options = {name: self.options(name) for name in self.by_name}

    def split(self, direction: Direction) -> Split:
        return Split(direction, self.num_nodes, self.weights)

    def options(self, name: str) -> tuple[Direction, ...]:
        """The directions layer `name`'s output can take: those it has with >= 1 element per node
        (a dense output: N, C), and replicated."""
        shape = self.by_name[name].output_shape
        valid: list[Direction] = []
        for d in DIRECTION_ORDER[:-1]:
            try:
                axis = direction_axis(d, len(shape))   # type: ignore[arg-type]
            except ConfigError:
                continue
            if shape[axis] >= self.num_nodes:
                valid.append(d)
        return (*valid, None)

    def transfer_time(self, nbytes: int) -> float:
        """One point-to-point send: latency + bytes / bandwidth (nothing when nothing is sent)."""
        return self.alpha + self.beta * nbytes if nbytes > 0 else 0.0

    def layer_cost(self, name: str, direction: Direction, producers: Mapping[str, Direction]) -> LayerCost:
        """`name`'s compute and receive times when split `direction`, its producers split as given."""
        if direction not in self._options[name]:
            raise PlanError(f"autoshard: layer {name!r} output {self.by_name[name].output_shape} cannot be split "
                            f"{_name(direction)!r} over {self.num_nodes} nodes; use one of "
                            f"{[_name(d) for d in self._options[name]]}.")
        layer, srcs = self._canonical[name]
        key = (layer, direction, tuple((self.by_name[s].output_shape, self.by_name[s].itemsize, producers[s])
                                       for s in srcs))
        if key not in self._cache:     # keyed by structure: the repeated blocks of a network share it
            self._cache[key] = self._layer_cost(layer, direction, key[2])
        return self._cache[key]

    def _canonical_layer(self, layer: Layer) -> tuple[Layer, tuple[str, ...]]:
        """The layer renamed "layer", reading producers renamed "in0", "in1"...; its distinct producers."""
        srcs = tuple(dict.fromkeys(layer.inputs))
        inputs = tuple(f"in{srcs.index(s)}" for s in layer.inputs)
        return dataclasses.replace(layer, name="layer", inputs=inputs), srcs

    def _layer_cost(self, layer: Layer, direction: Direction,
                    producers: tuple[tuple[tuple[int, ...], int, Direction], ...]) -> LayerCost:
        nodes = range(self.num_nodes)
        regions = self.split(direction).regions(layer.output_shape, f"layer {layer.name!r} output")
        per_element = flops_per_element(layer)
        compute = tuple(regions[i].num_elements * per_element / (self.speeds[i] * self.rate) for i in nodes)
        receive, received = [0.0] * self.num_nodes, [0] * self.num_nodes
        if producers:
            # the consumer alone, its producers as stand-in inputs: the optimiser's per-edge fetches (§3.3)
            stand_ins = [Layer(f"in{i}", "input", output_shape=shape, itemsize=itemsize)
                         for i, (shape, itemsize, _) in enumerate(producers)]
            splits = {s.name: self.split(d) for s, (_, _, d) in zip(stand_ins, producers, strict=True)}
            splits[layer.name] = self.split(direction)
            analysis = analyse_transfers([*stand_ins, layer], splits)
            for edge in analysis.inputs_of(layer.name):
                itemsize = producers[int(edge.producer[2:])][1]
                for dst in nodes:
                    for src in nodes:
                        nbytes = edge.fetched[dst][src].num_elements * itemsize
                        receive[dst] += self.transfer_time(nbytes)
                        received[dst] += nbytes
        return LayerCost(compute, tuple(receive), tuple(received))

    def plan_latency(self, directions: Mapping[str, Direction]) -> float:
        """The predicted end-to-end latency of a plan: the sum of its layers' latencies."""
        missing = [n for n in self.by_name if n not in directions]
        if missing:
            raise PlanError(f"autoshard: no direction for layers {missing}; give one (or None) for every layer.")
        return sum(self.layer_cost(n, directions[n], directions).latency for n in self.by_name)

    def single_direction(self, direction: Direction) -> dict[str, Direction]:
        """Every layer split `direction` where its output has it, replicated elsewhere."""
        return {n: direction if direction in self.options(n) else None for n in self.by_name}


# ---- the DP over the DAG's frontier --------------------------------------------------------------------


def _last_reads(layers: Sequence[Layer]) -> dict[str, int]:
    """The index of the last layer reading each layer (its own index when nothing reads it)."""
    last = {layer.name: i for i, layer in enumerate(layers)}
    for i, layer in enumerate(layers):
        for src in layer.inputs:
            last[src] = max(last[src], i)
    return last


def _search(model: CostModel) -> tuple[dict[str, Direction], bool]:
    """The cheapest direction per layer, and whether the search stayed exact (no beam cut)."""
    layers, rank = model.layers, {d: i for i, d in enumerate(DIRECTION_ORDER)}
    last = _last_reads(layers)
    frontier: tuple[str, ...] = ()
    # state (directions of the frontier) -> (cost, tie key, directions chosen so far)
    states: dict[tuple, tuple[float, tuple[int, ...], tuple[Direction, ...]]] = {(): (0.0, (), ())}
    exact = True
    for i, layer in enumerate(layers):
        keep = tuple(n for n in (*frontier, layer.name) if last[n] > i)
        nxt: dict[tuple, tuple[float, tuple[int, ...], tuple[Direction, ...]]] = {}
        for state, (cost, tie, chosen) in states.items():
            live = dict(zip(frontier, state, strict=True))
            for d in model.options(layer.name):
                live[layer.name] = d
                total = cost + model.layer_cost(layer.name, d, live).latency
                key = tuple(live[n] for n in keep)
                entry = (total, (*tie, rank[d]), (*chosen, d))
                if key not in nxt or entry[:2] < nxt[key][:2]:
                    nxt[key] = entry
        if len(nxt) > model.max_states:      # a beam beyond the cap: the cheapest states survive
            exact = False
            nxt = dict(sorted(nxt.items(), key=lambda kv: kv[1][:2])[: model.max_states])
        frontier, states = keep, nxt
    _, _, best = min(states.values(), key=lambda v: v[:2])
    return dict(zip((layer.name for layer in layers), best, strict=True)), exact


# ---- the result -------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """One layer of an inference partition."""

    name: str
    kind: str
    direction: Direction
    extents: tuple[tuple[int, ...], ...]  # [node] its output part's shape
    compute: tuple[float, ...]            # [node] seconds
    receive: tuple[float, ...]            # [node] seconds receiving this layer's inputs
    received_nbytes: tuple[int, ...]      # [node] bytes of inputs received (kept transfers)
    latency: float                        # max over nodes of receive + compute
    kept_nbytes: int                      # of this layer's output sent on (graph optimiser, §3.3)
    removed_nbytes: int                   # against the initial full synchronisation (§3.2)


@dataclasses.dataclass(frozen=True)
class InferencePartition:
    """Per layer direction and split, the predicted latency, and the single-direction baselines'."""

    num_nodes: int
    speeds: tuple[float, ...]
    layers: tuple[LayerPlan, ...]
    latency: float
    baselines: Mapping[str, float]        # "N", "C", "H", "W", "replicated" -> predicted latency
    exact: bool                           # the DP explored every frontier state

    @property
    def directions(self) -> dict[str, Direction]:
        return {lp.name: lp.direction for lp in self.layers}

    def layer(self, name: str) -> LayerPlan:
        for lp in self.layers:
            if lp.name == name:
                return lp
        raise PlanError(f"autoshard: no layer {name!r}; layers: {[lp.name for lp in self.layers]}.")

    def summary(self) -> str:
        """One line per layer (direction, extents per node, latency, bytes kept/removed), then totals."""
        lines = []
        for lp in self.layers:
            extents = " ".join("x".join(map(str, e)) for e in lp.extents)
            lines.append(f"{lp.name:<16} {_name(lp.direction):<10} {extents:<40} {lp.latency * 1e3:9.4f} ms  "
                         f"sent {lp.kept_nbytes} B, removed {lp.removed_nbytes} B")
        base = ", ".join(f"{k} {v * 1e3:.4f} ms" for k, v in self.baselines.items())
        lines.append(f"predicted latency {self.latency * 1e3:.4f} ms; single-direction plans: {base}")
        return "\n".join(lines)


def describe(model: CostModel, directions: Mapping[str, Direction],
             baselines: Mapping[str, float] | None = None, exact: bool = True) -> InferencePartition:
    """The result record of a plan (any plan: the DP's, a baseline, one given by hand)."""
    splits = {n: model.split(directions[n]) for n in model.by_name}
    analysis = analyse_transfers(model.layers, splits)
    layers = []
    for layer in model.layers:
        cost = model.layer_cost(layer.name, directions[layer.name], directions)
        lt = analysis.layer(layer.name)
        layers.append(LayerPlan(layer.name, layer.kind, directions[layer.name], tuple(o.extents for o in lt.outputs),
                                cost.compute, cost.receive, cost.received_nbytes, cost.latency,
                                lt.nbytes, lt.initial_nbytes - lt.nbytes))
    return InferencePartition(model.num_nodes, model.speeds, tuple(layers), sum(lp.latency for lp in layers),
                              dict(baselines or {}), exact)


def baselines(model: CostModel) -> dict[str, float]:
    """Predicted latency of each single-direction plan (all C is the paper's output-channel division)."""
    return {_name(d): model.plan_latency(model.single_direction(d)) for d in DIRECTION_ORDER}


def partition(layers: Sequence[Layer], hardware: HardwareSpec, num_nodes: int,
              speeds: Sequence[float] | None = None, dtype: str = "float32",
              max_states: int = 4096) -> InferencePartition:
    """Choose per layer a split direction (N, C, H, W or replicated) minimising predicted latency.

    layers: the inference graph in topological order (`core.shapemap.Layer`, graph inputs as kind
    "input"). speeds: relative node speeds (heterogeneous nodes get proportional, uneven parts).
    """
    model = CostModel(layers, hardware, num_nodes, speeds, dtype, max_states=max_states)
    best, exact = _search(model)
    base = baselines(model)
    if not exact:      # a beam may miss; never return worse than a single-direction plan
        cost = model.plan_latency(best)
        for d in DIRECTION_ORDER:
            if base[_name(d)] < cost:
                best, cost = model.single_direction(d), base[_name(d)]
    return describe(model, best, base, exact)
