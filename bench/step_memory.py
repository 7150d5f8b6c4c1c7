"""The peak live set of a compiled step, from XLA:GPU's or XLA:CPU's dumps (no accelerator needed).

`XLA_FLAGS=--xla_dump_to=DIR` writes, per compiled module, the scheduled HLO after optimizations
(`*after_optimizations.txt`) and its buffer assignment (`*buffer-assignment.txt`). This script walks
the entry computation's schedule, gives every value of the preallocated temp buffer the range from its
defining instruction to its last reader (through bitcasts and tuple elements), and reports the
instruction where the live bytes (the union of their offsets in the temp buffer) peak, with the values
live there grouped by phase (`jvp`: forward, `transpose(jvp)`: backward), jax op (op_name metadata)
and shape: what the planner's memory terms (saved activations, the backward's working set) are
compared with (bench/results/gpu_step_memory_h200.md).

    python bench/step_memory.py DUMP_DIR_OR_TAR [--module ID] [--top 40]

Without --module: every module with a buffer assignment, largest temp first, one line each.
"""

from __future__ import annotations

import argparse
import collections
import re
import tarfile
import tempfile
from pathlib import Path

_ALIAS = {"bitcast", "get-tuple-element"}


def parse_entry(text: str):
    """(schedule order, operands, op_name metadata, opcode, shape) of the entry computation."""
    entry = text[text.index("\nENTRY"):]
    entry = entry[:entry.index("\n}")]
    order, operands, meta, opcode, shape = [], {}, {}, {}, {}
    for ln in entry.splitlines()[1:]:
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z\-]+)\((.*)$", ln)
        if not m:
            continue
        name, shp, op, rest = m.groups()
        depth, i = 1, 0
        while i < len(rest) and depth:
            depth += {"(": 1, ")": -1}.get(rest[i], 0)
            i += 1
        order.append(name)
        opcode[name], shape[name] = op, shp
        operands[name] = [(a, int(b) if b else None)
                          for a, b in re.findall(r"%([\w.\-]+?)(?:#(\d+))?(?=[,)\s]|$)", rest[:i - 1])]
        mm = re.search(r'op_name="([^"]*)"', ln)
        cc = re.search(r'custom_call_target="([^"]*)"', ln)
        meta[name] = (mm.group(1) if mm else "") + (f" [{cc.group(1)}]" if cc else "")
    return order, operands, meta, opcode, shape


def temp_values(text: str) -> list[tuple[str, int | None, int, int, str]]:
    """(instruction, tuple index, size, offset, shape) of every value in the preallocated temp buffer."""
    out, in_temp = [], False
    for ln in text.splitlines():
        if ln.startswith("allocation"):
            in_temp = "preallocated-temp" in ln
        elif in_temp and ln.startswith(" value:"):
            m = re.match(r" value: <\d+ ([\w.\-]+)(?:\{([\d,]*)\})? @\d+> \(size=(\d+),offset=(\d+)\): (.*)", ln)
            if m:
                name, idx, size, off, shp = m.groups()
                out.append((name, int(idx.split(",")[0]) if idx else None, int(size), int(off), shp.strip()))
    return out


def peak(hlo: str, assignment: str):
    """(peak instruction index, schedule, metadata, live bytes, live values (def, last, offset, size,
    name, index, shape))."""
    order, operands, meta, opcode, shape = parse_entry(hlo)
    pos = {n: i for i, n in enumerate(order)}
    users = collections.defaultdict(list)
    for u, ops in operands.items():
        for a, k in ops:
            users[a].append((u, k))

    def last_use(name: str, k: int | None) -> int:
        best, todo, seen = pos[name], [(name, k)], set()
        while todo:
            n, kk = todo.pop()
            for u, uk in users.get(n, []):
                if (kk is not None and uk is not None and uk != kk) or (u, n) in seen:
                    continue
                seen.add((u, n))
                best = max(best, pos[u])
                if opcode[u] == "tuple":
                    best = len(order)          # returned: live to the end
                elif opcode[u] in _ALIAS:
                    todo.append((u, None))
        return best
    live = [(pos[n], last_use(n, k), off, size, n, k, shp) for n, k, size, off, shp in temp_values(assignment)
            if n in pos and size > 4096 and opcode[n] not in _ALIAS and not shp.startswith("(")]

    def live_at(t: int):
        now = [v for v in live if v[0] <= t <= v[1]]
        total, end = 0, -1
        for a, b in sorted((v[2], v[2] + v[3]) for v in now):
            if b > end:
                total, end = total + b - max(a, end), b
        return total, now
    t = max(sorted({v[0] for v in live}), key=lambda s: live_at(s)[0])
    total, now = live_at(t)
    return t, order, meta, total, now


def categories(meta: dict, live: list) -> dict[str, list]:
    """Live bytes by (phase, jax op with layer numbers folded, shape)."""
    unique = {}
    for v in sorted(live, key=lambda v: -v[3]):
        unique.setdefault((v[2], v[3]), v)
    out: dict[str, list] = collections.defaultdict(lambda: [0, 0])
    for v in unique.values():
        md, shp = meta[v[4]], v[6]
        if shp.startswith(("s8", "u8")):
            key = "workspace " + md.rsplit("[", 1)[-1].rstrip("]")
        else:
            phase = "bwd" if "transpose(" in md else ("fwd" if "jvp(" in md else "other")
            op = re.sub(r"(block|layer|stage)_\d+", r"\1_N", md.split(")/", 1)[-1])
            op = re.sub(r" \[__.*", "", op)             # a library call's target
            key = f"{phase} {op} {shp.split('{')[0]}"
        out[key][0] += v[3]
        out[key][1] += 1
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dump", help="a dump folder or a .tar.xz of one")
    ap.add_argument("--module", default=None, help="the module id (module_ID.*)")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args(argv)
    root = Path(args.dump)
    if root.is_file():
        tmp = Path(tempfile.mkdtemp())
        with tarfile.open(root) as tar:
            tar.extractall(tmp, filter="data")
        root = tmp
    found = {p.name.split(".")[0].split("_")[1]: p for p in root.rglob("*buffer-assignment.txt")}
    if args.module is None:
        rows = []
        for mod, p in found.items():
            m = re.search(r"allocation \d+: size (\d+),(?: page 0,)? preallocated-temp", p.read_text())
            rows.append((int(m.group(1)) if m else 0, mod))
        for temp, mod in sorted(rows, reverse=True):
            print(f"module {mod}: temp {temp / 2**20:,.0f} MiB")
        return
    ba = found[args.module]
    hlo = ba.with_name(ba.name.replace("-buffer-assignment.txt", ".txt"))
    t, order, meta, total, live = peak(hlo.read_text(), ba.read_text())
    print(f"peak at instruction {t} of {len(order)} ({order[t]}: {meta[order[t]]}): {total / 2**20:,.1f} MiB live "
          "in the temp buffer")
    for key, (b, n) in sorted(categories(meta, live).items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"{b / 2**20:10.1f} MiB  x{n:<3d} {key}")


if __name__ == "__main__":
    main()
