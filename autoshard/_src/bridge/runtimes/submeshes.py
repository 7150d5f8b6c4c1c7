"""Stage submeshes for the MPMD runtime: a stage assignment checked and turned into one jax Mesh per stage.

An assignment gives each stage either a (data, model) shape (devices taken in order, as the 3-D search's
`predicted["3d"]["chosen"]["submeshes"]` lists them) or {"devices": [ids], "shape": (data, model)}. It is
refused (`PipelineError`) before anything is placed when two stages share a device, a device is left out,
or a stage's device count differs from its shape.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from ...core.errors import PipelineError

AXES = ("data", "model")


def stage_meshes(assignment: Sequence[Any], devices: Sequence[Any] | None = None) -> list[Mesh]:
    """One Auto-axes ("data", "model") Mesh per stage over `devices` (default: all of jax's)."""
    pool = list(jax.devices() if devices is None else devices)
    by_id = {d.id: d for d in pool}
    if not isinstance(assignment, (list, tuple)) or len(assignment) < 2:
        raise PipelineError(f"autoshard MPMD pipeline: the stage assignment must list 2 or more stages, got "
                            f"{assignment!r}.")
    ids, shapes = _explicit(assignment, [d.id for d in pool])
    seen: dict[int, int] = {}
    for s, stage_ids in enumerate(ids):
        for i in stage_ids:
            if i not in by_id:
                raise PipelineError(f"autoshard MPMD pipeline: stage {s} names device {i}, which is not among the "
                                    f"{len(pool)} devices {sorted(by_id)}.")
            if i in seen:
                raise PipelineError(f"autoshard MPMD pipeline: stages {seen[i]} and {s} both claim device {i}; stage "
                                    "submeshes must not overlap (each stage is its own program on its own devices).")
            seen[i] = s
    dropped = sorted(set(by_id) - set(seen))
    if dropped:
        raise PipelineError(f"autoshard MPMD pipeline: devices {dropped} belong to no stage (the assignment covers "
                            f"{len(seen)} of {len(pool)}); every device must run a stage. Fix: give them to a "
                            "stage, or pass devices= with only the devices to use.")
    return [Mesh(np.array([by_id[i] for i in stage_ids]).reshape(shape), AXES, axis_types=(AxisType.Auto,) * 2)
            for stage_ids, shape in zip(ids, shapes, strict=True)]


def _explicit(assignment: Sequence[Any], pool: list[int]) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """(device ids, (data, model)) per stage; bare shapes take the pool's devices in order."""
    ids: list[list[int]] = []
    shapes: list[tuple[int, int]] = []
    nxt = 0
    for s, st in enumerate(assignment):
        if isinstance(st, Mapping):
            stage_ids = [int(i) for i in st.get("devices", ())]
            shape = _shape(s, st.get("shape", (len(stage_ids), 1)))
        else:
            shape = _shape(s, st)
            stage_ids = pool[nxt:nxt + math.prod(shape)]
            nxt += math.prod(shape)
            if len(stage_ids) < math.prod(shape):
                raise PipelineError(f"autoshard MPMD pipeline: stage {s} needs {math.prod(shape)} devices; only "
                                    f"{len(stage_ids)} of the {len(pool)} are left after the earlier stages.")
        if len(stage_ids) != math.prod(shape):
            raise PipelineError(f"autoshard MPMD pipeline: stage {s} has {len(stage_ids)} devices but shape "
                                f"{shape} (data x model) needs {math.prod(shape)}.")
        ids.append(stage_ids)
        shapes.append(shape)
    return ids, shapes


def _shape(s: int, shape: Any) -> tuple[int, int]:
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape, 1)
    if (not isinstance(shape, (list, tuple)) or len(shape) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in shape)):
        raise PipelineError(f"autoshard MPMD pipeline: stage {s}'s submesh must be (data, model) positive ints, "
                            f"got {shape!r}.")
    return int(shape[0]), int(shape[1])
