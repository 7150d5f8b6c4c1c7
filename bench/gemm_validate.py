"""The GEMM kernel model against the measured GEMMs of `bench/gpu_calibrate.py` (no accelerator needed).

Reads `bench/results/gpu_calibrate_<gpu>.json`, prices every GEMM case with the planner's own
`core.kernels.op_seconds` on the preset, and prints measured / predicted before (the prediction stored in
the json, the model of its commit) and now, by group. The constants are set on the *fit* cases only
(large bf16 GEMMs at tensor-parallel 1, hidden >= 4096, and the tile / wave sweep); the tensor-parallel 8,
the small tensor-parallel 1 and the float32 (TF32) cases check them. `--fit` repeats the grid search over
(mma_efficiency, k_overhead) on the fit cases that set the preset's values. Writes
`bench/results/gemm_validate_<gpu>.md`.

    python bench/gemm_validate.py [--gpu h100] [--fit]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import statistics
from pathlib import Path

from autoshard._src.core.hardware import get_hardware
from autoshard._src.core.kernels import op_seconds

RESULTS = Path(__file__).resolve().parent / "results"
_DOT = {"contracting": ((1,), (0,)), "batch": ((), ())}
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


def predicted(hw, case: dict) -> float:
    """The kernel model's seconds for one m x k by k x n product (launch included), as the planner prices it."""
    m, n, k, dtype = case["m"], case["n"], case["k"], case["dtype"]
    peak = hw.peak_flops(dtype)
    nbytes = (m * k + k * n + m * n) * _ITEMSIZE[dtype]
    return op_seconds(hw.kernels, "dot_general", _DOT, [(m, k), (k, n)], (m, n), 2.0 * m * n * k, nbytes,
                      peak * hw.compute_efficiency, hw.memory_bandwidth, peak=peak)


def groups(cases: list[dict]) -> dict[str, list[dict]]:
    def fit(c):
        return c["dtype"] == "bfloat16" and c["tp"] == 1 and (c["layer"] == "sweep" or c["h"] >= 4096)
    return {"fit: large bf16 tp 1 (h >= 4096) + tile/wave sweep": [c for c in cases if fit(c)],
            "check: tp 8 (bf16)": [c for c in cases if c["tp"] == 8],
            "check: small tp 1 (bf16, h 1024-2048)": [c for c in cases if not fit(c) and c["tp"] == 1
                                                      and c["dtype"] == "bfloat16"],
            "check: float32 (TF32)": [c for c in cases if c["dtype"] == "float32"],
            "all": cases}


def summary(ratios: list[float]) -> str:
    inside = sum(0.8 <= r <= 1.25 for r in ratios) / len(ratios)
    return (f"{min(ratios):.2f} | {statistics.median(ratios):.2f} | {max(ratios):.2f} | {inside:.0%}")


def fit(hw, cases: list[dict]) -> tuple[float, int]:
    """(mma_efficiency, k_overhead) minimising the mean |log(measured / predicted)| over `cases`."""
    best = None
    for eff, k0 in itertools.product([x / 100 for x in range(60, 91)], range(0, 1025, 64)):
        trial = dataclasses.replace(hw, kernels=dataclasses.replace(hw.kernels, mma_efficiency=eff, k_overhead=k0))
        err = statistics.fmean(abs(math.log(c["measured"] / predicted(trial, c))) for c in cases)
        if best is None or err < best[0]:
            best = (err, eff, k0)
    return best[1], best[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", default="h100")
    ap.add_argument("--fit", action="store_true", help="repeat the grid search that set the preset's constants")
    args = ap.parse_args()
    data = json.loads((RESULTS / f"gpu_calibrate_{args.gpu}.json").read_text())
    hw = get_hardware(data["meta"]["preset"])
    cases = data["sections"]["gemm"]
    km = hw.kernels
    lines = [f"# GEMM kernel model vs {data['meta']['device_kind']} ({len(cases)} GEMMs)", "",
             "`python bench/gemm_validate.py`: measured / predicted (> 1: the model is optimistic), before = the "
             f"prediction stored in `gpu_calibrate_{args.gpu}.json`, now = preset `{hw.name}`: mma_efficiency "
             f"{km.mma_efficiency}, k_overhead {km.k_overhead}, launch {km.launch * 1e6:g} us, bandwidth "
             f"{km.bandwidth_efficiency}, tile {km.tile}.", "",
             "| cases | n | before min / median / max / in [0.8, 1.25] | now min / median / max / in [0.8, 1.25] |",
             "|---|---|---|---|"]
    for name, rows in groups(cases).items():
        before = summary([c["ratio"] for c in rows])
        now = summary([c["measured"] / predicted(hw, c) for c in rows])
        lines.append(f"| {name} | {len(rows)} | {before.replace(' | ', ' / ')} | {now.replace(' | ', ' / ')} |")
    if args.fit:
        eff, k0 = fit(hw, next(iter(groups(cases).values())))
        lines += ["", f"Grid search on the fit cases: mma_efficiency {eff}, k_overhead {k0}."]
    text = "\n".join(lines) + "\n"
    print(text)
    (RESULTS / f"gemm_validate_{args.gpu}.md").write_text(text)


if __name__ == "__main__":
    main()
