"""Progress lines for slow phases, and XLA's C++ stderr kept out of the reports.

Each phase (trace, search, profile, compile, sweep cell) prints one line to stderr when it ends,
with its wall time; on a terminal the line shows live with a ticking clock once the phase has run
for a second. XLA writes warnings (e.g. SPMD "Involuntary full rematerialization") straight to
file descriptor 2 from C++, where Python cannot intercept them; `NativeStderr` points that
descriptor at a temporary file for the duration, and the CLI prints a one-line summary after its
tables instead.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import TextIO

from ..core.quantities import fmt_seconds

LIVE_AFTER = 1.0          # seconds before a terminal shows the ticking line


class Progress:
    """Phase timer writing to `stream` (stderr by default); `quiet` keeps the phases silent."""

    def __init__(self, stream: TextIO | None = None, quiet: bool = False):
        self.stream = stream if stream is not None else sys.stderr
        self.quiet = quiet
        self.total = 0.0

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        stop = threading.Event()
        live = None
        if not self.quiet and _is_tty(self.stream):
            live = threading.Thread(target=self._tick, args=(name, t0, stop), daemon=True)
            live.start()
        ok = False
        try:
            yield
            ok = True
        finally:
            stop.set()
            if live is not None:
                live.join()
            elapsed = time.perf_counter() - t0
            self.total += elapsed
            if live is not None:
                self.stream.write("\r\033[K")      # clear the live line
            if not self.quiet and ok:           # a failed phase leaves the stage to the error's one line
                self.stream.write(f"  {name:<26} {fmt_seconds(elapsed):>8}\n")
            self.stream.flush()

    def after(self, lines: list[str]) -> None:
        """Notes that belong after the report (captured warnings), on the same stream."""
        for line in lines:
            self.stream.write(line + "\n")
        self.stream.flush()

    def _tick(self, name: str, t0: float, stop: threading.Event) -> None:
        if stop.wait(LIVE_AFTER):
            return
        while not stop.wait(0.2):
            self.stream.write(f"\r  {name:<26} {fmt_seconds(time.perf_counter() - t0):>8} ...")
            self.stream.flush()


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


# glog line prefix as XLA writes it: severity, MMDD, time, thread, file:line]
_GLOG = re.compile(r"^([IWEF])\d{4} [\d:.]+\s+\d+\s+[^\]\s]+\]\s?(.*)$")


class NativeStderr:
    """Redirects file descriptor 2 (C++ and Python stderr alike) to a temporary file while active.

    The progress stream keeps writing to the real stderr: when it is the process's fd 2, it is
    swapped for a stream over a saved copy of that descriptor for the duration. `enabled=False`
    (--debug) leaves stderr alone, so a crash shows XLA's output where it happened."""

    def __init__(self, progress: Progress, enabled: bool = True):
        self.progress = progress
        self.enabled = enabled
        self.text = ""

    def __enter__(self) -> NativeStderr:
        if not self.enabled:
            return self
        sys.stderr.flush()
        self._saved = os.dup(2)
        self._tmp = tempfile.TemporaryFile()
        os.dup2(self._tmp.fileno(), 2)
        self._old_stream = self.progress.stream
        if _fileno(self._old_stream) == 2:
            self.progress.stream = os.fdopen(os.dup(self._saved), "w", encoding="utf-8", errors="replace")
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        sys.stderr.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        if self.progress.stream is not self._old_stream:
            self.progress.stream.close()
            self.progress.stream = self._old_stream
        self._tmp.seek(0)
        self.text = self._tmp.read().decode("utf-8", errors="replace")
        self._tmp.close()

    def summary(self) -> list[str]:
        """One line: how many messages XLA (or anything else) wrote, and the first of them."""
        lines = [line for line in self.text.splitlines() if line.strip()]
        if not lines:
            return []
        messages = [m for m in (_GLOG.match(line) for line in lines) if m]
        if messages:
            warn = [m for m in messages if m.group(1) in "WEF"]
            picked = warn or messages
            first = picked[0].group(2).strip()
            return [f"note: XLA wrote {len(picked)} {'warning' if warn else 'message'}"
                    f"{'s' if len(picked) > 1 else ''} to stderr during the run ({len(lines)} lines; "
                    f"first: {_clip(first)}); --debug shows them as they come"]
        return [f"note: {len(lines)} line{'s' if len(lines) > 1 else ''} went to stderr during the run "
                f"(first: {_clip(lines[0].strip())}); --debug shows them as they come"]


def _fileno(stream: TextIO) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, ValueError, OSError):
        return None


def _clip(text: str, width: int = 140) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."
