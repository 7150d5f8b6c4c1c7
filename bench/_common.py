"""Shared by the bench scripts: where the numbers were measured (machine, versions, commit)."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def git_state() -> dict:
    """Commit of the checkout and whether the library or model zoo differ from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "autoshard", "models", "pipeline"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None}
    return {"commit": head, "modified_at_start": [line[3:] for line in dirty if line.strip()]}


def machine(git: dict | None = None) -> dict:
    import jax
    import jaxlib
    import numpy as np

    import autoshard

    return {"python": platform.python_version(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "numpy": np.__version__, "autoshard": autoshard.__version__, "cpus": os.cpu_count(),
            "git": git if git is not None else git_state(), "devices": len(jax.devices()),
            "platform": platform.platform()}
