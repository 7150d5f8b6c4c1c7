"""Numbers for people: bytes, seconds, counts and flops, auto-scaled to three significant digits.

Every quantity the CLI and the planners print goes through here, so no report or error shows `0.00 GiB`
or a bare float without its unit.
"""

from __future__ import annotations

import math

_BYTES = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_COUNTS = ("", "k", "M", "B", "T")          # parameters: 124M, 175B
_FLOPS = ("FLOP", "kFLOP", "MFLOP", "GFLOP", "TFLOP", "PFLOP", "EFLOP")


def _sig3(value: float) -> str:
    """Three significant digits without exponent notation (1000-1023 KiB stays `1020 KiB`)."""
    if value == 0:
        return "0"
    if abs(value) >= 100:
        return f"{value:.0f}"
    digits = 2 - int(math.floor(math.log10(abs(value))))
    text = f"{value:.{max(digits, 0)}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _scaled(value: float, base: float, names: tuple[str, ...], sep: str = " ") -> str:
    k = 0
    while abs(value) >= base * 0.9995 and k < len(names) - 1:
        value /= base
        k += 1
    return f"{_sig3(value)}{sep}{names[k]}"


def fmt_bytes(n: float | None) -> str:
    """1536 -> '1.5 KiB'; binary prefixes, as jax and XLA report memory."""
    if n is None:
        return "-"
    return f"{n:.0f} B" if abs(n) < 1024 else _scaled(n, 1024, _BYTES)


def fmt_seconds(s: float | None) -> str:
    """0.00094 -> '940 µs'; ns, µs, ms, s, then minutes past ten minutes."""
    if s is None:
        return "-"
    if s == 0:
        return "0 s"
    a = abs(s)
    if a >= 600:
        return f"{s / 60:.1f} min"
    for scale, unit in ((1, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if a >= scale * 0.9995:
            return f"{_sig3(s / scale)} {unit}"
    return f"{_sig3(s / 1e-9)} ns"


def fmt_count(n: float) -> str:
    """30080 -> '30.1k', 1.75e11 -> '175B' (decimal: parameter counts)."""
    return _scaled(n, 1000, _COUNTS, sep="")


def fmt_flops(n: float) -> str:
    """5.7e6 -> '5.7 MFLOP'."""
    return _scaled(n, 1000, _FLOPS)


def fmt_rate(bytes_per_second: float) -> str:
    """Bandwidth in decimal GB/s, as vendors quote it."""
    return _scaled(bytes_per_second, 1000, ("B/s", "kB/s", "MB/s", "GB/s", "TB/s"))


_SIZE_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> tuple[float, bool]:
    """'16GiB' -> (17179869184.0, True); '1e9' -> (1e9, False). The flag says whether a unit was given.
    ValueError on anything else."""
    t = text.strip().lower().replace(" ", "")
    unit = next((u for u in sorted(_SIZE_UNITS, key=len, reverse=True) if t.endswith(u)), "")
    number = t[: len(t) - len(unit)] if unit else t
    value = float(number)            # ValueError for garbage
    if not math.isfinite(value):
        raise ValueError(text)
    return value * _SIZE_UNITS.get(unit, 1), bool(unit)


def ranges(numbers: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2,5,7-8'."""
    out, nums = [], sorted(set(numbers))
    i = 0
    while i < len(nums):
        j = i
        while j + 1 < len(nums) and nums[j + 1] == nums[j] + 1:
            j += 1
        out.append(str(nums[i]) if i == j else f"{nums[i]}-{nums[j]}")
        i = j + 1
    return ",".join(out)
