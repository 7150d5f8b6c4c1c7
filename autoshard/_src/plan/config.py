"""One frozen, validated `Config`: everything a plan and a decorated step are made from (pure).

Built once, from keywords, a TOML file, or both (keywords win); unknown keys are errors. Planning
and the decorator read nothing else, so defaults live here and nowhere else:

* hardware: `None` means the local device's preset, resolved by the jax bridge when planning
  (`cpu-sim` on CPU, `h100-sxm` / `a100-sxm` / `v100-sxm` by device kind); pass a preset name,
  a `HardwareSpec` or overrides such as `{"base": "h100-sxm", "memory_bytes": 40e9}` to plan for
  other hardware (e.g. 1024 GPUs from a laptop).
* schedule: "1f1b"; profile: "model" (roofline on the hardware spec); memory budget: the
  planner's default share of device memory; donate: True (state arguments are consumed).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import tomllib
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..core.errors import AutoshardError, ConfigError
from ..core.hardware import HardwareSpec, get_hardware
from ..core.mesh import MeshSpec, candidate_meshes, mesh_spec
from ..pipeline.registry import AUTO, get_partitioner, partitioner_names
from ..pipeline.schedules.registry import schedule_names
from ..tensor.search import STORAGE_MODES, SearchOptions
from .joint_planner import JOINT_OPTION_KEYS, auto_mesh_options, fixed_shape_options
from .options import check_pipeline_options, check_search_fields

PROFILES = ("model", "measured")
# planning for more devices than any cluster has is a typo (10**9 for 10**3); refused before work
MAX_DEVICES = 2**20
# mesh="auto" prices every factorisation of the device count: bounded so planning stays in minutes
MAX_AUTO_MESHES = 512
_PIPELINE_ONLY = ("schedule", "profile", "pipeline_options", "num_microbatches")


@dataclasses.dataclass(frozen=True)
class Config:
    """How to plan and run a step. `mesh`: a MeshSpec (from a dict, a jax Mesh or a MeshSpec) or
    "auto": the planner chooses the factorisation of `devices` (None: the local device count).
    `search`: tensor search options (`SearchOptions` or a dict of its fields). `pipeline`: None
    (tensor sharding only), a registered partitioner name (`pipeline.partitioner_names()`) or "auto"."""

    mesh: MeshSpec | str | None = None
    devices: int | None = None
    hardware: HardwareSpec | None = None
    memory_budget: float | None = None
    search: SearchOptions = SearchOptions()
    pipeline: str | None = None
    schedule: str = "1f1b"
    profile: str = "model"
    pipeline_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    num_microbatches: int | None = None
    donate: bool = True
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        if self.mesh is not None and self.mesh != "auto":
            set_("mesh", mesh_spec(self.mesh))
        if self.devices is not None and (isinstance(self.devices, bool) or not isinstance(self.devices, int)
                                         or self.devices < 1):
            raise ConfigError(f"autoshard: devices={self.devices!r} must be an int >= 1.")
        self._check_size()
        if isinstance(self.cache_dir, os.PathLike):      # a pathlib.Path is as good as its string
            set_("cache_dir", os.fspath(self.cache_dir))
        for name in ("pipeline", "schedule", "profile", "cache_dir"):
            value = getattr(self, name)
            if not (isinstance(value, str) or (value is None and name in ("pipeline", "cache_dir"))):
                also = {"pipeline": " (or None)", "cache_dir": " (or a path, or None)"}.get(name, "")
                raise ConfigError(f"autoshard: {name}={value!r} must be a string{also}.")
        if not isinstance(self.pipeline_options or {}, Mapping):
            raise ConfigError(f"autoshard: pipeline_options={self.pipeline_options!r} must be a dict (a TOML table "
                              "[pipeline_options]) of option name -> value.")
        if self.hardware is not None:
            set_("hardware", get_hardware(self.hardware))
        if self.memory_budget is not None and not _positive(self.memory_budget):
            raise ConfigError(f"autoshard: memory_budget={self.memory_budget!r} must be a finite number of bytes > 0 "
                              "per device (or None for the planner's default share of device memory).")
        set_("search", _search_options(self.search, self.memory_budget))
        set_("pipeline_options", types.MappingProxyType(dict(self.pipeline_options or {})))
        if not isinstance(self.donate, bool):
            raise ConfigError(f"autoshard: donate={self.donate!r} must be True or False.")
        self._check_pipeline()

    def _check_size(self) -> None:
        """Sizes no cluster has, and mesh='auto' device counts with too many factorisations to price, are
        refused now, in a second, not after hours of planning."""
        size = self.mesh.size if isinstance(self.mesh, MeshSpec) else self.devices
        if size is not None and size > MAX_DEVICES:
            what = f"mesh {self.mesh}" if isinstance(self.mesh, MeshSpec) else f"devices={self.devices}"
            raise ConfigError(f"autoshard: {what} is {size} devices, more than any cluster has (the largest hold "
                              f"~1e5 accelerators; autoshard plans up to {MAX_DEVICES}). Fix: check the count.")
        if self.mesh == "auto" and self.devices is not None:
            count = len(candidate_meshes(self.devices))
            if count > MAX_AUTO_MESHES:
                raise ConfigError(
                    f"autoshard: mesh='auto' with devices={self.devices} would price {count} mesh shapes (every "
                    f"factorisation of {self.devices} into up to 3 axes; at most {MAX_AUTO_MESHES} keep planning "
                    "within minutes). Fix: pass the mesh, e.g. mesh={'data': ..., 'model': ...}, or a device count "
                    "with fewer divisors (a power of two, or a multiple of 8 and a power of two).")

    def _check_pipeline(self) -> None:
        check_pipeline_options(self.pipeline_options)
        if self.pipeline is None:
            given = [k for k in _PIPELINE_ONLY if getattr(self, k) != _DEFAULTS[k]]
            if self.mesh == "auto" and given == ["pipeline_options"]:      # the 3-D search's own options
                unknown = sorted(set(self.pipeline_options) - set(JOINT_OPTION_KEYS))
                if unknown:
                    raise ConfigError(f"autoshard: pipeline_options {unknown} do not apply to mesh='auto' (the 3-D "
                                      f"search); valid: {sorted(JOINT_OPTION_KEYS)}.")
                auto_mesh_options(self.pipeline_options)        # contradictions: now, not when planning
                return
            if given:
                verb = "apply" if len(given) > 1 else "applies"
                raise ConfigError(f"autoshard: {', '.join(given)} {verb} to pipeline plans only; pass "
                                  "pipeline='rannc', 'graphpipe' or 'auto' as well, or drop them.")
            return
        if self.pipeline != AUTO:
            part = get_partitioner(self.pipeline)
            parts = [part]
            if self.schedule not in part.schedules:
                raise ConfigError(f"autoshard: schedule={self.schedule!r} is not supported by the {self.pipeline} "
                                  f"partitioner; valid: {list(part.schedules)}.")
        else:
            parts = [get_partitioner(n) for n in partitioner_names()]
            if self.schedule not in schedule_names():
                raise ConfigError(f"autoshard: schedule={self.schedule!r} is unknown; registered: {schedule_names()}.")
        if self.profile not in PROFILES:
            raise ConfigError(f"autoshard: profile={self.profile!r} is unknown; valid: {list(PROFILES)} ('model' "
                              "prices ops with the hardware spec's roofline, 'measured' times them on the local "
                              "device).")
        valid = set().union(*(p.options for p in parts))
        three_d = self.pipeline == AUTO and isinstance(self.mesh, MeshSpec) and "pipe" in self.mesh.names
        if three_d:
            valid = set(JOINT_OPTION_KEYS)          # a "pipe" mesh: the 3-D search (plan.joint_planner)
        unknown = sorted(set(self.pipeline_options) - valid)
        if unknown:
            raise ConfigError(f"autoshard: pipeline_options keys {unknown} are unknown for pipeline={self.pipeline!r}; "
                              f"valid: {sorted(valid)}.")
        if self.num_microbatches is not None and (isinstance(self.num_microbatches, bool)
                                                  or not isinstance(self.num_microbatches, int)
                                                  or self.num_microbatches < 1):
            raise ConfigError(f"autoshard: num_microbatches={self.num_microbatches!r} must be an int >= 1.")
        if self.pipeline == "graphpipe" and self.num_microbatches is not None:
            raise ConfigError(f"autoshard: num_microbatches={self.num_microbatches} with pipeline='graphpipe': "
                              "GraphPipe chooses each plan's micro-batch size itself, and the runtime would run "
                              "another count than the plan's. Fix: drop num_microbatches (bound the size with "
                              "pipeline_options={'max_microbatch_size': ...}), or use pipeline='rannc', which "
                              "plans for the given count.")
        if self.pipeline != AUTO and isinstance(self.mesh, MeshSpec):
            why = parts[0].unsupported(self.mesh, self.pipeline_options)
            if why:
                raise ConfigError(f"autoshard: {why}.")
        if three_d:
            fixed_shape_options(self.mesh, self.schedule, self.num_microbatches, self.pipeline_options)

    # --- building ---------------------------------------------------------------------------
    @classmethod
    def make(cls, config: str | Path | Mapping[str, Any] | Config | None = None, **kwargs: Any) -> Config:
        """A Config from a TOML file path (or a mapping of the same keys, or a Config) overridden by
        keyword arguments; keywords that are None are not given. `options=` is `search=`."""
        if "options" in kwargs:
            if kwargs.get("search") is not None:
                raise ConfigError("autoshard: pass search options once: options= or search=, not both.")
            kwargs["search"] = kwargs.pop("options")
        base: dict[str, Any]
        where = "autoshard"
        if config is None:
            base = {}
        elif isinstance(config, Config):
            base = {f.name: getattr(config, f.name) for f in dataclasses.fields(cls)}
        elif isinstance(config, Mapping):
            base = dict(config)
        elif isinstance(config, (str, Path)):
            base, where = load_toml(config), f"autoshard config {str(config)!r}"
        else:
            raise ConfigError(f"autoshard: config={config!r} (type {type(config).__name__}) must be a TOML file path, "
                              "a dict of config keys or a Config.")
        given = {k: v for k, v in kwargs.items() if v is not None}
        try:
            return cls.from_mapping({**base, **given})
        except ConfigError as err:
            if where == "autoshard":
                raise
            keys = f" with keywords {sorted(given)}" if given else ""
            raise type(err)(f"{err} (in {where.removeprefix('autoshard ')}{keys})") from err

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], where: str = "autoshard") -> Config:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {unknown}; valid keys: {sorted(fields)}.")
        try:
            return cls(**data)
        except AutoshardError:
            raise
        except (TypeError, ValueError) as err:      # a value of a type no check foresaw: still typed, one line
            raise ConfigError(f"{where}: a config value has the wrong type ({err}); keys given: "
                              f"{sorted(data)}.") from err

    def replace(self, **changes: Any) -> Config:
        return dataclasses.replace(self, **changes)


_DEFAULTS = {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
             for f in dataclasses.fields(Config)}


def load_toml(path: str | Path) -> dict[str, Any]:
    """The keys of an autoshard TOML config: mesh (table axis -> size, or "auto"), devices, hardware
    (preset name or table), memory_budget, [search] (or [options]), pipeline, schedule, profile,
    [pipeline_options], num_microbatches, donate, cache_dir."""
    p = Path(path)
    data = _read_toml(p)
    if "options" in data:
        if "search" in data:
            raise ConfigError(f"autoshard config {str(p)!r} has both [options] and [search]; they are one table "
                              "(the tensor search options) under two names. Fix: merge them into [search].")
        data["search"] = data.pop("options")
    fields = {f.name for f in dataclasses.fields(Config)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ConfigError(f"autoshard config {str(p)!r}: unknown key(s) {unknown}; valid keys: {sorted(fields)}.")
    if isinstance(data.get("search"), Mapping):
        _search_options(data["search"], None, where=f"autoshard config {str(p)!r}: [search]")
    return data


def _read_toml(p: Path) -> dict[str, Any]:
    """The file's TOML as a dict, or a ConfigError naming the file and what is wrong with it."""
    where = f"autoshard config {str(p)!r}"
    try:
        raw = p.read_bytes()
    except FileNotFoundError as err:
        raise ConfigError(f"{where} does not exist.") from err
    except IsADirectoryError as err:
        raise ConfigError(f"{where} is a directory; give the path of a .toml file.") from err
    except OSError as err:
        raise ConfigError(f"{where} cannot be read: {err.strerror or err}.") from err
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError(f"{where} is not a text file (byte {err.start} is not UTF-8); give a TOML file.") from err
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{where} is not valid TOML: {err}.") from err


def _search_options(value: Any, memory_budget: float | None, where: str = "autoshard: search") -> SearchOptions:
    if isinstance(value, Mapping):
        names = {f.name for f in dataclasses.fields(SearchOptions)} - {"memory_budget"}
        bad = sorted(set(value) - names)
        if bad:
            raise ConfigError(f"{where}: unknown key(s) {bad}; valid: {sorted(names)}.")
        value = SearchOptions(**{k: tuple(v) if isinstance(v, list) else v for k, v in value.items()})
    if not isinstance(value, SearchOptions):
        raise ConfigError(f"{where}={value!r} must be a SearchOptions or a dict of its fields.")
    if memory_budget is not None:
        value = dataclasses.replace(value, memory_budget=float(memory_budget))
    _check_search_fields(value, where)
    return value


def _check_search_fields(opts: SearchOptions, where: str) -> None:
    """Each SearchOptions field within what the search can use (else a ConfigError naming it)."""
    modes = opts.storage_modes
    if isinstance(modes, str) or not isinstance(modes, tuple) or not modes or \
            any(not isinstance(m, str) or m not in STORAGE_MODES for m in modes):
        raise ConfigError(f"{where}: storage_modes={modes!r}; give a non-empty tuple of {list(STORAGE_MODES)}.")
    check_search_fields(dataclasses.asdict(opts), where)


def _positive(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and 0 < x < math.inf
