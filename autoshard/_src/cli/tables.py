"""Text tables, readable keypaths and the parameter summary grouped by block type (pure: no jax).

A GPT-3 plan has 1,540 parameters but one block type with 96 instances: the summary prints each
block type once with its instance count, its parameters merged where they share shape and spec
(`attn.{k,o,q,v}.kernel`), and names the instances a row covers when it is not all of them.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Hashable, Iterable, Sequence

from ..core.quantities import fmt_bytes, ranges
from ..plan.specs import Spec, spec_str

ARG_NAMES = ("params", "opt_state", "batch")     # the zoo's train_step(params, opt_state, batch)
_PART = re.compile(r"\['((?:[^'\\]|\\.)*)'\]|\[(\d+)\]|\.([A-Za-z_]\w*)")
_NUMBERED = re.compile(r"^(.*)_(\d+)$")
_ITEMSIZE = {"float64": 8, "int64": 8, "float32": 4, "int32": 4, "uint32": 4, "bfloat16": 2, "float16": 2,
             "int16": 2, "int8": 1, "uint8": 1, "bool": 1}


def table(rows: Sequence[Sequence[str]], align: str = "", indent: str = "  ") -> list[str]:
    """Aligned columns; row 0 is the header, underlined. `align` has 'l'/'r' per column (default l)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for k, row in enumerate(rows):
        cells = [c.rjust(w) if align[i:i + 1] == "r" else c.ljust(w)
                 for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        out.append((indent + "  ".join(cells)).rstrip())
        if k == 0:
            out.append(indent + "  ".join("-" * w for w in widths))
    return out


def mesh_text(mesh: Iterable[tuple[str, int]]) -> str:
    return " x ".join(f"{n}={s}" for n, s in mesh)


def shape_text(shape: Sequence[int]) -> str:
    return "x".join(map(str, shape)) or "scalar"


def spec_text(spec: Spec) -> str:
    return "replicated" if not any(spec) else spec_str(spec)


def parts(keypath: str) -> list[str]:
    """"[0]['block_3']['fc1']['kernel']" -> ['[0]', 'block_3', 'fc1', 'kernel'] (nnx's .value dropped)."""
    out = [m.group(1) if m.group(1) is not None else f"[{m.group(2)}]" if m.group(2) is not None else m.group(3)
           for m in _PART.finditer(keypath)]
    return out[:-1] if out and out[-1] == "value" else out


def friendly(keypath: str, n_args: int = 3) -> str:
    """"[2]['inputs']" -> 'batch.inputs' for the zoo's three step arguments; dotted otherwise."""
    ps = parts(keypath)
    if ps and n_args == len(ARG_NAMES) and ps[0] in ("[0]", "[1]", "[2]"):
        ps[0] = ARG_NAMES[int(ps[0][1:-1])]
    return ".".join(ps).replace(".[", "[")


def split_block(keypath: str) -> tuple[str, tuple[int, ...], tuple[str, ...]]:
    """(block type, instance numbers, path inside the block) of a parameter keypath.

    The block is the path up to its last numbered component (`block_7`, `layers[3]`), numbers
    replaced by `*`; parameters outside any numbered component belong to the block type ''."""
    ps = parts(keypath)
    if ps and re.fullmatch(r"\[\d+\]", ps[0]):          # the step argument index
        ps = ps[1:]
    last = max((i for i, p in enumerate(ps) if _NUMBERED.match(p) or re.fullmatch(r"\[\d+\]", p)), default=-1)
    if last < 0:
        return "", (), tuple(ps)
    head, numbers = [], []
    for p in ps[: last + 1]:
        m = _NUMBERED.match(p)
        if m:
            head.append(f"{m.group(1)}_*")
            numbers.append(int(m.group(2)))
        elif re.fullmatch(r"\[\d+\]", p):
            head.append("[*]")
            numbers.append(int(p[1:-1]))
        else:
            head.append(p)
    return ".".join(head).replace(".[", "["), tuple(numbers), tuple(ps[last + 1:])


def merge_paths(paths: Sequence[tuple[str, ...]], keys: Sequence[Hashable]) -> list[tuple[str, list[int]]]:
    """Paths with equal keys that differ in one component merge into a brace pattern, repeatedly
    ('attn.k.kernel' + 'attn.q.kernel' -> 'attn.{k,q}.kernel'). Returns (text, member indices)."""
    groups = [([frozenset([c]) for c in path], key, [i]) for i, (path, key) in enumerate(zip(paths, keys, strict=True))]
    changed = True
    while changed:
        changed = False
        for pos in range(max((len(g[0]) for g in groups), default=0)):
            by_key: dict[tuple, tuple] = {}
            kept = []
            for g in groups:
                names, key, members = g
                if pos >= len(names):
                    kept.append(g)
                    continue
                k = (key, len(names), tuple(n for i, n in enumerate(names) if i != pos))
                if k in by_key:
                    target = by_key[k]
                    target[0][pos] = target[0][pos] | names[pos]
                    target[2].extend(members)
                    changed = True
                else:
                    by_key[k] = g
                    kept.append(g)
            groups = kept
    return [(".".join(next(iter(n)) if len(n) == 1 else "{" + ",".join(sorted(n)) + "}" for n in names), members)
            for names, _, members in groups]


@dataclasses.dataclass(frozen=True)
class ParamRecord:
    keypath: str
    shape: tuple[int, ...]
    spec: Spec
    per_device: float
    extra: tuple[str, ...] = ()          # columns that are part of the grouping key, e.g. (gradient sync,)
    stage: int | None = None             # pipeline stage holding it (3-D plans), listed per row


@dataclasses.dataclass
class ParamRow:
    """Parameters of one block type sharing shape, spec and extra columns, their names merged."""

    block: str
    names: str
    record: ParamRecord                  # the first member: shape, spec, per_device, extra
    instances: set[tuple[int, ...]]
    stages: set[int]


def group_params(records: Iterable[ParamRecord]) -> tuple[list[ParamRow], dict[str, set]]:
    """Rows by block type, merged where only one path component differs; and each block type's instances."""
    by_path: dict[tuple, tuple[ParamRecord, set, set]] = {}      # -> (first record, instances, stages)
    instances: dict[str, set] = {}
    for r in records:
        block, inst, rest = split_block(r.keypath)
        instances.setdefault(block, set()).add(inst)
        entry = by_path.setdefault((block, rest, r.shape, r.spec, r.per_device, r.extra), (r, set(), set()))
        entry[1].add(inst)
        if r.stage is not None:
            entry[2].add(r.stage)
    keys = list(by_path)
    merged = merge_paths([k[1] for k in keys], [(k[0], *k[2:], frozenset(by_path[k][1])) for k in keys])
    rows = []
    for text, members in sorted(merged, key=lambda m: min(m[1])):
        first = by_path[keys[members[0]]]
        rows.append(ParamRow(keys[members[0]][0], text, first[0], set(first[1]),
                             set().union(*(by_path[keys[i]][2] for i in members))))
    return rows, instances


def block_label(block: str, instances: set) -> str:
    if not block:
        return "(outside blocks)"
    return f"{block} x{len(instances)}"


def coverage(row: ParamRow, all_instances: set) -> str:
    """'' when the row holds for every instance of its block; else which instances ('[0,5]', '[1-4]')."""
    if row.instances == all_instances or not row.block:
        return ""
    if all(len(i) == 1 for i in row.instances):
        return f" [{ranges([i[0] for i in row.instances])}]"
    labels = sorted(".".join(map(str, i)) for i in row.instances)
    return f" [{', '.join(labels)}]" if len(labels) <= 4 else f" [{len(labels)} of {len(all_instances)}]"


def grouped_param_lines(records: Sequence[ParamRecord], extra_headers: Sequence[str]) -> list[str]:
    """The parameter table grouped by block type: one row per distinct (path, shape, spec); for
    records of pipeline stages, a column of the stages each row's parameters live in."""
    rows, instances = group_params(records)
    staged = any(r.stage is not None for r in records)
    seen = list(dict.fromkeys(r.block for r in rows))
    order = sorted(seen, key=lambda b: (b == "", seen.index(b)))     # block types first, the rest last
    head = ("block type", "parameters", "shape", "spec", "per device", *extra_headers)
    out = [head + (("stages",) if staged else ())]
    for block in order:
        first = True
        for row in (r for r in rows if r.block == block):
            label = block_label(block, instances[block]) if first else ""
            stages = (ranges(sorted(row.stages)),) if staged else ()
            r = row.record
            out.append((label, row.names + coverage(row, instances[block]), shape_text(r.shape), spec_text(r.spec),
                        fmt_bytes(r.per_device), *r.extra, *stages))
            first = False
    return table(out, align="llllr" + "l" * (len(out[0]) - 5))


def full_param_lines(records: Iterable[ParamRecord], extra_headers: Sequence[str]) -> list[str]:
    """One row per parameter (`--full`)."""
    out = [("parameter", "shape", "spec", "per device", *extra_headers)]
    for r in records:
        out.append((friendly(r.keypath), shape_text(r.shape), spec_text(r.spec), fmt_bytes(r.per_device), *r.extra))
    return table(out, align="lllr" + "l" * len(extra_headers))


def bytes_per_device(shape: Sequence[int], dtype: str, spec: Spec, mesh: dict[str, int]) -> float:
    """Bytes of one device's shard (ceil-divided per split dim, as jax pads uneven shards)."""
    n = 1
    for d, size in enumerate(shape):
        parts_ = math.prod(mesh.get(a, 1) for a in (spec[d] if d < len(spec) else ()))
        n *= -(-size // parts_)
    return n * _ITEMSIZE.get(dtype, 4)
