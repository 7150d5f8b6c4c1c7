"""Per-device share of the zoo GPT's priced ops (issue 30, "What to build 1"): the chosen 3-D point, its
predicted step and each stage's forward / backward seconds per micro-batch, for GPT (bfloat16, 4 layers,
d 1024, 16 heads, seq 1024, batch 256) on 64 a100-sxm.

    python bench/share_gpt.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import autoshard  # noqa: E402
import models  # noqa: E402
from autoshard._src.core.grouping import group  # noqa: E402
from autoshard._src.joint.search import joint_search  # noqa: E402
from autoshard._src.tensor.search import SearchOptions  # noqa: E402

CFG = dict(num_layers=4, d_model=1024, num_heads=16, seq_len=1024, batch_size=256, dtype="bfloat16")


def show(name, p) -> None:
    if p is None:
        print(f"{name}: none")
        return
    print(f"{name}: {p.describe()}  step {p.step_time * 1e3:.2f} ms")
    for k, s in enumerate(p.stages):
        print(f"   stage {k}: units [{s.start}, {s.stop}) data {s.data} x model {s.model} {s.storage} remat {s.remat}"
              f"  fwd {s.forward * 1e3:.3f} ms  bwd {s.backward * 1e3:.3f} ms  (bwd/fwd {s.backward / s.forward:.2f})"
              f"  tail {s.tail * 1e3:.3f} ms  mem {s.memory / 2**30:.2f} GiB")


def main() -> None:
    m = models.get("gpt", "debug", **CFG)
    args = m.abstract_state()
    t0 = time.perf_counter()
    graph = autoshard.trace(m.train_step, *args)
    hw = autoshard.get_hardware("a100-sxm")
    res = joint_search(graph, group(graph), 64, hw, SearchOptions())
    print(f"searched in {time.perf_counter() - t0:.1f} s")
    show("chosen", res.best)
    show("tensor only", res.tensor_only)
    show("megatron grid", res.grid.best)
    plan = autoshard.plan(m.train_step, *args, mesh="auto", devices=64, hardware="a100-sxm")
    print(f"autoshard.plan: {plan.predicted['3d']['chosen']['label']}  step {plan.predicted['step_time'] * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
