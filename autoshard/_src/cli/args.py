"""Flag values checked where argparse reads them, so a bad flag fails before any work, in one line
naming the flag, the value and the fix (argparse prefixes "argument --flag:" to these messages)."""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import NoReturn

from ..core.hardware import presets
from ..core.quantities import fmt_bytes, parse_bytes

_AXIS = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MIN_BARE_BUDGET = 2**20   # a unit-less budget below 1 MiB is almost surely meant in GiB
# tracing unrolls every layer (~0.1 s and ~2 MB each on the zoo's GPT): 20000 layers took 30 min and 36 GB
MAX_LAYERS = 512


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: no usage block, a pointer to --help instead (exit 2)."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        raise SystemExit(2)


def mesh(text: str) -> dict[str, int] | str:
    """'data=2,model=4' -> {'data': 2, 'model': 4}; 'auto' stays 'auto' (the planner picks the shape)."""
    if text.strip() == "auto":
        return "auto"
    out: dict[str, int] = {}
    for part in text.split(","):
        name, sep, size = (s.strip() for s in part.partition("="))
        if not sep or not name or not size:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not name=size[,name=size...]; e.g. --mesh data=4,model=2 (or --mesh auto)")
        if not _AXIS.match(name):
            raise argparse.ArgumentTypeError(
                f"axis name {name!r} in {text!r} is not an identifier; use letters, digits and _, e.g. data=4")
        if name in out:
            raise argparse.ArgumentTypeError(
                f"axis {name!r} appears twice in {text!r}; give each axis once, e.g. {name}={size}")
        if not size.isdigit() or int(size) < 1:
            raise argparse.ArgumentTypeError(
                f"axis {name}={size} in {text!r}: a size must be a whole number >= 1, e.g. {name}=2")
        out[name] = int(size)
    return out


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return value


def hardware(text: str) -> str:
    if text not in presets():
        raise argparse.ArgumentTypeError(
            f"unknown hardware preset {text!r}; choose one of {', '.join(presets())} (autoshard list shows their "
            "numbers)")
    return text


def memory_budget(text: str) -> float:
    """Bytes per device, with an optional unit: 80GiB, 512MiB, 40GB, 3e10."""
    try:
        value, has_unit = parse_bytes(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; give bytes with a unit, e.g. 16GiB or "
                                         "512MiB") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0 bytes per device, e.g. 16GiB")
    if not has_unit and value < MIN_BARE_BUDGET:
        raise argparse.ArgumentTypeError(
            f"{text} means {fmt_bytes(value)} per device, too small for any plan; give a unit, "
            f"e.g. {text}GiB (or {text}KiB if you mean it)")
    return value


def output_path(text: str) -> str:
    """A file the command can write: checked now, before minutes of planning, by opening it (created
    and removed again when new; opened for append, never truncated, when it exists): permission bits
    say nothing to root or on /proc, a read-only mount or a full quota."""
    path = os.path.abspath(text)
    parent = os.path.dirname(path)
    if os.path.isdir(path) or text.endswith(os.sep):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file name, e.g. "
                                         f"{os.path.join(text, 'plan.json')}")
    if not os.path.isdir(parent):
        what = "is a file, not a directory" if os.path.exists(parent) else "does not exist"
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: the directory {parent} {what}; create it "
                                         "or write elsewhere")
    existed = os.path.lexists(path)
    try:
        fd = os.open(path, os.O_WRONLY | (os.O_APPEND if existed else os.O_CREAT | os.O_EXCL), 0o644)
    except OSError as err:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {err.strerror or err} (in {parent}); write "
                                         "elsewhere, e.g. --out ./plan.json") from None
    os.close(fd)
    if not existed:
        os.remove(path)          # the probe: the command writes the file when it has the result
    return text


def input_path(text: str) -> str:
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"no such file {text!r}; give a file written by --out (autoshard plan "
                                         "... --out FILE)")
    if not os.access(text, os.R_OK):
        raise argparse.ArgumentTypeError(f"cannot read {text!r}: permission denied")
    return text


class UsageError(Exception):
    """A flag value found wrong after parsing (it needs the model or the plan file): exit 2, one line."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"argument {flag}: {message}")
