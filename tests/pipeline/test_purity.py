"""Schedules, validator and simulator import no jax: they load with jax, flax and optax blocked."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PURE_MODULES = [
    "pipeline._graph_schedule",
    "pipeline._graphpipe",
    "pipeline._layer_graph_build",
    "pipeline._schedule",
    "pipeline._simulate",
    "pipeline._sp",
    "pipeline._spp",
    "pipeline._validate",
]


def test_pipeline_modules_import_without_jax():
    # Both package __init__s are bypassed: autoshard's imports the jax-facing tracer, and pipeline's
    # re-exports modules that other tests check separately. Only the listed modules must be pure.
    code = textwrap.dedent(f"""
        import importlib, sys, types
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("jax", "jaxlib", "flax", "optax"):
                    raise ImportError("pure module imported " + name)
        sys.meta_path.insert(0, Block())
        for pkg_name in ("autoshard", "pipeline"):
            pkg = types.ModuleType(pkg_name)
            pkg.__path__ = [str({str(ROOT)!r} + "/" + pkg_name)]
            sys.modules[pkg_name] = pkg
        for name in {PURE_MODULES!r}:
            importlib.import_module(name)
        sched = sys.modules["pipeline._schedule"].schedule("graph-1f1b", num_stages=3, num_microbatches=4)
        sys.modules["pipeline._simulate"].simulate(sched)
        assert not any(m.split(".")[0] == "jax" for m in sys.modules), "jax got imported"
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
