"""The package's shape: layers import one way, pure layers need no jax, faces stay thin.

Layers, lowest first: core -> tensor -> pipeline -> joint -> inference -> plan -> bridge -> cli. A module
may import its own layer and the layers below (inference: core only); only the bridge (and the CLI
above it) imports jax, only the CLI imports the model zoo, and no function-level import reaches into
the package (the usual way to hide a cycle). Read from the source with `ast`, so a violation fails
without running anything.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["core", "tensor", "pipeline", "joint", "inference", "plan", "bridge", "cli"]
PURE = ["core", "tensor", "pipeline", "joint", "inference", "plan"]
ONLY = {"inference": {"core"}}     # layers that may import only these below them
JAX = ("jax", "jaxlib", "flax", "optax", "orbax")
# run first in a subprocess: any import of a jax package fails loudly
BLOCK_JAX = ("import importlib, sys\n"
             "class Block:\n"
             "    def find_spec(self, name, path=None, target=None):\n"
             f"        if name.split('.')[0] in {JAX!r}:\n"
             "            raise ImportError('a pure module imported ' + name)\n"
             "sys.meta_path.insert(0, Block())")


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in ("autoshard", "pipeline"):
        for f in (ROOT / pkg).rglob("*.py"):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = f
    return mods


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, bool]]:
    """(absolute module, at module level?) for every import in the file."""
    tree = ast.parse(path.read_text())
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    top = {id(n) for n in tree.body} | {id(n) for s in tree.body if isinstance(s, ast.If) for n in s.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            pkg = base[: len(base) - node.level + 1] if node.level else []
            mod = ".".join(pkg + ([node.module] if node.module else []))
            out.append((mod, id(node) in top))
            out += [(f"{mod}.{a.name}", id(node) in top) for a in node.names if f"{mod}.{a.name}" in MODULES]
    return out


def _layer(name: str) -> str | None:
    parts = name.split(".")
    if parts[:2] == ["autoshard", "_src"] and len(parts) > 2:
        return parts[2] if parts[2] in LAYERS else None
    return None


def _graph() -> nx.DiGraph:
    g = nx.DiGraph()
    for name, path in MODULES.items():
        g.add_node(name)
        for target, _ in _imports(name, path):
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                g.add_edge(name, target)
    return g


def test_no_import_cycles():
    cycles = [sorted(c) for c in nx.strongly_connected_components(_graph()) if len(c) > 1]
    assert not cycles, f"import cycles: {cycles}"


def test_layers_import_downwards_only():
    bad = []
    for a, b in _graph().edges:
        la, lb = _layer(a), _layer(b)
        if la and lb and (LAYERS.index(lb) > LAYERS.index(la) or lb not in ONLY.get(la, {lb}) | {la}):
            bad.append(f"{a} ({la}) imports {b} ({lb})")
        if la and la != "cli" and b in ("autoshard", "pipeline"):
            bad.append(f"{a} imports the public face {b}")
    assert not bad, "\n".join(bad)


def test_only_the_bridge_imports_jax_and_only_the_cli_imports_models():
    bad = []
    for name, path in MODULES.items():
        layer = _layer(name)
        for target, _ in _imports(name, path):
            root = target.split(".")[0]
            if root in JAX and layer not in ("bridge", "cli") and not name.endswith("__init__"):
                bad.append(f"{name} imports {target}")
            if root == "models" and layer != "cli":
                bad.append(f"{name} imports the model zoo ({target})")
    assert not bad, "\n".join(bad)


def test_no_function_level_import_of_the_package():
    bad = [f"{name} imports {t} inside a function"
           for name, path in MODULES.items() for t, at_top in _imports(name, path)
           if not at_top and t.split(".")[0] in ("autoshard", "pipeline") and _layer(name) != "cli"]
    assert not bad, "\n".join(bad)


def test_faces_only_reexport():
    for face in ("autoshard/__init__.py", "pipeline/__init__.py"):
        tree = ast.parse((ROOT / face).read_text())
        defs = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        assert not defs, f"{face} defines {defs}; define them in autoshard/_src and re-export"


@pytest.mark.parametrize("layer", PURE)
def test_pure_layer_imports_with_jax_blocked(layer):
    # no faked packages: the faces load their jax-facing names lazily, so importing a pure module
    # through them must not touch jax
    names = sorted(n for n in MODULES if _layer(n) == layer)
    code = BLOCK_JAX + textwrap.dedent(f"""
        for name in {names!r}:
            importlib.import_module(name)
        import autoshard, pipeline
        assert not any(m.split(".")[0] in {JAX!r} for m in sys.modules), "jax got imported"
        print("ok", len({names!r}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok"), out.stdout


def test_pure_planning_runs_with_jax_blocked():
    """RaNNC plans a synthetic step end to end into a Plan, and a schedule simulates, without jax."""
    code = BLOCK_JAX + textwrap.dedent(f"""
        import pipeline
        from autoshard import Config, get_hardware
        from autoshard._src.plan.make import make_plan
        from tests.core._synthetic import model
        graph = model(["M/block_0", "M/block_1", "M/block_2", "M/block_3"])
        plan = make_plan(graph, Config(mesh={{"data": 4}}, pipeline="rannc", memory_budget=60_000),
                         get_hardware("v100-sxm"))
        assert len(plan.stages) > 1 and plan.is_pipeline, plan
        assert "stages" in plan.explain()
        pipeline.simulate(pipeline.schedule("graph-1f1b", num_stages=3, num_microbatches=4))
        assert not any(m.split(".")[0] in {JAX!r} for m in sys.modules), "jax got imported"
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_library_does_not_import_the_model_zoo():
    code = "import sys, autoshard, pipeline; autoshard.autoshard; assert 'models' not in sys.modules; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr


def test_public_faces_are_narrow():
    import autoshard
    import pipeline

    names = [n for n in dir(autoshard) if not n.startswith("_")]
    # 29 + the checkpoint pair (save, restore) + CheckpointError and StepFailedError (issue 29)
    assert len(names) <= 33, names
    errors = [n for n in names if n.endswith("Error")]
    assert all(issubclass(getattr(autoshard, n), autoshard.AutoshardError) for n in errors)
    for name in names + [n for n in dir(pipeline) if not n.startswith("_")]:   # every lazy name resolves
        assert getattr(autoshard, name, None) is not None or getattr(pipeline, name, None) is not None, name
