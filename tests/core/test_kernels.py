"""Kernel efficiency (issue 20): tile and wave quantization as NVIDIA's matrix multiplication guide
describes them, on an A100-like model (108 SMs, 256 x 128 tiles). Pure Python, milliseconds."""

from __future__ import annotations

import dataclasses
import math

import pytest

from autoshard._src.core.errors import HardwareError
from autoshard._src.core.kernels import (
    KernelModel,
    gemm_dims,
    kernel_model,
    matmul_seconds,
    op_seconds,
    split_k_seconds,
    tile_feed,
    tiles,
    waves,
)

# mma_efficiency 1 and no per-tile overhead: the tile and wave arithmetic alone, at the dense peak
A100 = KernelModel(sms=108, tile=(256, 128), launch=4e-6, bandwidth_efficiency=0.9, mma_efficiency=1.0)
RATE = 312e12          # bf16 dense flop/s


def test_tile_quantization_a_partial_tile_costs_a_whole_one():
    assert tiles(A100, 1, 256, 128) == 1
    assert tiles(A100, 1, 257, 128) == 2                     # one more row: a second tile row
    # within one wave, 257 rows cost as much as 512
    assert matmul_seconds(A100, 1, 257, 128, 4096, RATE) == matmul_seconds(A100, 1, 512, 128, 4096, RATE)


def test_wave_quantization_steps_at_the_sm_count():
    # 1792 x 1792 in 256 x 128 tiles: 7 x 14 = 98 tiles, one wave on 108 SMs (91 % of them busy)
    assert tiles(A100, 1, 1792, 1792) == 98 and waves(A100, 1, 1792, 1792) == 1
    # 108 tiles one wave, 109 two: smaller tiles do not rescue the second wave, since they reuse each
    # operand less (128 x 128 tiles: 218 in 3 waves at 0.75 of the rate; 64 x 64: 9 waves at 0.375)
    assert waves(A100, 108, 256, 128) == 1 and waves(A100, 109, 256, 128) == 2
    one = matmul_seconds(A100, 108, 256, 128, 1024, RATE)
    two = matmul_seconds(A100, 109, 256, 128, 1024, RATE)
    assert one == pytest.approx(2 * 108 * 256 * 128 * 1024 / RATE)
    assert two == pytest.approx(2 * one)


def test_large_products_approach_the_roofline():
    m, n, k = 256 * 108 * 4, 128 * 8, 8192           # whole tiles, whole waves
    assert matmul_seconds(A100, 1, m, n, k, RATE) == pytest.approx(2 * m * n * k / RATE)


def test_small_micro_batches_run_below_peak():
    """A micro-batch of 2 sequences fills 64 of 108 SMs with 64 x 64 tiles (running at 0.375 of the big
    tile's rate), 16 fill 64 with 256 x 128 tiles: per sample, 2 run 2.7x slower than 16; the roofline
    says 1x (the effect GraphPipe's shallower pipelines exploit)."""
    S, D, F = 128, 1024, 1024

    def per_sample(b):
        return matmul_seconds(A100, 1, b * S, F, D, RATE) / b

    roofline = 2 * S * F * D / RATE
    assert per_sample(2) == pytest.approx(108 / 64 / 0.375 * roofline)   # one wave of 64 x 64 tiles
    assert per_sample(16) == pytest.approx(108 / 64 * roofline)           # one wave of 256 x 128 tiles
    assert per_sample(2) == pytest.approx(per_sample(16) / 0.375)


def test_tile_feed_follows_operand_reuse():
    assert tile_feed(A100, (256, 128)) == 1.0
    assert tile_feed(A100, (128, 128)) == pytest.approx(0.75)
    assert tile_feed(A100, (64, 64)) == pytest.approx(0.375)


H100 = kernel_model("h100")
H100_BF16 = 989.4e12


def _efficiency(km, m, n, k, peak=H100_BF16):
    return 2.0 * m * n * k / matmul_seconds(km, 1, m, n, k, peak) / peak


def test_gemm_efficiency_grows_with_size():
    sizes = [256, 512, 1024, 2048, 4096, 8192, 16384]
    eff = [_efficiency(H100, s, s, s) for s in sizes]
    assert all(b >= a for a, b in zip(eff, eff[1:], strict=False))


def test_large_square_gemm_runs_near_the_measured_large_gemm_efficiency():
    # gpu_calibrate_h100: large bf16 GEMMs at 0.46-0.76 of the dense peak, median 0.68
    assert 0.65 <= _efficiency(H100, 16384, 16384, 16384) <= 0.76


def test_short_k_and_few_rows_run_far_below_peak_per_flop():
    big = _efficiency(H100, 8192, 8192, 8192)
    assert _efficiency(H100, 8192, 8192, 64) < 0.2 * big       # K = 64: prologue and epilogue dominate
    assert _efficiency(H100, 128, 8192, 8192) <= 0.5 * big     # M = 128: one row of small tiles
    # measured on the H100 (gpu_calibrate_h100): 4096 x 1024 x 128 at 0.07 of peak, 128 x 4096 x 4096 at
    # 0.15; with the launch and the memory traffic, as the planner prices them
    dot = {"contracting": ((1,), (0,)), "batch": ((), ())}
    for m, n, k in ((4096, 1024, 128), (128, 4096, 4096)):
        secs = op_seconds(H100, "dot_general", dot, [(m, k), (k, n)], (m, n), 2.0 * m * n * k,
                          2 * (m * k + k * n + m * n), 0.6 * H100_BF16, 3.35e12, peak=H100_BF16)
        assert 2.0 * m * n * k / secs / H100_BF16 < 0.25


def test_gemm_dims_of_matmuls_and_convolutions():
    dot = {"contracting": ((2,), (0,)), "batch": ((), ())}
    assert gemm_dims("dot_general", dot, [(8, 128, 512), (512, 2048)], (8, 128, 2048)) == (1, 1024, 2048, 512)
    bmm = {"contracting": ((3,), (3,)), "batch": ((0, 1), (0, 1))}
    assert gemm_dims("dot_general", bmm, [(2, 4, 16, 8), (2, 4, 16, 8)], (2, 4, 16, 16)) == (8, 16, 16, 8)
    conv = {"lhs_spec": (0, 3, 1, 2), "rhs_spec": (3, 2, 0, 1), "out_spec": (0, 3, 1, 2), "feature_group_count": 1}
    # NHWC 4x32x32x64 conv 3x3x64x128 -> 4x32x32x128: M = 4*32*32, N = 128, K = 64*9
    assert gemm_dims("conv_general_dilated", conv, [(4, 32, 32, 64), (3, 3, 64, 128)], (4, 32, 32, 128)) == \
        (1, 4096, 128, 576)
    assert gemm_dims("add", {}, [(4,), (4,)], (4,)) is None


def test_op_seconds_prices_memory_at_the_achievable_bandwidth_and_kernels_launch():
    bw = 2.039e12
    t = op_seconds(A100, "add", {}, [(1 << 20,), (1 << 20,)], (1 << 20,), 1 << 20, 12 << 20, RATE, bw, peak=RATE)
    assert t == pytest.approx((12 << 20) / (0.9 * bw))       # elementwise: fused, no launch of its own
    dot = {"contracting": ((1,), (0,)), "batch": ((), ())}
    tiny = op_seconds(A100, "dot_general", dot, [(2, 64), (64, 64)], (2, 64), 2 * 2 * 64 * 64, 0, RATE, bw,
                      peak=RATE)
    # a launch and one 64 x 64 tile, at its operand reuse's share of one SM's rate
    assert math.isclose(tiny, 4e-6 + 2 * 64 * 64 * 64 / (0.375 * RATE / 108))


def test_kernel_model_is_validated_and_round_trips():
    assert kernel_model({"sms": 108, "tile": [256, 128]}) == KernelModel(sms=108)
    h100 = kernel_model("h100")
    assert kernel_model(dataclasses.asdict(h100)) == h100
    assert (h100.mma_efficiency, h100.k_overhead, h100.launch, h100.bandwidth_efficiency) == (0.75, 384, 2.4e-6, 0.77)
    assert kernel_model(None) is None
    for bad in ({"sms": 0}, {"sms": 8, "tile": (0, 128)}, {"sms": 8, "bandwidth_efficiency": 1.5},
                {"sms": 8, "mma_efficiency": 0}, {"sms": 8, "mma_efficiency": 1.2}, {"sms": 8, "k_overhead": -1},
                {"sms": 8, "k_overhead": 1.5}):
        with pytest.raises(HardwareError):
            kernel_model(bad)


def test_a_weight_gradient_convolution_splits_its_k_over_idle_sms():
    # ResNet-50's first 1x1 filter gradient (batch 128, 56 x 56, 64 -> 64): M = N = 64 (one tile), K =
    # 128*56*56. Unsplit, one SM would run all of K; cuDNN splits K over the SMs (its workspace holds
    # sms / tiles float32 copies of the output) and reduces the partial sums
    bw, k = 2.039e12, 128 * 56 * 56
    conv = {"lhs_spec": (3, 0, 1, 2), "rhs_spec": (3, 0, 1, 2), "out_spec": (2, 3, 0, 1), "feature_group_count": 1}
    x, dy, dw = (128, 56, 56, 64), (128, 56, 56, 64), (1, 1, 64, 64)
    assert gemm_dims("conv_general_dilated", conv, [x, dy], dw) == (1, 64, 64, k)
    flops = 2.0 * 64 * 64 * k
    secs = op_seconds(A100, "conv_general_dilated", conv, [x, dy], dw, flops, 0, RATE, bw, peak=RATE)
    unsplit = matmul_seconds(A100, 1, 64, 64, k, RATE)
    one_tile_slices = split_k_seconds(A100, (256, 128), 1, 64 * 64, k, RATE, bw)
    # 108 slices of one 256 x 128 tile, the partial sums written and read once
    assert one_tile_slices == pytest.approx(2 * 256 * 128 * math.ceil(k / 108) / (RATE / 108)
                                            + 2 * 4 * 108 * 64 * 64 / (0.9 * bw))
    # the fastest tile: 64 x 64, 108 slices at its lower operand reuse
    choices = [split_k_seconds(A100, t, 1, 64 * 64, k, RATE, bw) for t in ((256, 128), (128, 128), (128, 64), (64, 64))]
    assert min(choices) == choices[-1] < one_tile_slices
    assert secs == pytest.approx(A100.launch + min(unsplit, *choices))
    assert secs < unsplit / 20
    # a matmul of the same shape is priced unsplit (cuBLAS: SPLIT_K_OPS), and a product that fills the
    # SMs gains nothing from slices
    dot = {"contracting": ((0,), (0,)), "batch": ((), ())}
    assert op_seconds(A100, "dot_general", dot, [(k, 64), (k, 64)], (64, 64), flops, 0, RATE, bw, peak=RATE) == \
        pytest.approx(A100.launch + unsplit)
    assert matmul_seconds(A100, 1, 8192, 8192, 1024, RATE, bw) == matmul_seconds(A100, 1, 8192, 8192, 1024, RATE)


def test_the_tensor_search_prices_a_split_k_convolution_as_op_seconds():
    # the vectorised pricing (tensor/kernel_costs.py) and op_seconds agree on a filter gradient
    import numpy as np

    from autoshard._src.tensor.kernel_costs import GemmCosts, _Gemm
    bw, k = 2.039e12, 128 * 56 * 56
    costs = GemmCosts(A100, {})
    costs.gemms.append(_Gemm(1.0, RATE, (((1, -1),), ((64, -1),), ((256, -1),), ((k, -1),)), 0.0, (), 1.0, bw))
    secs = costs.seconds(np.zeros((1, 1), dtype=np.int64), np.ones(1), lambda plans, loop: np.zeros(1, dtype=np.int64))
    conv = {"lhs_spec": (3, 0, 1, 2), "rhs_spec": (3, 0, 1, 2), "out_spec": (2, 3, 0, 1), "feature_group_count": 1}
    want = op_seconds(A100, "conv_general_dilated", conv, [(128, 56, 56, 64), (128, 56, 56, 256)], (1, 1, 64, 256),
                      2.0 * 64 * 256 * k, 0, RATE, bw, peak=RATE, launches=0)
    assert secs[0] == pytest.approx(want)
