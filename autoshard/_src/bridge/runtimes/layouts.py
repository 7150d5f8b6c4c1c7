"""How the pipeline runtime lays pytrees out in its stage buffers (imports jax).

Flat (`Layout`): every leaf of a stage's parameters (or of a stage's output) raveled into one 1-D
row; stages' rows stacked into a [stages, P] buffer sharded over `pipe`. The runtime's manual mode
uses it: inside `shard_map` each device sees its own rows and the data axes are explicit.

Sharded (`ShardedLayout`): for 3-D plans, whose stages split tensors over automatic mesh axes
(`data`, `model`) by their tensor plan. A leaf with spec `P(None, "model")` cannot live in a flat row
without losing its split, so leaves are grouped by the axes that split them (and dtype): group g is a
[*axis sizes, W_g] buffer split over exactly those axes, and each leaf is stored *shard-major*: its
split dims' axis pieces moved to the front, so the [j, ...] slice holds shard j of every leaf in the
group. Unpacking is a slice, a reshape and a transpose that keep the split, so XLA moves nothing;
a stage's rows for all groups stack into [stages, *axis sizes, W_g] buffers split over `pipe` too.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ...core.errors import PipelineError

Spec = tuple[tuple[str, ...], ...]


def on_one_place(tree: Any) -> Any:
    """`tree`, or host copies of its arrays when they are committed to different devices (the state an
    MPMD step returns lives on its stages' submeshes): one jax computation reads one device set."""
    places = {frozenset(x.sharding.device_set) for x in jax.tree.leaves(tree)
              if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.committed}
    return jax.device_get(tree) if len(places) > 1 else tree


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the leaves of one pytree sit in a flat 1-D buffer (leaves keep their own dtypes)."""

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    offsets: tuple[int, ...]
    size: int
    paths: tuple[str, ...] = ()     # jax.tree_util.keystr of every leaf

    def pack(self, tree: Any, width: int, dtype: Any) -> jax.Array:
        leaves = jax.tree.leaves(tree)
        parts = [jnp.ravel(x).astype(dtype) for x in leaves]
        if width > self.size:
            parts.append(jnp.zeros((width - self.size,), dtype))
        return jnp.concatenate(parts) if parts else jnp.zeros((width,), dtype)

    def structs(self) -> Any:
        return jax.tree.unflatten(self.treedef, [jax.ShapeDtypeStruct(s, d)
                                                 for s, d in zip(self.shapes, self.dtypes, strict=True)])

    def unpack(self, flat: jax.Array) -> Any:
        leaves = [lax.slice_in_dim(flat, o, o + math.prod(s)).reshape(s).astype(d)
                  for o, s, d in zip(self.offsets, self.shapes, self.dtypes, strict=True)]
        return jax.tree.unflatten(self.treedef, leaves)


def layout(tree: Any, what: str) -> Layout:
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = [x for _, x in with_paths]
    bad = [(i, x) for i, x in enumerate(leaves) if not jnp.issubdtype(x.dtype, jnp.floating)]
    if bad:
        i, x = bad[0]
        raise PipelineError(
            f"pipeline runtime: {what} has a {x.dtype} leaf (leaf {i}, shape {tuple(x.shape)}); the runtime "
            f"moves only floating-point parameters and activations between stages. Pass integer data "
            f"through the batch (every stage sees its micro-batch) or cast it to float.")
    shapes = tuple(tuple(int(d) for d in x.shape) for x in leaves)
    sizes = [math.prod(s) for s in shapes]
    offsets = tuple(int(o) for o in np.cumsum([0, *sizes[:-1]])) if sizes else ()
    return Layout(treedef, shapes, tuple(str(x.dtype) for x in leaves), offsets, int(sum(sizes)),
                  tuple(jax.tree_util.keystr(kp) for kp, _ in with_paths))


def buffer_dtype(layouts: Sequence[Layout]) -> Any:
    dtypes = [d for lay in layouts for d in lay.dtypes]
    return jnp.result_type(*dtypes) if dtypes else jnp.float32


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class StackedParams:
    """All stages' parameters as one [stages, P] buffer sharded over the pipe axis (row s holds stage
    s's leaves, flattened and zero-padded), or, for 3-D plans, a tuple of such buffers, one per
    sharded group ([stages, *axis sizes, W]). A pytree of those buffers, so elementwise optax
    transforms (sgd, momentum, adam, adamw without masks) update it exactly as they would the
    per-stage trees; transforms that look at whole tensors (per-layer norms, masks) need `unstack`."""

    flat: Any                       # jax.Array, or a tuple of them (sharded groups)
    layouts: tuple[Any, ...]

    def tree_flatten(self):
        return (self.flat,), self.layouts

    @classmethod
    def tree_unflatten(cls, layouts, children):
        return cls(children[0], layouts)


# --- codecs: one row of a stage buffer <-> a stage's pytree ---------------------------------------


@dataclasses.dataclass(frozen=True)
class FlatCodec:
    """Rows of one flat buffer ([width] of `dtype`) for the stages' flat layouts."""

    layouts: tuple[Layout | None, ...]      # per stage (None: a sink stage's output)
    width: int
    dtype: Any

    def unpack(self, s: int, row: jax.Array) -> Any:
        return self.layouts[s].unpack(row)

    def pack(self, s: int, tree: Any) -> jax.Array:
        return self.layouts[s].pack(tree, self.width, self.dtype)

    def zero(self) -> jax.Array:
        return jnp.zeros((self.width,), self.dtype)

    def tie_slice(self, s: int, path: str) -> tuple[int | None, int, int]:
        lay = self.layouts[s]
        i = lay.paths.index(path)
        return None, lay.offsets[i], math.prod(lay.shapes[i])

    def tie_kind(self, s: int, path: str) -> tuple:
        lay = self.layouts[s]
        i = lay.paths.index(path)
        return lay.shapes[i], lay.dtypes[i]


@dataclasses.dataclass(frozen=True)
class Placed:
    """One leaf of a sharded layout: stored split by `spec` in group `group` at `offset` (per-device
    elements `size`); constrained to `compute` (its spec without ZeRO storage axes) when unpacked."""

    shape: tuple[int, ...]
    dtype: str
    spec: Spec
    compute: Spec
    group: int
    offset: int
    size: int


@dataclasses.dataclass(frozen=True)
class ShardedLayout:
    treedef: Any
    leaves: tuple[Placed, ...]
    paths: tuple[str, ...]


def _pieces(shape: tuple[int, ...], spec: Spec, sizes: Mapping[str, int], axes: tuple[str, ...]):
    """(expanded shape, permutation to shard-major order) of a leaf split by `spec`."""
    expanded, where, local = [], {}, []
    for d, n in enumerate(shape):
        split = 1
        for a in spec[d]:
            where[a] = len(expanded)
            expanded.append(sizes[a])
            split *= sizes[a]
        local.append(len(expanded))
        expanded.append(n // split)
    return expanded, [where[a] for a in axes] + local


def to_shard_major(x: jax.Array, spec: Spec, sizes: Mapping[str, int], axes: tuple[str, ...]) -> jax.Array:
    expanded, perm = _pieces(tuple(x.shape), spec, sizes, axes)
    return x.reshape(expanded).transpose(perm).reshape(*[sizes[a] for a in axes], -1)


def from_shard_major(y: jax.Array, shape: tuple[int, ...], spec: Spec, sizes: Mapping[str, int],
                     axes: tuple[str, ...]) -> jax.Array:
    expanded, perm = _pieces(shape, spec, sizes, axes)
    return y.reshape([expanded[p] for p in perm]).transpose(np.argsort(perm)).reshape(shape)


def fitting_spec(shape: tuple[int, ...], spec: Spec | None, sizes: Mapping[str, int]) -> Spec:
    """`spec` on this shape, keeping only the dims whose split divides (a spec for another shape or
    rank becomes replicated: a layout choice, never a change of results)."""
    if spec is None or len(spec) != len(shape):
        return tuple(() for _ in shape)
    return tuple(tuple(ax) if n % math.prod(sizes[a] for a in ax) == 0 else () for n, ax in zip(shape, spec,
                                                                                               strict=True))


@dataclasses.dataclass(frozen=True)
class ShardedCodec:
    """Rows of the sharded group buffers: group g is [*sizes of axes[g], widths[g]] of dtypes[g]."""

    layouts: tuple[ShardedLayout | None, ...]      # per stage (None: a sink stage's output)
    axes: tuple[tuple[str, ...], ...]
    dtypes: tuple[str, ...]
    widths: tuple[int, ...]
    mesh: Mesh

    @classmethod
    def build(cls, trees: Mapping[int, Any], specs: Mapping[int, Mapping[str, Spec]], mesh: Mesh,
              compute: Mapping[int, Mapping[str, Spec]] | None = None, stages: int | None = None) -> ShardedCodec:
        """Layouts for `trees` (stage -> pytree of arrays or ShapeDtypeStructs) split by `specs` (stage ->
        keystr path -> spec over mesh axes; missing leaves are replicated), unpacked constrained to
        `compute` (default `specs`). `stages`: the stage count (default: every stage has a tree)."""
        sizes = dict(mesh.shape)
        order = {a: i for i, a in enumerate(mesh.axis_names)}
        keys: list[tuple[tuple[str, ...], str]] = []
        widths: list[int] = []
        layouts: list[ShardedLayout | None] = [None] * (stages if stages is not None else len(trees))
        for s, tree in trees.items():
            with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
            used = [0] * len(keys)
            placed, paths = [], []
            for kp, x in with_paths:
                path = jax.tree_util.keystr(kp)
                shape = tuple(int(d) for d in x.shape)
                spec = fitting_spec(shape, specs.get(s, {}).get(path), sizes)
                comp = fitting_spec(shape, (compute or specs).get(s, {}).get(path), sizes)
                key = (tuple(sorted({a for ax in spec for a in ax}, key=order.__getitem__)), str(x.dtype))
                if key not in keys:
                    keys.append(key)
                    widths.append(0)
                    used.append(0)
                g = keys.index(key)
                n = math.prod(shape) // math.prod(sizes[a] for a in key[0])
                placed.append(Placed(shape, str(x.dtype), spec, comp, g, used[g], n))
                used[g] += n
                paths.append(path)
            widths = [max(w, u) for w, u in zip(widths, used, strict=True)]
            layouts[s] = ShardedLayout(treedef, tuple(placed), tuple(paths))
        return cls(tuple(layouts), tuple(k for k, _ in keys), tuple(d for _, d in keys),
                   tuple(max(1, w) for w in widths), mesh)

    def _sizes(self) -> dict[str, int]:
        return dict(self.mesh.shape)

    def group_shape(self, g: int) -> tuple[int, ...]:
        return (*[self.mesh.shape[a] for a in self.axes[g]], self.widths[g])

    def structs(self, s: int) -> Any:
        lay = self.layouts[s]
        return jax.tree.unflatten(lay.treedef, [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in lay.leaves])

    def unpack(self, s: int, row: tuple[jax.Array, ...], constrain: bool = True) -> Any:
        """Stage s's pytree from its row; inside the pipeline each leaf is constrained to its compute
        spec (the stage's tensor plan), outside (`constrain=False`) XLA places it."""
        sizes, lay = self._sizes(), self.layouts[s]
        leaves = []
        for leaf in lay.leaves:
            piece = lax.slice_in_dim(row[leaf.group], leaf.offset, leaf.offset + leaf.size, axis=-1)
            x = from_shard_major(piece, leaf.shape, leaf.spec, sizes, self.axes[leaf.group])
            if constrain:
                x = constrain_to(x, partition_spec(leaf.compute), self.mesh)
            leaves.append(x)
        return jax.tree.unflatten(lay.treedef, leaves)

    def pack(self, s: int, tree: Any) -> tuple[jax.Array, ...]:
        sizes, lay = self._sizes(), self.layouts[s]
        parts: list[list[jax.Array]] = [[] for _ in self.axes]
        for leaf, x in zip(lay.leaves, jax.tree.leaves(tree), strict=True):
            parts[leaf.group].append(to_shard_major(jnp.asarray(x).astype(leaf.dtype), leaf.spec, sizes,
                                                    self.axes[leaf.group]))
        rows = []
        for g, ps in enumerate(parts):
            lead = self.group_shape(g)[:-1]
            used = sum(p.shape[-1] for p in ps)
            if used < self.widths[g]:
                ps.append(jnp.zeros((*lead, self.widths[g] - used), self.dtypes[g]))
            row = jnp.concatenate(ps, axis=-1) if len(ps) > 1 else ps[0]
            rows.append(constrain_to(row, P(*self.axes[g], None), self.mesh))
        return tuple(rows)

    def zero(self) -> tuple[jax.Array, ...]:
        return tuple(jnp.zeros(self.group_shape(g), d) for g, d in enumerate(self.dtypes))

    def stacked_sharding(self, pipe: str) -> tuple[NamedSharding, ...]:
        return tuple(NamedSharding(self.mesh, P(pipe, *ax, None)) for ax in self.axes)

    def tie_slice(self, s: int, path: str) -> tuple[int | None, int, int]:
        lay = self.layouts[s]
        leaf = lay.leaves[lay.paths.index(path)]
        return leaf.group, leaf.offset, leaf.size

    def tie_kind(self, s: int, path: str) -> tuple:
        lay = self.layouts[s]
        leaf = lay.leaves[lay.paths.index(path)]
        return leaf.shape, leaf.dtype, leaf.spec


def constrain_to(x: jax.Array, spec: P, mesh: Mesh) -> jax.Array:
    """`with_sharding_constraint` on the mesh in context: inside the runtime's shard_map that is the
    mesh whose pipe axis is manual (a constraint naming the all-automatic mesh there would mix two
    meshes in one op), outside it `mesh`."""
    context = jax.sharding.get_abstract_mesh()
    return lax.with_sharding_constraint(x, spec if context.axis_names else NamedSharding(mesh, spec))


def partition_spec(spec: Spec) -> P:
    return P(*[(ax[0] if len(ax) == 1 else ax) if ax else None for ax in spec])


def check_specs(specs: Mapping[int, Mapping[str, Spec]], mesh: Mesh, pipe: str) -> None:
    """Stage specs may name only the mesh's non-pipe axes, each at most once per leaf."""
    for s, by_path in specs.items():
        for path, spec in by_path.items():
            named = [a for ax in spec for a in ax]
            bad = [a for a in named if a not in mesh.axis_names or a == pipe]
            if bad or len(named) != len(set(named)):
                raise PipelineError(
                    f"pipeline runtime: stage {s}'s spec {spec} for {path} names "
                    f"{'axes ' + str(bad) + ' that are not non-pipe axes of' if bad else 'an axis twice on'} the "
                    f"mesh {dict(mesh.shape)}.")
