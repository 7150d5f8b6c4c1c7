"""The part of a step after its gradients, split into per-stage programs (the MPMD decorator's optimizer).

A pipelined step's loss runs as stages on their own submeshes (`mpmd.py`); what the step does with the
gradients (the optimizer update, metrics) is a flat program (`compat.flatten_calls`) whose inputs are the
step's argument leaves, the loss and the gradient leaves. Each eqn runs on one stage:

* the seeds: a parameter and its gradient live on the parameter's owner stage, the loss on the sink;
* an eqn reading seeded (placed) values runs on their stage; reading several stages' values (a global
  gradient norm adding per-stage sums, a leaf scaled by that norm), on the stage holding most of its
  input bytes (on a tie, the stage of the older input), the others sent there (scalars, in the usual
  case);
* an eqn reading no placed value (a step counter, a learning-rate schedule, an optimizer state leaf
  before its first update) is *free*: recomputed inside every stage program that needs it.

Eqns are grouped into segments by (level, stage): an eqn's level is one more than that of an input made on
another stage, so a segment only reads values made in earlier levels (or its own stage's). Every segment
is one jitted program on its stage's devices; segments of one level run concurrently (asynchronous dispatch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..compat import FlatProgram, is_literal


@dataclasses.dataclass
class Segment:
    """Eqns (indices into the program, in program order) one stage runs at one level."""

    stage: int
    level: int
    eqns: list[int]
    inputs: list[Any] = dataclasses.field(default_factory=list)     # keys read from outside the segment
    outputs: list[Any] = dataclasses.field(default_factory=list)    # keys read after it


def split(prog: FlatProgram, seeds: Mapping[Any, int], nbytes: Mapping[Any, int],
          default_stage: int = 0) -> list[Segment]:
    """The segments of `prog` given the stage of its seeded input keys (`seeds`), in execution order.
    Free results of the program are computed on `default_stage`."""
    home: dict[Any, int] = dict(seeds)
    level: dict[Any, int] = {k: 0 for k in seeds}
    producer: dict[Any, int] = {}
    placed_eqns: dict[int, tuple[int, int]] = {}        # eqn -> (stage, level)
    for e, fe in enumerate(prog.eqns):
        for k in fe.outputs:
            producer[k] = e
        ins = [k for k in fe.inputs if not is_literal(k) and k in home]
        if not ins:
            continue                                     # free: recomputed where needed
        # most input bytes; on a tie the stage whose input is older (a gradient leaf before a norm
        # combined from all stages: the scale is sent, not the leaf), then the lower stage
        weight: dict[int, int] = {}
        oldest: dict[int, int] = {}
        for k in ins:
            weight[home[k]] = weight.get(home[k], 0) + max(1, nbytes.get(k, 1))
            oldest[home[k]] = min(oldest.get(home[k], level[k]), level[k])
        s = max(sorted(weight), key=lambda st: (weight[st], -oldest[st]))
        lv = max(level[k] + (home[k] != s) for k in ins)
        placed_eqns[e] = (s, lv)
        for k in fe.outputs:
            home[k], level[k] = s, lv
    segments: dict[tuple[int, int], Segment] = {}
    for e, (s, lv) in placed_eqns.items():
        segments.setdefault((lv, s), Segment(s, lv, [])).eqns.append(e)
    outs = [k for k in prog.outputs if not is_literal(k)]
    free_outs = [k for k in outs if k not in home and k in producer]
    if free_outs:
        segments.setdefault((0, default_stage), Segment(default_stage, 0, []))
    ordered = [segments[key] for key in sorted(segments)]
    made_in: dict[Any, Segment] = {}
    for seg in ordered:
        wanted = set()
        for e in seg.eqns:
            wanted.update(k for k in prog.eqns[e].inputs if not is_literal(k) and k not in home)
        if seg.stage == default_stage and seg.level == 0:
            wanted.update(free_outs)
        seg.eqns = sorted(set(seg.eqns) | _free_closure(prog, wanted, producer))
        made = {k for e in seg.eqns for k in prog.eqns[e].outputs}
        seg.inputs = sorted({k for e in seg.eqns for k in prog.eqns[e].inputs
                             if not is_literal(k) and k not in made and k not in prog.consts})
        for k in made:
            made_in.setdefault(k, seg)
    for seg in ordered:
        for k in seg.inputs:
            if k in made_in and made_in[k] is not seg:
                made_in[k].outputs.append(k)
    for k in outs:
        if k in made_in:
            made_in[k].outputs.append(k)
    for seg in ordered:
        seg.outputs = sorted(set(seg.outputs))
    return ordered


def _free_closure(prog: FlatProgram, wanted: set, producer: Mapping[Any, int]) -> set[int]:
    """The free eqns computing `wanted` (keys), transitively."""
    todo, found = [k for k in wanted if k in producer], set()
    while todo:
        e = producer[todo.pop()]
        if e in found:
            continue
        found.add(e)
        todo.extend(k for k in prog.eqns[e].inputs if not is_literal(k) and k in producer)
    return found
