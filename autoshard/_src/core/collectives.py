"""The collective kinds, one row each: everything the planner, the cost model and the HLO reader
need to know about a kind lives here (pure: no jax import). Adding a kind is adding a row.

Wire bytes follow the bandwidth-optimal ring algorithms (Patarasuk & Yuan, JPDC 2009; Thakur,
Rabenseifner & Gropp, IJHPCA 2005), per device, for a FULL buffer of B bytes over n devices:

* all-reduce = reduce-scatter + all-gather: 2(n-1)/n * B, in 2(n-1) steps
* all-gather (B = the gathered output), reduce-scatter (B = the input): (n-1)/n * B, n-1 steps
* all-to-all: each of the n-1 peers gets B/n: (n-1)/n * B, n-1 steps
* collective-permute: B, one send to one peer, 1 step

Efficiencies are the default achievable fraction of link bandwidth (TAP §4.6 observes all-reduce
> all-gather > all-to-all in NCCL; TAP gives no numbers, these keep that order and sit near
nccl-tests bus bandwidth on NVLink, ~75-85 % for all-reduce). Hardware presets copy them; a
HardwareSpec may override each.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Literal


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective kind."""

    kind: str                               # the name used everywhere ("all-reduce")
    wire_factor: Callable[[int], float]     # bytes each device sends / full buffer bytes, over n devices
    steps: Callable[[int], int]             # sequential latency steps over n >= 2 devices
    efficiency: float                       # default achievable fraction of link bandwidth
    hlo_opcode: str                         # XLA's opcode (async form: "<opcode>-start" / "-done")
    hlo_buffer: Literal["operand", "result"]  # which side of the HLO instruction is the full buffer
    hlo_start_tuple: bool = False           # its async "-start" returns (operands, results[, context])
    cpu_lowering: str | None = None         # the kind XLA:CPU emits instead, when it lacks this one

    def bytes_on_wire(self, nbytes: float, n: int) -> float:
        return 0.0 if n <= 1 else self.wire_factor(n) * nbytes

    def latency_steps(self, n: int) -> int:
        return 0 if n <= 1 else self.steps(n)


COLLECTIVES: dict[str, Collective] = {c.kind: c for c in (
    Collective("all-reduce", lambda n: 2 * (n - 1) / n, lambda n: 2 * (n - 1), 0.8, "all-reduce", "operand"),
    Collective("all-gather", lambda n: (n - 1) / n, lambda n: n - 1, 0.7, "all-gather", "result",
               hlo_start_tuple=True),
    Collective("reduce-scatter", lambda n: (n - 1) / n, lambda n: n - 1, 0.75, "reduce-scatter", "operand",
               cpu_lowering="all-reduce"),   # XLA:CPU: all-reduce + dynamic-slice
    Collective("all-to-all", lambda n: (n - 1) / n, lambda n: n - 1, 0.55, "all-to-all", "operand"),
    Collective("collective-permute", lambda n: 1.0, lambda n: 1, 0.7, "collective-permute", "operand",
               hlo_start_tuple=True),
)}
KINDS: tuple[str, ...] = tuple(COLLECTIVES)
DEFAULT_EFFICIENCY: dict[str, float] = {k: c.efficiency for k, c in COLLECTIVES.items()}
BY_HLO_OPCODE: dict[str, Collective] = {c.hlo_opcode: c for c in COLLECTIVES.values()}


def lowered_kind(kind: str, platform: str) -> str:
    """The kind a backend's compiled program shows for a planned `kind` (XLA:CPU has no reduce-scatter)."""
    c = COLLECTIVES[kind]
    return c.cpu_lowering if platform == "cpu" and c.cpu_lowering else kind


def on_backend(collectives: list[Mapping[str, Any]], platform: str, sizes: Mapping[str, int]
               ) -> list[dict[str, Any]]:
    """A plan's collectives (dicts of kind, axes, phase, count, bytes) as `platform` compiles them.

    On a GPU (or TPU) every planned kind exists. XLA:CPU has no reduce-scatter: it all-reduces and
    slices. A gradient's (ZeRO) reduce-scatter becomes one all-reduce over all its axes; an
    activation's reduce-scatter over several mesh axes (sequence parallelism over a 2-D
    tensor-parallel group) becomes one all-reduce per axis in mesh order, each on what the previous
    one left."""
    out = []
    for c in collectives:
        kind, axes = c["kind"], tuple(c["axes"])
        if platform == "cpu" and kind == "reduce-scatter" and len(axes) > 1 and c["phase"] in ("forward", "backward"):
            left = 1
            for a in axes:
                out.append(dict(c, kind="all-reduce", axes=[a], bytes=float(c["bytes"]) / left))
                left *= sizes.get(a, 1)
        else:
            out.append(dict(c, kind=lowered_kind(kind, platform), axes=list(axes)))
    return out


def lowered_differently(collective: Mapping[str, Any], platform: str, sizes: Mapping[str, int]
                        ) -> list[tuple[str, tuple[str, ...]]]:
    """(kind, axes) of each collective `platform` compiles one planned `collective` to, or [] when it
    compiles it as planned (what a plan report prints beside it)."""
    lowered = [(c["kind"], tuple(c["axes"])) for c in on_backend([collective], platform, sizes)]
    return [] if lowered == [(collective["kind"], tuple(collective["axes"]))] else lowered
