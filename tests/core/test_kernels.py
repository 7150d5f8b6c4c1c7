"""Kernel efficiency (issue 20): tile and wave quantization as NVIDIA's matrix multiplication guide
describes them, on an A100-like model (108 SMs, 256 x 128 tiles). Pure Python, milliseconds."""

from __future__ import annotations

import math

import pytest

from autoshard._src.core.errors import HardwareError
from autoshard._src.core.kernels import (
    KernelModel,
    gemm_dims,
    kernel_model,
    matmul_seconds,
    op_seconds,
    tiles,
    waves,
)

A100 = KernelModel(sms=108, tile=(256, 128), launch=4e-6, bandwidth_efficiency=0.9)
RATE = 312e12          # bf16 dense flop/s


def test_tile_quantization_a_partial_tile_costs_a_whole_one():
    assert tiles(A100, 1, 256, 128) == 1
    assert tiles(A100, 1, 257, 128) == 2                     # one more row: a second tile row
    # within one wave, 257 rows cost as much as 512
    assert matmul_seconds(A100, 1, 257, 128, 4096, RATE) == matmul_seconds(A100, 1, 512, 128, 4096, RATE)


def test_wave_quantization_steps_at_the_sm_count():
    # 1792 x 1792 in 256 x 128 tiles: 7 x 14 = 98 tiles, one wave on 108 SMs (91 % of them busy)
    assert tiles(A100, 1, 1792, 1792) == 98 and waves(A100, 1, 1792, 1792) == 1
    # 108 tiles one wave, 109 two: in 256 x 128 tiles the time would double for 1 % more work; in
    # 64 x 64 tiles (8 per big one) 872 tiles take 9 waves of 108 against 8, and the kernel picks those
    assert waves(A100, 108, 256, 128) == 1 and waves(A100, 109, 256, 128) == 2
    one = matmul_seconds(A100, 108, 256, 128, 1024, RATE)
    two = matmul_seconds(A100, 109, 256, 128, 1024, RATE)
    assert one == pytest.approx(2 * 108 * 256 * 128 * 1024 / RATE)
    assert two == pytest.approx(9 / 8 * one)


def test_large_products_approach_the_roofline():
    m, n, k = 256 * 108 * 4, 128 * 8, 8192           # whole tiles, whole waves
    assert matmul_seconds(A100, 1, m, n, k, RATE) == pytest.approx(2 * m * n * k / RATE)


def test_small_micro_batches_run_below_peak():
    """A micro-batch of 2 sequences fills one wave of 64 x 64 tiles, 16 fill 5: per sample, 2 run 1.6x
    slower than 16 (the effect GraphPipe's shallower pipelines exploit); the roofline says 1x."""
    S, D, F = 128, 1024, 1024

    def per_sample(b):
        return matmul_seconds(A100, 1, b * S, F, D, RATE) / b

    assert per_sample(2) == pytest.approx(1.6 * per_sample(16))
    roofline = 2 * S * F * D / RATE
    assert per_sample(2) == pytest.approx(108 / 64 * roofline)          # one wave, 64 of 108 SMs busy
    assert per_sample(16) == pytest.approx(5 * 108 / 512 * roofline)    # 5 waves for 4.74 waves of work


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
    t = op_seconds(A100, "add", {}, [(1 << 20,), (1 << 20,)], (1 << 20,), 1 << 20, 12 << 20, RATE, bw)
    assert t == pytest.approx((12 << 20) / (0.9 * bw))       # elementwise: fused, no launch of its own
    dot = {"contracting": ((1,), (0,)), "batch": ((), ())}
    tiny = op_seconds(A100, "dot_general", dot, [(2, 64), (64, 64)], (2, 64), 2 * 2 * 64 * 64, 0, RATE, bw)
    assert math.isclose(tiny, 4e-6 + 2 * 64 * 64 * 64 / (RATE / 108))   # a launch and one 64 x 64 tile


def test_kernel_model_is_validated_and_round_trips():
    assert kernel_model({"sms": 132, "tile": [256, 128]}) == KernelModel(sms=132) == kernel_model("h100")
    assert kernel_model(None) is None
    for bad in ({"sms": 0}, {"sms": 8, "tile": (0, 128)}, {"sms": 8, "bandwidth_efficiency": 1.5}):
        with pytest.raises(HardwareError):
            kernel_model(bad)
