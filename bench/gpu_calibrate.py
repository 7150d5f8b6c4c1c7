"""Time the kernels the planner prices, on whatever accelerator is present, beside the kernel model's
prediction (issue 30, deliverable 7).

Sections (each writes its rows as it finishes, so a run stopped early keeps what it measured):

* ``copy``: a streaming read + write of 1 MiB .. 2 GiB (achievable HBM bandwidth, launch floor);
* ``launch``: a chain of N dependent tiny matmuls in one jitted program, N = 1 and 64: the slope is
  the per-kernel cost inside a compiled program (launch + tail), the planner's ``KernelModel.launch``;
* ``gemm``: the matmuls of a GPT layer (qkv, attention out, fc1, fc2; forward, data-gradient and
  weight-gradient shapes) at hidden 1024 .. 12288, tensor-parallel splits 1 and 8, bf16, a float32
  (TF32 under jax's default precision) subset, and a sweep of rows across tile and wave boundaries;
* ``fused``: softmax, LayerNorm, tanh-GELU and bias + residual chains as XLA compiles them: measured,
  the current model's price (one HBM pass per jaxpr equation), and one pass over the chain's external
  inputs and outputs (a single fused kernel), with the compiled program's kernel count and XLA's own
  ``cost_analysis()`` bytes;
* ``attention``: ``jax.nn.dot_product_attention`` (causal, bf16) forward and forward + backward with
  ``implementation`` None / "xla" / "cudnn";
* ``layer``: one pre-LN GPT layer (bf16 compute over float32 parameters, GELU 4h) forward + backward
  under ``jax.jit`` beside the current model's price of the same traced program.

Predictions use the planner's own functions (``core.kernels.op_seconds`` on the preset that matches
the device: ``h100-sxm``, ``a100-sxm``, ``v100-sxm``; ``cpu-sim`` on a CPU, where the run is a smoke
test with small shapes). Times are medians of timed calls queued back to back after a warm-up (so
the device, not Python dispatch, sets the pace for kernels longer than a few microseconds).

    python bench/gpu_calibrate.py [--quick] [--out-dir bench/results] [--budget 480]

Writes ``gpu_calibrate_<device>.json`` and ``.md`` (device: h100, a100, v100, cpu, ...).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine  # noqa: E402

import autoshard  # noqa: E402
from autoshard._src.core.attention import priced_fusion  # noqa: E402
from autoshard._src.core.hardware import get_hardware  # noqa: E402
from autoshard._src.core.kernels import compute_dtype, op_seconds  # noqa: E402

_DOT = {"contracting": ((1,), (0,)), "batch": ((), ())}


def device_slug() -> tuple[str, str, str]:
    """(file slug, device kind, hardware preset) of the first device."""
    dev = jax.devices()[0]
    kind = getattr(dev, "device_kind", dev.platform)
    for gpu, preset in (("H200", "h200-sxm"), ("H100", "h100-sxm"), ("A100", "a100-sxm"), ("V100", "v100-sxm")):
        if gpu in kind:
            return gpu.lower(), kind, preset
    if dev.platform == "cpu":
        return "cpu", kind, "cpu-sim"
    return re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-") or dev.platform, kind, "h100-sxm"


def timed(fn, *args, runs: int = 15) -> float:
    """Median seconds per call: `runs` samples, each a queue of calls dispatched back to back (enough
    for >= 2 ms, at most 50) then waited on, after two warm-up calls."""
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    queue = max(1, min(50, int(2e-3 / max(time.perf_counter() - t0, 1e-7))))
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        out = None
        for _ in range(queue):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / queue)
    return statistics.median(samples)


HLO_DIR: list[Path] = []     # --hlo-dir: where compiled programs are kept (the fusion model's evidence)


def compiled_facts(fn, *args, name: str = "") -> dict:
    """Kernels in the compiled program's entry computation and XLA's own cost analysis."""
    compiled = jax.jit(fn).lower(*args).compile()
    text = compiled.as_text()
    if HLO_DIR and name:
        (HLO_DIR[0] / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}.hlo.txt").write_text(text)
    entry = text[text.find("ENTRY"):]
    entry = entry[:entry.find("\n}")]
    skip = ("parameter(", "constant(", "tuple(", "get-tuple-element(", "bitcast(", "copy-start(", "copy-done(")
    kernels = [ln for ln in entry.splitlines()[1:] if "=" in ln and not any(s in ln for s in skip)]
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) and cost else cost
    cost = cost or {}
    return {"kernels": len(kernels), "fusions": sum("fusion(" in ln for ln in kernels),
            "custom_calls": sum("custom-call(" in ln for ln in kernels),
            "xla_bytes": float(cost.get("bytes accessed", 0.0)), "xla_flops": float(cost.get("flops", 0.0))}


def model_price(fn, args, hw, attention: str = "as_traced") -> dict:
    """The current model's price of `fn(*args)` on one device: every traced op by `op_seconds` (the
    pipeline partitioners' and 3-D tables' per-op cost), plus the roofline of its matmul flops.
    `attention="flash"` prices recognised attention as FlashAttention kernels (core/attention.py)."""
    graph = autoshard.trace(fn, *args)
    # ops priced for the bytes and kernels left after fusion
    km, fz = hw.kernels, priced_fusion(graph, hw.kernels is not None, attention)
    total = launches = gemm = other = 0.0
    for op in graph.ops:
        dtype = compute_dtype(op.primitive, op.in_dtypes, op.out_dtypes)
        rate = hw.peak_flops(dtype) * hw.compute_efficiency
        nbytes = fz.bytes[op.index]
        if km is not None:
            t = op_seconds(km, op.primitive, op.params, op.in_shapes, op.out_shapes[0] if op.out_shapes else (),
                           op.flops, nbytes, rate, hw.memory_bandwidth, peak=hw.peak_flops(dtype),
                           launches=fz.launches[op.index], scale=fz.compute_scale(op.index))
        else:
            t = max(fz.compute_scale(op.index) * op.flops / rate, nbytes / hw.memory_bandwidth)
        t *= op.repeat
        total += t
        if op.primitive in ("dot_general", "conv_general_dilated"):
            gemm += t
        else:
            other += t
        launches += op.repeat
    rep = np.array([op.repeat for op in graph.ops], dtype=float)
    return {"predicted": total, "predicted_gemm": gemm, "predicted_other": other, "traced_ops": int(launches),
            "predicted_kernels": float((fz.launches * rep).sum()),
            "predicted_bytes": float((fz.bytes * rep).sum()),
            "traced_bytes": float(sum(op.bytes * op.repeat for op in graph.ops)),
            "traced_flops": float(sum(op.flops * op.repeat for op in graph.ops))}


def gemm_predicted(hw, m: int, n: int, k: int, dtype: str) -> float:
    km, size = hw.kernels, jnp.dtype(dtype).itemsize
    rate = hw.peak_flops(dtype) * hw.compute_efficiency
    nbytes = (m * k + k * n + m * n) * size
    if km is None:
        return max(2 * m * n * k / rate, nbytes / hw.memory_bandwidth)
    return op_seconds(km, "dot_general", _DOT, [(m, k), (k, n)], (m, n), 2.0 * m * n * k, nbytes, rate,
                      hw.memory_bandwidth, peak=hw.peak_flops(dtype))


class Recorder:
    """Rows per section, written to JSON after every row; a time budget over the whole run."""

    def __init__(self, path: Path, meta: dict, budget: float) -> None:
        self.path, self.data, self.deadline = path, {"meta": meta, "sections": {}}, time.time() + budget
        self.skipped: list[str] = []

    def out_of_time(self, what: str) -> bool:
        if time.time() > self.deadline:
            self.skipped.append(what)
            return True
        return False

    def add(self, section: str, row: dict) -> None:
        self.data["sections"].setdefault(section, []).append(row)
        self.data["meta"]["skipped_for_time"] = self.skipped
        self.path.write_text(json.dumps(self.data, indent=1))
        print(section, json.dumps(row), flush=True)


def run_copy(rec: Recorder, hw, quick: bool) -> None:
    sizes = [2**20, 2**24, 2**26] if quick else [2**20, 2**22, 2**24, 2**26, 2**28, 2**30, 2**31]
    fn = jax.jit(lambda x: x * 2.0)
    for nbytes in sizes:
        if rec.out_of_time(f"copy {nbytes}"):
            return
        x = jnp.ones((nbytes // 4,), jnp.float32)
        t = timed(fn, x)
        moved = 2 * nbytes
        km = hw.kernels
        pred = moved / (hw.memory_bandwidth * (km.bandwidth_efficiency if km else 1.0))
        rec.add("copy", {"bytes": nbytes, "measured": t, "bandwidth": moved / t, "predicted": pred,
                         "bandwidth_fraction": moved / t / hw.memory_bandwidth})


def run_launch(rec: Recorder, hw, quick: bool) -> None:
    n_long = 16 if quick else 64

    def chain(n):
        def f(x, w):
            for _ in range(n):
                x = jnp.dot(x, w)
            return x
        return jax.jit(f)

    for size in (64, 256):
        x = jnp.ones((size, size), jnp.float32) / size
        w = jnp.eye(size, dtype=jnp.float32)
        t1, tn = timed(chain(1), x, w), timed(chain(n_long), x, w)
        facts = compiled_facts(chain(n_long), x, w)
        rec.add("launch", {"size": size, "chain": n_long, "one": t1, "many": tn,
                           "per_kernel": (tn - t1) / (n_long - 1), "kernels_compiled": facts["kernels"],
                           "model_launch": hw.kernels.launch if hw.kernels else None})


def _gemm_shapes(quick: bool) -> list[dict]:
    """A GPT layer's matmuls: (name, m, n, k) forward, data gradient and weight gradient."""
    hiddens, tps, tokens = ([256, 512], [1, 2], [512]) if quick else ([1024, 2048, 4096, 8192, 12288], [1, 8], [4096])
    out = []
    for h in hiddens:
        for t in tps:
            for T in tokens:
                for name, k, n in (("qkv", h, 3 * h // t), ("proj", h // t, h), ("fc1", h, 4 * h // t),
                                   ("fc2", 4 * h // t, h)):
                    out += [{"layer": name, "pass": "fwd", "h": h, "tp": t, "m": T, "n": n, "k": k},
                            {"layer": name, "pass": "dgrad", "h": h, "tp": t, "m": T, "n": k, "k": n},
                            {"layer": name, "pass": "wgrad", "h": h, "tp": t, "m": k, "n": n, "k": T}]
    return out


def _wave_sweep(quick: bool) -> list[dict]:
    """Rows across tile (256 / 128) and wave boundaries at n = k = 4096 (2048 in quick runs)."""
    n = 512 if quick else 4096
    rows = [128, 256, 257, 384, 512] if quick else [128, 256, 257, 512, 768, 1024, 1025, 1536, 2048, 2049, 3072,
                                                     4096, 4097, 6144, 8192, 8448, 16384]
    return [{"layer": "sweep", "pass": "fwd", "h": n, "tp": 1, "m": m, "n": n, "k": n} for m in rows]


def _replicas(seconds: float, nbytes: int) -> int:
    """Independent copies of a kernel in one program so that a call keeps the device busy >= 0.3 ms
    (at most 32, 4 GB of operands): Python's dispatch (~40 us a call on jax 0.11) then overlaps the
    device's work instead of setting the pace."""
    return int(max(1, min(32, math.ceil(3e-4 / max(seconds, 1e-7)), 4e9 // max(nbytes, 1))))


def run_gemm(rec: Recorder, hw, quick: bool) -> None:
    f32 = [dict(s, dtype="float32") for s in _gemm_shapes(quick) if s["h"] in (1024, 4096, 256) and s["tp"] == 1]
    cases = [dict(s, dtype="bfloat16") for s in _gemm_shapes(quick) + _wave_sweep(quick)] + f32
    key = jax.random.PRNGKey(0)
    fields = ("layer", "pass", "h", "tp", "m", "n", "k", "dtype")
    done = {tuple(r[f] for f in fields) for r in rec.data["sections"].get("gemm", [])}
    for case in cases:
        if tuple(case[f] for f in fields) in done:      # --resume: measured by an earlier run
            continue
        if rec.out_of_time(f"gemm {case}"):
            return
        m, n, k, dtype = case["m"], case["n"], case["k"], case["dtype"]
        pred = gemm_predicted(hw, m, n, k, dtype)
        reps = _replicas(pred, (m * k + k * n + m * n) * jnp.dtype(dtype).itemsize)
        a = jax.random.normal(key, (reps, m, k), dtype)
        b = jax.random.normal(key, (reps, k, n), dtype)
        # distinct operands per replica: XLA neither merges nor deduplicates them (DotMerger, CSE)
        fn = jax.jit(lambda a, b: tuple(a[r] @ b[r] for r in range(a.shape[0])))
        t = timed(fn, a, b, runs=10) / reps
        flops = 2.0 * m * n * k
        rec.add("gemm", dict(case, replicas=reps, measured=t, predicted=pred, tflops=flops / t / 1e12,
                             efficiency=flops / t / hw.peak_flops(dtype), ratio=t / pred))
        del a, b


def _softmax(x):
    return jax.nn.softmax(x.astype(jnp.float32), axis=-1).astype(x.dtype)


def _layernorm(x, g, b):
    x32 = x.astype(jnp.float32)
    mu = x32.mean(-1, keepdims=True)
    var = ((x32 - mu) ** 2).mean(-1, keepdims=True)
    return ((x32 - mu) * jax.lax.rsqrt(var + 1e-5) * g + b).astype(x.dtype)


def _gelu(x, bias):
    return jax.nn.gelu(x + bias, approximate=True)


def _bias_residual(x, bias, r):
    return x + bias + r


def run_fused(rec: Recorder, hw, quick: bool) -> None:
    T, h, B, H, S = (512, 256, 1, 4, 256) if quick else (8192, 4096, 2, 32, 2048)
    cases = []
    for dtype in ("bfloat16", "float32"):
        dt = jnp.dtype(dtype)
        cases += [("softmax", _softmax, (jnp.ones((B, H, S, S), dt),)),
                  ("layernorm", _layernorm, (jnp.ones((T, h), dt), jnp.ones((h,), jnp.float32),
                                             jnp.zeros((h,), jnp.float32))),
                  ("gelu_tanh", _gelu, (jnp.ones((T, 4 * h), dt), jnp.ones((4 * h,), dt))),
                  ("bias_residual", _bias_residual, (jnp.ones((T, h), dt), jnp.ones((h,), dt), jnp.ones((T, h), dt)))]
    for name, f, args in cases:
        for mode in ("fwd", "fwd+bwd"):
            if rec.out_of_time(f"fused {name} {mode}"):
                return
            fn = f if mode == "fwd" else jax.grad(lambda *a, f=f: f(*a).astype(jnp.float32).sum(),
                                                  argnums=tuple(range(len(args))))
            jf = jax.jit(fn)
            t = timed(jf, *args)
            outs = jax.tree.leaves(jax.eval_shape(fn, *args))
            io = sum(a.nbytes for a in args) + sum(o.size * o.dtype.itemsize for o in outs)
            km = hw.kernels
            one_pass = io / (hw.memory_bandwidth * (km.bandwidth_efficiency if km else 1.0))
            row = {"op": name, "mode": mode, "dtype": str(args[0].dtype), "shape": list(args[0].shape),
                   "measured": t, "one_pass": one_pass, "io_bytes": io}
            row.update(model_price(fn, args, hw))
            row.update(compiled_facts(fn, *args, name=f"fused_{name}_{mode}_{row['dtype']}"))
            row["ratio_model"] = t / row["predicted"]
            row["ratio_one_pass"] = t / one_pass
            rec.add("fused", row)


def _attention_impls() -> list[str | None]:
    return [None, "xla"] + (["cudnn"] if jax.devices()[0].platform == "gpu" else [])


def run_attention(rec: Recorder, hw, quick: bool) -> None:
    shapes = [(1, 256, 4, 64)] if quick else [(4, 1024, 16, 128), (2, 2048, 16, 128), (1, 4096, 32, 128),
                                              (4, 2048, 32, 64)]
    key = jax.random.PRNGKey(1)
    for B, S, H, D in shapes:
        q, k, v = (jax.random.normal(jax.random.fold_in(key, i), (B, S, H, D), jnp.bfloat16) for i in range(3))
        flops_fwd = 4.0 * B * H * S * S * D / 2          # causal: half the score matrix is computed
        for impl in _attention_impls():
            def fwd(q, k, v, impl=impl):
                return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)

            def fwd_bwd(q, k, v, fwd=fwd):
                return jax.grad(lambda q, k, v: fwd(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))(q, k, v)

            for mode, fn, flops in (("fwd", fwd, flops_fwd), ("fwd+bwd", fwd_bwd, 3.5 * flops_fwd)):
                if rec.out_of_time(f"attention {B, S, H, D} {impl} {mode}"):
                    return
                row = {"B": B, "S": S, "H": H, "D": D, "impl": str(impl), "mode": mode}
                try:
                    t = timed(jax.jit(fn), q, k, v)
                except Exception as exc:   # cudnn refuses some shapes / GPUs: record why, keep going
                    rec.add("attention", dict(row, error=f"{type(exc).__name__}: {str(exc)[:300]}"))
                    continue
                row.update(measured=t, tflops=flops / t / 1e12)
                try:
                    row.update(model_price(fn, (q, k, v), hw))
                    row["ratio_model"] = t / row["predicted"]
                except Exception as exc:
                    row["model_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                row.update(compiled_facts(fn, q, k, v, name=f"attention_{B}x{S}x{H}x{D}_{impl}_{mode}"))
                rec.add("attention", row)


def gpt_layer_loss(params, x, impl, heads):
    """One pre-LN GPT layer's shard under tensor parallelism (`heads` local heads; the layer's
    all-reduces are not run): bf16 compute over float32 parameters, the summed output as the loss."""
    p = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    B, S, h = x.shape
    y = _layernorm(x, params["ln1_g"], params["ln1_b"])
    qkv = (y @ p["wqkv"] + p["bqkv"]).reshape(B, S, 3, heads, -1)
    a = jax.nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], is_causal=True, implementation=impl)
    x = x + a.reshape(B, S, -1) @ p["wo"] + p["bo"]
    y = _layernorm(x, params["ln2_g"], params["ln2_b"])
    x = x + jax.nn.gelu(y @ p["w1"] + p["b1"], approximate=True) @ p["w2"] + p["b2"]
    return x.astype(jnp.float32).mean()


# (name, hidden, heads, tensor-parallel size, micro-batch): the per-GPU layer of every run in
# ../shared/published_runs.md (SC'21 Table 1, Korthikanti et al. 2022), sequence 2048
_PUBLISHED_LAYERS = [("1.7B", 2304, 24, 1, 16), ("3.6B", 3072, 32, 2, 16), ("7.5B", 4096, 32, 4, 16),
                     ("18.4B", 6144, 48, 8, 8), ("39.1B", 8192, 64, 8, 4), ("76.1B", 10240, 80, 8, 2),
                     ("145.6B", 12288, 96, 8, 2), ("310.1B", 16384, 128, 8, 1), ("529.6B", 20480, 128, 8, 1),
                     ("1008B", 25600, 160, 8, 1), ("22B", 6144, 64, 8, 4)]


def _layer_params(h: int, tp: int) -> dict:
    key = jax.random.PRNGKey(2)
    shapes = {"wqkv": (h, 3 * h // tp), "bqkv": (3 * h // tp,), "wo": (h // tp, h), "bo": (h,),
              "w1": (h, 4 * h // tp), "b1": (4 * h // tp,), "w2": (4 * h // tp, h), "b2": (h,)}
    out = {k: jax.random.normal(jax.random.fold_in(key, i), s) * 0.02 for i, (k, s) in enumerate(shapes.items())}
    out.update(ln1_g=jnp.ones((h,)), ln1_b=jnp.zeros((h,)), ln2_g=jnp.ones((h,)), ln2_b=jnp.zeros((h,)))
    return out


def run_layer(rec: Recorder, hw, quick: bool) -> None:
    configs = [("tiny", 256, 4, 1, 1)] if quick else _PUBLISHED_LAYERS
    S = 256 if quick else 2048
    for name, h, heads, tp, B in configs:
        params = _layer_params(h, tp)
        x = jax.random.normal(jax.random.PRNGKey(3), (B, S, h), jnp.bfloat16)
        # matmul flops, forward + backward (3x forward): dense 24 B S h^2 / tp, causal attention 2 B S^2 h / tp
        matmul_flops = 3 * (24.0 * B * S * h * h + 2.0 * B * S * S * h) / tp
        variants = [(impl, False) for impl in _attention_impls()] + [("cudnn" if not quick else None, True)]
        for impl, remat in variants:
            if rec.out_of_time(f"layer {name} {impl} {remat}"):
                return
            loss = (lambda p, x, impl=impl, local=heads // tp: gpt_layer_loss(p, x, impl, local))
            fn = jax.value_and_grad(jax.checkpoint(loss) if remat else loss)
            row = {"run": name, "h": h, "heads": heads, "tp": tp, "B": B, "S": S, "impl": str(impl), "remat": remat}
            try:
                t = timed(jax.jit(fn), params, x, runs=8)
            except Exception as exc:
                rec.add("layer", dict(row, error=f"{type(exc).__name__}: {str(exc)[:300]}"))
                continue
            row.update(measured=t, model_tflops=matmul_flops / t / 1e12)
            try:
                row.update(model_price(fn, (params, x), hw))
                row["ratio_model"] = t / row["predicted"]
            except Exception as exc:
                row["model_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            row.update(compiled_facts(fn, params, x, name=f"layer_{name}_{impl}{'_remat' if remat else ''}"))
            rec.add("layer", row)
        del params, x


# whole train steps of the zoo (float32 parameters and compute: TF32 matmuls on Ampere and later)
# and the published runs' model (bench/published_runs.py: gpt-gpu, float16 compute over float32 master
# weights, sequence 2048, vocabulary 51200) at one GPU's share of two of its layer widths
_GPU_GPT = dict(seq_len=2048, vocab_size=51200, dtype="float16")
_STEPS = [("gpt-gpu", "debug", dict(_GPU_GPT, d_model=2048, num_heads=16, num_layers=8, batch_size=8)),
          ("gpt-gpu", "debug", dict(_GPU_GPT, d_model=4096, num_heads=32, num_layers=4, batch_size=4)),
          ("gpt", "gpt2-small", {}), ("gpt", "gpt2-medium", {}), ("bert", "bert-large", {}),
          ("resnet", "resnet50", {}), ("moe", "switch-base-8", {}), ("t5", "t5-large", {})]


def run_step(rec: Recorder, hw, quick: bool) -> None:
    """A zoo model's whole train step (forward, backward, optimizer) under jax.jit on one device,
    beside the planner's predicted step time for the one-device mesh (`autoshard.plan(...)
    .predicted["step_time"]`, the tensor evaluator) and the per-op kernel-model sum."""
    import models
    for name, config, overrides in ([("gpt", "debug", {}), ("mlp", "debug", {})] if quick else _STEPS):
        if rec.out_of_time(f"step {name} {config}"):
            return
        row = {"model": name, "config": config, "overrides": overrides}
        try:
            m = models.get(name, config, **overrides)
            params = m.init(jax.random.PRNGKey(0))
            args = (params, m.init_opt_state(params), m.batch())
            t = timed(jax.jit(m.train_step), *args, runs=8)
            plan = autoshard.plan(m.train_step, *args, mesh={"data": 1}, hardware=hw)
            row.update(measured=t, predicted=plan.predicted["step_time"], ratio=t / plan.predicted["step_time"])
            price = model_price(m.train_step, args, hw)
            row.update(op_sum=price["predicted"], ratio_op_sum=t / price["predicted"],
                       traced_flops=price["traced_flops"], tflops=price["traced_flops"] / t / 1e12)
            n_done = len(rec.data["sections"].get("step", []))
            row.update(compiled_facts(m.train_step, *args, name=f"step_{name}_{config}_{n_done}"))
            audit = autoshard.audit(plan, m.train_step, *args)       # the plan compiled here: memory on this backend
            row.update(compiled_memory=dict(audit.memory), predicted_memory=dict(audit.predicted_memory),
                       memory_gaps=[f"{g.what}: {g.predicted:.4g} vs {g.audited:.4g}" for g in audit.gaps
                                    if g.what.startswith("memory")])
        except Exception as exc:      # one model failing must not cost the others' rows
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        rec.add("step", row)


def _fmt(x, unit=1.0, digits=3):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x / unit:.{digits}g}"


def write_markdown(data: dict, path: Path) -> None:
    meta, sec = data["meta"], data["sections"]
    lines = [f"# gpu_calibrate on {meta['device_kind']} (preset {meta['preset']})", "",
             f"`python bench/gpu_calibrate.py{' --quick' if meta['quick'] else ''}`; jax {meta['machine']['jax']}, "
             f"commit {meta['machine']['git'].get('commit')}; times are medians (ms). ratio = measured / predicted "
             "(the current kernel model; > 1: the model is optimistic).", ""]
    if meta.get("skipped_for_time"):
        lines += [f"Skipped for the time budget: {len(meta['skipped_for_time'])} cases.", ""]
    if "copy" in sec:
        lines += ["## copy (x * 2, read + write)", "", "| MiB | ms | GB/s | of peak | predicted ms |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['bytes'] / 2**20:.0f} | {_fmt(r['measured'], 1e-3)} | {_fmt(r['bandwidth'], 1e9, 4)} | "
                  f"{r['bandwidth_fraction']:.2f} | {_fmt(r['predicted'], 1e-3)} |" for r in sec["copy"]]
        lines.append("")
    if "launch" in sec:
        lines += ["## per kernel inside one program (chain of dependent small matmuls)", "",
                  "| size | chain | one ms | chain ms | us per kernel | kernels compiled | model launch us |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['size']} | {r['chain']} | {_fmt(r['one'], 1e-3)} | {_fmt(r['many'], 1e-3)} | "
                  f"{_fmt(r['per_kernel'], 1e-6)} | {r['kernels_compiled']} | {_fmt(r['model_launch'], 1e-6)} |"
                  for r in sec["launch"]]
        lines.append("")
    if "gemm" in sec:
        lines += ["## GEMMs", "", "| dtype | layer | pass | h | tp | m | n | k | ms | TFLOP/s | of peak | predicted ms "
                  "| ratio |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['dtype']} | {r['layer']} | {r['pass']} | {r['h']} | {r['tp']} | {r['m']} | {r['n']} "
                  f"| {r['k']} "
                  f"| {_fmt(r['measured'], 1e-3)} | {r['tflops']:.0f} | {r['efficiency']:.2f} | "
                  f"{_fmt(r['predicted'], 1e-3)} | {r['ratio']:.2f} |" for r in sec["gemm"]]
        lines.append("")
    if "fused" in sec:
        lines += ["## fused elementwise chains", "", "| op | mode | dtype | shape | ms | model ms | one pass ms | "
                  "kernels | traced ops | XLA bytes / io bytes | ratio to model | ratio to one pass |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['op']} | {r['mode']} | {r['dtype']} | {r['shape']} | {_fmt(r['measured'], 1e-3)} | "
                  f"{_fmt(r['predicted'], 1e-3)} | {_fmt(r['one_pass'], 1e-3)} | {r['kernels']} | {r['traced_ops']} | "
                  f"{r['xla_bytes'] / r['io_bytes']:.2f} | {r['ratio_model']:.2f} | {r['ratio_one_pass']:.2f} |"
                  for r in sec["fused"]]
        lines.append("")
    if "step" in sec:
        lines += ["## whole train steps (one device, jax.jit)", "", "| model | config | ms | TFLOP/s | planner ms "
                  "| ratio | per-op sum ms | ratio | kernels | argument+temp MiB compiled | predicted | note |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in sec["step"]:
            mem = [r.get(k, {}).get("argument+temp") for k in ("compiled_memory", "predicted_memory")]
            config = r["config"] + "".join(f" {k}={v}" for k, v in r.get("overrides", {}).items()
                                           if k in ("d_model", "num_layers", "batch_size"))
            lines.append(f"| {r['model']} | {config} | {_fmt(r.get('measured'), 1e-3)} | "
                         f"{_fmt(r.get('tflops'), 1, 4)} | {_fmt(r.get('predicted'), 1e-3)} | "
                         f"{_fmt(r.get('ratio'), 1, 3)} | {_fmt(r.get('op_sum'), 1e-3)} | "
                         f"{_fmt(r.get('ratio_op_sum'), 1, 3)} | {r.get('kernels', '-')} | {_fmt(mem[0], 2**20, 4)} | "
                         f"{_fmt(mem[1], 2**20, 4)} | {r.get('error', '')[:120]} |")
        lines.append("")
    for name, keys in (("attention", ("B", "S", "H", "D", "impl", "mode")),
                       ("layer", ("run", "h", "heads", "tp", "B", "S", "impl", "remat"))):
        if name not in sec:
            continue
        rate = "tflops" if name == "attention" else "model_tflops"
        lines += [f"## {name}", "", "| " + " | ".join(keys) + " | ms | TFLOP/s | model ms | ratio | kernels | note |",
                  "|" + "---|" * (len(keys) + 6)]
        for r in sec[name]:
            cells = [str(r[k]) for k in keys]
            note = r.get("error") or r.get("model_error") or ""
            cells += [_fmt(r.get("measured"), 1e-3), _fmt(r.get(rate), 1, 4), _fmt(r.get("predicted"), 1e-3),
                      _fmt(r.get("ratio_model"), 1, 3), str(r.get("kernels", "-")), note[:120]]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    path.write_text("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small shapes (the default on a CPU)")
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for the whole run; later cases skipped")
    ap.add_argument("--sections", default="copy,launch,fused,attention,layer,step,gemm")
    ap.add_argument("--merge", default=None, help="a previous result JSON whose other sections are kept")
    ap.add_argument("--resume", action="store_true", help="with --merge: keep its rows of every section and "
                    "measure only the cases it lacks (gemm)")
    ap.add_argument("--hlo-dir", default=None, help="keep each compiled program's HLO text here")
    args = ap.parse_args(argv)
    if args.hlo_dir:
        HLO_DIR.append(Path(args.hlo_dir))
        HLO_DIR[0].mkdir(parents=True, exist_ok=True)
    slug, kind, preset = device_slug()
    quick = args.quick or slug == "cpu"
    hw = get_hardware(preset)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device_kind": kind, "preset": preset, "quick": quick, "machine": machine(),
            "hardware": {"peak_bf16": hw.peak_flops("bfloat16"), "peak_f32": hw.peak_flops("float32"),
                         "memory_bandwidth": hw.memory_bandwidth, "compute_efficiency": hw.compute_efficiency,
                         "kernels": None if hw.kernels is None else vars(hw.kernels)}}
    rec = Recorder(out / f"gpu_calibrate_{slug}.json", meta, args.budget)
    if args.merge:   # keep the sections this run does not measure again
        old = json.loads(Path(args.merge).read_text())
        rerun = set() if args.resume else set(args.sections.split(","))
        rec.data["sections"] = {k: v for k, v in old["sections"].items() if k not in rerun}
        rec.data["meta"]["merged_from"] = {"sections": sorted(rec.data["sections"]), "machine": old["meta"]["machine"]}
    runners = {"copy": run_copy, "launch": run_launch, "gemm": run_gemm, "fused": run_fused,
               "attention": run_attention, "layer": run_layer, "step": run_step}
    for name in args.sections.split(","):
        t0 = time.time()
        runners[name](rec, hw, quick)
        print(f"# {name}: {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
    rec.data["meta"]["skipped_for_time"] = rec.skipped
    rec.path.write_text(json.dumps(rec.data, indent=1))
    write_markdown(rec.data, out / f"gpu_calibrate_{slug}.md")
    print(f"wrote {rec.path} and {out / f'gpu_calibrate_{slug}.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
