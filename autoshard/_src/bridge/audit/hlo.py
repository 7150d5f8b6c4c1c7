"""Collectives of a compiled program, read from its HLO text (pure: no jax import).

XLA prints two forms of replica groups (explicit `{{0,4},{1,5}}` and iota `[4,2]<=[2,4]T(1,0)`),
combines small collectives into tuple-shaped ones, and may run a collective inside a while body
(a scanned layer stack): each is handled so that a record says what moved per device per step.

A record's `bytes` is the per-device buffer of the collective, the quantity the planner predicts:
an all-reduce's operand, an all-gather's (gathered) result, a reduce-scatter's (full) operand, an
all-to-all's or collective-permute's operand. Device ordinals in replica groups are positions in
the mesh's device order (SPMD partition ids; with one replica, global ids are the same numbers).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import numpy as np

from ...core.attribution import parse_scope
from ...core.collectives import BY_HLO_OPCODE

_DTYPE_BYTES = {
    "pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3fnuz": 1,
    "f8e5m2fnuz": 1, "f8e4m3b11fnuz": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
    "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_COMMENT = re.compile(r"/\*.*?\*/")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
_OP = re.compile(r"\s(?P<op>[a-z][a-z0-9\-]*)\((?P<operands>[^()]*)\)")
_COMP_HEADER = re.compile(r"^\s*(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*(?:\(.*\))?\s*->.*\{\s*$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)"?')


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of the compiled program (one element of a combined tuple collective)."""

    kind: str                      # a collective kind (core.collectives.KINDS)
    bytes: int                     # per-device buffer bytes per execution
    count: int                     # executions per step (trip counts of enclosing loops)
    axes: tuple[str, ...]          # mesh axes its groups span
    module: str                    # source module from the op_name metadata ("" if none)
    phase: str                     # forward / backward / optimizer, from the op_name transforms
    op_name: str                   # the raw metadata
    instruction: str               # HLO instruction name
    groups: str                    # replica groups as printed
    element: int = 0               # position in a combined (tuple) collective
    elements: int = 1              # size of that tuple: one launch moves all its elements


def array_bytes(shape_text: str) -> list[int]:
    """Bytes of each array in an HLO shape ("f32[8,16]{1,0}" or a tuple of them); token[] etc.: 0."""
    out = []
    for dtype, dims in _ARRAY.findall(_COMMENT.sub("", shape_text)):
        n = 1
        for d in dims.split(",") if dims else ():
            n *= int(d)
        out.append(n * _DTYPE_BYTES.get(dtype, 0))
    return out


def _mesh_groups(text: str) -> list[list[int]]:
    """XLA's named-axes form: `mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'a'}`: devices laid out
    on that mesh (iota, transposed, or listed) and grouped along the named axes in braces."""
    axes = re.findall(r"'([^']*)'\s*=\s*(\d+)", text[:text.index("]") + 1])
    names = [a for a, _ in axes]
    sizes = [int(n) for _, n in axes]
    total = int(np.prod(sizes)) if sizes else 1
    ids = np.arange(total)
    dm = re.search(r"device_ids=\((.*)\)\s*\{", text)
    if dm:
        body = dm.group(1).strip()
        im = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", body)
        if im:
            ids = np.arange(total).reshape([int(x) for x in im.group(1).split(",")])
            if im.group(2):
                ids = ids.transpose([int(x) for x in im.group(2).split(",")])
            ids = ids.reshape(-1)
        else:
            ids = np.array([int(x) for x in re.findall(r"\d+", body)])
    grid = ids.reshape(sizes)
    chosen = re.findall(r"'([^']*)'", text[text.rindex("{"):])
    g_axes = [names.index(a) for a in chosen]
    rest = [i for i in range(len(names)) if i not in g_axes]
    size = int(np.prod([sizes[i] for i in g_axes])) if g_axes else 1
    return grid.transpose(rest + g_axes).reshape(-1, size).tolist()


def parse_replica_groups(text: str, num_devices: int) -> list[list[int]]:
    """`{{0,4},{1,5}}`, `{}` (every device), the iota form `[G,S]<=[d0,d1,...]T(p...)` or the
    named-axes form `mesh[...], device_ids=(...) {axes}`."""
    text = text.strip()
    if text.startswith("mesh["):
        return _mesh_groups(text)
    if text.startswith("["):
        m = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
        if m is None:
            raise ValueError(f"unparsed replica_groups {text!r}")
        shape = [int(x) for x in m.group(1).split(",")]
        dims = [int(x) for x in m.group(2).split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape(shape[0], -1).tolist()
    groups = [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d,\s]*)\}", text)]
    groups = [g for g in groups if g]
    return groups or [list(range(num_devices))]


def group_axes(groups: Sequence[Sequence[int]], mesh_names: Sequence[str],
               mesh_sizes: Sequence[int]) -> tuple[str, ...]:
    """Mesh axes along which members of a group differ (device ordinal = row-major mesh position)."""
    varying = np.zeros(len(mesh_sizes), dtype=bool)
    for g in groups:
        if len(g) < 2:
            continue
        coords = np.array(np.unravel_index(np.asarray(g), tuple(mesh_sizes))).T
        varying |= (coords != coords[0]).any(axis=0)
    return tuple(n for n, v in zip(mesh_names, varying, strict=True) if v)


def source_of(op_name: str, optimizer_scopes: Sequence[str] = ("optimizer",)) -> tuple[str, str]:
    """(module path, phase) of an op_name like "jit(step)/transpose(jvp(GPT))/block_0/fc1/dot_general"."""
    comps = op_name.split("/")
    fn = ""
    if comps and comps[0].startswith(("jit(", "pjit(")):
        fn = comps[0][comps[0].index("(") + 1:-1]
        comps = comps[1:]
    comps = comps[:-1]  # the primitive
    module, transforms = parse_scope("/".join(comps))
    module = module or fn  # outside every module: the step function itself (e.g. the loss mean)
    if any(s in module.split("/") for s in optimizer_scopes):
        phase = "optimizer"
    elif "transpose" in transforms:
        phase = "backward"
    else:
        phase = "forward"
    return module, phase


@dataclasses.dataclass
class _Instr:
    name: str
    computation: str
    shape: str
    op: str
    operands: list[str]
    attrs: str


def _instructions(hlo: str) -> tuple[list[_Instr], dict[str, int]]:
    """Every instruction with its computation, and the number of times each computation runs per
    step (while bodies with a known trip count multiply; other callees run once per call)."""
    instrs: list[_Instr] = []
    comp = ""
    for line in hlo.splitlines():
        h = _COMP_HEADER.match(line)
        if h and "=" not in line.split("(")[0]:
            comp = h.group("name")
            continue
        m = _INSTR.match(line)
        if m is None:
            continue
        rest = m.group("rest")
        om = _OP.search(_COMMENT.sub("", rest))
        if om is None:
            continue
        shape = _COMMENT.sub("", rest)[:om.start()]
        attrs = _COMMENT.sub("", rest)[om.end():]
        operands = re.findall(r"%([\w.\-]+)", om.group("operands"))
        instrs.append(_Instr(m.group("name"), comp, shape, om.group("op"), operands, attrs))
    # call graph: computation -> [(callee, multiplier)]
    calls: dict[str, list[tuple[str, int]]] = {}
    for ins in instrs:
        trip = 1
        if ins.op == "while":
            t = _TRIP.search(ins.attrs)
            trip = int(t.group(1)) if t else 1
        for key in ("body", "condition", "to_apply", "calls", "branch_computations", "true_computation",
                    "false_computation"):
            for callee in re.findall(rf"\b{key}=\{{?([^,}}]+(?:,\s*%[\w.\-]+)*)\}}?", ins.attrs):
                for c in re.findall(r"%?([\w.\-]+)", callee):
                    calls.setdefault(ins.computation, []).append((c, trip if key == "body" else 1))
    called = {c for lst in calls.values() for c, _ in lst}
    roots = [c for c in dict.fromkeys(i.computation for i in instrs) if c not in called]
    runs: dict[str, int] = {}

    def visit(c: str, mult: int, depth: int = 0) -> None:
        if depth > 64:
            return
        runs[c] = runs.get(c, 0) + mult
        for callee, t in calls.get(c, ()):
            visit(callee, mult * t, depth + 1)

    for r in roots:
        visit(r, 1)
    return instrs, runs


def collectives(hlo: str, mesh_names: Sequence[str], mesh_sizes: Sequence[int]) -> list[Collective]:
    """Every collective in `hlo` (one record per element of a tuple collective)."""
    instrs, runs = _instructions(hlo)
    by_name = {i.name: i for i in instrs}
    ndev = int(np.prod(mesh_sizes)) if len(mesh_sizes) else 1
    out: list[Collective] = []
    for ins in instrs:
        spec = BY_HLO_OPCODE.get(ins.op[:-len("-start")] if ins.op.endswith("-start") else ins.op)
        if spec is None:
            continue
        kind = spec.kind
        if kind == "collective-permute":
            pairs = re.search(r"source_target_pairs=(\{[\d,{}\s]*\})", ins.attrs)
            groups_text = pairs.group(1) if pairs else "{}"
            groups = parse_replica_groups(groups_text, ndev) if pairs else []
        else:
            rg = re.search(r"replica_groups=(mesh\[[^\]]*\](?:,\s*device_ids=\((?:[^()]|\([^()]*\))*\))?"
                           r"\s*\{[^}]*\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?|\{[\d,{}\s]*\})", ins.attrs)
            groups_text = rg.group(1) if rg else "{}"
            groups = parse_replica_groups(groups_text, ndev)
        axes = group_axes(groups, mesh_names, mesh_sizes)
        result = array_bytes(ins.shape)
        operands = [by_name.get(o) for o in ins.operands]
        operand_bytes = [sum(array_bytes(o.shape)) if o is not None else None for o in operands]
        if ins.op.endswith("-start") and spec.hlo_start_tuple:
            result = result[len(result) // 2:] if len(result) > 1 else result  # (operands, results[, ctx])
            result = [b for b in result if b]
        n = len(operands)
        for k in range(max(n, 1)):
            if spec.hlo_buffer == "operand" and n and operand_bytes[k] is not None:
                b = operand_bytes[k]
            else:
                b = result[k] if k < len(result) else (result[0] if result else 0)
            src = operands[k] if k < n and operands[k] is not None else None
            name_m = _OP_NAME.search(ins.attrs)
            op_name = name_m.group(1) if name_m else ""
            if n > 1 and src is not None:  # a combined collective: each element keeps its own source
                sm = _OP_NAME.search(src.attrs)
                op_name = sm.group(1) if sm else op_name
            module, phase = source_of(op_name) if op_name else ("", "")
            out.append(Collective(kind, int(b), runs.get(ins.computation, 1), axes, module, phase, op_name,
                                  ins.name, groups_text, k, max(n, 1)))
    return out


def summarize(records: Sequence[Collective]) -> dict[str, dict[str, float]]:
    """{"kind@axes": {"bytes": per-step bytes, "count": executions}} over records."""
    out: dict[str, dict[str, float]] = {}
    for r in records:
        key = f"{r.kind}@{','.join(r.axes)}"
        d = out.setdefault(key, {"bytes": 0.0, "count": 0.0})
        d["bytes"] += r.bytes * r.count
        d["count"] += r.count if r.element == 0 else 0  # launches, not tuple elements
    return out
