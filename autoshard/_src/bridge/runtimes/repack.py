"""Between steps a pipelined step keeps the user's pytrees stored ZeRO-style; each step moves the
parameters into the runtime's stage rows and the gradients back, by one all-to-all each way.

Storage (`storage_spec`): a leaf's largest dimension divisible by the device count is split over
every mesh axis (so each device holds 1/N of it), other leaves are replicated. Stage rows: stage k's
parameters on the devices of its pipe rank (rank k, or k % pipe under interleaved 1F1B, where a
rank holds the rows of its v stages), as a flat row or the shard-major group buffers of a 3-D
stage (`layouts.ShardedCodec`).

Left to XLA, stacking ZeRO pieces into pipe-sharded rows is a concatenate of reshaped sharded leaves
that the SPMD partitioner can only do by replicating the whole buffer (its "involuntary full
rematerialization"): ~7x the parameter bytes per step on a debug GPT. Here it is explicit, in a
`shard_map` manual over every axis:

- in: every device packs its pieces of the split leaves of rank r's stages into block r of a [pipe, W]
  buffer; one all-to-all over `pipe` hands block r to pipe rank r, an all-gather over the other axes
  completes the leaves, and each rank assembles its own rows (`lax.switch` on the pipe index, no
  collectives inside). Replicated leaves are already everywhere.
- out: each pipe rank completes its gradient row (all-gather over a 3-D stage's split axes), cuts
  every leaf it owns into the storage pieces of its data coordinates, one per destination pipe
  rank, and one all-to-all over `pipe` delivers them; replicated leaves are summed over `pipe` from
  their owner (zeros elsewhere).
Per device that is about a stage's parameters in and its gradients out, not the whole model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .layouts import ShardedCodec, StackedParams, from_shard_major, to_shard_major


def storage_dim(shape: tuple[int, ...], devices: int) -> int | None:
    """The dimension a stored leaf is split on: the largest one divisible by the device count."""
    dims = [d for d, n in enumerate(shape) if n % devices == 0]
    return max(dims, key=lambda i: (shape[i], -i)) if dims else None


def storage_spec(mesh: Mesh, shape: tuple[int, ...]) -> P:
    """A leaf's storage between steps: split on `storage_dim` over every mesh axis, else replicated.
    A function of the shape only, so a step's outputs come out laid out as its inputs went in."""
    d = storage_dim(shape, mesh.size)
    if d is None:
        return P()
    spec: list[Any] = [None] * len(shape)
    spec[d] = tuple(mesh.axis_names)
    return P(*spec)


def storage_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    return NamedSharding(mesh, storage_spec(mesh, shape))


@dataclasses.dataclass(frozen=True)
class _Stored:
    """One leaf of the user's parameter tree: its storage split and where its pieces travel."""

    shape: tuple[int, ...]
    dtype: Any
    dim: int | None                # storage split dim (None: replicated everywhere)
    owner: int                     # the stage whose gradient is the leaf's gradient
    holders: tuple[int, ...]       # the stages whose rows hold it (tied leaves: several)
    offset: int                    # replicated: offset in the replicated buffer; split: in its block

    def piece_size(self, devices: int) -> int:
        """Elements of one storage piece (1/devices of the leaf)."""
        return math.prod(self.shape) // devices


class Repacker:
    """Moves one parameter tree between storage and the stage rows of one pipeline program."""

    def __init__(self, run: Any, structs: Sequence[Any], stacked: StackedParams):
        self.run, self.codec = run, stacked.layouts
        self.program, self.mesh = run.program, run.program.mesh
        self.pipe = self.program.pipe_axis
        self.others = tuple(a for a in self.mesh.axis_names if a != self.pipe)
        self.sizes = dict(self.mesh.shape)
        self.N, self.S = self.mesh.size, self.program.num_stages
        sched = self.program.schedule
        self.rank_of = sched.rank_of                      # blocks and sends go per pipe rank
        self.on_rank = [sched.stages_on(r) for r in range(len(sched.ranks))]
        if not isinstance(self.codec, ShardedCodec):
            self.width, self.row_dtype = int(stacked.flat.shape[1]), stacked.flat.dtype
        self.dtype = jnp.result_type(*[x.dtype for x in structs]) if structs else jnp.float32
        self.leaves = self._place(structs)

    def _place(self, structs: Sequence[Any]) -> tuple[_Stored, ...]:
        block = [0] * len(self.on_rank)     # per rank: split pieces packed for its stages (forward)
        owned = [0] * len(self.on_rank)     # per rank: split pieces its stages own (backward)
        repl = 0
        out = []
        for i, x in enumerate(structs):
            shape = tuple(int(n) for n in x.shape)
            dim = storage_dim(shape, self.N)
            owner, holders = self.run._owner[i], self.run._holders[i]
            n = math.prod(shape) // self.N
            if dim is None:
                out.append(_Stored(shape, x.dtype, None, owner, holders, repl))
                repl += math.prod(shape)
                continue
            out.append(_Stored(shape, x.dtype, dim, owner, holders, 0))
            for s in holders:
                block[self.rank_of[s]] += n
            owned[self.rank_of[owner]] += n
        self.block_width = max(1, *block)
        self.owned_width = max(1, *owned)
        self.repl_width = max(1, repl)
        return tuple(out)

    # --- pieces <-> leaves (local array code inside the shard_map) ---------------------------------

    def _mesh_order(self, pieces: jax.Array, leading: tuple[str, ...], leaf: _Stored) -> jax.Array:
        """The leaf from its N storage pieces stacked on leading axes named `leading`."""
        piece_shape = list(leaf.shape)
        piece_shape[leaf.dim] //= self.N
        x = pieces.reshape(*[self.sizes[a] for a in leading], *piece_shape)
        perm = [leading.index(a) for a in self.mesh.axis_names]
        x = x.transpose(*perm, *range(len(leading), x.ndim)).reshape(self.N, *piece_shape)
        return jnp.moveaxis(x, 0, leaf.dim).reshape(leaf.shape)

    def _my_pieces(self, full: jax.Array, leaf: _Stored) -> jax.Array:
        """[pipe, piece size]: the storage pieces of `full` at this device's non-pipe coordinates, one
        per pipe rank."""
        d = leaf.dim
        piece_shape = list(leaf.shape)
        piece_shape[d] //= self.N
        x = full.reshape(*leaf.shape[:d], self.N, *piece_shape[d:])
        x = jnp.moveaxis(x, d, 0).reshape(*[self.sizes[a] for a in self.mesh.axis_names], *piece_shape)
        names = list(self.mesh.axis_names)
        for a in self.others:                       # index my coordinate on every non-pipe axis
            i = names.index(a)
            x = lax.dynamic_index_in_dim(x, lax.axis_index(a), i, keepdims=False)
            names.pop(i)
        return x.reshape(self.sizes[self.pipe], -1)

    # --- parameters in ------------------------------------------------------------------------------

    def stack(self, params: Any) -> StackedParams:
        leaves = jax.tree.leaves(params)
        in_specs = tuple(storage_spec(self.mesh, x.shape) for x in self.leaves)
        row_specs = self._row_specs()
        fn = jax.shard_map(self._stack_local, mesh=self.mesh, in_specs=(in_specs,), out_specs=row_specs,
                           check_vma=False)
        return StackedParams(fn(tuple(leaves)), self.codec)

    def _row_specs(self) -> Any:
        if isinstance(self.codec, ShardedCodec):
            return tuple(P(self.pipe, *ax, None) for ax in self.codec.axes)
        return P(self.pipe)

    def _stack_local(self, leaves: tuple[jax.Array, ...]) -> Any:
        send = []
        for stages in self.on_rank:    # block r: my pieces of the split leaves rank r's stages hold
            parts = [x.reshape(-1).astype(self.dtype) for s in stages
                     for x, lf in zip(leaves, self.leaves, strict=True) if lf.dim is not None and s in lf.holders]
            send.append(_padded(parts, self.block_width, self.dtype))
        got = lax.all_to_all(jnp.stack(send), self.pipe, 0, 0, tiled=False)     # [pipe, W]
        for a in reversed(self.others):
            got = lax.all_gather(got, a, axis=0, tiled=False)                   # [*others, pipe, W]
        branches = [lambda got, leaves, r=r: self._rows(r, got, leaves) for r in range(len(self.on_rank))]
        return lax.switch(lax.axis_index(self.pipe), branches, got, leaves)

    def _rows(self, r: int, got: jax.Array, leaves: tuple[jax.Array, ...]) -> Any:
        """Rank r's rows, one per stage it holds, read from its block in the order they were packed."""
        rows, at = [], 0
        for s in self.on_rank[r]:
            row, at = self._row(s, got, leaves, at)
            rows.append(row)
        return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *rows)

    def _row(self, s: int, got: jax.Array, leaves: tuple[jax.Array, ...], at: int) -> tuple[Any, int]:
        """Stage s's row (this device's part of it) from the gathered blocks (its pieces from offset
        `at`) and replicated leaves; and the offset after them."""
        tree = []
        leading = (*self.others, self.pipe)
        for x, lf in zip(leaves, self.leaves, strict=True):
            if s not in lf.holders:
                continue
            if lf.dim is None:
                tree.append(x)
                continue
            n = lf.piece_size(self.N)
            tree.append(self._mesh_order(got[..., at:at + n], leading, lf).astype(lf.dtype))
            at += n
        mine = [k for k, lf in zip(self.run._keys, self.leaves, strict=True) if s in lf.holders]
        stage_tree = dict(zip(mine, tree, strict=True))
        if isinstance(self.codec, ShardedCodec):
            return self._sharded_row(s, stage_tree), at
        return self.codec[s].pack(stage_tree, self.width, self.row_dtype)[None], at

    def _sharded_row(self, s: int, stage_tree: Any) -> tuple[jax.Array, ...]:
        """This device's slice of stage s's group buffers (its coordinates on each group's axes)."""
        codec, sizes = self.codec, self.sizes
        lay = codec.layouts[s]
        parts: list[list[jax.Array]] = [[] for _ in codec.axes]
        for leaf, x in zip(lay.leaves, jax.tree.leaves(stage_tree), strict=True):
            y = to_shard_major(x.astype(leaf.dtype), leaf.spec, sizes, codec.axes[leaf.group])
            for a in codec.axes[leaf.group]:
                y = lax.dynamic_index_in_dim(y, lax.axis_index(a), 0, keepdims=False)
            parts[leaf.group].append(y)
        rows = []
        for g, ps in enumerate(parts):
            row = _padded(ps, codec.widths[g], codec.dtypes[g])
            rows.append(row.reshape(1, *[1] * len(codec.axes[g]), -1))
        return tuple(rows)

    # --- gradients out ------------------------------------------------------------------------------

    def unstack(self, grads: StackedParams) -> Any:
        out_specs = tuple(storage_spec(self.mesh, lf.shape) for lf in self.leaves)
        fn = jax.shard_map(self._unstack_local, mesh=self.mesh, in_specs=(self._row_specs(),),
                           out_specs=out_specs, check_vma=False)
        return jax.tree.unflatten(self.run._treedef, list(fn(grads.flat)))

    def _full_rows(self, flat: Any) -> list[Any]:
        """Every device's complete rows, one per stage of its rank (3-D groups gathered over their
        split axes)."""
        v = len(self.on_rank[0])
        if not isinstance(self.codec, ShardedCodec):
            return [flat[c] for c in range(v)]
        out = []
        for c in range(v):
            rows = []
            for g, buf in enumerate(flat):
                row = buf[c]
                for i, a in reversed(list(enumerate(self.codec.axes[g]))):
                    row = lax.all_gather(row, a, axis=i, tiled=True)
                rows.append(row)
            out.append(tuple(rows))
        return out

    def _unstack_local(self, flat: Any) -> tuple[jax.Array, ...]:
        rows = self._full_rows(flat)
        branches = [lambda rows, r=r: self._owned_pieces(r, rows) for r in range(len(self.on_rank))]
        send, repl = lax.switch(lax.axis_index(self.pipe), branches, rows)
        got = lax.all_to_all(send, self.pipe, 0, 0, tiled=False)      # [pipe (owner's rank), W]
        repl = lax.psum(repl, self.pipe)
        out, at = [], [0] * len(self.on_rank)
        for lf in self.leaves:
            if lf.dim is None:
                n = math.prod(lf.shape)
                out.append(repl[lf.offset:lf.offset + n].reshape(lf.shape).astype(lf.dtype))
                continue
            n = lf.piece_size(self.N)
            piece_shape = list(lf.shape)
            piece_shape[lf.dim] //= self.N
            r = self.rank_of[lf.owner]
            out.append(got[r, at[r]:at[r] + n].reshape(piece_shape).astype(lf.dtype))
            at[r] += n
        return tuple(out)

    def _owned_pieces(self, r: int, rows: list[Any]) -> tuple[jax.Array, jax.Array]:
        """([pipe, W] storage pieces of the split leaves rank r's stages own, per destination rank; the
        replicated buffer with the replicated leaves they own)."""
        sharded = isinstance(self.codec, ShardedCodec)
        # stage trees are dicts keyed by the leaves' keys
        trees = {s: self._unpack_sharded(s, rows[c]) if sharded else self.codec[s].unpack(rows[c])
                 for c, s in enumerate(self.on_rank[r])}
        pieces, repl = [], jnp.zeros((self.repl_width,), self.dtype)
        for k, lf in zip(self.run._keys, self.leaves, strict=True):
            if lf.owner not in trees:
                continue
            g = trees[lf.owner][k].astype(self.dtype)
            if lf.dim is None:
                repl = lax.dynamic_update_slice_in_dim(repl, g.reshape(-1), lf.offset, 0)
            else:
                pieces.append(self._my_pieces(g, lf))
        pipe = self.sizes[self.pipe]
        if not pieces:
            return jnp.zeros((pipe, self.owned_width), self.dtype), repl
        send = jnp.concatenate(pieces, axis=1)
        if send.shape[1] < self.owned_width:
            send = jnp.pad(send, ((0, 0), (0, self.owned_width - send.shape[1])))
        return send, repl

    def _unpack_sharded(self, s: int, rows: tuple[jax.Array, ...]) -> Any:
        codec, lay = self.codec, self.codec.layouts[s]
        leaves = []
        for leaf in lay.leaves:
            piece = lax.slice_in_dim(rows[leaf.group], leaf.offset, leaf.offset + leaf.size, axis=-1)
            leaves.append(from_shard_major(piece, leaf.shape, leaf.spec, self.sizes, codec.axes[leaf.group]))
        return jax.tree.unflatten(lay.treedef, leaves)


def _padded(parts: list[jax.Array], width: int, dtype: Any) -> jax.Array:
    used = sum(int(p.shape[-1]) for p in parts)
    if used < width:
        parts = [*parts, jnp.zeros((width - used,), dtype)]
    return jnp.concatenate(parts) if len(parts) > 1 else parts[0]
