"""@autoshard.autoshard: plan on the first call (or load a cached plan), compile, place; then run."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from ..core.errors import ConfigError, PlanError
from ..core.graph import fingerprint
from ..inference.plan import MODES
from ..pipeline.costs import traced_batch
from ..plan.config import Config
from ..plan.plan import Plan
from ..plan.planner import IDLE_AXIS
from ..plan.validate import check_plan
from .api import bind, hardware_of, local_config, plan_traced
from .compat import typed_sharding, untyped
from .emit.emit import (
    ShapesChanged,
    donated_argnums,
    jit_step,
    make_mesh,
    own_mesh_context,
    shape_guarded,
    shardings,
    signature,
)
from .emit.plan_fit import check_fingerprint, check_outputs
from .inference.api import InferenceAutosharded
from .runtimes.choose import runs_mpmd
from .runtimes.mpmd_step import MpmdStep
from .runtimes.pipelined_step import pipelined_step
from .trace.call_args import check_leaves, failed, positional, unaliased
from .trace.trace import Traced, trace_step

_PLAN_CACHE: dict[tuple, Plan] = {}
# what one argument signature (structure, shapes, dtypes) prepares: kept per signature, so a step
# called with alternating structures or batch shapes plans and compiles each once
_PROGRAM = ("_plan", "plan_args", "_mesh", "_jitted", "_in_shardings", "_in_devices", "_pipelined", "_treedef",
            "_donated")


def _abstract(args: tuple) -> tuple:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x,
                        args)


class Autosharded:
    """A step function parallelised by autoshard. Call it like the original.

    Keywords are `autoshard.Config` fields (mesh, devices, hardware, memory_budget, options or
    search, pipeline, schedule, profile, pipeline_options, num_microbatches, donate, cache_dir);
    `config` is a TOML file (or mapping, or Config) they override; `plan` a Plan or plan file to
    run instead of planning (it must have been made for this step)."""

    def __init__(self, fn: Callable, *, config: Any = None, plan: Plan | str | os.PathLike | None = None,
                 **kwargs: Any):
        self.config = Config.make(config, **kwargs)
        # a jax Mesh names its devices (maybe a subset): the step runs on exactly those
        given = kwargs.get("mesh")
        self._devices = list(given.devices.flat) if isinstance(given, jax.sharding.Mesh) else None
        self.plan_args: tuple | None = None
        if self.config.mesh is None and plan is None:
            raise ConfigError("autoshard: no mesh given; pass mesh={'data': 2, 'model': 4} (axis "
                              "name -> size), a jax Mesh, or 'auto', or a config file with [mesh].")
        self.fn = fn
        self._given_plan = plan
        self._plan: Plan | None = None
        self._jitted = None
        self._mesh = None
        self._pipelined = None
        self._in_shardings = None
        self._in_devices: list = []          # per argument leaf: its planned sharding's device set
        self._treedef = None
        self._donated: tuple[int, ...] = ()
        self._programs: dict[tuple, tuple] = {}
        functools.update_wrapper(self, fn)

    # --- planning -------------------------------------------------------------------------
    def _key(self, fp: str, config: Config) -> tuple:
        return (fp, repr(config.replace(donate=True, cache_dir=None)))

    def _load_given(self, traced: Traced, args: tuple) -> Plan:
        given = self._given_plan
        if isinstance(given, Plan):
            check_plan(given, "autoshard: plan=")     # a Plan built or edited in Python: the file's checks
            p = given
        elif isinstance(given, (str, os.PathLike)):
            p = Plan.from_json(_read_plan_file(given))
        else:
            raise PlanError(f"autoshard: plan={type(given).__name__} is neither an autoshard.Plan nor the path of a "
                            "plan file" + (" (an inference plan: decorate with autoshard.autoshard(mode='inference', "
                                           "mesh=...) instead)" if type(given).__name__ == "InferencePlan" else "")
                            + ". Fix: pass autoshard.plan(step, *args, ...), Plan.from_json(text) or a file path.")
        asked = self.config.mesh
        if asked is not None and asked != "auto" and tuple(asked.axes) != tuple(p.mesh):
            raise PlanError(
                f"autoshard: plan= was made for mesh {dict(p.mesh)} but mesh={dict(asked.axes)} was also given; the "
                "plan's shardings only fit its own mesh. Fix: drop mesh= to run the plan on its mesh, or drop plan= "
                "to plan for the new mesh (autoshard.restore moves a checkpoint between the two).")
        check_fingerprint(p, traced.graph, "autoshard: plan=")
        check_outputs(p, traced.graph, "autoshard: plan=")
        return bind(p, *args)

    def _make_plan(self, traced: Traced, trace_seconds: float, args: tuple) -> Plan:
        """The plan for this trace: the given one, a cached one (memory, then cache_dir), or a new one."""
        if self._given_plan is not None:
            return self._load_given(traced, args)
        config = local_config(self.config)
        key = self._key(fingerprint(traced.graph), config)
        path = None
        if config.cache_dir is not None:
            path = Path(config.cache_dir) / (hashlib.sha1(repr(key).encode()).hexdigest()[:20] + ".json")
        p, write = _PLAN_CACHE.get(key), False
        if path is not None:        # a missing or unusable entry is (re)written; one found in memory too
            write = p is not None and not path.is_file()
            if p is None:
                p = _cached_plan(path, args, traced)
                write = p is None
        if p is None:
            # mesh="auto": tensor plans, the part of the 3-D space this runtime runs from a plain step
            p = plan_traced(self.fn, _abstract(args), traced.graph, config, trace_seconds, three_d=False)
        p = bind(p, *args)
        check_outputs(p, traced.graph, "autoshard: the new plan")      # the planner's own contract
        _PLAN_CACHE[key] = p
        if write and jax.process_index() == 0:      # one writer on a shared file system
            _write_cache(path, p)
        return p

    def _prepare(self, args: tuple) -> None:
        # one trace serves the fingerprint, the planner and the emission of the first call
        abstract = _abstract(args)
        t0 = time.perf_counter()
        traced = trace_step(self.fn, *abstract, keep_eqns=self.config.profile == "measured")
        self._plan = same_plan_everywhere(self._make_plan(traced, time.perf_counter() - t0, args), args)
        for w in self._plan.warnings:
            if w.startswith(IDLE_AXIS):
                warnings.warn(f"autoshard: {w}", stacklevel=3)
        self.plan_args = abstract
        self._treedef = jax.tree.structure(args)
        self._donated = donated_argnums(self._plan, len(args)) if self.config.donate else ()
        self._pipelined = None
        if runs_mpmd(self._plan):
            self._prepare_mpmd(args, traced)
            return
        self._mesh = make_mesh(self._plan, self._devices)
        if self._plan.is_pipeline:
            self._prepare_pipeline(args, traced)
            return
        # a tensor plan's remat is replayed in the traced backward pass, whatever computes the gradients
        # (jax.value_and_grad, jax.grad, autoshard.value_and_grad, nnx.grad): bridge/emit/remat_jaxpr.py
        self._jitted = jit_step(traced, self._plan, self._mesh, abstract, donate=self.config.donate, guard=True,
                                remat=self._plan.stages[0].remat != "none")
        self._in_shardings, _ = shardings(self._plan, self._mesh)

    def _select(self, args: tuple) -> None:
        """Make the program for the signature of `args` current: the one prepared earlier, or a new one
        (traced and planned; the plan cache makes a return to an earlier model cheap)."""
        key = signature(args)
        if key not in self._programs:
            current = tuple(getattr(self, name) for name in _PROGRAM)
            try:
                self._prepare(args)
                self._in_devices = [s.device_set for s in jax.tree.leaves(self._in_shardings)]
            except BaseException:       # a failed plan leaves the step as it was (no half-made program)
                for name, value in zip(_PROGRAM, current, strict=True):
                    setattr(self, name, value)
                raise
            self._programs[key] = tuple(getattr(self, name) for name in _PROGRAM)
        for name, value in zip(_PROGRAM, self._programs[key], strict=True):
            setattr(self, name, value)

    def _prepare_pipeline(self, args: tuple, traced: Traced) -> None:
        # the step's state stays the user's pytrees, stored ZeRO-style between steps; only the
        # loss's value_and_grad runs as stages inside (see pipelined_step)
        step, self._pipelined, self._in_shardings, outs = pipelined_step(
            self.fn, self._plan, self._mesh, args, num_microbatches=self.config.num_microbatches,
            hardware=hardware_of(self.config), traced=traced)
        self._mesh = self._pipelined.mesh          # GraphPipe: the (pipe, data) mesh its stages run on
        self._jitted = jax.jit(shape_guarded(step, args), in_shardings=self._in_shardings, out_shardings=outs,
                               donate_argnums=self._donated)

    def _prepare_mpmd(self, args: tuple, traced: Traced) -> None:
        """A pipeline plan the single-program runtime cannot run as planned (stages on unequal submeshes,
        unequal replicas or micro-batch counts): the step driven over per-stage programs (mpmd_step.py).
        Nothing is donated: each stage's programs keep their arrays on their own devices."""
        step = MpmdStep(self.fn, self._plan, args, batch_size=traced_batch(traced.graph),
                        devices=self._devices, num_microbatches=self.config.num_microbatches)
        # the mesh of all the plan's devices, as the user named it; the stages run on submeshes of it
        self._pipelined, self._jitted, self._mesh = step.run, step, make_mesh(self._plan, self._devices)
        self._in_shardings, self._donated = None, ()

    # --- public ---------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        """Run the step. Keywords bind to their positions; a new pytree structure, shape or dtype is
        a new program, planned once (never shardings planned for other arguments). A failure of the
        compiled program that jax reports at the call is a StepFailedError saying whether the donated
        inputs are gone; one it reports later (jax dispatches asynchronously) surfaces where the
        results are read, as jax's own error. A caller's `with jax.set_mesh(...)` does not reach the step."""
        with own_mesh_context():
            return self._call(args, kwargs)

    def _call(self, args: tuple, kwargs: dict) -> Any:
        args = positional(self.fn, args, kwargs)
        leaves, treedef = jax.tree_util.tree_flatten(args)
        check_leaves(args, leaves, self.plan_args, concrete=True)
        if self._treedef is None or treedef != self._treedef:
            self._select(args)
            return self._run(args, self._placed(args))
        try:
            return self._run(args, args, leaves)
        except ShapesChanged:     # raised while jax re-traces, before anything runs or is donated
            self._select(args)
            return self._run(args, self._placed(args))

    def _run(self, given: tuple, args: tuple, leaves: list | None = None) -> Any:
        """The compiled step on `args` (`given` as the caller passed them, for the failure message)."""
        leaves = jax.tree.leaves(args) if leaves is None else leaves
        if _misplaced(leaves, self._in_devices):
            # committed elsewhere (jax.device_put(x, device), a restore without shardings): jit refuses
            # such arrays with explicit in_shardings, so they are moved first, as on the first call
            args = self._placed(args)
            leaves = jax.tree.leaves(args)
        elif self._in_shardings is not None and not all(isinstance(x, jax.Array) for x in leaves):
            # host data (numpy batches from a loader) placed as on the first call: its type then
            # carries the planned sharding, the same program's input type (no retrace on every call)
            args = jax.tree.map(lambda x, s: x if isinstance(x, jax.Array) else jax.device_put(x, s),
                                args, self._in_shardings)
            leaves = jax.tree.leaves(args)
        args = unaliased(args, leaves, self._donated)
        try:
            return self._jitted(*args)
        except jax.errors.JaxRuntimeError as err:
            raise failed(err, given, self._donated) from err

    @property
    def plan(self) -> Plan:
        """The plan of the arguments last called with (each structure and shape has its own)."""
        if self._plan is None:
            raise PlanError("autoshard: no plan yet; call the step once (or .lower(*args)).")
        return self._plan

    def lower(self, *args, **kwargs):
        with own_mesh_context():
            return self._lower(positional(self.fn, args, kwargs))

    def _lower(self, args: tuple):
        check_leaves(args, jax.tree.leaves(args), self.plan_args, concrete=False)
        if self._treedef is None or jax.tree.structure(args) != self._treedef:
            self._select(args)
        if isinstance(self._jitted, MpmdStep):
            raise PlanError("autoshard: this step's plan runs MPMD (each stage its own program on its own devices), "
                            "so there is no single program to lower; step.pipelined lists the stage programs and "
                            "step.explain() the programs after the gradients.")
        try:
            return self._jitted.lower(*untyped(args))
        except ShapesChanged:
            self._select(args)
            return self._jitted.lower(*untyped(args))

    def explain(self) -> str:
        text = self.plan.explain()
        if isinstance(self._jitted, MpmdStep):
            return text + "\n\nRuntime (MPMD):\n" + self._jitted.describe()
        if self._pipelined is not None:
            text += "\n\nRuntime cut of the loss (autoshard.pipelined):\n" + self._pipelined.describe()
        return text

    @property
    def pipelined(self):
        """The `Pipelined` a pipeline plan's step runs its loss with (None for tensor plans)."""
        return self._pipelined

    def shardings(self, *args, **kwargs) -> Any:
        """The NamedSharding pytree (shaped like `args`) the step expects its arguments in; plans on
        the first use, like a call. Give it to `jax.device_put`, or to `autoshard.restore` (via
        ShapeDtypeStructs) to load a checkpoint straight into the step's layout."""
        with own_mesh_context():
            self._select(positional(self.fn, args, kwargs))
        return self._in_shardings

    @property
    def jitted(self) -> Any:
        """The `jax.jit` function the step calls (plain jax: `.lower(*args)`, `.trace(*args)`)."""
        if self._jitted is None:
            raise PlanError("autoshard: nothing compiled yet; call the step once (or .lower(*args)).")
        return self._jitted

    @property
    def mesh(self) -> Any:
        """The concrete `jax.sharding.Mesh` the step runs on (after the first call). A step whose plan runs
        MPMD runs its stages on submeshes of this mesh: `step.pipelined.meshes`."""
        if self._mesh is None:
            raise PlanError("autoshard: no mesh yet; call the step once (or .lower(*args)).")
        return self._mesh

    @property
    def donate_argnums(self) -> tuple[int, ...]:
        """The arguments the step donates (consumes): those made only of state it returns."""
        if self._plan is None:
            raise PlanError("autoshard: no plan yet, so nothing is donated yet; call the step once (or .lower(*args)).")
        return self._donated

    def place(self, *args, **kwargs):
        """Put arguments on the mesh with the planned shardings (done on the first call)."""
        args = positional(self.fn, args, kwargs)
        check_leaves(args, jax.tree.leaves(args), self.plan_args, concrete=True)
        with own_mesh_context():
            self._select(args)
            return self._placed(args)

    def _placed(self, args: tuple) -> tuple:
        # the step donates its state arguments; a placement sharing a buffer with the caller's array
        # (jax reuses a single-device array's buffer for its shard of a replicated sharding, even
        # with may_alias=False) would delete the caller's array, so those leaves are copied first
        if self._in_shardings is None:      # an MPMD step places each stage's arrays itself, every call
            return args
        placed = jax.device_put(args, self._in_shardings)
        if not self.config.donate:
            return placed

        def own(orig, new, sharding):
            if isinstance(orig, jax.Array) and _buffers(orig) & _buffers(new):
                return jax.device_put(orig.copy(), sharding)
            return new

        return jax.tree.map(own, args, placed, self._in_shardings)


def _misplaced(leaves: list, wanted: list) -> bool:
    """Whether an argument array is committed to other devices than its planned sharding's (`wanted`:
    their device sets, kept per program; one set comparison per leaf and call), or placed on a mesh with
    Explicit axes (its sharding is part of its type: the step would trace it as another program's input)."""
    return len(wanted) == len(leaves) and any(
        isinstance(x, jax.Array) and getattr(x, "committed", False)
        and (x.sharding.device_set != devices or typed_sharding(x.sharding))
        for x, devices in zip(leaves, wanted, strict=True))


def same_plan_everywhere(plan: Plan, args: tuple) -> Plan:
    """In a multi-process run every process plans the same step the same way, but timings in the plan
    differ; process 0's plan is broadcast so all run (and report) exactly one plan."""
    if jax.process_count() == 1:
        return plan
    text = np.frombuffer(plan.to_json().encode(), dtype=np.uint8)
    n = int(multihost_utils.broadcast_one_to_all(np.int64(text.size)))
    padded = np.zeros(n, np.uint8)
    padded[:min(n, text.size)] = text[:n]
    ours = np.asarray(multihost_utils.broadcast_one_to_all(padded))
    return bind(Plan.from_json(ours.tobytes().decode()), *args)


def _cached_plan(path: Path, args: tuple, traced: Traced) -> Plan | None:
    """The plan cached at `path` for this step, or None. A cache entry is only a shortcut: one that cannot be
    read, parsed or bound to these arguments (truncated by a kill, edited, of another autoshard) is
    planned again and rewritten, with a warning, never an error."""
    try:
        if not path.is_file():
            return None
        p = Plan.from_json(path.read_bytes())
        check_fingerprint(p, traced.graph, "the cached plan")
        check_outputs(p, traced.graph, "the cached plan")
        return bind(p, *args)       # its specs against these arguments
    except (OSError, PlanError) as err:
        warnings.warn(f"autoshard: ignoring the unusable plan cache entry {str(path)!r} "
                      f"({getattr(err, 'strerror', None) or err}); planning again and rewriting it.", stacklevel=5)
        return None


def _write_cache(path: Path, plan: Plan) -> None:
    """Write a cache entry whole or not at all (a temporary file renamed into place: a kill mid-write leaves
    no truncated entry); a cache directory that cannot be written costs the cache, not the run."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(plan.to_json())
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        warnings.warn(f"autoshard: cannot write the plan cache entry {str(path)!r} ({err.strerror or err}); the "
                      "step runs without caching its plan. Fix: cache_dir= a writable directory.", stacklevel=5)


def _read_plan_file(path: Any) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise PlanError(f"autoshard: cannot read the plan file plan={str(path)!r} ({err.strerror}). Fix: pass the path "
                        "of a file written by plan.to_json(), a Plan, or drop plan= to plan now.") from err


def _buffers(x: Any) -> set[int]:
    try:
        return {sh.data.unsafe_buffer_pointer() for sh in x.addressable_shards}
    except Exception:   # a deleted or non-addressable array: nothing of the caller's to protect
        return set()


def autoshard(fn: Callable | None = None, *, mode: str = "train", **kwargs) -> Any:
    """Decorator: `@autoshard(mesh={"data": 2, "model": 4}, hardware="h100-sxm")` for a train step;
    `autoshard(mode="inference", mesh={"x": 3})(apply_fn)` partitions an inference function over the
    nodes of a one-axis mesh (BBGraP; options in `inference.plan.InferenceConfig`)."""
    if mode not in MODES:
        raise ConfigError(f"autoshard: mode={mode!r} must be one of {list(MODES)}.")
    if mode == "inference":
        make: Callable = functools.partial(InferenceAutosharded, **kwargs)
    else:
        make = functools.partial(Autosharded, **kwargs)
    return make if fn is None else make(fn)
