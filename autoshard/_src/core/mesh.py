"""Device meshes as plain data, and which links each mesh axis uses (pure: no jax import).

The planner reasons about a mesh by its axis names and sizes only; `mesh_spec` reads them off a
dict, a `MeshSpec` or anything shaped like `jax.sharding.Mesh`/`AbstractMesh` (duck-typed, so this
module loads without jax). `axis_links` maps each axis to the link its collectives run over, which
is what makes an inter-node axis expensive (TAP §4.6: inter-node communication is the bottleneck).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from typing import Any

from .errors import MeshError
from .hardware import HardwareSpec


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """Ordered mesh axes `((name, size), ...)`; devices are laid out row-major (last axis fastest)."""

    axes: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        axes = tuple(self.axes) if isinstance(self.axes, (tuple, list)) else None
        if not axes:
            raise MeshError(f"autoshard: mesh axes={self.axes!r} must hold at least one (name, size) axis, "
                            "e.g. {'data': 8}.")
        seen: set[str] = set()
        clean = []
        for axis in axes:
            if not (isinstance(axis, (tuple, list)) and len(axis) == 2):
                raise MeshError(f"autoshard: mesh axis {axis!r} must be a (name, size) pair.")
            name, size = axis
            if not isinstance(name, str) or not name:
                raise MeshError(f"autoshard: mesh axis name {name!r} must be a non-empty string.")
            if name in seen:
                raise MeshError(f"autoshard: mesh axis name {name!r} appears twice in {self.axes!r}; give each "
                                "axis a unique name.")
            seen.add(name)
            # numpy ints are fine (mesh shapes often come from np.prod); bools and floats are not
            if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1:
                raise MeshError(f"autoshard: mesh axis {name!r} has size {size!r}; sizes must be ints >= 1 "
                                "(use size 1 for an unused axis, or drop it).")
            clean.append((name, int(size)))
        object.__setattr__(self, "axes", tuple(clean))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.axes)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(s for _, s in self.axes)

    @property
    def size(self) -> int:
        """Number of devices."""
        return math.prod(self.sizes)

    def axis_size(self, name: str) -> int:
        for n, s in self.axes:
            if n == name:
                return s
        raise MeshError(f"autoshard: mesh axis {name!r} is not in mesh {self}; valid axes: {list(self.names)}.")

    def to_dict(self) -> dict[str, int]:
        return dict(self.axes)

    def __str__(self) -> str:
        return " x ".join(f"{n}={s}" for n, s in self.axes)


def mesh_spec(mesh: Any) -> MeshSpec:
    """A `MeshSpec` from a dict `{name: size}` (insertion order), a `MeshSpec`, or an object with
    `.axis_names` and a `.shape` mapping name -> size (`jax.sharding.Mesh`, `AbstractMesh`)."""
    if isinstance(mesh, MeshSpec):
        return mesh
    if isinstance(mesh, Mapping):
        return MeshSpec(tuple(mesh.items()))
    names, shape = getattr(mesh, "axis_names", None), getattr(mesh, "shape", None)
    if names is not None and isinstance(shape, Mapping):
        check_distinct_devices(mesh)
        missing = [n for n in names if n not in shape]
        if missing:
            raise MeshError(f"autoshard: mesh {mesh!r} names axes {missing} that its .shape {dict(shape)!r} lacks.")
        return MeshSpec(tuple((n, shape[n]) for n in names))
    raise MeshError(f"autoshard: mesh={mesh!r} (type {type(mesh).__name__}) is not a mesh; pass a dict such as "
                    "{'data': 2, 'model': 4}, a MeshSpec or a jax.sharding.Mesh.")


def check_distinct_devices(mesh: Any, where: str = "autoshard") -> None:
    """MeshError if a concrete mesh (one with a `.devices` array, a `jax.sharding.Mesh`) lists a device
    more than once: jax builds such a Mesh but fails with a bare assertion when an array is placed on it."""
    try:
        devices = getattr(mesh, "devices", None)
    except (TypeError, ValueError):     # a jax AbstractMesh: axes, no devices
        devices = None
    flat = list(getattr(devices, "flat", ()))
    keys = [(getattr(d, "platform", ""), getattr(d, "id", id(d))) for d in flat]
    counts = {k: keys.count(k) for k in set(keys)} if len(set(keys)) < len(keys) else {}
    twice = [(d, counts[k]) for d, k in zip(flat, keys, strict=True) if counts.get(k, 0) > 1]
    if twice:
        d, n = twice[0]
        seen = set(keys)
        shape = dict(zip(getattr(mesh, "axis_names", ()), getattr(devices, "shape", ()), strict=False))
        raise MeshError(
            f"{where}: the jax Mesh {shape} lists device {d} {n} times ({len(flat)} slots, "
            f"{len(seen)} distinct devices); each mesh position needs its own device. Fix: build it from distinct "
            "devices, e.g. jax.make_mesh(sizes, names) or Mesh(np.array(jax.devices()[:n]).reshape(sizes), names), "
            "or pass the axis sizes as a dict and let autoshard pick the devices.")


def candidate_meshes(devices: int, max_axes: int = 3) -> list[MeshSpec]:
    """Meshes to search for mesh="auto": every ordered factorization of `devices` into 1..`max_axes`
    axes of size >= 2 (and the 1-axis mesh), named "a0", "a1", ... — the planner gives names no
    meaning. Ordered by axis count, then sizes descending, so results are deterministic."""
    if isinstance(devices, bool) or not isinstance(devices, numbers.Integral) or devices < 1:
        raise MeshError(f"autoshard: devices={devices!r} must be an int >= 1 (the number of devices to plan for).")
    if isinstance(max_axes, bool) or not isinstance(max_axes, numbers.Integral) or max_axes < 1:
        raise MeshError(f"autoshard: max_axes={max_axes!r} must be an int >= 1.")
    found = [(int(devices),)]
    for k in range(2, int(max_axes) + 1):
        found += sorted(_factorizations(int(devices), k), reverse=True)
    return [MeshSpec(tuple((f"a{i}", s) for i, s in enumerate(sizes))) for sizes in found]


def _factorizations(n: int, k: int) -> list[tuple[int, ...]]:
    """Ordered k-tuples of factors >= 2 whose product is n (over n's divisors: cost independent of n's size)."""
    if k == 1:
        return [(n,)] if n >= 2 else []
    return [(d, *rest) for d in _divisors(n) if d >= 2 for rest in _factorizations(n // d, k - 1)]


def _divisors(n: int) -> list[int]:
    """The divisors of n in ascending order (trial division up to sqrt(n))."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


@dataclasses.dataclass(frozen=True)
class Link:
    """The link a mesh axis's ring collectives are bottlenecked by."""

    bandwidth: float    # bytes/s per device per direction
    latency: float      # seconds per collective step
    inter_node: bool


def axis_links(mesh: Any, hw: HardwareSpec) -> dict[str, Link]:
    """Link per mesh axis. Devices are numbered row-major over the mesh (last axis fastest) and
    packed `devices_per_node` to a node. An axis is intra-node when each of its device groups stays
    inside one node (for aligned meshes: stride * size <= devices_per_node, stride = product of the
    later axes' sizes); otherwise its ring crosses nodes and runs at the inter-node link's speed."""
    mesh = mesh_spec(mesh)
    intra = Link(hw.intra_node_bandwidth, hw.intra_node_latency, inter_node=False)
    inter = Link(hw.inter_node_bandwidth, hw.inter_node_latency, inter_node=True)
    sizes = mesh.sizes
    return {name: intra if _within_nodes(math.prod(sizes[:i]), size, math.prod(sizes[i + 1:]), hw.devices_per_node)
            else inter for i, (name, size) in enumerate(mesh.axes)}


def _within_nodes(outer: int, size: int, stride: int, per_node: int) -> bool:
    """Whether every group of an axis (`size` devices `stride` apart, `outer` blocks of size*stride
    devices) stays inside one node of `per_node` devices. Arithmetic, exact also when node
    boundaries cut groups unevenly: a block starting at residue r (mod per_node) keeps its groups
    in one node iff r + size*stride <= per_node; residues repeat every per_node/gcd blocks, so at
    most per_node blocks are looked at, whatever the device count."""
    if size == 1:
        return True
    block = size * stride
    if block > per_node:
        return False
    cycle = min(outer, per_node // math.gcd(block, per_node))
    return all((o * block) % per_node + block <= per_node for o in range(cycle))
