"""Per-device memory of many plans at once, for the tensor evaluator (pure: no jax import): parameters,
gradients, optimizer state and activations under a storage mode (replicated, ZeRO-1, ZeRO-3 / FSDP),
with the gradient peak as a GPU backend lays the buffers out and the extra XLA:CPU needs.

`MemoryModel` is a mixin of `evaluator._Evaluator`: it reads the tensors the evaluator summarised
(`params`, `gathered`, `state`, `acts`, `backward_values`, `cut_copies`, `groups`, `partial_cuts`) and
its mesh tables (`msize`, `nm`, `_or`, `_coll`).
"""

from __future__ import annotations

import numpy as np


def kept_share(before: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """Per plan, the share of its gradients' bytes the optimizer keeps (a ZeRO gradient is scattered)."""
    return np.where(before > 0, kept / np.maximum(before, 1e-30), 1.0)


class MemoryModel:
    """Memory per device of plans[C, K] (see the module docstring)."""

    def _shared_memory(self, out: dict[str, np.ndarray], plans: np.ndarray) -> dict:
        """What every storage mode shares, into `out` (saved activations, the backward's working set, values
        kept in two layouts, the reduced gradients); returned: the parameters' masks and gradient bytes."""
        C, full = plans.shape[0], self.nm - 1
        masks = [self._storage_masks(plans, dims, shape, full) for dims, shape, _ in self.params]
        grads_before = np.zeros(C)      # every gradient as its op produces it (whole over ZeRO axes)
        largest = np.zeros(C)           # the largest one parameter's gradient
        for (m, _), (_, _, b), one in zip(masks, self.params, self.param_largest, strict=True):
            grads_before += b / self.msize[m]
            largest = np.maximum(largest, one / self.msize[m])
        for fs, b in self.acts:
            out["activations"] += b / self.msize[self._or(plans, fs)]
        working = np.zeros(C)
        for fs, b in self.backward_values:
            working = np.maximum(working, b / self.msize[self._or(plans, fs)])
        out["activations"] += working
        self._cut_copy_memory(out, plans)
        out["grads_before"] = grads_before
        out["grads_largest"] = largest
        out["grads_reduced"] = self._reduced_gradient_bytes(plans)
        return {"masks": masks, "grads_before": grads_before}

    def _storage_memory(self, out: dict[str, np.ndarray], plans: np.ndarray, storage: str, shared: dict) -> None:
        """Parameters, optimizer state, ZeRO's gathered copies and the gradients under `storage`."""
        C, full = plans.shape[0], self.nm - 1
        grads_kept = np.zeros(C)        # as the optimizer keeps it (a ZeRO gradient scattered)
        for (m, free), (_, _, b) in zip(shared["masks"], self.params, strict=True):
            n, nt = self.msize[m], self.msize[free]
            if storage == "replicated":
                out["params"] += b / n
                grads_kept += b / n
            elif storage == "zero1":
                out["params"] += b / n
                grads_kept += b / (n * nt)
                # grads reduce-scatter (instead of all-reduce) + params all-gather after the update:
                # the same bytes as the all-reduce already counted; one extra collective's latency
                out["storage_comm"] += self._coll("all-gather", np.zeros(C), free)
            else:  # zero3 / FSDP: the gathered copies live from their forward use to the backward
                out["params"] += b / (n * nt)
                grads_kept += b / (n * nt)
                out["activations"] += np.where(free > 0, b / n, 0.0)
        if storage == "zero3":
            for dims, shape, b in self.gathered:
                m, free = self._storage_masks(plans, dims, shape, full)
                out["storage_comm"] += self._coll("all-gather", b / self.msize[m], free)
        for dims, shape, b in self.state:
            m, free = self._storage_masks(plans, dims, shape, full)
            n = self.msize[m]
            out["optimizer"] += b / n if storage == "replicated" else b / (n * self.msize[free])
        grads_before = shared["grads_before"]
        out["grads_kept"] = grads_kept
        out["grads_scattered"] = out["grads_reduced"] * kept_share(grads_before, grads_kept)
        out["grads"], out["cpu_temp_extra"] = self._gradient_memory(plans, out["activations"], grads_before,
                                                                    grads_kept, out)

    def _cut_copy_memory(self, out: dict[str, np.ndarray], plans: np.ndarray) -> None:
        """Values cut at a region boundary, kept in the layouts the backward reads (and re-gathered)."""
        for (before, after, own_kept, copy_kept), b in self.cut_copies:   # a value in two layouts
            moved = np.zeros(plans.shape[0], dtype=bool)
            sliced = np.ones(plans.shape[0], dtype=bool)      # the kept layout is a slice of the moved one (a gather)
            for i, j in zip(before, after, strict=True):
                bm, am = (plans[:, i] if i >= 0 else 0), (plans[:, j] if j >= 0 else 0)
                moved |= bm != am
                sliced &= (am & ~bm) == 0
            after_mask = self._or(plans, tuple(j for j in after if j >= 0))
            before_mask = self._or(plans, tuple(i for i in before if i >= 0))
            copy = b / self.msize[after_mask]
            # each layout the backward reads is kept; a gathered copy replaces the split one (slicing it
            # again is free); where the plan does not move the value, one buffer serves both readers.
            # XLA keeps a gathered copy for the backward's matmul (XLA:CPU's buffers show it), unless
            # remat saves the split value alone: its backward then gathers again (Megatron's SP)
            own = b / self.msize[before_mask]
            gathered = moved & sliced
            both = (own if own_kept else 0.0) + (copy if copy_kept else 0.0)
            one = np.where(gathered & copy_kept, copy, own) if (own_kept or copy_kept) else 0.0
            out["activations"] += np.where(moved & ~gathered, both, one)
            if copy_kept:
                out["regathered"] += np.where(gathered, copy - own, 0.0)
                out["regather_comm"] += np.where(gathered, self._coll("all-gather", copy, before_mask & ~after_mask),
                                                 0.0)

    def _gradient_memory(self, plans: np.ndarray, acts: np.ndarray, before: np.ndarray, kept: np.ndarray,
                         out: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """(gradient bytes per device beyond the saved activations, as a GPU backend lays them out;
        the extra XLA:CPU needs).

        The backward pass frees the saved activations as it produces the gradients, layer by layer,
        so the live set peaks at one end: all activations (its start) or the gradients (its end).
        With the optimizer in the step, XLA's all-reduce combiner merges the gradient reductions into
        a few collectives after the backward pass, so every reduced gradient (whole over ZeRO axes)
        is alive at its end, and each reduction's result is a second buffer: an all-reduce is not in
        place, a reduce-scatter's result is the kept shard. XLA:CPU has no reduce-scatter: its
        all-reduce's result is whole. A gradient no reduction waits for is consumed by its parameter's
        update as the backward produces it (the update is scheduled right after), so of those one is
        alive at a time, the largest counted; unless the updates read a reduction over every gradient
        (a global norm), which holds them all to the end. Without the optimizer the gradients are the
        step's outputs (`kept`), alive beside everything else; so are a pipeline stage's accumulated
        gradients."""
        # the CPU live set at the backward's end, beside nothing saved (plan.platform_memory weighs it
        # against what XLA:CPU holds at the backward's start); 0 where the gradients are a sum term
        out["grads_end_cpu"] = out["grads_alone"] = np.zeros(plans.shape[0])
        if not self.fused_update:
            return kept, np.zeros(plans.shape[0])
        if self.accumulate:
            return before, np.zeros(plans.shape[0])
        reduced, scattered = out["grads_reduced"], out["grads_scattered"]
        # held to the end: every partial sum a reduction waits for (a parameter read twice, a tied
        # embedding, has one per use: XLA reduces each before adding them), and with a global norm
        # the gradients no reduction waits for too
        waiting = np.maximum(before, reduced) if self.update_reads_all else reduced
        # one gradient beside the activations still saved (the first: nearly all of them)
        alone = np.where(before > waiting * (1 + 1e-9), np.minimum(out["grads_largest"], before - waiting), 0.0)
        gpu = np.maximum(0.0, waiting + scattered - acts) + alone
        cpu = np.maximum(0.0, waiting + reduced - acts) + alone
        out["grads_end_cpu"], out["grads_alone"] = waiting + reduced, alone
        return gpu, cpu - gpu

    def _reduced_gradient_bytes(self, plans: np.ndarray) -> np.ndarray:
        """Per plan, the per-device bytes of the gradients that go through a reduction (summed over
        split batch or sequence axes)."""
        out = np.zeros(plans.shape[0])
        for (loop, red, kind), _, ar_bytes, _ in self.groups:
            if kind == "grad" and red and ar_bytes:
                r = self._or(plans, red)
                out += np.where(self.msize[r] > 1, ar_bytes * self.msize[r] / self.msize[self._or(plans, loop)], 0.0)
        for loop, red, _, _, out_bytes, w, phase in self.partial_cuts:
            if phase == "grad":
                r = self._or(plans, red)
                per_device = w * out_bytes * self.msize[r] / self.msize[self._or(plans, loop)]
                out += np.where(self.msize[r] > 1, per_device, 0.0)
        return out

    def _storage_masks(self, plans: np.ndarray, dims: tuple[int, ...], shape: tuple[int, ...],
                       full: int) -> tuple[np.ndarray, np.ndarray]:
        """(axes splitting the tensor, axes ZeRO can add): the unused axes, if one dim still
        divides by them on top of its own split (the rule emission follows)."""
        C = plans.shape[0]
        per_dim = [plans[:, k] if k >= 0 else np.zeros(C, dtype=np.int64) for k in dims]
        m = np.zeros(C, dtype=np.int64)
        for md in per_dim:
            m |= md
        free = full & ~m
        nf = self.msize[free].astype(np.int64)
        ok = np.zeros(C, dtype=bool)
        for d, md in enumerate(per_dim):
            ok |= shape[d] % (self.msize[md].astype(np.int64) * nf) == 0
        return m, np.where(ok & (nf > 1), free, 0)
