"""Per unit kind, what every tensor plan of a stage submesh costs (pure: no jax import).

For one submesh shape (e.g. data 2 x model 8) the tensor search's plan space is enumerated once
(every assignment of the submesh axes to the step's factors) and each unit kind's ops are priced
under every plan and storage mode with the search's own evaluator, split by how the cost scales:

=============  =================================================  ======================
array          what (per device, at the traced batch)              scales with
=============  =================================================  ======================
fwd, bwd       forward / backward compute + tensor-parallel comm   micro-batch size
fwd_dots       forward matmul compute                              micro-batch size
fwd_attn       forward attention scores + softmax compute          micro-batch size
               (+ the sequence-parallel stream's re-gathers)
const          weight-only forward+backward ops (transposes)       per micro-batch
gather         ZeRO-3 parameter all-gathers                        per micro-batch
sync           gradient all-reduce over the stage's data axes      per step
step           optimizer ops + ZeRO-1 parameter all-gather         per step
static         parameters + gradients + optimizer state (+ ZeRO-3  held
               gathered copies, saved weight-only values)
acts           forward values the backward reads                   size x micro-batches in flight
acts_dots      every forward matmul output                         (remat 'dots' keeps each one)
acts_attn      the attention scores / probabilities among them     (remat 'selective' drops these,
               and the all-gathered sequence-parallel stream:      re-gathered by the backward)
data           the batch inputs the unit reads                     size x in flight
=============  =================================================  ======================

On a submesh with a model axis the plans of the sequence-parallel space come next to them
(`tensor.search.sequence_parallel_analysis`: the residual stream cut from the tensor-parallel
regions, its sequence split over their axes; Korthikanti et al. 2022), priced by the same
evaluator: each stage chooses sequence parallelism or not like any other plan, and no tensor search
runs beside the 3-D search. Plans that another plan beats on every array of every kind are dropped
(they can never be a stage's best choice, whatever its units), which keeps the stage search small.

`fwd_attn` / `acts_attn` price the ops `core.attention.recomputed_ops` names; under
`attention="flash"` both are 0: FlashAttention saves no [B, H, S, S] tensor and its backward
already recomputes the scores (priced in `bwd`), so selective remat is remat 'none' there.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..core.cost import CostModel
from ..core.hardware import HardwareSpec
from ..core.mesh import MeshSpec
from ..tensor.experts import batch_factors, expert_assignments, factor_site
from ..tensor.memory import kept_share
from ..tensor.search import STORAGE_MODES, PlanSpace, SearchOptions
from .units import Units

ARRAYS = ("fwd", "bwd", "fwd_dots", "fwd_attn", "const", "gather", "sync", "step", "static", "acts", "acts_dots",
          "acts_attn", "data")


@dataclasses.dataclass
class ShapeTables:
    """`values[name]`: array [kinds, storage modes, plans] per ARRAYS entry over the kept plans of
    `space` (`rows`: axis masks per candidate factor) then those of `sp_space` (`sp_rows`, sequence
    parallel; none when the submesh has no model axis or the step no such regions);
    `batch_split[p]`: devices the batch is split over."""

    mesh: MeshSpec
    space: PlanSpace
    rows: np.ndarray
    values: dict[str, np.ndarray]
    batch_split: np.ndarray
    storage_modes: tuple[str, ...]
    megatron: np.ndarray | str        # Megatron-LM's plan row on this submesh, or why there is none
    sp_space: PlanSpace | None = None
    sp_rows: np.ndarray | None = None
    megatron_sp: np.ndarray | str = "no sequence-parallel space on this submesh"
    sequence_split: np.ndarray | None = None    # [plans] devices the residual stream's sequence is split over

    @property
    def n_plans(self) -> int:
        return self.rows.shape[0] + (0 if self.sp_rows is None else self.sp_rows.shape[0])

    def plan(self, p: int) -> tuple[tuple[int, ...], bool]:
        """(row, sequence parallel) of plan index `p`."""
        n = self.rows.shape[0]
        row = self.rows[p] if p < n else self.sp_rows[p - n]
        return tuple(int(x) for x in row), p >= n

    def space_of(self, sequence_parallel: bool) -> PlanSpace:
        return self.sp_space if sequence_parallel else self.space

    def index(self, row, sequence_parallel: bool = False) -> int:
        """The plan index of `row` in the plain (or sequence-parallel) plans."""
        rows, base = (self.sp_rows, self.rows.shape[0]) if sequence_parallel else (self.rows, 0)
        return base + int(np.flatnonzero((rows == np.asarray(row)).all(axis=1))[0])

    def megatron_plans(self) -> list[int]:
        """Plan indices of Megatron-LM's plan, without and with sequence parallelism, where they apply."""
        return [self.index(row, sp) for row, sp in ((self.megatron, False), (self.megatron_sp, True))
                if not isinstance(row, str)]


def _evaluators(space: PlanSpace, hw: HardwareSpec, cost: CostModel, options: SearchOptions, kind) -> dict:
    """One evaluator per slice of `kind` (built once; each storage mode is a separate evaluation)."""
    sl = kind.slices
    out = {name: space.evaluator(hw, cost, options, sl[name], (), keep_all=name == "fwd_dots")
           for name in ("fwd", "fwd_dots", "fwd_attn", "bwd", "const", "step")}
    out["held"] = space.evaluator(hw, cost, options, {}, kind.inputs, accumulate=True)
    return out


def expert_row(space: PlanSpace, name: str) -> np.ndarray | str:
    """The plan row of the hand-written expert `name` on the space's submesh, or why there is none
    (naming the parameter dims it would split that the space leaves out)."""
    a = expert_assignments(space.graph, space.fg, space.in_map, space.mesh).get(name, f"unknown expert {name!r}")
    if isinstance(a, str):
        return a
    fa, _ = a
    cidx = {f: i for i, f in enumerate(space.candidates)}
    outside = [f for f in fa if f not in cidx]
    if outside:
        return (f"splits dims the 3-D search does not enumerate on submesh {space.mesh} (over its plan space cap "
                f"or in no op it prices): {_sites(space, outside, fa)}")
    row = np.zeros(len(space.candidates), dtype=np.int64)
    for f, axes in fa.items():
        row[cidx[f]] = sum(1 << space.mesh.names.index(ax) for ax in axes)
    hits = np.flatnonzero((space.plans == row).all(axis=1))
    return row if hits.size else (f"its assignment is not among the plans enumerated on submesh {space.mesh}: "
                                  f"{_sites(space, list(fa), fa)}")


def _sites(space: PlanSpace, factors: list[int], fa: dict[int, tuple[str, ...]]) -> str:
    return "; ".join(f"{factor_site(space.graph, space.fg, f, space.in_map)} (size {space.fg.factor_size(f)}) "
                     f"over {fa[f]}" for f in factors)


def megatron_expert(mesh: MeshSpec, sequence_parallel: bool = False) -> str:
    """Megatron-LM's tensor plan on a (data, model) submesh: batch on data, heads/FFN/vocab on model
    (with sequence parallelism: the residual stream's sequence on model too)."""
    names = mesh.names
    if "model" not in names:
        return "data-parallel"
    if sequence_parallel:
        return "megatron-sp"
    return "data-megatron" if "data" in names else "megatron"


def shape_tables(space: PlanSpace, units: Units, hw: HardwareSpec, cost: CostModel, options: SearchOptions,
                 sp_space: PlanSpace | None = None) -> ShapeTables:
    """Every kind of `units` priced under every plan of `space` (a stage submesh) and of `sp_space`
    (its sequence-parallel space, optional) and storage mode. Plans dominated everywhere are dropped,
    except Megatron-LM's (the grid of experts uses them)."""
    modes = tuple(m for m in STORAGE_MODES if m in options.storage_modes)
    spaces = [sp for sp in (space, sp_space) if sp is not None]
    # sequence_parallel="on": the submesh's plans are the sequence-parallel ones only (none plain)
    plain_out = options.sequence_parallel == "on" and sp_space is not None
    priced = [_priced(sp, units, hw, cost, options, modes) for sp in spaces]
    vals = {a: np.concatenate([v[a] for v in priced], axis=2) for a in ARRAYS}
    offsets = np.cumsum([0] + [sp.plans.shape[0] for sp in spaces])
    if plain_out:
        vals = {a: v[:, :, offsets[1]:] for a, v in vals.items()}
        offsets = np.array([0, 0, offsets[2] - offsets[1]])
    keep = _undominated(vals)
    experts = [expert_row(sp, megatron_expert(sp.mesh, sp is sp_space)) for sp in spaces]
    if plain_out:
        experts[0] = "sequence_parallel='on' leaves only the sequence-parallel plans"
    for o, sp, row in zip(offsets, spaces, experts, strict=False):
        if not isinstance(row, str):
            keep = np.union1d(keep, o + np.flatnonzero((sp.plans == row).all(axis=1))).astype(np.int64)
    kept = [keep[(keep >= offsets[i]) & (keep < offsets[i + 1])] - offsets[i] for i in range(len(spaces))]
    if not kept[0].size and len(spaces) > 1 and not plain_out:   # the plain space all dominated: keep one
        kept[0], keep = np.array([0]), np.union1d(keep, [0]).astype(np.int64)
    bsplit = np.concatenate([_batch_split(sp, sp.plans[k]) for sp, k in zip(spaces, kept, strict=True)])
    sp_part = spaces[1] if len(spaces) > 1 else None
    seq = np.ones(len(keep))
    if sp_part is not None:      # a stage's kept unit inputs (the stream) are split along the sequence too
        seq[kept[0].size:] = _split(sp_part, sp_part.plans[kept[1]], sp_part.fg.sequence)
    return ShapeTables(space.mesh, space, space.plans[kept[0]], {a: v[:, :, keep] for a, v in vals.items()},
                       bsplit, modes, experts[0], sp_space=sp_part,
                       sp_rows=None if sp_part is None else sp_part.plans[kept[1]],
                       megatron_sp=experts[1] if sp_part is not None else "no sequence-parallel space on this submesh",
                       sequence_split=seq)


def _priced(space: PlanSpace, units: Units, hw: HardwareSpec, cost: CostModel, options: SearchOptions,
            modes: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The ARRAYS of every kind under every plan of `space` and storage mode in `modes`: [K, Z, P]."""
    plans = space.plans
    K, Z, C = len(units.kinds), len(modes), plans.shape[0]
    vals = {a: np.zeros((K, Z, C)) for a in ARRAYS}
    for k, kind in enumerate(units.kinds):
        evs = _evaluators(space, hw, cost, options, kind)
        by_mode = {n: evs[n].evaluate_modes(plans, modes) for n in ("fwd", "fwd_dots", "fwd_attn", "bwd", "const",
                                                                     "step", "held")}
        for z, storage in enumerate(modes):
            fwd, dots, attn, bwd, const, step, held = (by_mode[n][storage] for n in
                                                       ("fwd", "fwd_dots", "fwd_attn", "bwd", "const", "step", "held"))
            vals["fwd"][k, z] = fwd["compute"] + fwd["fwd_comm"] + fwd["bwd_comm"]
            vals["fwd_dots"][k, z] = dots["compute"]
            if options.attention != "flash":     # see the module docstring
                # the rerun forward re-issues its forward collectives (none inside a heads-parallel region)
                vals["fwd_attn"][k, z] = attn["compute"] + attn["fwd_comm"]
                vals["acts_attn"][k, z] = attn["activations"]
            # selective remat saves a sequence-parallel stream split: its backward gathers it again
            vals["fwd_attn"][k, z] += fwd["regather_comm"]
            vals["acts_attn"][k, z] += fwd["regathered"]
            vals["bwd"][k, z] = bwd["compute"] + bwd["fwd_comm"] + bwd["bwd_comm"]
            vals["const"][k, z] = const["compute"] + const["fwd_comm"] + const["bwd_comm"] + const["grad_sync"]
            vals["sync"][k, z] = bwd["grad_sync"]
            per_microbatch = storage == "zero3"
            vals["gather"][k, z] = held["storage_comm"] if per_microbatch else 0.0
            vals["step"][k, z] = (step["compute"] + step["opt_comm"] + step["fwd_comm"] + step["bwd_comm"]
                                  + (0.0 if per_microbatch else held["storage_comm"]))
            # gradients accumulate over the micro-batches; their reduction's result (an all-reduce is
            # not in place, a reduce-scatter keeps the shard) is counted beside them (conservative)
            vals["static"][k, z] = (held["params"] + held["grads"] + held["optimizer"] + held["activations"]
                                    + const["activations"]
                                    + bwd["grads_reduced"] * kept_share(held["grads_before"], held["grads_kept"]))
            vals["acts"][k, z] = fwd["activations"]
            vals["acts_dots"][k, z] = dots["activations"]
            vals["data"][k, z] = held["data"]
    return vals


def _undominated(vals: dict[str, np.ndarray]) -> np.ndarray:
    """Indices of plans no other plan matches or beats on every array of every kind and storage
    mode (ties keep the first, in enumeration order: fewer splits first)."""
    flat = np.ascontiguousarray(np.concatenate([np.round(v.reshape(-1, v.shape[-1]), 15) for v in vals.values()],
                                               axis=0).T)    # [C, D]
    seen: dict[bytes, int] = {}
    for i in range(flat.shape[0]):          # the first of identical rows (hashing rows beats sorting them)
        seen.setdefault(flat[i].tobytes(), i)
    cand = np.array(sorted(seen.values()), dtype=np.int64)
    pts = flat[cand]
    order = np.argsort(pts.sum(axis=1), kind="stable")     # a dominator has a smaller sum: test those first
    kept = np.empty_like(pts)
    keep: list[int] = []
    for i in order:
        p = pts[i]
        if keep and (kept[:len(keep)] <= p).all(axis=1).any():
            continue
        kept[len(keep)] = p
        keep.append(int(cand[i]))
    return np.array(sorted(keep), dtype=np.int64)


def _batch_split(space: PlanSpace, rows: np.ndarray) -> np.ndarray:
    """Devices each plan splits the batch over (1 when the batch stays whole)."""
    return _split(space, rows, batch_factors(space.graph, space.fg))


def _split(space: PlanSpace, rows: np.ndarray, factors) -> np.ndarray:
    """Devices each plan splits `factors` over together (1 when it leaves them whole)."""
    cidx = {f: i for i, f in enumerate(space.candidates)}
    bf = [cidx[f] for f in factors if f in cidx]
    sizes = space.mesh.sizes
    out = np.ones(rows.shape[0])
    for r in range(rows.shape[0]):
        mask = 0
        for i in bf:
            mask |= int(rows[r, i])
        out[r] = math.prod(s for i, s in enumerate(sizes) if mask >> i & 1)
    return out
