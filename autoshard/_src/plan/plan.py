"""Plan: the frozen, JSON-round-tripping result of planning (contract in shared/DESIGN.md).

One type for tensor, pipeline and (next) 3-D plans: a plan is a list of stages, each with the ops
it runs, its device group (a submesh), its tensor sharding (factors -> mesh axes, storage mode,
activation constraints), its replicas and micro-batches and its predicted costs; plus the
whole step's input/output specs, the schedule, the mesh, hardware, predictions and provenance. A
tensor plan is one stage over the whole mesh; a RaNNC or GraphPipe plan is stages that are data
parallel inside.

Specs are stored as plain data keyed by pytree keypath — per dimension a tuple of mesh axis names,
`()` for unsplit — so a plan is readable, diffable (tests/golden) and editable. `input_specs` turns
them into a pytree of `jax.sharding.PartitionSpec` shaped like the step's arguments.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any, Protocol

from ..core.collectives import on_backend
from ..core.errors import PlanError
from .explain import equal_submeshes, explain_3d, explain_pipeline, explain_tensor
from .specs import Spec, as_spec
from .validate import check_plan

FORMAT_VERSION = 2   # 2: stages for every plan, activation constraints keyed by op key (1: by op index)
Factor = tuple[int, str, int, tuple[str, ...]]     # (id, description, size, mesh axes)


class ArgStructure(Protocol):
    """The pytree structure of a step's arguments, as the jax bridge reads it: the leaves' keypaths
    in flat order, and a way to build the PartitionSpec pytree from per-leaf specs."""

    keypaths: tuple[str, ...]

    def partition_specs(self, specs: tuple[Spec, ...]) -> Any: ...


def buffers(terms: Mapping[str, float], platform: str) -> dict[str, float]:
    """Memory terms (params, optimizer, data, grads, activations, cpu_temp_extra) as XLA's buffers on
    `platform`: arguments (parameters, optimizer state, the batch) and temporaries (gradients, saved
    activations; on XLA:CPU a ZeRO gradient's whole all-reduce result, `cpu_temp_extra`)."""
    arg = terms["params"] + terms["optimizer"] + terms["data"]
    temp = terms["grads"] + terms["activations"] + (terms.get("cpu_temp_extra", 0.0) if platform == "cpu" else 0.0)
    return {"argument": arg, "temp": temp, "argument+temp": arg + temp}


@dataclasses.dataclass(frozen=True)
class ParamReport:
    keypath: str
    shape: tuple[int, ...]
    dtype: str
    spec: Spec
    bytes_per_device: int
    grad_sync: str        # e.g. "all-reduce over data", "reduce-scatter over data", "none"


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage of a plan (contract: `.mesh`, `.replicas`, `.microbatch_size`, `.predicted_forward`
    / `.predicted_backward` seconds per micro-batch, `.memory` bytes per device).

    `mesh` is the stage's device group as named axes; `factors`, `storage` and
    `activation_constraints` its tensor sharding over them. `ops` empty means every op of the step
    (a one-stage tensor plan)."""

    index: int
    mesh: tuple[tuple[str, int], ...]        # the stage's submesh, e.g. (("data", 2), ("model", 8))
    replicas: int                            # data-parallel copies of the stage's work
    microbatch_size: int                     # samples per replica per micro-batch (the busiest replica)
    predicted_forward: float                 # seconds per micro-batch
    predicted_backward: float                # seconds per micro-batch, incl. amortised gradient sync
    memory: float                            # peak bytes per device
    microbatches: int = 1                    # micro-batches per step (GraphPipe: per stage)
    after: tuple[int, ...] = ()              # stages feeding this one (a chain, or a DAG)
    units: tuple[int, ...] = ()              # partitioner units it holds: RaNNC blocks, GraphPipe layer nodes
    ops: tuple[int, ...] = ()                # op indices of the traced step (empty: all)
    modules: tuple[str, ...] = ()            # top-level modules its forward ops come from, in order
    params: tuple[str, ...] = ()             # keypaths of the parameters it holds
    factors: tuple[Factor, ...] = ()         # logical dims -> mesh axes of its submesh
    storage: str = "replicated"              # replicated | zero1 | zero3
    activation_constraints: tuple[tuple[str, Spec], ...] = ()   # (op key, spec of output 0), see op_keys
    # none | selective (recompute the attention scores / softmax) | dots (keep matmul outputs) |
    # full (recompute the forward); see joint/stage_choice.py
    remat: str = "none"
    param_specs: tuple[tuple[str, Spec], ...] = ()   # 3-D stages: (keypath, spec) of its parameters
    batch_axes: tuple[str, ...] = ()         # 3-D stages: the submesh axes splitting its micro-batch

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Stage:
        ints = lambda xs: tuple(int(x) for x in xs)  # noqa: E731
        return cls(
            index=int(d["index"]), mesh=tuple((n, s) for n, s in d["mesh"]), replicas=int(d["replicas"]),
            microbatch_size=int(d["microbatch_size"]), predicted_forward=float(d["predicted_forward"]),
            predicted_backward=float(d["predicted_backward"]), memory=float(d["memory"]),
            microbatches=int(d["microbatches"]), after=ints(d["after"]), units=ints(d["units"]), ops=ints(d["ops"]),
            modules=tuple(str(m) for m in d["modules"]), params=tuple(str(p) for p in d["params"]),
            factors=tuple((int(i), str(desc), int(size), tuple(ax)) for i, desc, size, ax in d["factors"]),
            storage=str(d["storage"]),
            activation_constraints=tuple((str(k), as_spec(s)) for k, s in d["activation_constraints"]),
            remat=str(d.get("remat", "none")),
            param_specs=tuple((str(k), as_spec(v)) for k, v in d.get("param_specs", ())),
            batch_axes=tuple(str(a) for a in d.get("batch_axes", ())))


@dataclasses.dataclass(frozen=True)
class Plan:
    """A plan for one traced step on one mesh and hardware: one stage (tensor sharding) or several
    (a pipeline, `schedule` naming the order they run in)."""

    mesh: tuple[tuple[str, int], ...]
    hardware: str
    input_keypaths: tuple[str, ...]
    input_specs_flat: tuple[Spec, ...]
    output_keypaths: tuple[str, ...]
    output_specs_flat: tuple[Spec, ...]
    stages: tuple[Stage, ...]
    predicted: Mapping[str, Any]
    params: tuple[ParamReport, ...]
    warnings: tuple[str, ...]
    provenance: Mapping[str, Any]
    schedule: str | None = None              # pipeline schedule name; None for a one-stage tensor plan
    microbatches: int = 1
    _args: ArgStructure | None = dataclasses.field(default=None, compare=False, repr=False)

    # --- stages ------------------------------------------------------------------------------
    @property
    def is_pipeline(self) -> bool:
        return self.schedule is not None

    @property
    def factors(self) -> tuple[Factor, ...]:
        """A tensor plan's logical dims -> mesh axes (its one stage's); () for pipeline plans."""
        return () if self.is_pipeline else self.stages[0].factors

    @property
    def storage(self) -> str:
        return "replicated" if self.is_pipeline else self.stages[0].storage

    def collectives_on(self, platform: str) -> list[dict[str, Any]]:
        """The predicted collectives as `platform` ("gpu", "tpu", "cpu") compiles them: what an
        audit on that platform compares with (XLA:CPU all-reduces where a GPU reduce-scatters)."""
        return on_backend(list(self.predicted.get("collectives") or []), platform, dict(self.mesh))

    def memory_on(self, platform: str) -> dict[str, float]:
        """Predicted bytes per device as `platform` lays out the compiled step's buffers: arguments
        (parameters, optimizer state, the batch) and temporaries (gradients, saved activations; on
        XLA:CPU a ZeRO gradient's whole all-reduce result, `cpu_temp_extra`)."""
        return buffers(self.predicted["memory"], platform)

    @property
    def remat_labels(self) -> tuple[str, ...]:
        """The block instances a tensor plan's remat applies to: its units' labels (the 3-D search's
        one-stage plan, which the tensor planner returns when only remat fits) or `predicted["remat_labels"]`
        (a plan edited by hand)."""
        return tuple(self.predicted.get("3d", {}).get("unit_labels", ()) or self.predicted.get("remat_labels", ()))

    @property
    def activation_constraints(self) -> tuple[tuple[str, Spec], ...]:
        return () if self.is_pipeline else self.stages[0].activation_constraints

    @property
    def runtime(self) -> str:
        """The runtime that runs the plan: "mpmd" when its pipeline stages cannot share one pipe x data x
        model program (a 3-D plan's stages on unequal submeshes; a RaNNC or GraphPipe plan's stages with
        unequal replicas or micro-batch counts): each stage its own program on its own devices. Else "spmd"."""
        if not self.is_pipeline:
            return "spmd"
        three_d = self.predicted.get("3d")
        if three_d is not None:
            return "spmd" if equal_submeshes(three_d) and len({s.mesh for s in self.stages}) == 1 else "mpmd"
        uneven = len({s.replicas for s in self.stages}) > 1 or len({s.microbatches for s in self.stages}) > 1
        return "mpmd" if uneven else "spmd"

    # --- pytrees -------------------------------------------------------------------------------
    @property
    def input_specs(self):
        """PartitionSpec pytree shaped like the step's arguments (params, opt_state, batch)."""
        if self._args is None:
            raise PlanError(
                "Plan.input_specs: this plan was loaded from JSON and does not know the structure "
                "of the step's arguments. Fix: autoshard.bind(plan, *args) with the same arguments (or "
                "ShapeDtypeStructs), or use plan.specs_by_keypath().")
        return self._args.partition_specs(self.input_specs_flat)

    def specs_by_keypath(self) -> dict[str, Spec]:
        return dict(zip(self.input_keypaths, self.input_specs_flat, strict=True))

    def with_args(self, structure: ArgStructure) -> Plan:
        """This plan bound to an argument structure (checked against its keypaths); the jax bridge
        builds `structure` from the step's arguments (`autoshard.bind(plan, *args)`)."""
        keypaths = tuple(structure.keypaths)
        if keypaths != self.input_keypaths:
            missing = sorted(set(self.input_keypaths) - set(keypaths))[:3]
            extra = sorted(set(keypaths) - set(self.input_keypaths))[:3]
            raise PlanError(
                f"autoshard.bind: the arguments do not match the plan ({len(keypaths)} leaves given, "
                f"{len(self.input_keypaths)} planned; planned but missing: {missing}; "
                f"not planned: {extra}). The plan belongs to another model or step; re-plan "
                "with autoshard.plan(step, *args, ...).")
        return dataclasses.replace(self, _args=structure)

    # --- JSON ----------------------------------------------------------------------------------
    def to_json(self) -> str:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "_args"}
        d["params"] = [dataclasses.asdict(p) for p in self.params]
        d["stages"] = [s.to_dict() for s in self.stages]
        d["format_version"] = FORMAT_VERSION
        return json.dumps(d, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Plan:
        """The plan `to_json` wrote, every field checked against its mesh (`validate.check_plan`): a PlanError
        naming the field, leaf and fix for anything else (an edited, truncated or foreign file)."""
        if isinstance(text, (bytes, bytearray)):
            try:
                text = text.decode()
            except UnicodeDecodeError as err:
                raise PlanError("Plan.from_json: the text is not UTF-8 (a binary or corrupted file). Fix: load a file "
                                "written by plan.to_json(), or re-plan with autoshard.plan(step, *args, ...).") from err
        if not isinstance(text, str):
            raise PlanError(f"Plan.from_json: expected the JSON text of a plan (str), got {type(text).__name__}. Fix: "
                            "Plan.from_json(Path(file).read_text()), or pass the Plan itself.")
        try:
            d = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as err:
            raise PlanError(f"Plan.from_json: not JSON ({err}).") from err
        version = d.get("format_version") if isinstance(d, dict) else None
        if not isinstance(d, dict):
            raise PlanError(f"Plan.from_json: not an autoshard plan (a JSON {type(d).__name__}, {str(d)[:60]!r}; a "
                            "plan is a JSON object). Fix: load a file written by plan.to_json().")
        if version != FORMAT_VERSION:
            old = isinstance(version, int) and version < FORMAT_VERSION
            raise PlanError(
                f"Plan.from_json: expected an autoshard plan of format_version {FORMAT_VERSION}, got {version!r}"
                + (". The file was written by an earlier autoshard (plans now hold stages, and activation "
                   "constraints are keyed by op name, not trace position). Fix: re-plan with "
                   "autoshard.plan(step, *args, ...) and save the new plan." if old else
                   ". Fix: load a file written by plan.to_json() of this autoshard, or re-plan."))
        try:
            plan = cls._from_dict(d)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            what = (f"the key {err.args[0]!r} is missing" if isinstance(err, KeyError)
                    else f"{type(err).__name__}: {err}")
            raise PlanError(f"Plan.from_json: not a complete autoshard plan ({what}). Fix: load a file written by "
                            "plan.to_json(), or re-plan with autoshard.plan(step, *args, ...).") from err
        check_plan(plan)
        return plan

    @classmethod
    def _from_dict(cls, d: dict[str, Any]) -> Plan:
        spec = as_spec
        return cls(
            mesh=tuple((n, s) for n, s in d["mesh"]),         # checked by check_plan (names, int sizes >= 1)
            hardware=str(d["hardware"]),
            input_keypaths=_strings(d["input_keypaths"], "input_keypaths"),
            input_specs_flat=tuple(spec(s) for s in _items(d["input_specs_flat"], "input_specs_flat")),
            output_keypaths=_strings(d["output_keypaths"], "output_keypaths"),
            output_specs_flat=tuple(spec(s) for s in _items(d["output_specs_flat"], "output_specs_flat")),
            predicted=_mapping(d["predicted"], "predicted"),
            params=tuple(ParamReport(str(p["keypath"]), tuple(int(n) for n in p["shape"]), str(p["dtype"]),
                                     spec(p["spec"]), int(p["bytes_per_device"]), str(p["grad_sync"]))
                         for p in _items(d["params"], "params")),
            warnings=_strings(d["warnings"], "warnings"),
            provenance=_mapping(d["provenance"], "provenance"),
            stages=tuple(Stage.from_dict(s) for s in _items(d["stages"], "stages")),
            schedule=d["schedule"],
            microbatches=_int(d["microbatches"], "microbatches"),
        )

    # --- reports -------------------------------------------------------------------------------
    @property
    def mesh_dict(self) -> dict[str, int]:
        return dict(self.mesh)

    def explain(self) -> str:
        """A readable report: per-stage table for pipeline plans; factors, collectives, per-parameter
        specs and the comparison with expert plans for tensor plans."""
        if self.is_pipeline:
            return explain_3d(self) if "3d" in self.predicted else explain_pipeline(self)
        return explain_tensor(self)


def _items(x: Any, field: str) -> list:
    if not isinstance(x, list):
        raise ValueError(f"{field} must be a JSON list, got {type(x).__name__} {str(x)[:40]!r}")
    return x


def _strings(x: Any, field: str) -> tuple[str, ...]:
    if not all(isinstance(v, str) for v in _items(x, field)):
        raise ValueError(f"{field} must be a list of strings")
    return tuple(x)


def _int(x: Any, field: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise ValueError(f"{field}={x!r} must be an integer")
    return x


def _mapping(x: Any, field: str) -> Mapping[str, Any]:
    if not isinstance(x, dict):
        raise ValueError(f"{field} must be a JSON object, got {type(x).__name__}")
    return _freeze(x)


def _freeze(x):
    if isinstance(x, dict):
        return {k: _freeze(v) for k, v in x.items()}
    if isinstance(x, list):
        return tuple(_freeze(v) for v in x)
    return x
