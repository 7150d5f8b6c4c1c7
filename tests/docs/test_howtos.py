"""The README's how-tos run as written. A fenced ```python block right after `<!-- howto: NAME FLAGS -->`
is a how-to; FLAGS are `slow` (the slow set), `needs=MODULE` (skipped without it, as
pytest.importorskip), `after=OTHER` (runs in the namespace OTHER's block left, as a reader continues
from an earlier how-to) and `processes=N` (a script for N processes joined by jax.distributed: run
here as N local processes of 8 // N CPU devices each, gloo collectives, as tests/integration/
test_multihost.py runs its workers). Every other ```python block must say why it is not run
(`<!-- not run: REASON -->`), so no snippet escapes the test unnoticed.

Also: the Quick start has exactly its two commands, and every relative link in README.md and docs/*.md
names a file that exists."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import flax.linen
import flax.nnx
import jax
import optax
import pytest

import autoshard

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
QUICK_START = ["python -m pip install -e . && autoshard", "bash tests/run.sh"]

_BLOCK = re.compile(r"(?:<!-- (howto|not run): ?(.*?) -->\n)?```python\n(.*?)```", re.S)


@dataclass(frozen=True)
class Howto:
    name: str
    code: str
    slow: bool = False
    needs: str | None = None
    after: str | None = None
    processes: int = 1


def _howtos(text: str) -> tuple[dict[str, Howto], list[str]]:
    """The how-tos of `text` by name, and the ```python blocks that carry neither marker."""
    found: dict[str, Howto] = {}
    unmarked = []
    for kind, marker, code in _BLOCK.findall(text):
        if kind == "not run":
            assert marker.strip(), "a `<!-- not run: -->` block must say why"
        elif kind != "howto":
            unmarked.append(code)
        else:
            name, *flags = marker.split()
            opts = dict(f.split("=", 1) if "=" in f else (f, True) for f in flags)
            assert set(opts) <= {"slow", "needs", "after", "processes"}, (name, opts)
            assert name not in found, f"two how-tos named {name!r}"
            found[name] = Howto(name, code, slow=bool(opts.get("slow")), needs=opts.get("needs"),
                                after=opts.get("after"), processes=int(opts.get("processes", 1)))
    for h in found.values():
        assert h.after is None or h.after in found, f"how-to {h.name!r} comes after unknown {h.after!r}"
    return found, unmarked


HOWTOS, UNMARKED = _howtos(README.read_text())


def _params():
    for h in HOWTOS.values():
        slow = h.slow or any(HOWTOS[a].slow for a in _chain(h.name)[:-1])
        yield pytest.param(h.name, id=h.name, marks=[pytest.mark.slow] if slow else [])


def _chain(name: str) -> list[str]:
    """`name` and the how-tos it continues from, first to last."""
    chain = [name]
    while HOWTOS[chain[0]].after is not None:
        chain.insert(0, HOWTOS[chain[0]].after)
    return chain


def _needs(name: str) -> None:
    for n in _chain(name):
        if HOWTOS[n].needs:
            pytest.importorskip(HOWTOS[n].needs)


def test_every_python_block_is_a_howto_or_says_why_not():
    assert not UNMARKED, [code[:200] for code in UNMARKED]


def test_the_readme_has_howtos_for_each_task():
    assert {"linen", "nnx", "hf", "mesh", "abstract", "pipeline", "checkpoint", "multihost", "audit"} <= set(HOWTOS)


# the libraries the how-tos import, loaded with this module as any test module loads what it tests (a
# how-to's own `import` then costs nothing, and its time is its own work: tracing, planning, compiling)
_ = (flax.linen, flax.nnx, optax, autoshard.autoshard)


@pytest.mark.parametrize("name", list(_params()))
def test_howto_runs(name, tmp_path, monkeypatch):
    _needs(name)
    monkeypatch.chdir(tmp_path)           # files a how-to writes (plan.json, checkpoints/) land here
    h = HOWTOS[name]
    if h.processes > 1:
        _run_processes(h, tmp_path)
        return
    _run(name)


_LEFT: dict[str, dict] = {}        # how-to name -> the namespace its block left (kept for those after it)


def _run(name: str) -> dict:
    """Run how-to `name` in a fresh module, continuing from (a copy of) what its `after` how-to left, as
    a reader runs how-to 1 and then how-to 3 in one session; each how-to before it runs once."""
    h = HOWTOS[name]
    module = types.ModuleType(f"readme_howto_{name.replace('-', '_')}")
    sys.modules[module.__name__] = module          # a real module: flax's dataclasses look theirs up
    if h.after is not None:
        left = _LEFT[h.after] if h.after in _LEFT else _run(h.after)
        module.__dict__.update({k: _copied(v) for k, v in left.items() if not k.startswith("__")})
    exec(compile(h.code, f"README.md[howto {name}]", "exec"), module.__dict__)
    _LEFT[name] = module.__dict__
    return module.__dict__


def _copied(value):
    """`value` with its jax arrays copied: a how-to's step donates the state it is given, and the next
    how-to that continues from the same one must still find it."""
    return jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, value)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# what the README tells a reader to add to rehearse a multi-host script on one CPU machine
_CPU_HOSTS = ('import jax\njax.config.update("jax_num_cpu_devices", {n})\n'
              'jax.config.update("jax_cpu_collectives_implementation", "gloo")\n')


def _run_processes(h: Howto, tmp_path: Path) -> None:
    script = tmp_path / f"{h.name}.py"
    script.write_text(_CPU_HOSTS.format(n=8 // h.processes) + h.code)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("XLA_FLAGS", None)
    address = f"127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen([sys.executable, str(script), address, str(h.processes), str(i)], cwd=tmp_path,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(h.processes)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=240)
            assert p.returncode == 0, err[-3000:]
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    lines = [line for out in outs for line in out.splitlines() if line.startswith("process ")]
    assert len(lines) == h.processes, outs
    losses = {line.rsplit("loss", 1)[1].strip() for line in lines}
    assert len(losses) == 1, lines              # one plan, one program: the same loss everywhere


def _section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def test_quick_start_is_exactly_the_two_commands():
    text = README.read_text()
    assert text.startswith("# autoshard\n\n## Quick start\n")
    section = _section(text, "Quick start")
    blocks = re.findall(r"```(\w*)\n(.*?)```", section, re.S)
    assert len(blocks) == 1, blocks
    lang, body = blocks[0]
    assert lang == "bash" and body.splitlines() == QUICK_START, body


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _pages() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def test_every_relative_link_names_a_file():
    broken = []
    for page in _pages():
        for target in _LINK.findall(page.read_text()):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue                     # https:, mailto:, an anchor in the page itself
            path = (page.parent / target.split("#", 1)[0]).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_every_docs_page_is_linked_from_the_readme():
    readme = README.read_text()
    linked = {(ROOT / t.split("#", 1)[0]).resolve() for t in _LINK.findall(readme)}
    orphans = [p.name for p in _pages()[1:] if p.resolve() not in linked]
    assert not orphans, orphans
