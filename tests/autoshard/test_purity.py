"""The planner core imports no jax: graph, attribution, flops and grouping load with jax blocked."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PURE_MODULES = [
    "autoshard._cost",
    "autoshard._errors",
    "autoshard._experts",
    "autoshard._factors",
    "autoshard._flops",
    "autoshard._graph",
    "autoshard._graph_attribution",
    "autoshard._group",
    "autoshard._hlo",
    "autoshard._hardware",
    "autoshard._instances",
    "autoshard._mesh",
    "autoshard._search",
]


def test_pure_modules_import_without_jax():
    # The package __init__ imports the jax-facing trace module, so the pure modules are loaded
    # under a bare package object; any jax/flax/optax import then fails loudly.
    code = textwrap.dedent(f"""
        import importlib, sys, types
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("jax", "jaxlib", "flax", "optax"):
                    raise ImportError("pure module imported " + name)
        sys.meta_path.insert(0, Block())
        pkg = types.ModuleType("autoshard")
        pkg.__path__ = [{str(ROOT / "autoshard")!r}]
        sys.modules["autoshard"] = pkg
        for name in {PURE_MODULES!r}:
            importlib.import_module(name)
        assert not any(m.split(".")[0] == "jax" for m in sys.modules), "jax got imported"
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_library_does_not_import_the_model_zoo():
    code = "import sys, autoshard; assert 'models' not in sys.modules; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
