"""@autoshard.autoshard: plan on the first call (or load a cached plan), compile, place; then run."""

from __future__ import annotations

import functools
import hashlib
import os
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from ..core.errors import ConfigError, PlanError
from ..core.graph import fingerprint
from ..plan.plan import Plan
from ..tensor.search import SearchOptions
from .api import bind
from .api import plan as make_plan
from .emit import ShapesChanged, donated_argnums, jit_step, make_mesh, shape_guarded, shardings
from .pipelined_step import pipelined_step
from .trace import trace

_CONFIG_KEYS = {"mesh", "hardware", "memory_budget", "options", "cache_dir", "pipeline", "schedule",
                "num_microbatches", "pipeline_options"}
_OPTION_KEYS = {"storage_modes", "max_plans", "overlap", "bucket_bytes"}
_PLAN_CACHE: dict[tuple, Plan] = {}


def load_config(path: str | os.PathLike) -> dict[str, Any]:
    """Read an autoshard TOML config (mesh, hardware, memory_budget, options, cache_dir, and for
    pipelines pipeline, schedule, num_microbatches, pipeline_options)."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError as err:
        raise ConfigError(f"autoshard config {str(p)!r} does not exist.") from err
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"autoshard config {str(p)!r} is not valid TOML: {err}.") from err
    unknown = sorted(set(data) - _CONFIG_KEYS)
    if unknown:
        raise ConfigError(f"autoshard config {str(p)!r}: unknown key(s) {unknown}; valid keys: "
                          f"{sorted(_CONFIG_KEYS)}.")
    bad = sorted(set(data.get("options", {})) - _OPTION_KEYS)
    if bad:
        raise ConfigError(f"autoshard config {str(p)!r}: unknown [options] key(s) {bad}; valid: "
                          f"{sorted(_OPTION_KEYS)}.")
    return data


def default_hardware() -> str:
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        return "cpu-sim"
    kind = getattr(dev, "device_kind", "").upper()
    for key, name in (("H100", "h100-sxm"), ("A100", "a100-sxm"), ("V100", "v100-sxm")):
        if key in kind:
            return name
    raise ConfigError(f"autoshard: no hardware preset for device kind {kind!r}; pass hardware= a "
                      "preset name or explicit numbers (see autoshard hardware presets).")


def _abstract(args: tuple) -> tuple:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x,
                        args)


class Autosharded:
    """A step function parallelised by autoshard. Call it like the original."""

    def __init__(self, fn: Callable, *, mesh: Any = None, hardware: Any = None,
                 memory_budget: float | None = None, config: str | os.PathLike | None = None,
                 plan: Plan | str | os.PathLike | None = None, donate: bool = True,
                 cache_dir: str | os.PathLike | None = None, options: SearchOptions | None = None,
                 pipeline: str | None = None, schedule: str | None = None, num_microbatches: int | None = None,
                 pipeline_options: dict | None = None):
        cfg = load_config(config) if config is not None else {}
        self.pipeline = pipeline if pipeline is not None else cfg.get("pipeline")
        self.schedule = schedule if schedule is not None else cfg.get("schedule", "1f1b")
        self.num_microbatches = num_microbatches if num_microbatches is not None else cfg.get("num_microbatches")
        self.pipeline_options = pipeline_options if pipeline_options is not None else cfg.get("pipeline_options")
        if self.pipeline is None and (schedule, num_microbatches, pipeline_options) != (None, None, None):
            raise ConfigError("autoshard: schedule, num_microbatches and pipeline_options apply to pipeline "
                              "plans only; pass pipeline='rannc' (or 'auto') with a 'pipe' mesh axis, or drop them.")
        self.fn = fn
        self.mesh_arg = mesh if mesh is not None else cfg.get("mesh")
        if self.mesh_arg is None:
            raise ConfigError("autoshard: no mesh given; pass mesh={'data': 2, 'model': 4} (axis "
                              "name -> size), a jax Mesh, or 'auto', or a config file with [mesh].")
        self.hardware = hardware if hardware is not None else cfg.get("hardware")
        self.memory_budget = memory_budget if memory_budget is not None else cfg.get("memory_budget")
        self.options = options or (SearchOptions(**{k: tuple(v) if isinstance(v, list) else v
                                                    for k, v in cfg.get("options", {}).items()}))
        self.cache_dir = cache_dir if cache_dir is not None else cfg.get("cache_dir")
        self.donate = donate
        self._given_plan = plan
        self._plan: Plan | None = None
        self._jitted = None
        self._mesh = None
        self._pipelined = None
        functools.update_wrapper(self, fn)

    # --- planning -------------------------------------------------------------------------
    def _key(self, fp: str) -> tuple:
        return (fp, repr(self.mesh_arg if not hasattr(self.mesh_arg, "shape") else dict(self.mesh_arg.shape)),
                repr(self.hardware), self.memory_budget, repr(self.options), self.pipeline, self.schedule,
                repr(self.pipeline_options))

    def _load_given(self, args: tuple) -> Plan:
        given = self._given_plan
        p = given if isinstance(given, Plan) else Plan.from_json(Path(given).read_text())
        fp = fingerprint(trace(self.fn, *_abstract(args)))
        if p.provenance.get("fingerprint") != fp:
            raise PlanError(
                f"autoshard: the plan was made for another model or step (plan fingerprint "
                f"{p.provenance.get('fingerprint')}, step {p.provenance.get('step')!r}; this step's "
                f"fingerprint {fp}). Fix: re-plan with autoshard.plan(step, *args, mesh=...) or drop "
                "the plan= argument.")
        return bind(p, *args)

    def _make_plan(self, args: tuple) -> Plan:
        if self._given_plan is not None:
            return self._load_given(args)
        abstract = _abstract(args)
        hw = self.hardware if self.hardware is not None else default_hardware()
        fp = fingerprint(trace(self.fn, *abstract))
        key = self._key(fp)
        if key in _PLAN_CACHE:
            return bind(_PLAN_CACHE[key], *args)
        path = None
        if self.cache_dir is not None:
            path = Path(self.cache_dir) / (hashlib.sha1(repr(key).encode()).hexdigest()[:20] + ".json")
            if path.exists():
                p = Plan.from_json(path.read_text())
                if p.provenance.get("fingerprint") == fp:
                    _PLAN_CACHE[key] = p
                    return bind(p, *args)
        pipe_kw = {} if self.pipeline is None else dict(pipeline=self.pipeline, schedule=self.schedule,
                                                         pipeline_options=self.pipeline_options)
        p = make_plan(self.fn, *abstract, mesh=self.mesh_arg, hardware=hw, memory_budget=self.memory_budget,
                      devices=len(jax.devices()), options=self.options, **pipe_kw)
        _PLAN_CACHE[key] = p
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(p.to_json())
        return p

    def _prepare(self, args: tuple) -> None:
        self._plan = self._make_plan(args)
        self._mesh = make_mesh(self._plan)
        if self._plan.stages:
            self._prepare_pipeline(args)
            return
        self._jitted = jit_step(self.fn, self._plan, self._mesh, _abstract(args), donate=self.donate, guard=True)
        self._in_shardings, _ = shardings(self._plan, self._mesh)

    def _prepare_pipeline(self, args: tuple) -> None:
        # the step's state stays the user's pytrees, stored ZeRO-style between steps; only the
        # loss's value_and_grad runs as stages inside (see _pipelined_step)
        hw = self.hardware if self.hardware is not None else default_hardware()
        step, self._pipelined, self._in_shardings, outs = pipelined_step(
            self.fn, self._plan, self._mesh, args, num_microbatches=self.num_microbatches, hardware=hw)
        self._mesh = self._pipelined.mesh          # GraphPipe: the (pipe, data) mesh its stages run on
        self._jitted = jax.jit(shape_guarded(step, args), in_shardings=self._in_shardings, out_shardings=outs,
                               donate_argnums=donated_argnums(self._plan, len(args)) if self.donate else ())

    # --- public ---------------------------------------------------------------------------
    def __call__(self, *args):
        if self._jitted is None:
            self._prepare(args)
            args = self._placed(args)
        try:
            return self._jitted(*args)
        except ShapesChanged:
            # a new structure, shape or dtype is a new program: plan it (the plan cache makes a
            # return to earlier shapes cheap) rather than run shardings planned for other shapes
            self._prepare(args)
            return self._jitted(*self._placed(args))

    @property
    def plan(self) -> Plan:
        if self._plan is None:
            raise PlanError("autoshard: no plan yet; call the step once (or .lower(*args)).")
        return self._plan

    def lower(self, *args):
        if self._jitted is None:
            self._prepare(args)
        try:
            return self._jitted.lower(*args)
        except ShapesChanged:
            self._prepare(args)
            return self._jitted.lower(*args)

    def explain(self) -> str:
        text = self.plan.explain()
        if self._pipelined is not None:
            text += "\n\nRuntime cut of the loss (autoshard.pipelined):\n" + self._pipelined.describe()
        return text

    @property
    def pipelined(self):
        """The `autoshard.Pipelined` a pipeline plan's step runs its loss with (None for tensor plans)."""
        return self._pipelined

    def place(self, *args):
        """Put arguments on the mesh with the planned shardings (done on the first call)."""
        if self._jitted is None:
            self._prepare(args)
        return self._placed(args)

    def _placed(self, args: tuple) -> tuple:
        # the step donates its state arguments; a placement sharing a buffer with the caller's array
        # (jax reuses a single-device array's buffer for its shard of a replicated sharding, even
        # with may_alias=False) would delete the caller's array, so those leaves are copied first
        placed = jax.device_put(args, self._in_shardings)
        if not self.donate:
            return placed

        def own(orig, new, sharding):
            if isinstance(orig, jax.Array) and _buffers(orig) & _buffers(new):
                return jax.device_put(orig.copy(), sharding)
            return new

        return jax.tree.map(own, args, placed, self._in_shardings)


def _buffers(x: Any) -> set[int]:
    try:
        return {sh.data.unsafe_buffer_pointer() for sh in x.addressable_shards}
    except Exception:   # a deleted or non-addressable array: nothing of the caller's to protect
        return set()


def autoshard(fn: Callable | None = None, **kwargs) -> Any:
    """Decorator: `@autoshard(mesh={"data": 2, "model": 4}, hardware="h100-sxm")`."""
    if fn is None:
        return lambda f: Autosharded(f, **kwargs)
    return Autosharded(fn, **kwargs)
