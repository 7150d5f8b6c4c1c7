"""XLA:CPU's own buffers at the backward's start (plan/cpu_buffers.py), on synthetic inputs: which copies
the donated parameter buffers absorb, and which gradient syncs order an update."""

from __future__ import annotations

from autoshard._src.plan.cpu_buffers import _copies_beyond_vacated, _reduced


def test_equal_layers_hold_one_copy():
    # copy k+1 lives in the buffer copy k's parameter vacated (the Megatron MLP's compiled buffers)
    assert _copies_beyond_vacated([524288.0] * 6) == 524288.0


def test_kernels_of_different_sizes_hold_every_copy():
    # a convolutional net's kernels grow layer by layer: every copy stays in temporaries (the compiled
    # ResNet and CNN steps), also one smaller than an earlier kernel (its buffer went to a larger value)
    sizes = [864.0, 4608.0, 18432.0, 73728.0, 16384.0]
    assert _copies_beyond_vacated(sizes) == sum(sizes)


def test_one_copy_of_each_size():
    # a transformer layer's four [d, d] projections and two [d, 4d] / [4d, d] kernels, three layers
    layer = [4096.0] * 4 + [16384.0] * 2 + [64.0] * 2
    assert _copies_beyond_vacated(layer * 3) == 4096.0 + 16384.0 + 64.0
    assert _copies_beyond_vacated([]) == 0.0


def test_a_sync_over_single_device_axes_orders_nothing():
    sizes = {"data": 1, "model": 8, "pod": 2}
    assert not _reduced("none", sizes)
    assert not _reduced("all-reduce over data", sizes)          # no collective on an axis of one device
    assert _reduced("all-reduce over data,pod", sizes)
    assert _reduced("reduce-scatter over pod + all-reduce over data", sizes)
    assert not _reduced("reduce-scatter over data + all-reduce over data", sizes)
