"""Which data transfers an inference partition keeps: BBGraP's graph optimiser (§3.3, Fig. 5), pure.

The initial partition (§3.2) synchronises all nodes after every layer: each node sends its whole part
of a layer's output to every other node. The optimiser compares, per node, the input the next layer
reads (`required_input`, Eq. 3-6) with the output that node computed itself, and keeps only the rest:

- Fig. 5(c) required == local output: nothing is sent, crop and concatenation go (`Case.LOCAL`);
- Fig. 5(d) required inside the local output: a crop, nothing sent (`Case.CROP`);
- Fig. 5(b) required = local output + borders: only the halo is fetched (`Case.HALO`);
- Fig. 5(e) part local, part elsewhere (also a change of split direction): crop and fetch the part
  held elsewhere (`Case.CROP_FETCH`);
- the whole tensor needed (a channel split feeding a conv, a reduction over the split dim): full
  synchronisation, and only there (`Case.GATHER`).

Splits are partitions (disjoint parts) or replicated (every node holds everything), so every element a
node lacks has exactly one owner to fetch it from. A layer read by several consumers sends each
(src, dst) pair the union of what they read, once.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence

from .errors import ConfigError, PlanError
from .layers import Layer, required_input
from .shapemap import ShapeMap, Split, union_size


class Case(enum.StrEnum):
    """How a node gets one operand of a layer (the cases of §3.3, Fig. 5)."""

    NOTHING = "nothing"          # it reads none of it (a concat operand outside its part)
    LOCAL = "local"              # Fig. 5(c)
    CROP = "crop"                # Fig. 5(d)
    HALO = "halo"                # Fig. 5(b)
    CROP_FETCH = "crop-fetch"    # Fig. 5(e)
    GATHER = "gather"            # full synchronisation


def classify(required: ShapeMap, local: ShapeMap, full: ShapeMap) -> Case:
    """The Fig. 5 case of a node that reads `required` and computed `local` of a tensor `full`."""
    if required.is_empty:
        return Case.NOTHING
    if required == local:
        return Case.LOCAL
    if required.issubset(local):
        return Case.CROP
    if required == full:
        return Case.GATHER
    if not local.is_empty and local.issubset(required):
        return Case.HALO
    return Case.CROP_FETCH


@dataclasses.dataclass(frozen=True)
class EdgeTransfers:
    """One operand edge producer -> consumer, per consumer node (indices are node ids)."""

    producer: str
    consumer: str
    operand: int
    required: tuple[ShapeMap, ...]             # [node]: the producer output its part of the consumer reads
    cases: tuple[Case, ...]                    # [node]
    fetched: tuple[tuple[ShapeMap, ...], ...]  # [dst][src]: what dst receives from src (empty when src == dst)


@dataclasses.dataclass(frozen=True)
class PairTransfer:
    """What src sends dst of one layer's output after the optimiser, against the initial full copy."""

    src: int
    dst: int
    regions: tuple[ShapeMap, ...]   # one per consumer edge that reads something of src's part (may overlap)
    elements: int                   # in their union, sent once
    nbytes: int
    initial_elements: int           # the initial partition's copy: src's part, less what dst holds itself
    initial_nbytes: int

    @property
    def kept(self) -> bool:
        return self.elements > 0

    @property
    def removed_nbytes(self) -> int:
        return self.initial_nbytes - self.nbytes


@dataclasses.dataclass(frozen=True)
class LayerTransfers:
    """The transfers of one layer's output: to each consumer edge per node, and per (src, dst) pair."""

    layer: str
    split: Split
    outputs: tuple[ShapeMap, ...]        # [node]: its part of this layer's output
    edges: tuple[EdgeTransfers, ...]     # one per consumer operand reading this layer
    pairs: tuple[PairTransfer, ...]      # every (src, dst), src != dst, when the output is read at all

    @property
    def kept(self) -> tuple[PairTransfer, ...]:
        return tuple(p for p in self.pairs if p.kept)

    @property
    def removed(self) -> tuple[PairTransfer, ...]:
        """Pairs the optimiser dropped entirely (cropped pairs are in `kept`, with `removed_nbytes`)."""
        return tuple(p for p in self.pairs if not p.kept and p.initial_elements)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pairs)

    @property
    def initial_nbytes(self) -> int:
        return sum(p.initial_nbytes for p in self.pairs)

    def pair(self, src: int, dst: int) -> PairTransfer:
        for p in self.pairs:
            if (p.src, p.dst) == (src, dst):
                return p
        raise PlanError(f"autoshard: layer {self.layer!r} has no transfer {src} -> {dst}; its output is not read, "
                        f"or a node id is outside 0..{len(self.outputs) - 1} or src == dst.")


@dataclasses.dataclass(frozen=True)
class TransferAnalysis:
    """The optimised transfers of a whole partition, layer by layer (in the order given)."""

    num_nodes: int
    layers: tuple[LayerTransfers, ...]

    def layer(self, name: str) -> LayerTransfers:
        for lt in self.layers:
            if lt.layer == name:
                return lt
        raise PlanError(f"autoshard: no layer {name!r}; layers: {[lt.layer for lt in self.layers]}.")

    def inputs_of(self, consumer: str) -> tuple[EdgeTransfers, ...]:
        """The edges into `consumer`, in operand order."""
        edges = [e for lt in self.layers for e in lt.edges if e.consumer == consumer]
        return tuple(sorted(edges, key=lambda e: e.operand))

    @property
    def nbytes(self) -> int:
        return sum(lt.nbytes for lt in self.layers)

    @property
    def initial_nbytes(self) -> int:
        return sum(lt.initial_nbytes for lt in self.layers)

    def pair_nbytes(self) -> dict[tuple[int, int], int]:
        """Bytes each (src, dst) link carries over the whole partition, kept transfers only."""
        total: dict[tuple[int, int], int] = {}
        for p in (p for lt in self.layers for p in lt.kept):
            total[p.src, p.dst] = total.get((p.src, p.dst), 0) + p.nbytes
        return total

    def summary(self) -> str:
        """One line per layer: split, per-node extents, cases of its consumers, bytes kept / initial."""
        lines = []
        for lt in self.layers:
            extents = " ".join("x".join(map(str, o.extents)) for o in lt.outputs)
            cases = "; ".join(f"{e.consumer}[{e.operand}]: {','.join(e.cases)}" for e in lt.edges)
            lines.append(f"{lt.layer:<16} {lt.split.direction or 'replicated':<10} {extents:<40} "
                         f"{lt.nbytes}/{lt.initial_nbytes} B  {cases}")
        return "\n".join(lines)


def _validate(layers: Sequence[Layer], splits: Mapping[str, Split]) -> int:
    """The common node count; raises for unknown producers, shape mismatches and missing splits."""
    seen: dict[str, Layer] = {}
    for layer in layers:
        if layer.name in seen:
            raise ConfigError(f"autoshard: two layers are named {layer.name!r}; give each a unique name.")
        for src, shape in zip(layer.inputs, layer.input_shapes, strict=True):
            if src not in seen:
                raise ConfigError(f"autoshard: layer {layer.name!r} reads {src!r}, which is not an earlier layer; "
                                  "list layers in topological order and add kind 'input' layers for graph inputs.")
            if seen[src].output_shape != shape:
                raise ConfigError(f"autoshard: layer {layer.name!r} reads {src!r} as shape {shape}, but it outputs "
                                  f"{seen[src].output_shape}; fix either shape.")
        seen[layer.name] = layer
    missing = [name for name in seen if name not in splits]
    if missing:
        raise PlanError(f"autoshard: no split for layers {missing}; give a Split (or Split(None, n)) for every layer.")
    counts = {splits[name].num_nodes for name in seen}
    if len(counts) > 1:
        raise PlanError(f"autoshard: splits use different node counts {sorted(counts)}; every layer must be "
                        "split over the same nodes.")
    return counts.pop() if counts else 1


def _edge(producer: Layer, consumer: str, operand: int, required: Sequence[ShapeMap],
          outputs: Sequence[ShapeMap]) -> EdgeTransfers:
    """Fig. 5 per node: what it reads, its case, and what it must fetch from each other node."""
    full = ShapeMap.full(producer.output_shape)
    nodes = range(len(outputs))
    cases = tuple(classify(required[d], outputs[d], full) for d in nodes)
    empty = ShapeMap.empty(full.rank)
    fetched = tuple(tuple(empty if s == d or required[d].issubset(outputs[d]) else required[d].intersect(outputs[s])
                          for s in nodes) for d in nodes)
    return EdgeTransfers(producer.name, consumer, operand, tuple(required), cases, fetched)


def _pairs(layer: Layer, edges: Sequence[EdgeTransfers], outputs: Sequence[ShapeMap]) -> tuple[PairTransfer, ...]:
    if not edges:
        return ()     # the network's output: assembling it is the emitter's business
    pairs = []
    for dst in range(len(outputs)):
        for src in range(len(outputs)):
            if src == dst:
                continue
            regions = tuple(r for r in (e.fetched[dst][src] for e in edges) if not r.is_empty)
            elements = union_size(regions)
            initial = outputs[src].num_elements - outputs[src].intersect(outputs[dst]).num_elements
            pairs.append(PairTransfer(src, dst, regions, elements, elements * layer.itemsize,
                                      initial, initial * layer.itemsize))
    return tuple(pairs)


def analyse_transfers(layers: Sequence[Layer], splits: Mapping[str, Split]) -> TransferAnalysis:
    """Run the graph optimiser over `layers` (topological order) with each layer's output split.

    Returns per layer its per-node output parts, per consumer edge the Fig. 5 case and fetched regions
    per node, and per (src, dst) pair the kept transfer (elements, bytes) beside the initial full copy.
    """
    num_nodes = _validate(layers, splits)
    outputs = {layer.name: splits[layer.name].regions(layer.output_shape, f"layer {layer.name!r} output "
                                                     f"{layer.output_shape}") for layer in layers}
    by_name = {layer.name: layer for layer in layers}
    edges: dict[str, list[EdgeTransfers]] = {layer.name: [] for layer in layers}
    for consumer in layers:
        per_node = [required_input(consumer, region) for region in outputs[consumer.name]]
        for operand, src in enumerate(consumer.inputs):
            required = [reads[operand] for reads in per_node]
            edges[src].append(_edge(by_name[src], consumer.name, operand, required, outputs[src]))
    result = tuple(LayerTransfers(layer.name, splits[layer.name], outputs[layer.name], tuple(edges[layer.name]),
                                  _pairs(layer, edges[layer.name], outputs[layer.name])) for layer in layers)
    return TransferAnalysis(num_nodes, result)
