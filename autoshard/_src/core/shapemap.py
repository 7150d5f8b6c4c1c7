"""ShapeMaps: which part of a tensor each node holds or needs, for BBGraP inference partitioning (pure).

BBGraP (shared/papers/bbgrap-black-box-graph-partitioner.md, §3) splits each layer's output over the
nodes along one direction (N, C, H or W) and derives, from kernel, stride, dilation and padding, the
input each node needs (Eq. 1-6). This module is that arithmetic on plain data:

- `IntervalSet` per dimension and `ShapeMap`, a box of them (Fig. 2: several ranges per dim allowed);
- `split_sizes` / `Split`: the output split, Eq. 1 with round-robin remainders, or proportional to
  per-node weights (heterogeneous nodes, the paper's future work) by largest remainders;
- `true_kernel_extent` (Eq. 2), `input_interval_size` (Eq. 3), `WindowDim.input_interval` (Eq. 4-6);
- `Window`: a conv's or pool's geometry in lax terms. The `Layer` descriptors and `required_input`
  (per layer kind, what an output ShapeMap reads) are in `core.layers`.

Conventions. Tensors are channels-last: NHWC, or NWC / NC at lower rank, as Flax and
`lax.conv_general_dilated(..., dimension_numbers=("NHWC", "HWIO", "NHWC"))` use; a tracer transposes
other layouts into this one. Intervals are half-open [start, stop) in unpadded coordinates: the
paper's Left/Right (Eq. 4-5) are our start/stop with Right exclusive (Eq. 5 gives node 0
Right = IV - P_left, which is the interval's length). Where an edge window's taps fall in the
padding, the interval is the hull of the elements actually read, tighter than Eq. 4-5's window hull.
Not represented: lhs_dilation (transposed convs, refused) and batch_group_count (a tracer refuses it).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from fractions import Fraction
from typing import NamedTuple

from .errors import ConfigError, PlanError

# ---- intervals ---------------------------------------------------------------------------------------


class Interval(NamedTuple):
    """Half-open [start, stop) along one dimension."""

    start: int
    stop: int

    @property
    def size(self) -> int:
        return max(0, self.stop - self.start)


def _normalise(intervals: Iterable[Sequence[int]]) -> tuple[Interval, ...]:
    """Sorted, merged, non-empty intervals; a reversed pair (a negative size) is an error."""
    pairs = []
    for pair in intervals:
        start, stop = (int(v) for v in pair)
        if stop < start:
            raise ConfigError(f"autoshard: interval [{start}, {stop}) has negative size; give (start, stop) "
                              "with start <= stop.")
        if stop > start:
            pairs.append((start, stop))
    merged: list[list[int]] = []
    for start, stop in sorted(pairs):
        if merged and start <= merged[-1][1]:           # overlapping or touching: one range
            merged[-1][1] = max(merged[-1][1], stop)
        else:
            merged.append([start, stop])
    return tuple(Interval(a, b) for a, b in merged)


@dataclasses.dataclass(frozen=True)
class IntervalSet:
    """A union of disjoint ranges along one dimension (kept sorted and merged)."""

    intervals: tuple[Interval, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "intervals", _normalise(self.intervals))

    @classmethod
    def range(cls, start: int, stop: int) -> IntervalSet:
        return cls(((start, stop),))

    @property
    def size(self) -> int:
        return sum(iv.size for iv in self.intervals)

    @property
    def is_empty(self) -> bool:
        return not self.intervals

    @property
    def hull(self) -> Interval:
        """The smallest single interval holding every range ((0, 0) when empty)."""
        return Interval(self.intervals[0].start, self.intervals[-1].stop) if self.intervals else Interval(0, 0)

    def union(self, other: IntervalSet) -> IntervalSet:
        return IntervalSet(self.intervals + other.intervals)

    def intersect(self, other: IntervalSet) -> IntervalSet:
        overlaps = ((max(a.start, b.start), min(a.stop, b.stop)) for a in self.intervals for b in other.intervals)
        return IntervalSet(tuple((lo, hi) for lo, hi in overlaps if hi > lo))

    def issubset(self, other: IntervalSet) -> bool:
        return self.intersect(other) == self

    def covers(self, start: int, stop: int) -> bool:
        """Whether [start, stop) lies inside one range."""
        return any(iv.start <= start and stop <= iv.stop for iv in self.intervals)

    def map(self, fn: Callable[[Interval], Interval]) -> IntervalSet:
        """The union of `fn` applied to each range."""
        return IntervalSet(tuple(fn(iv) for iv in self.intervals))

    def __str__(self) -> str:
        return "|".join(f"{iv.start}:{iv.stop}" for iv in self.intervals) or "-"


# ---- ShapeMaps -----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ShapeMap:
    """A box of a tensor: one IntervalSet per dimension (§3.1, Fig. 2). An empty box has every dim empty,
    so that all empty boxes of one rank compare equal."""

    dims: tuple[IntervalSet, ...]

    def __post_init__(self) -> None:
        dims = tuple(d if isinstance(d, IntervalSet) else IntervalSet(d) for d in self.dims)
        if any(d.is_empty for d in dims):
            dims = tuple(IntervalSet() for _ in dims)
        object.__setattr__(self, "dims", dims)

    @classmethod
    def box(cls, *ranges: tuple[int, int]) -> ShapeMap:
        """`ShapeMap.box((0, 1), (0, 8), (2, 5), (0, 4))`: one range per dimension."""
        return cls(tuple(IntervalSet.range(a, b) for a, b in ranges))

    @classmethod
    def full(cls, shape: Sequence[int]) -> ShapeMap:
        return cls.box(*((0, s) for s in shape))

    @classmethod
    def empty(cls, rank: int) -> ShapeMap:
        return cls(tuple(IntervalSet() for _ in range(rank)))

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def is_empty(self) -> bool:
        return any(d.is_empty for d in self.dims)

    @property
    def extents(self) -> tuple[int, ...]:
        """Elements per dimension."""
        return tuple(d.size for d in self.dims)

    @property
    def num_elements(self) -> int:
        return math.prod(self.extents)

    def intersect(self, other: ShapeMap) -> ShapeMap:
        return ShapeMap(tuple(a.intersect(b) for a, b in zip(self.dims, other.dims, strict=True)))

    def issubset(self, other: ShapeMap) -> bool:
        return self.is_empty or all(a.issubset(b) for a, b in zip(self.dims, other.dims, strict=True))

    def with_dim(self, axis: int, dim: IntervalSet) -> ShapeMap:
        return ShapeMap(self.dims[:axis] + (dim,) + self.dims[axis + 1:])

    def __str__(self) -> str:
        return "[" + ", ".join(str(d) for d in self.dims) + "]"


def union_size(maps: Sequence[ShapeMap]) -> int:
    """Elements in the union of boxes (counted once where they overlap): a sweep over the first dim's
    elementary segments, recursing on the boxes that cover each segment."""
    boxes = [m for m in maps if not m.is_empty]
    if not boxes:
        return 0
    if boxes[0].rank == 0:
        return 1
    cuts = sorted({p for b in boxes for iv in b.dims[0].intervals for p in iv})
    total = 0
    for lo, hi in zip(cuts, cuts[1:], strict=False):
        rest = [ShapeMap(b.dims[1:]) for b in boxes if b.dims[0].covers(lo, hi)]
        if rest:
            total += (hi - lo) * union_size(rest)
    return total


# ---- directions and output splits (Eq. 1) -------------------------------------------------------------

DIRECTIONS = ("N", "C", "H", "W")


def check_int(what: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ConfigError(f"autoshard: {what}={value!r} must be an int >= {minimum}.")
    return int(value)


def _check_direction(direction: object) -> None:
    if direction not in DIRECTIONS:
        raise ConfigError(f"autoshard: split direction {direction!r} is unknown; use one of {', '.join(DIRECTIONS)} "
                          "(or None for a replicated output).")


def direction_axis(direction: str, rank: int) -> int:
    """The axis a direction names in the channels-last layout: N=0, C=last, W=rank-2, H=rank-3."""
    _check_direction(direction)
    axis = {"N": 0, "C": rank - 1, "W": rank - 2, "H": rank - 3}[direction]
    if rank < 2 or (axis < 1 and direction != "N"):
        raise ConfigError(f"autoshard: direction {direction!r} does not exist on a rank-{rank} tensor "
                          "(channels-last: NC, NWC, NHWC); split along a direction the tensor has.")
    return axis


def split_sizes(total: int, num_nodes: int, weights: Sequence[float] | None = None,
                where: str = "the split dimension") -> tuple[int, ...]:
    """How many elements of `total` each node gets, in node order.

    Even (Eq. 1): floor(O / N_d) each, the remainder one each round-robin from node 0 (8 over 3 ->
    3, 3, 2). Weighted: node i's share is total * w_i / sum(w) rounded by largest remainders, ties to the
    lower node, so every size is within one element of its share and equal weights reproduce Eq. 1.
    A weighted node whose share is under one element may get zero.
    """
    total = check_int(f"size of {where}", total, 0)
    num_nodes = check_int("num_nodes", num_nodes, 1)
    if num_nodes > total:
        raise PlanError(f"autoshard: cannot split {where} of size {total} over {num_nodes} nodes (more nodes than "
                        f"elements); use at most {total} nodes along it or split another direction.")
    if weights is None:
        base, extra = divmod(total, num_nodes)
        return tuple(base + (i < extra) for i in range(num_nodes))
    fractions = _check_weights(weights, num_nodes)
    ideal = [total * f / sum(fractions) for f in fractions]    # exact rationals: deterministic ties
    sizes = [math.floor(x) for x in ideal]
    by_remainder = sorted(range(num_nodes), key=lambda i: (sizes[i] - ideal[i], i))
    for i in by_remainder[: total - sum(sizes)]:
        sizes[i] += 1
    return tuple(sizes)


def _check_weights(weights: Sequence[float], num_nodes: int) -> list[Fraction]:
    weights = tuple(weights)
    if len(weights) != num_nodes:
        raise PlanError(f"autoshard: {len(weights)} node weights {weights!r} for {num_nodes} nodes; give one "
                        "weight (relative speed) per node.")
    ok = all(isinstance(w, numbers.Real) and not isinstance(w, bool) and math.isfinite(w) and w > 0
             for w in weights)
    if not ok:
        raise PlanError(f"autoshard: node weights {weights!r} must be finite numbers > 0 (relative node speeds); "
                        "leave out a node that should get no work.")
    return [Fraction(w) for w in weights]


@dataclasses.dataclass(frozen=True)
class Split:
    """A layer's output split: contiguous blocks along `direction` in node order, sized by Eq. 1 or by
    `weights` (relative node speeds). direction=None: every node computes the whole output."""

    direction: str | None
    num_nodes: int
    weights: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.direction is not None:
            _check_direction(self.direction)
        check_int("num_nodes", self.num_nodes, 1)
        if self.weights is not None:
            object.__setattr__(self, "weights", tuple(self.weights))
            _check_weights(self.weights, self.num_nodes)

    def sizes(self, shape: Sequence[int], where: str = "the output") -> tuple[int, ...]:
        """Elements per node along the split axis (the whole output size each when replicated)."""
        if self.direction is None:
            return (math.prod(shape),) * self.num_nodes
        axis = direction_axis(self.direction, len(shape))
        return split_sizes(shape[axis], self.num_nodes, self.weights, f"direction {self.direction} of {where}")

    def regions(self, shape: Sequence[int], where: str = "the output") -> tuple[ShapeMap, ...]:
        """Each node's part of an output of this shape."""
        full = ShapeMap.full(shape)
        if self.direction is None:
            return (full,) * self.num_nodes
        axis = direction_axis(self.direction, len(shape))
        offsets = [0]
        for size in self.sizes(shape, where):
            offsets.append(offsets[-1] + size)
        return tuple(full.with_dim(axis, IntervalSet.range(a, b)) for a, b in zip(offsets, offsets[1:], strict=False))


# ---- windows: conv and pooling geometry (Eq. 2-6) ---------------------------------------------------------


def true_kernel_extent(kernel: int, dilation: int) -> int:
    """Eq. 2: tK = (K - 1) * D + 1, the input span one dilated kernel covers."""
    return (kernel - 1) * dilation + 1


def input_interval_size(num_outputs: int, kernel: int, stride: int, dilation: int) -> int:
    """Eq. 3: IV = (O - 1) * S + tK, the (padded) input span that O consecutive outputs read."""
    return 0 if num_outputs <= 0 else (num_outputs - 1) * stride + true_kernel_extent(kernel, dilation)


class WindowDim(NamedTuple):
    """One spatial dimension of a window: kernel, stride, dilation and (lo, hi) padding."""

    kernel: int
    stride: int = 1
    dilation: int = 1
    pad_lo: int = 0
    pad_hi: int = 0

    def output_size(self, input_size: int) -> int:
        padded = input_size + self.pad_lo + self.pad_hi
        extent = true_kernel_extent(self.kernel, self.dilation)
        if padded < extent:
            raise ConfigError(f"autoshard: kernel {self.kernel} with dilation {self.dilation} spans {extent} elements, "
                              f"more than the padded input {padded} (= {input_size} + padding "
                              f"({self.pad_lo}, {self.pad_hi})); pad more or use a smaller kernel.")
        return (padded - extent) // self.stride + 1

    def input_interval(self, outputs: Interval, input_size: int) -> Interval:
        """Eq. 4-6: the input a run of outputs reads. The paper's Left = S * (outputs before it) - P_left
        (Eq. 4) and Right = Left + IV (Eq. 3, 5), cropped at the borders by its padding terms, are the hull
        of the windows; we return the hull of the elements they read inside [0, input_size), which is
        the same wherever the edge windows end on real elements, and tighter where an edge window's taps
        fall in the padding (dilation gaps, strides over the kernel, padding over a node's share)."""
        first, last = input_size, -1
        for k in range(self.kernel):
            tap = k * self.dilation - self.pad_lo              # input index tap k reads for output 0
            lowest = max(outputs.start, -(tap // self.stride))  # first output whose tap k is >= 0
            highest = min(outputs.stop - 1, (input_size - 1 - tap) // self.stride)   # last one < input_size
            if lowest <= highest:
                first, last = min(first, lowest * self.stride + tap), max(last, highest * self.stride + tap)
        return Interval(first, last + 1) if last >= first else Interval(0, 0)


def node_input_intervals(output_sizes: Sequence[int], window: WindowDim, input_size: int) -> tuple[Interval, ...]:
    """pI_(d,i) (Eq. 6) for every node, given the output sizes pO_(d,i) of Eq. 1 in node order."""
    result, offset = [], 0
    for size in output_sizes:
        result.append(window.input_interval(Interval(offset, offset + size), input_size))
        offset += size
    return tuple(result)


def _pairs(value: object, length: int, what: str) -> tuple[tuple[int, int], ...]:
    try:
        pairs = tuple((int(lo), int(hi)) for lo, hi in value)  # type: ignore[union-attr]
    except (TypeError, ValueError) as err:
        raise ConfigError(f"autoshard: {what}={value!r} must be one (lo, hi) pair of ints per spatial dim, "
                          "as lax.conv_general_dilated's explicit padding.") from err
    if len(pairs) != length:
        raise ConfigError(f"autoshard: {what}={value!r} has {len(pairs)} pairs for {length} spatial dims.")
    return pairs


@dataclasses.dataclass(frozen=True)
class Window:
    """A conv or pooling window over the spatial dims (H, W order), in lax's terms: `kernel` is the rhs
    spatial shape / reduce_window's window_dimensions, `strides` window_strides, `padding` explicit
    (lo, hi) pairs (negative crops, as in lax), `dilation` rhs_dilation / window_dilation,
    `lhs_dilation` lhs_dilation / base_dilation. Omitted fields default to 1 (padding to 0)."""

    kernel: tuple[int, ...]
    strides: tuple[int, ...] | None = None
    padding: tuple[tuple[int, int], ...] | None = None
    dilation: tuple[int, ...] | None = None
    lhs_dilation: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        kernel = tuple(check_int("window kernel size", k, 1) for k in self.kernel)
        n = len(kernel)
        ones = (1,) * n

        def ints(name: str, value: object) -> tuple[int, ...]:
            got = tuple(check_int(f"window {name}", v, 1) for v in (ones if value is None else value))
            if len(got) != n:
                raise ConfigError(f"autoshard: window {name}={value!r} has {len(got)} entries for a {n}-D kernel "
                                  f"{kernel}; give one per spatial dim.")
            return got

        fields = {"kernel": kernel, "strides": ints("strides", self.strides),
                  "dilation": ints("dilation", self.dilation), "lhs_dilation": ints("lhs_dilation", self.lhs_dilation),
                  "padding": _pairs(((0, 0),) * n if self.padding is None else self.padding, n, "window padding")}
        for name, value in fields.items():
            object.__setattr__(self, name, value)
        if self.lhs_dilation != ones:
            raise ConfigError(f"autoshard: lhs_dilation={self.lhs_dilation} (a transposed convolution or dilated "
                              "pooling base) is not supported by the inference partitioner yet; keep that layer "
                              "replicated (Split(None, n)).")

    def dim(self, i: int) -> WindowDim:
        lo, hi = self.padding[i]  # type: ignore[index]
        return WindowDim(self.kernel[i], self.strides[i], self.dilation[i], lo, hi)  # type: ignore[index]

    def output_spatial(self, input_spatial: Sequence[int]) -> tuple[int, ...]:
        return tuple(self.dim(i).output_size(s) for i, s in enumerate(input_spatial))
