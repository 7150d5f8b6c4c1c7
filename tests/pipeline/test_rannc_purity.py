"""The RaNNC partitioner imports no jax: it loads, and plans a synthetic step, with jax blocked."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RANNC_MODULES = [
    "pipeline._atomic",
    "pipeline._blocks",
    "pipeline._costs",
    "pipeline._stages",
    "pipeline._uniform",
]


def test_rannc_modules_import_and_run_without_jax():
    # Both package __init__s are bypassed (autoshard's imports the tracer; pipeline's may import a
    # runtime); the listed modules, and a full atomic -> blocks -> stages run, must not need jax.
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
        for name in {RANNC_MODULES!r}:
            importlib.import_module(name)
        from tests.autoshard._synthetic import model
        from autoshard._group import group
        stages, uniform = sys.modules["pipeline._stages"], sys.modules["pipeline._uniform"]
        graph = model(["M/block_0", "M/block_1", "M/block_2", "M/block_3"])
        plan = stages.plan_stages(graph, 4, "v100-sxm", k=6, memory_budget=60_000)
        costs = sys.modules["pipeline._costs"].PipelineCosts(sys.modules["pipeline._atomic"].atomic_partition(graph))
        uniform.uniform_split(costs, 2, 4, 1, grouping=group(graph))
        assert len(plan.stages) > 1
        assert not any(m.split(".")[0] == "jax" for m in sys.modules), "jax got imported"
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
