"""Plan: the frozen, JSON-round-tripping result of planning (contract in shared/DESIGN.md).

Specs are stored as plain data keyed by pytree keypath — per dimension a tuple of mesh axis names,
`()` for unsplit — so a plan is readable, diffable (tests/golden) and editable. `input_specs` turns
them into a pytree of `jax.sharding.PartitionSpec` shaped like the step's arguments.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any, Protocol

from ..core.errors import PlanError

Spec = tuple[tuple[str, ...], ...]
FORMAT_VERSION = 1


class ArgStructure(Protocol):
    """The pytree structure of a step's arguments, as the jax bridge reads it: the leaves' keypaths
    in flat order, and a way to build the PartitionSpec pytree from per-leaf specs."""

    keypaths: tuple[str, ...]

    def partition_specs(self, specs: tuple[Spec, ...]) -> Any: ...


def spec_str(spec: Spec) -> str:
    parts = []
    for axes in spec:
        parts.append("None" if not axes else (axes[0] if len(axes) == 1 else "(" + ",".join(axes) + ")"))
    return "P(" + ", ".join(parts) + ")"


@dataclasses.dataclass(frozen=True)
class ParamReport:
    keypath: str
    shape: tuple[int, ...]
    dtype: str
    spec: Spec
    bytes_per_device: int
    grad_sync: str        # e.g. "all-reduce over data", "reduce-scatter over data", "none"


@dataclasses.dataclass(frozen=True)
class PipelineStage:
    """One pipeline stage of a plan (contract: `.replicas`, `.microbatch_size`,
    `.predicted_forward` / `.predicted_backward` seconds per micro-batch, `.memory` bytes per device)."""

    index: int
    units: tuple[int, ...]           # partitioner units it holds: RaNNC blocks, GraphPipe layer nodes
    ops: tuple[int, ...]             # op indices of the traced step
    modules: tuple[str, ...]         # top-level modules its forward ops come from, in order
    params: tuple[str, ...]          # keypaths of the parameters it holds
    replicas: int                    # devices running it (data parallel inside the stage)
    microbatch_size: int             # samples per replica per micro-batch (the busiest replica)
    predicted_forward: float         # seconds per micro-batch
    predicted_backward: float
    memory: float                    # peak bytes per device
    microbatches: int = 1            # micro-batches per step (GraphPipe: per stage)
    after: tuple[int, ...] = ()      # stages feeding this one (a chain for RaNNC, a DAG for GraphPipe)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PipelineStage:
        return cls(int(d["index"]), tuple(int(u) for u in d["units"]), tuple(int(o) for o in d["ops"]),
                   tuple(d["modules"]), tuple(d["params"]), int(d["replicas"]), int(d["microbatch_size"]),
                   float(d["predicted_forward"]), float(d["predicted_backward"]), float(d["memory"]),
                   int(d["microbatches"]), tuple(int(a) for a in d["after"]))


def _span(units: tuple[int, ...]) -> str:
    if not units:
        return "-"
    if list(units) == list(range(units[0], units[-1] + 1)):
        return f"{units[0]}-{units[-1]}" if len(units) > 1 else str(units[0])
    return f"{len(units)} ({units[0]}..{units[-1]})"


@dataclasses.dataclass(frozen=True)
class Plan:
    """A sharding plan for one traced step on one mesh and hardware."""

    mesh: tuple[tuple[str, int], ...]
    hardware: str
    input_keypaths: tuple[str, ...]
    input_specs_flat: tuple[Spec, ...]
    output_keypaths: tuple[str, ...]
    output_specs_flat: tuple[Spec, ...]
    activation_constraints: tuple[tuple[int, Spec], ...]   # (op index in the trace, spec of output 0)
    factors: tuple[tuple[int, str, int, tuple[str, ...]], ...]  # (id, description, size, axes)
    storage: str
    predicted: Mapping[str, Any]
    params: tuple[ParamReport, ...]
    warnings: tuple[str, ...]
    provenance: Mapping[str, Any]
    stages: tuple[PipelineStage, ...] = ()   # pipeline plans only (pipeline="rannc" or "graphpipe")
    microbatches: int = 1
    _args: ArgStructure | None = dataclasses.field(default=None, compare=False, repr=False)

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
    def from_json(cls, text: str) -> Plan:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as err:
            raise PlanError(f"Plan.from_json: not JSON ({err}).") from err
        if not isinstance(d, dict) or d.get("format_version") != FORMAT_VERSION:
            raise PlanError(f"Plan.from_json: expected an autoshard plan of format_version "
                            f"{FORMAT_VERSION}, got {d.get('format_version') if isinstance(d, dict) else d!r}.")
        d.pop("format_version")

        def spec(s) -> Spec:
            return tuple(tuple(a) for a in s)

        return cls(
            mesh=tuple((n, int(s)) for n, s in d["mesh"]),
            hardware=d["hardware"],
            input_keypaths=tuple(d["input_keypaths"]),
            input_specs_flat=tuple(spec(s) for s in d["input_specs_flat"]),
            output_keypaths=tuple(d["output_keypaths"]),
            output_specs_flat=tuple(spec(s) for s in d["output_specs_flat"]),
            activation_constraints=tuple((int(i), spec(s)) for i, s in d["activation_constraints"]),
            factors=tuple((int(i), desc, int(size), tuple(ax)) for i, desc, size, ax in d["factors"]),
            storage=d["storage"],
            predicted=_freeze(d["predicted"]),
            params=tuple(ParamReport(p["keypath"], tuple(p["shape"]), p["dtype"], spec(p["spec"]),
                                     int(p["bytes_per_device"]), p["grad_sync"]) for p in d["params"]),
            warnings=tuple(d["warnings"]),
            provenance=_freeze(d["provenance"]),
            stages=tuple(PipelineStage.from_dict(s) for s in d.get("stages", ())),
            microbatches=int(d.get("microbatches", 1)),
        )

    # --- reports -------------------------------------------------------------------------------
    @property
    def mesh_dict(self) -> dict[str, int]:
        return dict(self.mesh)

    def explain(self) -> str:
        if self.stages:
            return self._explain_pipeline()
        p = self.predicted
        lines = [
            f"autoshard plan on mesh {' x '.join(f'{n}={s}' for n, s in self.mesh)}, "
            f"hardware {self.hardware}, storage {self.storage}",
            f"predicted step {p['step_time'] * 1e3:.3f} ms "
            f"(compute {p['breakdown']['compute'] * 1e3:.3f} ms, forward comm "
            f"{p['breakdown']['fwd_comm'] * 1e3:.3f} ms, backward comm {p['breakdown']['bwd_comm'] * 1e3:.3f} ms, "
            f"grad sync {p['breakdown']['grad_sync'] * 1e3:.3f} ms (overlapped), storage comm "
            f"{p['breakdown']['storage_comm'] * 1e3:.3f} ms); memory "
            f"{p['memory']['total'] / 2**30:.3f} GiB per device of {p['memory_budget'] / 2**30:.2f} GiB",
            "",
            "logical dims (factors) -> mesh axes:",
        ]
        for _, desc, size, axes in self.factors:
            lines.append(f"  {desc:<40} size {size:<8} -> {', '.join(axes) if axes else 'replicated'}")
        lines.append("")
        if p.get("collectives"):
            lines.append("predicted collectives per step (per-device buffer bytes):")
            for c in p["collectives"]:
                lines.append(f"  {c['kind']:<15} over {','.join(c['axes']):<12} {c['phase']:<9} "
                             f"x{c['count']:<6g} {c['bytes']:>16,.0f} B")
            lines.append("")
        rows = [("parameter", "shape", "spec", "bytes/device", "gradient sync")]
        for r in self.params:
            rows.append((r.keypath, "x".join(map(str, r.shape)) or "scalar", spec_str(r.spec),
                         f"{r.bytes_per_device:,}", r.grad_sync))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for k, r in enumerate(rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
            if k == 0:
                lines.append("  ".join("-" * w for w in widths))
        if "experts" in p:
            lines.append("")
            lines.append("vs expert plans (same cost model):")
            lines.extend(_expert_lines(p))
        for w in self.warnings:
            lines.append(f"warning: {w}")
        return "\n".join(lines)


    def _explain_pipeline(self) -> str:
        p, pp = self.predicted, self.predicted["pipeline"]
        unit = pp["unit"]
        lines = [
            f"autoshard pipeline plan ({pp['method']}, {pp['schedule']} schedule, profile {pp['profile']}) on "
            f"{pp['devices']} devices (mesh {' x '.join(f'{n}={s}' for n, s in self.mesh)}), hardware {self.hardware}"
            + (f", {pp['devices_used']} of them used" if pp["devices_used"] != pp["devices"] else ""),
            f"{len(self.stages)} stages (depth {pp['depth']}) x {pp['pipelines']} pipeline copies, "
            f"{self.microbatches} micro-batches of batch {pp['batch_size']}; predicted step "
            f"{p['step_time'] * 1e3:.3f} ms, throughput {pp['batch_size'] / p['step_time']:.4g} samples/s, "
            f"max/mean stage time {pp['max_over_mean']:.3f}; peak memory {p['memory']['total'] / 2**30:.3f} GiB "
            f"per device of {p['memory_budget'] / 2**30:.2f} GiB",
            f"search {pp['search_seconds']:.3f} s over {pp['units']} {unit}; event simulator: step "
            f"{pp['simulated_step_time'] * 1e3:.3f} ms, bubble {pp['bubble_fraction']:.1%}, in flight per stage "
            f"{list(pp['peak_inflight'])}",
            "",
        ]
        dag = any(s.after != ((s.index - 1,) if s.index else ()) for s in self.stages)
        rows = [("stage", *(("after",) if dag else ()), unit.split()[-1].rstrip("s"), "ops", "replicas", "micro-batch",
                 "forward ms", "backward ms", "memory GiB", "modules")]
        for s in self.stages:
            mods = ", ".join(s.modules[:3]) + (f", ... ({len(s.modules)})" if len(s.modules) > 3 else "")
            rows.append((str(s.index), *((",".join(map(str, s.after)) or "-",) if dag else ()), _span(s.units),
                         str(len(s.ops)), str(s.replicas), f"{s.microbatch_size} x{s.microbatches}",
                         f"{s.predicted_forward * 1e3:.3f}", f"{s.predicted_backward * 1e3:.3f}",
                         f"{s.memory / 2**30:.3f}", mods or "-"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for k, r in enumerate(rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
            if k == 0:
                lines.append("  ".join("-" * w for w in widths))
        lines.append("")
        base = pp.get("baseline")
        if base:
            ratio = base["step_time"] / p["step_time"]
            lines.append(f"vs {base['name']} ({base['stages']} stages, depth {base['depth']}, {base['microbatches']} "
                         f"micro-batches): {base['step_time'] * 1e3:.3f} ms, max/mean {base['max_over_mean']:.3f}; "
                         + (f"this plan is {ratio:.2f}x faster" if ratio >= 1 else
                            f"the {base['name']} is {1 / ratio:.2f}x faster ({base['hint']})"))
        else:
            lines.append(f"vs {pp['baseline_name']}: none applies ({pp['baseline_reason']})")
        auto = pp.get("auto")
        if auto:
            steps = auto["simulated_step_time"]
            others = [f"{n} {t * 1e3:.3f} ms" for n, t in sorted(steps.items()) if n != auto["chosen"]]
            others += [f"{n} skipped: {why}" for n, why in sorted(auto["skipped"].items())]
            lines.append(f"pipeline='auto' chose {auto['chosen']} (simulated step {steps[auto['chosen']] * 1e3:.3f} ms)"
                         + (f" over {'; '.join(others)}" if others else ""))
        for w in self.warnings:
            lines.append(f"warning: {w}")
        return "\n".join(lines)


_PARTS = {"compute": "compute", "fwd_comm": "forward communication", "bwd_comm": "backward communication",
          "opt_comm": "optimizer communication", "grad_sync": "gradient sync", "storage_comm": "ZeRO gathers"}


def _expert_lines(p: Mapping[str, Any]) -> list[str]:
    """One line per expert: its step time and memory, and why the chosen plan differs."""
    lines = []
    t, bd = p["step_time"], p["breakdown"]
    for name, e in p["experts"].items():
        if "reason" in e:
            lines.append(f"  {name:<15} not applicable: {e['reason']}")
            continue
        head = (f"  {name:<15} {e['step_time'] * 1e3:10.3f} ms  {e['memory'] / 2**30:8.3f} GiB"
                + ("" if e["feasible"] else "  (exceeds the memory budget)"))
        if not e["feasible"]:
            lines.append(head + "; the chosen plan fits")
        elif e["step_time"] > t * (1 + 1e-9):
            # the component where the chosen plan saves most
            diffs = {k: e["breakdown"][k] - bd[k] for k in _PARTS}
            k = max(diffs, key=diffs.get)
            lines.append(head + f"; chosen plan is {e['step_time'] / t:.2f}x faster: {_PARTS[k]} "
                                f"{bd[k] * 1e3:.3f} ms instead of {e['breakdown'][k] * 1e3:.3f} ms")
        else:
            lines.append(head + "; ties with the chosen plan")
    return lines


def _freeze(x):
    if isinstance(x, dict):
        return {k: _freeze(v) for k, v in x.items()}
    if isinstance(x, list):
        return tuple(_freeze(v) for v in x)
    return x
