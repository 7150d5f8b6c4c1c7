"""The collectives that move a value between layouts, for the tensor evaluator (pure: no jax import):
reshards at region boundaries (all-to-alls, local slices, all-gathers), partial sums read split by
their consumers (reduce-scatters and all-reduces) and the gathers of reshapes merging a split dim.

`CollectiveMoves` is a mixin of `evaluator._Evaluator`: it reads the moves the evaluator summarised
(`reshards`, `partial_cuts`, `regathers`), its mesh tables (`mesh`, `msize`, `_or`) and `options`.
Each generator yields per-plan arrays (plans[C, K], one axis mask per factor) that `_add_times` prices
and `comm_records` lists, so pricing and the plan's predicted collectives never disagree.
"""

from __future__ import annotations

import numpy as np


class CollectiveMoves:
    """Collective moves of plans[C, K] (see the module docstring)."""

    def _reshard_moves(self, plans: np.ndarray):
        """Per reshard and move: (kind, axis mask (per plan), per-device buffer bytes per plan,
        executions, phase, which plans). An axis on one dim before and another after is an
        all-to-all (one per axis, `_all_to_alls`); the axes on a dim before and on none after are one
        all-gather (after the all-to-alls, as emission orders it); an axis on none before: a local slice."""
        for b_idx, a_idx, nb, w, phase in self.reshards:
            bmask = self._or(plans, tuple(i for i in b_idx if i >= 0))
            amask = self._or(plans, tuple(i for i in a_idx if i >= 0))
            for mask, held in self._all_to_alls(plans, b_idx, a_idx):
                yield "all-to-all", mask, nb / self.msize[bmask | held], w, phase, mask > 0
            # the axes the consumers leave unused are gathered together, last (as emission orders it)
            gone = bmask & ~amask
            yield "all-gather", gone, nb / self.msize[bmask & amask], w, phase, gone > 0

    def _all_to_alls(self, plans: np.ndarray, b_idx: tuple[int, ...], a_idx: tuple[int, ...]
                     ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per plan, the axis masks of a reshard's all-to-alls, each with the axes sliced locally before
        it (its buffer is split over them too).

        An axis that leaves one dim for another is one all-to-all. Axes leaving one dim for the same
        other dim are one all-to-all over all of them when they are the minor axes (a dim's axes are
        in mesh order) of both dims: both tilings then run over the same devices in the same order,
        which XLA moves in one all-to-all (`reshard_steps` takes them in one step); one at a time
        costs it a second all-to-all and a collective-permute. Emission walks the target's dims in
        order, each dim's axes in mesh order, and slices an axis the value did not use where it comes
        in that walk: before the all-to-alls into later dims, or into its dim as minor axes."""
        C = plans.shape[0]
        axes = [(k, 1 << k) for k, size in enumerate(self.mesh.sizes) if size > 1]
        bdim, adim = {}, {}
        for k, bit in axes:
            bdim[k], adim[k] = np.full(C, -1), np.full(C, -1)
            for d, i in enumerate(b_idx):
                if i >= 0:
                    bdim[k] = np.where(plans[:, i] & bit, d, bdim[k])
            for d, i in enumerate(a_idx):
                if i >= 0:
                    adim[k] = np.where(plans[:, i] & bit, d, adim[k])
        moves = {k: (bdim[k] >= 0) & (adim[k] >= 0) & (bdim[k] != adim[k]) for k, _ in axes}
        sliced = {k: (bdim[k] < 0) & (adim[k] >= 0) for k, _ in axes}
        absorbed = {k: np.zeros(C, dtype=bool) for k, _ in axes}
        out = []
        for n, (k, bit) in enumerate(axes):
            group, whole = np.full(C, bit), moves[k].copy()
            for j, jbit in axes[n + 1:]:
                joins = moves[j] & (bdim[j] == bdim[k]) & (adim[j] == adim[k])
                group |= np.where(joins, jbit, 0)
                # a minor axis staying on either dim splits the group's tiling
                whole &= joins | ((bdim[j] != bdim[k]) & (adim[j] != adim[k]))
            whole &= group != bit
            for j, jbit in axes[n + 1:]:
                absorbed[j] |= whole & ~absorbed[k] & ((group & jbit) > 0)
            held = np.zeros(C, dtype=np.int64)
            for j, jbit in axes:
                first = (adim[j] < adim[k]) | ((adim[j] == adim[k]) & (j < k))
                held |= np.where(sliced[j] & first, jbit, 0)
            out.append((np.where(moves[k] & ~absorbed[k], np.where(whole, group, bit), 0), held))
        return out

    def _partial_sums(self, plans: np.ndarray):
        """Per partial sum read split by its consumers (or reduced in parts): (kind, per-device buffer
        bytes per plan, axis mask per plan, executions, latencies paid, phase) for the reduce-scatter over the reduced
        axes the consumers' layout splits and the all-reduce(s) over the others (a local slice then
        finishes the move)."""
        for loop, red, parts, a_idx, out_bytes, w, phase in self.partial_cuts:
            r_mask = self._or(plans, red)
            buf = out_bytes * self.msize[r_mask] / self.msize[self._or(plans, loop)]
            rs = r_mask & self._or(plans, tuple(i for i in a_idx if i >= 0))
            # gradients travel in buckets (TAP §4.7.1): each pays its per-device share of a bucket's latency
            count = w * np.minimum(1.0, buf / self.options.bucket_bytes) if phase == "grad" else w
            for part in parts or (red,):
                yield "all-reduce", buf, self._or(plans, part) & ~rs, w, count, phase
            yield "reduce-scatter", buf, rs, w, count, phase

    def _regathers(self, plans: np.ndarray):
        """Per reshape merging a split minor dim: (axis mask per plan, per-device result bytes per plan,
        executions, phase): the input gathered over the minor dims' axes, split as before elsewhere."""
        for minor, rest, b, w, phase in self.regathers:
            keep = self._or(plans, rest)
            yield self._or(plans, minor) & ~keep, b / self.msize[keep], w, phase
