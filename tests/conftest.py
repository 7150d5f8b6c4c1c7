"""Test-wide setup: 8 simulated CPU devices, configured before any jax backend starts."""

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")
