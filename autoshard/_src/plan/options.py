"""Every pipeline / 3-D / search option's type, range and meaning, checked in one place (pure).

`Config` checks `pipeline_options` and `search` against this schema before anything plans, so a
mistyped value (`k="many"`, `prune="false"`, `max_model=-1`) is a ConfigError naming the option,
the value and what it must be, never a value a partitioner reads its own way (`bool("false")` is
True). Keys of partitioners registered from outside that the schema does not know pass unchecked
(the partitioner owns them); unknown keys are refused by `Config` with the valid ones listed.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from typing import Any

from ..core.errors import ConfigError
from ..joint.stage_choice import REMAT
from ..pipeline.rannc.stages import SEARCHES

BOOL, INT, NUMBER, CHOICE, CHOICES = "bool", "int", "number", "choice", "choices"


@dataclasses.dataclass(frozen=True)
class Option:
    """One option: `kind` (BOOL, INT, NUMBER, CHOICE: one of `choices`, CHOICES: one or a list of
    them), the range [`low`, `high`] for numbers, whether None is allowed, and what it means."""

    name: str
    kind: str
    meaning: str
    low: float | None = None
    high: float | None = None
    choices: tuple[Any, ...] = ()
    none_ok: bool = False

    def want(self) -> str:
        if self.kind == BOOL:
            text = "True or False"
        elif self.kind in (INT, NUMBER):
            text = ("an int" if self.kind == INT else "a number") + _range(self.low, self.high)
        elif self.kind == CHOICE:
            text = f"one of {list(self.choices)}"
        else:
            text = f"one or a non-empty list of {list(self.choices)}"
        return text + (" (or None)" if self.none_ok else "")

    def ok(self, value: Any) -> bool:
        if value is None:
            return self.none_ok
        if self.kind == BOOL:
            return isinstance(value, bool)
        if self.kind in (INT, NUMBER):
            typed = isinstance(value, numbers.Integral if self.kind == INT else numbers.Real)
            return typed and not isinstance(value, bool) and math.isfinite(value) and \
                (self.low is None or value >= self.low) and (self.high is None or value <= self.high)
        if self.kind == CHOICE:
            return isinstance(value, str) and value in self.choices
        many = (value,) if isinstance(value, str) else value
        return isinstance(many, (tuple, list)) and bool(many) and all(isinstance(v, str) and v in self.choices
                                                                       for v in many)

    def check(self, value: Any, where: str) -> None:
        if not self.ok(value):
            raise ConfigError(f"{where}: {self.name}={value!r} must be {self.want()}: {self.meaning}.")


def _range(low: float | None, high: float | None) -> str:
    if low is not None and high is not None:
        return f" in [{low:g}, {high:g}]"
    return f" >= {low:g}" if low is not None else f" <= {high:g}" if high is not None else ""


PIPELINE_SCHEMA = {o.name: o for o in (
    # RaNNC
    Option("k", INT, "the number of blocks RaNNC groups the step's atomic components into", low=1),
    Option("recompute", BOOL, "recompute each stage's forward in its backward (less activation memory)"),
    Option("use_blocks", BOOL, "search stages over blocks (True) or over atomic components (False)"),
    Option("search", CHOICE, "when RaNNC's search stops: 'all' (every node and stage count), 'node', 'stage'",
           choices=tuple(SEARCHES)),
    Option("prune", BOOL, "RaNNC's published pruning of the stage DP (faster, may miss the best split)"),
    # GraphPipe
    Option("max_microbatch_size", INT, "the largest micro-batch GraphPipe considers", low=1, none_ok=True),
    Option("depth", INT, "cut the module tree at this many path components to form GraphPipe's layer nodes",
           low=1, none_ok=True),
    Option("per_stage_microbatch", BOOL, "give each GraphPipe stage its own micro-batch size"),
    # the 3-D search (mesh='auto', or a 'pipe' mesh with pipeline='auto')
    Option("remat", CHOICES, "the rematerialisation policies the 3-D search may choose per stage",
           choices=tuple(REMAT)),
    Option("max_microbatches", INT, "the most micro-batches the 3-D search tries", low=1),
    Option("max_model", INT, "the largest tensor-parallel (model axis) size the 3-D search tries", low=1,
           none_ok=True),
    Option("expert", CHOICE, "'megatron': the best Megatron-LM grid point of the mesh's shape instead of the "
           "3-D search's best", choices=("megatron",), none_ok=True),
    Option("equal_submeshes", BOOL, "plan only stages on equal submeshes (the ones the runtime runs)"),
)}


SEARCH_SCHEMA = {o.name: o for o in (
    Option("max_plans", INT, "the enumeration cap of the tensor search", low=1),
    Option("overlap", NUMBER, "the share of backward compute gradient sync can hide behind", low=0, high=1),
    Option("bucket_bytes", NUMBER, "the gradient packing threshold in bytes", low=1),
    Option("memory_budget", NUMBER, "bytes per device", low=1, none_ok=True),
    Option("sequence_parallel", CHOICE, "'auto' (the sequence-parallel space searched too, its plan taken when "
           "predicted faster), 'on' (that space only) or 'off'",
           choices=("auto", "on", "off")),
    Option("attention", CHOICE, "'as_traced' (the program's attention as XLA runs it) or 'flash' (each recognised "
           "attention priced as FlashAttention's kernels: no [batch, heads, seq, seq] tensor in memory)",
           choices=("as_traced", "flash")),
)}


def check_pipeline_options(options: Mapping[str, Any], where: str = "autoshard: pipeline_options") -> None:
    """Each option the schema knows within its type and range (else a ConfigError naming it)."""
    for name, value in options.items():
        if not isinstance(name, str):
            raise ConfigError(f"{where}: key {name!r} must be a string option name, e.g. 'k'.")
        if name in PIPELINE_SCHEMA:
            PIPELINE_SCHEMA[name].check(value, where)


def check_search_fields(fields: Mapping[str, Any], where: str) -> None:
    for name, value in fields.items():
        if name in SEARCH_SCHEMA:
            SEARCH_SCHEMA[name].check(value, where)
