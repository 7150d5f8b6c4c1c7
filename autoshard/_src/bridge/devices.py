"""The local devices' hardware preset (bridge: imports jax)."""

from __future__ import annotations

import jax

from ..core.errors import HardwareError
from ..core.hardware import HardwareSpec, get_hardware


def local_hardware() -> HardwareSpec:
    """The hardware preset of the local devices: the one default `Config.hardware=None` stands for."""
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        return get_hardware("cpu-sim")
    kind = getattr(dev, "device_kind", "").upper()
    for key, name in (("H200", "h200-sxm"), ("H100", "h100-sxm"), ("A100", "a100-sxm"), ("V100", "v100-sxm")):
        if key in kind:
            return get_hardware(name)
    raise HardwareError(f"autoshard: no hardware preset for the local device kind {kind!r}; pass hardware= a preset "
                        "name or explicit numbers, e.g. {'base': 'h100-sxm', 'flops': {...}, 'memory_bytes': ...}.")
