"""`autoshard.pipelined`: the plan picks the runtime. A plan the one-program SPMD runtime cannot run as
planned runs MPMD (`mpmd.MpmdPipeline`, the `Pipelined` surface) over the mesh's devices: a 3-D plan whose
stages sit on unequal submeshes, a RaNNC or GraphPipe plan whose stages have different replica counts or
micro-batch counts (`plan.runtime` "mpmd"). Everything else runs on the SPMD runtime (`cut.pipelined`)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.sharding import Mesh

from ...core.errors import PipelineError
from .cut import Pipelined
from .cut import pipelined as spmd_pipelined
from .from_plan import mpmd_from_plan, plan_submeshes
from .mpmd import MpmdPipeline


def runs_mpmd(plan: Any) -> bool:
    """A pipeline plan the SPMD runtime cannot run as planned (`Plan.runtime`)."""
    return plan is not None and getattr(plan, "runtime", "spmd") == "mpmd"


@functools.wraps(spmd_pipelined)
def pipelined(loss_fn: Callable, params: Any, batch: Any, *, mesh: Any, num_microbatches: int,
              plan: Any = None, check_loss: bool = True, **options: Any) -> Pipelined | MpmdPipeline:
    if not runs_mpmd(plan):
        return spmd_pipelined(loss_fn, params, batch, mesh=mesh, num_microbatches=num_microbatches, plan=plan,
                              check_loss=check_loss, **options)
    _check_pipe_axis(plan, mesh)
    # the plan's own count (its per-stage counts), or one count for every stage
    count = None if num_microbatches == plan.microbatches else num_microbatches
    return mpmd_from_plan(loss_fn, params, batch, plan, num_microbatches=count, devices=_devices(mesh),
                          check_loss=check_loss)


def _check_pipe_axis(plan: Any, mesh: Any) -> None:
    """A mesh naming a pipe axis names the stage count: it must be the plan's pipeline ranks (the MPMD runtime
    reads only the mesh's devices otherwise)."""
    shape = dict(mesh.shape) if isinstance(mesh, Mesh) else dict(mesh) if isinstance(mesh, Mapping) else {}
    subs = plan_submeshes(plan)
    n = sum(d * t for d, t in subs)
    if "pipe" in shape and shape["pipe"] != len(subs):
        raise PipelineError(f"autoshard.pipelined: the plan has {len(subs)} stages but the mesh's pipe axis has "
                            f"{shape['pipe']} (mesh {shape}); the plan runs MPMD, each stage on its own devices. Fix: "
                            f"pass the mesh the plan was made for, or mesh={{'devices': {n}}}.")


def _devices(mesh: Any) -> list | None:
    """The devices a mesh argument names: a Mesh's own, or the first prod(sizes) of jax's for a dict
    (anything else: all devices, and the stage assignment check reports a mismatch)."""
    if isinstance(mesh, Mesh):
        return list(mesh.devices.flat)
    if isinstance(mesh, Mapping) and all(isinstance(v, int) for v in mesh.values()):
        return jax.devices()[:math.prod(mesh.values())]
    return None
