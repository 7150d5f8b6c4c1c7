"""Inference mode: `autoshard.plan(fn, params, images, mode="inference", mesh={"x": 3})` and
`autoshard.autoshard(mode="inference", mesh={"x": 3})(apply_fn)` (bridge: imports jax).

Trace `fn` into BBGraP layers, partition them (the pure DP of `inference.partition`), emit the
partition as a jitted program (`bridge.inference.emit`), and compare what XLA compiled with the plan's halo
bytes (`audit_inference`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from ...core.errors import ConfigError, MeshError, PlanError
from ...core.hardware import HardwareSpec
from ...core.shapemap import direction_axis
from ...inference.partition import CostModel, baselines, describe, partition
from ...inference.plan import InferenceConfig, InferencePlan, single_direction
from ..audit import hlo as _hlo
from ..devices import local_hardware
from ..emit.emit import auto_axes, auto_placed, on_own_mesh
from ..trace.call_args import positional
from ..trace.trace import check_args
from .emit import constrained_program, explicit_program, layer_of_op
from .trace import TracedInference, trace_inference


def _signature(args: tuple) -> str:
    check_args(args)                 # strings and other non-arrays: a typed error naming the leaf
    leaves, tree = jax.tree.flatten(args)
    shapes = [f"{jax.numpy.result_type(x).name}{list(np.shape(x))}" for x in leaves]
    return f"{tree} {' '.join(shapes)}"


def _hardware(config: InferenceConfig) -> HardwareSpec:
    if config.hardware is not None:
        return config.hardware
    return local_hardware()


def _dtype(traced: TracedInference) -> str:
    first = next(layer for layer in traced.layers if layer.kind == "input")
    return {2: "bfloat16", 4: "float32", 8: "float32"}.get(first.itemsize, "float32")


def _even(traced: TracedInference, directions: dict[str, str | None], n: int) -> bool:
    for layer in traced.layers:
        d = directions[layer.name]
        if d is not None and layer.output_shape[direction_axis(d, len(layer.output_shape))] % n:
            return False
    return True


def plan_traced(traced: TracedInference, config: InferenceConfig, signature: str = "") -> InferencePlan:
    """The inference plan of already traced layers."""
    t0 = time.perf_counter()
    hardware, n = _hardware(config), config.num_nodes
    speeds = config.node_speeds()
    if config.direction is None:
        result = partition(traced.layers, hardware, n, speeds, _dtype(traced), config.max_states, config.max_fuse)
    else:
        model = CostModel(traced.layers, hardware, n, speeds, _dtype(traced), max_states=config.max_states,
                          max_fuse=config.max_fuse)
        result = describe(model, model.single_direction(single_direction(config.direction)), baselines(model))
    emission = config.emission
    if emission == "auto":
        simple = not result.fused and not result.proportional and _even(traced, result.directions, n)
        emission = "constrained" if simple else "explicit"
    elif emission == "constrained" and (result.fused or result.proportional or not _even(traced, result.directions, n)):
        raise ConfigError(f"autoshard (inference): emission='constrained' needs even splits on equal nodes and no "
                          f"fused runs, but this plan has {len(result.fused)} fused runs / speeds {speeds} / uneven "
                          f"parts over {n} nodes. Fix: emission='auto' or 'explicit' (or max_fuse=1).")
    return InferencePlan(config.axis_name, hardware.name, result, emission, signature, time.perf_counter() - t0)


@on_own_mesh
def plan_inference(fn: Callable, *args: Any, **kwargs: Any) -> InferencePlan:
    """`autoshard.plan(fn, *args, mode="inference", mesh=..., hardware=..., speeds=..., direction=...,
    max_fuse=..., data_argnums=..., emission=...)`; args may be ShapeDtypeStructs."""
    config = InferenceConfig.make(**kwargs)
    traced = trace_inference(fn, *args, data_argnums=config.data_argnums)
    return plan_traced(traced, config, _signature(args))


def make_inference_mesh(config: InferenceConfig, given: Any = None) -> Mesh:
    if isinstance(given, Mesh):
        return auto_axes(given)       # an Explicit-axis mesh (jax.make_mesh's default): same devices, Auto axes
    n, devices = config.num_nodes, jax.devices()
    if n > len(devices):
        raise MeshError(f"autoshard (inference): mesh {dict(config.mesh.axes)} needs {n} devices but jax has "
                        f"{len(devices)} ({devices[0].platform}). Fix: a smaller mesh, or more devices (on CPU: "
                        "jax.config.update('jax_num_cpu_devices', N) before jax starts).")
    return jax.make_mesh((n,), (config.axis_name,), axis_types=(AxisType.Auto,), devices=devices[:n])


def program(traced: TracedInference, plan: InferencePlan, mesh: Mesh) -> Callable:
    """The jitted program running `plan`."""
    directions = plan.partition.directions
    if plan.emission == "constrained":
        return jax.jit(constrained_program(traced, directions, mesh))
    return jax.jit(explicit_program(traced, directions, plan.partition.fused, mesh, plan.partition.weights))


class InferenceAutosharded:
    """`apply_fn` partitioned for inference. Call it like the original; `.plan` is the plan of the
    last call's shapes (a new argument shape is planned and compiled once, like jit)."""

    def __init__(self, fn: Callable, *, mode: str = "inference", mesh: Any = None, **kwargs: Any) -> None:
        if not callable(fn):
            raise ConfigError(f"autoshard (inference): {fn!r} is not callable; decorate the apply function.")
        self.fn = fn
        self.config = InferenceConfig.make(mesh=mesh, **kwargs)
        self._given_mesh = mesh if isinstance(mesh, Mesh) else None
        self._cache: dict[str, tuple[InferencePlan, Callable]] = {}
        self._last: InferencePlan | None = None
        functools.update_wrapper(self, fn)

    def _compiled(self, args: tuple) -> tuple[InferencePlan, Callable]:
        sig = _signature(args)
        if sig not in self._cache:
            traced = trace_inference(self.fn, *args, data_argnums=self.config.data_argnums)
            plan = plan_traced(traced, self.config, sig)
            mesh = make_inference_mesh(self.config, self._given_mesh)
            self._cache[sig] = (plan, program(traced, plan, mesh))
        return self._cache[sig]

    @on_own_mesh
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args = auto_placed(positional(self.fn, args, kwargs))
        plan, run = self._compiled(args)
        self._last = plan
        return run(*args)

    @on_own_mesh
    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """The jitted program's `lower` for these arguments (inspect `.compile().as_text()`)."""
        args = auto_placed(positional(self.fn, args, kwargs))
        return self._compiled(args)[1].lower(*args)

    @property
    def plan(self) -> InferencePlan:
        if self._last is None:
            raise PlanError("autoshard (inference): no plan yet; call the function once (or use autoshard.plan(fn, "
                            "*args, mode='inference', ...) to plan without running).")
        return self._last

    def explain(self) -> str:
        return self.plan.explain()


def received_per_device(record: Any, n: int) -> list[int]:
    """Bytes each of the `n` devices receives in one compiled collective (all executions): a
    collective-permute delivers its buffer to each pair's target only (at a mesh's end a device may
    only send); an all-gather brings each device the other members' parts; anything else is counted
    whole on every member."""
    got = [0] * n
    nbytes = record.bytes * record.count
    groups = _hlo.parse_replica_groups(record.groups, n) if record.groups not in ("", "{}") else [list(range(n))]
    for group in groups:
        if record.kind == "collective-permute":
            got[group[1]] += nbytes
        elif record.kind == "all-gather":
            for d in group:
                got[d] += nbytes * (len(group) - 1) // len(group)
        else:
            for d in group:
                got[d] += nbytes
    return got


def audit_inference(fast: InferenceAutosharded, *args: Any) -> dict[str, Any]:
    """Compile `fast` for `args` and set what its collectives deliver beside the plan, per layer: the
    plan's largest per-node receive against the largest per-device receive of the collectives whose
    op metadata names the layer (`bridge.inference.emit.scope_of`); "output" is assembling the result."""
    if not isinstance(fast, InferenceAutosharded):
        raise PlanError(f"audit_inference: expected the function autoshard.autoshard(fn, mode='inference', mesh=...) "
                        f"returns, got {type(fast).__name__}. Fix: audit a training plan with autoshard.audit(plan, "
                        "step, *args), an inference function by decorating it first.")
    plan, _ = fast._compiled(args)
    compiled = fast.lower(*args).compile()
    n = plan.num_nodes
    records = _hlo.collectives(compiled.as_text(), (plan.axis_name,), (n,))
    by_kind: dict[str, int] = {}
    received: dict[str, list[int]] = {}
    for r in records:
        got = received_per_device(r, n)
        by_kind[r.kind] = by_kind.get(r.kind, 0) + max(got)
        layer = layer_of_op(r.op_name) or "(unattributed)"
        received[layer] = [a + b for a, b in zip(received.setdefault(layer, [0] * n), got, strict=True)]
    predicted = {lp.name: max(lp.received_nbytes) for lp in plan.layers if max(lp.received_nbytes)}
    audited = {name: max(got) for name, got in received.items() if max(got)}
    return {"emission": plan.emission, "predicted_nbytes": sum(predicted.values()),
            "audited_nbytes": sum(v for k, v in audited.items() if k != "output"),
            "output_nbytes": audited.get("output", 0), "by_kind": by_kind, "collectives": len(records),
            "predicted_by_layer": predicted, "audited_by_layer": audited}
