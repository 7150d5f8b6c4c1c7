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
the result is never worse than them. Ties go to the earlier option in DIRECTION_ORDER, layer by layer,
and to the unfused step.

Fused layers (§5's future work): a step may also cover a run of up to `max_fuse` conv/pool/elementwise
layers, each read only by the next, split H or W. Each node computes the grown regions the run's
last output needs (required_input backwards: redundant halo compute) and receives the head's grown
input once, instead of one halo exchange per layer; the DP takes it where fewer messages pay for
the extra compute. Intermediate layers of a run are dead after it, so the frontier state is unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from ..core.cost import alpha_beta
from ..core.errors import ConfigError, PlanError
from ..core.hardware import HardwareSpec
from ..core.layers import Layer, required_input
from ..core.shapemap import ShapeMap, Split, direction_axis
from ..core.transfers import analyse_transfers

Direction = str | None                    # "N", "C", "H", "W", or None: replicated
DIRECTION_ORDER: tuple[Direction, ...] = ("N", "C", "H", "W", None)   # the tie-break order
FUSABLE_KINDS = ("conv", "pool", "elementwise", "batchnorm")
FUSED_DIRECTIONS = ("H", "W")             # N and C runs read their producer's part whole: nothing to save


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


def _as_sent(layer: Layer, fetched: ShapeMap, owned: ShapeMap, producer: Direction, consumer: Direction) -> ShapeMap:
    """What is actually sent for a fetch: a window's halo goes as whole rows of the sender's part. Eq. 4-6
    give the hull of the elements a window reads in *every* dim; along a spatial dim that is split by
    neither side it can stop short of the border (the last column when no tap reaches it), but both the
    emitted exchange and XLA's send the producer part's whole extent there."""
    if fetched.is_empty or layer.kind not in ("conv", "pool"):
        return fetched
    rank = fetched.rank
    split = {direction_axis(d, rank) for d in (producer, consumer) if d is not None}
    dims = tuple(o if 0 < i < rank - 1 and i not in split else f
                 for i, (f, o) in enumerate(zip(fetched.dims, owned.dims, strict=True)))
    return ShapeMap(dims)


# ---- the cost model -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """One layer's predicted time under a split, given its producers' splits."""

    compute: tuple[float, ...]            # [node] seconds
    receive: tuple[float, ...]            # [node] seconds, kept transfers into it, serial
    received_nbytes: tuple[int, ...]      # [node]
    from_producer: tuple[int, ...] = ()   # [distinct producer, in input order] bytes received over all nodes

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
                 max_states: int = 4096, max_fuse: int = 4) -> None:
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
        if speeds is not None:
            Split(None, num_nodes, tuple(speeds))          # checks: one finite number > 0 per node
        self.speeds = tuple(float(s) for s in speeds) if speeds is not None else (1.0,) * num_nodes
        weighted = uneven and len(set(self.speeds)) > 1
        self.weights = self.speeds if weighted else None
        if isinstance(max_states, bool) or not isinstance(max_states, int) or max_states < 1:
            raise ConfigError(f"autoshard: max_states={max_states!r} must be an int >= 1.")
        self.max_states = max_states
        if isinstance(max_fuse, bool) or not isinstance(max_fuse, int) or max_fuse < 1:
            raise ConfigError(f"autoshard: max_fuse={max_fuse!r} must be an int >= 1 (1: no fused layers).")
        self.max_fuse = max_fuse
        self._readers = {name: sum(name in layer.inputs for layer in self.layers) for name in self.by_name}
        self._index = {layer.name: i for i, layer in enumerate(self.layers)}
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
        per_producer = [0] * len(producers)
        if producers:
            # the consumer alone, its producers as stand-in inputs: the optimiser's per-edge fetches (§3.3)
            stand_ins = [Layer(f"in{i}", "input", output_shape=shape, itemsize=itemsize)
                         for i, (shape, itemsize, _) in enumerate(producers)]
            splits = {s.name: self.split(d) for s, (_, _, d) in zip(stand_ins, producers, strict=True)}
            splits[layer.name] = self.split(direction)
            analysis = analyse_transfers([*stand_ins, layer], splits)
            for edge in analysis.inputs_of(layer.name):
                k = int(edge.producer[2:])
                itemsize, owned = producers[k][1], self.split(producers[k][2]).regions(producers[k][0])
                for dst in nodes:
                    for src in nodes:
                        sent = _as_sent(layer, edge.fetched[dst][src], owned[src], producers[k][2], direction)
                        nbytes = sent.num_elements * itemsize
                        receive[dst] += self.transfer_time(nbytes)
                        received[dst] += nbytes
                        per_producer[int(edge.producer[2:])] += nbytes
        return LayerCost(compute, tuple(receive), tuple(received), tuple(per_producer))

    def fusable_runs(self, index: int) -> tuple[tuple[str, ...], ...]:
        """Runs of 2..max_fuse layers from layers[index] that can be fused: a chain of windowed or
        elementwise layers, each reading only the previous one, which nothing else reads."""
        runs: list[tuple[str, ...]] = []
        names: list[str] = []
        for layer in self.layers[index:index + self.max_fuse]:
            if layer.kind not in FUSABLE_KINDS or len(set(layer.inputs)) != 1:
                break
            if names and (layer.inputs[0] != names[-1] or self._readers[names[-1]] != 1):
                break
            names.append(layer.name)
            if len(names) >= 2:
                runs.append(tuple(names))
        return tuple(runs)

    def run_cost(self, run: tuple[str, ...], direction: Direction,
                 producers: Mapping[str, Direction]) -> tuple[LayerCost, ...]:
        """A fused run (the paper's future work, §5): each node computes its part of the run's last output
        from grown regions of the earlier layers (Eq. 3-6 backwards: redundant halo compute) and receives
        only the head's grown input, once. One cost per layer; the head carries the receive."""
        if run not in self.fusable_runs(self._index.get(run[0], len(self.layers))) or direction not in \
                FUSED_DIRECTIONS or any(direction not in self._options[n] for n in run):
            raise PlanError(f"autoshard: layers {list(run)} cannot be fused split {_name(direction)!r}; fuse a chain "
                            f"of {', '.join(FUSABLE_KINDS)} layers, each read only by the next, split H or W.")
        src = self.by_name[run[0]].inputs[0]
        key = ("fused", run, direction, producers[src])
        if key not in self._cache:
            self._cache[key] = self._run_cost(run, direction, producers[src])
        return self._cache[key]  # type: ignore[return-value]

    def _run_cost(self, run: tuple[str, ...], direction: Direction, src_direction: Direction) -> tuple[LayerCost, ...]:
        nodes, layers = range(self.num_nodes), [self.by_name[n] for n in run]
        regions = [self.split(direction).regions(layers[-1].output_shape)]
        for layer in reversed(layers[1:]):                   # grown regions, last layer to head
            regions.insert(0, tuple(required_input(layer, r)[0] for r in regions[0]))
        producer = self.by_name[layers[0].inputs[0]]
        outputs = self.split(src_direction).regions(producer.output_shape)
        reads = [required_input(layers[0], r)[0] for r in regions[0]]
        receive, received = [0.0] * self.num_nodes, [0] * self.num_nodes
        for dst in nodes:
            if not reads[dst].issubset(outputs[dst]):     # Fig. 5(b)/(e): fetch the rest from its owners
                for src in (s for s in nodes if s != dst):
                    nbytes = reads[dst].intersect(outputs[src]).num_elements * producer.itemsize
                    receive[dst] += self.transfer_time(nbytes)
                    received[dst] += nbytes
        zeros = (0.0,) * self.num_nodes
        costs = []
        for j, layer in enumerate(layers):
            per = flops_per_element(layer)
            compute = tuple(regions[j][i].num_elements * per / (self.speeds[i] * self.rate) for i in nodes)
            costs.append(LayerCost(compute, tuple(receive), tuple(received), (sum(received),)) if j == 0
                         else LayerCost(compute, zeros, (0,) * self.num_nodes, (0,)))
        return tuple(costs)

    def run_regions(self, run: tuple[str, ...], direction: Direction) -> tuple[tuple[ShapeMap, ...], ...]:
        """[layer in run][node]: the grown region each node computes."""
        regions = [self.split(direction).regions(self.by_name[run[-1]].output_shape)]
        for name in reversed(run[1:]):
            regions.insert(0, tuple(required_input(self.by_name[name], r)[0] for r in regions[0]))
        return tuple(regions)

    def plan_latency(self, directions: Mapping[str, Direction], fused: Sequence[tuple[str, ...]] = ()) -> float:
        """The predicted end-to-end latency of a plan: the sum of its steps' latencies (a layer, or a
        fused run: max over nodes of its receive plus the run's compute)."""
        missing = [n for n in self.by_name if n not in directions]
        if missing:
            raise PlanError(f"autoshard: no direction for layers {missing}; give one (or None) for every layer.")
        return sum(latency for _, latency in self.step_latencies(directions, fused))

    def step_latencies(self, directions: Mapping[str, Direction],
                       fused: Sequence[tuple[str, ...]] = ()) -> list[tuple[tuple[str, ...], float]]:
        """(layers, latency) per step of a plan, in layer order."""
        runs = {tuple(run)[0]: tuple(run) for run in fused}
        members = [n for run in runs.values() for n in run]
        if len(members) != len(set(members)):
            raise PlanError(f"autoshard: fused runs {list(fused)} overlap; give each layer to one run at most.")
        steps, skip = [], set(members)
        for name in self.by_name:
            if name in runs:
                run = runs[name]
                if len({directions[n] for n in run}) != 1:
                    raise PlanError(f"autoshard: fused run {list(run)} has several directions; give one for the run.")
                steps.append((run, run_latency(self.run_cost(run, directions[name], directions))))
            elif name not in skip:
                steps.append(((name,), self.layer_cost(name, directions[name], directions).latency))
        return steps

    def single_direction(self, direction: Direction) -> dict[str, Direction]:
        """Every layer split `direction` where its output has it, replicated elsewhere."""
        return {n: direction if direction in self.options(n) else None for n in self.by_name}


def run_latency(costs: Sequence[LayerCost]) -> float:
    """A fused run's latency: max over nodes of its receive plus the compute of every layer in it."""
    return max(sum(c.receive[i] + c.compute[i] for c in costs) for i in range(len(costs[0].compute)))


# ---- the DP over the DAG's frontier --------------------------------------------------------------------


def _last_reads(layers: Sequence[Layer]) -> dict[str, int]:
    """The index of the last layer reading each layer (its own index when nothing reads it)."""
    last = {layer.name: i for i, layer in enumerate(layers)}
    for i, layer in enumerate(layers):
        for src in layer.inputs:
            last[src] = max(last[src], i)
    return last


Step = tuple[tuple[str, ...], Direction]     # the layers of one DP step (one, or a fused run) and their split


def _search(model: CostModel) -> tuple[tuple[Step, ...], bool]:
    """The cheapest steps (a direction per layer, fused runs), and whether the search stayed exact.

    Position p has processed layers[:p]; its state is the directions of the live layers there (read at
    or after p). A step from p covers one layer, or a fused run up to p + len(run)."""
    layers, rank = model.layers, {d: i for i, d in enumerate(DIRECTION_ORDER)}
    last = _last_reads(layers)
    live_at = [tuple(layer.name for layer in layers[:p] if last[layer.name] >= p) for p in range(len(layers) + 1)]
    # per position: state -> (cost, tie key, steps so far)
    states: list[dict[tuple, tuple[float, tuple[int, ...], tuple[Step, ...]]]] = [{} for _ in range(len(layers) + 1)]
    states[0][()] = (0.0, (), ())
    exact = True
    for p, layer in enumerate(layers):
        if len(states[p]) > model.max_states:       # a beam beyond the cap: the cheapest states survive
            exact = False
            states[p] = dict(sorted(states[p].items(), key=lambda kv: kv[1][:2])[: model.max_states])
        for state, (cost, tie, steps) in states[p].items():
            live = dict(zip(live_at[p], state, strict=True))
            for run, d, latency in _moves(model, p, layer, live):
                q, after = p + len(run), {**live, **{n: d for n in run}}
                key = tuple(after[n] for n in live_at[q])
                entry = (cost + latency, (*tie, rank[d] * 8 + len(run)), (*steps, (run, d)))
                if key not in states[q] or entry[:2] < states[q][key][:2]:
                    states[q][key] = entry
        states[p] = {}
    _, _, best = min(states[-1].values(), key=lambda v: v[:2])
    return best, exact


def _moves(model: CostModel, p: int, layer: Layer, live: Mapping[str, Direction]):
    """(layers, direction, latency) of each step from position p: the layer alone in each direction it
    has, then each fused run starting there, split H or W."""
    for d in model.options(layer.name):
        yield (layer.name,), d, model.layer_cost(layer.name, d, {**live, layer.name: d}).latency
    for run in model.fusable_runs(p):
        for d in FUSED_DIRECTIONS:
            if all(d in model.options(n) for n in run):
                yield run, d, run_latency(model.run_cost(run, d, live))


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
    latency: float                        # max over nodes of receive + compute; a fused run's on its last layer
    kept_nbytes: int                      # of this layer's output sent on (graph optimiser, §3.3), per reader
    removed_nbytes: int                   # against the initial full synchronisation (§3.2)
    fused: str | None = None              # the first layer of its fused run


@dataclasses.dataclass(frozen=True)
class InferencePartition:
    """Per layer direction and split, the predicted latency, and the single-direction baselines'."""

    num_nodes: int
    speeds: tuple[float, ...]
    layers: tuple[LayerPlan, ...]
    latency: float
    baselines: Mapping[str, float]        # "N", "C", "H", "W", "replicated" -> predicted latency
    exact: bool                           # the DP explored every frontier state
    fused: tuple[tuple[str, ...], ...] = ()   # fused runs, layer names in order
    proportional: bool = False            # parts sized by the speeds (else Eq. 1's even parts)

    @property
    def weights(self) -> tuple[float, ...] | None:
        """The split weights the parts were sized by (None: even parts)."""
        return self.speeds if self.proportional else None

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
            fused = f"  fused from {lp.fused}" if lp.fused else ""
            lines.append(f"{lp.name:<16} {_name(lp.direction):<10} {extents:<40} {lp.latency * 1e3:9.4f} ms  "
                         f"sent {lp.kept_nbytes} B, removed {lp.removed_nbytes} B{fused}")
        base = ", ".join(f"{k} {v * 1e3:.4f} ms" for k, v in self.baselines.items())
        lines.append(f"predicted latency {self.latency * 1e3:.4f} ms; single-direction plans: {base}")
        return "\n".join(lines)


def describe(model: CostModel, directions: Mapping[str, Direction], baselines: Mapping[str, float] | None = None,
             exact: bool = True, fused: Sequence[tuple[str, ...]] = ()) -> InferencePartition:
    """The result record of a plan (any plan: the DP's, a baseline, one given by hand)."""
    initial = analyse_transfers(model.layers, {n: model.split(directions[n]) for n in model.by_name})
    costs: dict[str, LayerCost] = {}
    latency: dict[str, float] = {}        # a fused run's latency is booked on its last layer
    head_of: dict[str, str] = {}
    extents: dict[str, tuple[tuple[int, ...], ...]] = {}
    for run, step_latency in model.step_latencies(directions, fused):
        if len(run) == 1:
            costs[run[0]] = model.layer_cost(run[0], directions[run[0]], directions)
            extents[run[0]], latency[run[0]] = tuple(o.extents for o in initial.layer(run[0]).outputs), step_latency
            continue
        run_costs = model.run_cost(run, directions[run[0]], directions)
        for name, cost, regions in zip(run, run_costs, model.run_regions(run, directions[run[0]]), strict=True):
            costs[name], latency[name] = cost, step_latency if name == run[-1] else 0.0
            head_of[name], extents[name] = run[0], tuple(r.extents for r in regions)
    sent = {n: 0 for n in model.by_name}
    for layer in model.layers:
        srcs = tuple(dict.fromkeys(layer.inputs))
        for src, nbytes in zip(srcs, costs[layer.name].from_producer, strict=False):
            sent[src] += nbytes
    layers = tuple(LayerPlan(n, model.by_name[n].kind, directions[n], extents[n], costs[n].compute, costs[n].receive,
                             costs[n].received_nbytes, latency[n], sent[n],
                             max(0, initial.layer(n).initial_nbytes - sent[n]), head_of.get(n))
                   for n in model.by_name)
    return InferencePartition(model.num_nodes, model.speeds, layers, sum(lp.latency for lp in layers),
                              dict(baselines or {}), exact, tuple(tuple(r) for r in fused), model.weights is not None)


def baselines(model: CostModel) -> dict[str, float]:
    """Predicted latency of each single-direction plan (all C is the paper's output-channel division)."""
    return {_name(d): model.plan_latency(model.single_direction(d)) for d in DIRECTION_ORDER}


def partition(layers: Sequence[Layer], hardware: HardwareSpec, num_nodes: int,
              speeds: Sequence[float] | None = None, dtype: str = "float32",
              max_states: int = 4096, max_fuse: int = 4) -> InferencePartition:
    """Choose per layer a split direction (N, C, H, W or replicated) minimising predicted latency, and
    which runs of up to `max_fuse` layers to fuse (1: none).

    layers: the inference graph in topological order (`core.layers.Layer`, graph inputs as kind
    "input"). speeds: relative node speeds; heterogeneous nodes get proportional, uneven parts, or
    Eq. 1's even parts where those predict faster (`InferencePartition.proportional` says which).
    """
    models = [CostModel(layers, hardware, num_nodes, speeds, dtype, max_states=max_states, max_fuse=max_fuse)]
    if models[0].weights is not None:   # heterogeneous: proportional parts can lose (small maps round badly)
        models.append(CostModel(layers, hardware, num_nodes, speeds, dtype, uneven=False, max_states=max_states,
                                max_fuse=max_fuse))
    results = [_best(model) for model in models]
    return min(results, key=lambda r: r.latency)       # ties: proportional parts (the first)


def _best(model: CostModel) -> InferencePartition:
    """The DP's plan under one cost model (one way of sizing the parts)."""
    steps, exact = _search(model)
    best = {name: d for run, d in steps for name in run}
    fused = tuple(run for run, _ in steps if len(run) > 1)
    base = baselines(model)
    if not exact:      # a beam may miss; never return worse than a single-direction plan
        cost = model.plan_latency(best, fused)
        for d in DIRECTION_ORDER:
            if base[_name(d)] < cost:
                best, fused, cost = model.single_direction(d), (), base[_name(d)]
    return describe(model, best, base, exact, fused)
